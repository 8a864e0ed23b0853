"""A model is what the recipe names (issue 49): `model.init_from` of another family or of another shape
than the recipe states is refused at load (a local directory) or at build (any name); every
`hf_causal_lm` model is causal, encoders' causal-LM classes included; a pretrained model keeps the
recipe's dropout and trains in float32; a local directory that is not there is named missing, not a
malformed hub name; and a checkpoint that does not fit says what differs.

Every model here is a real tiny transformers model whose directory the test writes: nothing is downloaded.
"""

import dataclasses
import shutil

import pytest
import torch
import transformers

from zoa_train.config import recipe_from_dict
from zoa_train.errors import UserError
from zoa_train.models import ModelInputs, create
from zoa_train.pretrained import local_path

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}


def save(path, model_or_config):
    model_or_config.save_pretrained(path)
    return str(path)


def qwen2(path):
    return save(path, transformers.Qwen2Config(**SMALL, num_key_value_heads=2))


def llama(path, **extra):
    config = transformers.LlamaConfig(**{**SMALL, "num_key_value_heads": 2, **extra})
    return save(path, transformers.LlamaForCausalLM(config))


def gpt2(path, **extra):
    config = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100, "bos_token_id": 0, "eos_token_id": 0, **extra}
    return save(path, transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)))


def bert(path):
    return save(path, transformers.BertForMaskedLM(transformers.BertConfig(**SMALL)))


def refusal(model: dict, data: dict | None = None) -> str:
    with pytest.raises(UserError) as refused:
        recipe_from_dict({"model": model, "data": data or {}}, "r.yaml")
    return str(refused.value)


# ---- another family, another shape ---------------------------------------------------------------


def test_init_from_of_another_family_is_refused_at_load_in_one_sentence(tmp_path):
    q, g, l_ = qwen2(tmp_path / "qwen"), gpt2(tmp_path / "gpt2"), llama(tmp_path / "llama")
    t5 = save(tmp_path / "t5", transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=100))
    assert refusal({"kind": "llama", "init_from": q}) == (
        f"r.yaml: model.init_from {q} holds a model of type qwen2 and model.kind llama takes type llama; set model.kind hf_causal_lm to train it."
    )
    assert refusal({"kind": "gpt2", "init_from": l_}) == (
        f"r.yaml: model.init_from {l_} holds a model of type llama and model.kind gpt2 takes type gpt2; set model.kind llama to train it."
    )
    assert refusal({"kind": "bert", "init_from": g}) == (
        f"r.yaml: model.init_from {g} holds a model of type gpt2 and model.kind bert takes type bert; give it the directory of a model of type bert."
    )
    assert refusal({"kind": "hf_causal_lm", "init_from": t5}) == (
        f"r.yaml: model.init_from {t5} holds a model of type t5, which transformers has no causal LM for, and model.kind hf_causal_lm trains causal LMs; "
        "give it the directory of a causal LM."
    )
    assert refusal({"kind": "hf_causal_lm", "hf_config": t5}) == (
        f"r.yaml: model.hf_config {t5} is a config of type t5, which transformers has no causal LM for; give a causal LM's config."
    )
    assert refusal({"kind": "hf_causal_lm", "hf_config": q, "init_from": q}) == (
        "r.yaml: model.hf_config and model.init_from both name the model; init_from brings its own config, so leave model.hf_config unset."
    )
    # hf_causal_lm takes any causal LM, the named families' too
    for directory in (q, g, l_):
        recipe_from_dict({"model": {"kind": "hf_causal_lm", "init_from": directory}})


def test_a_shape_the_recipe_states_must_be_the_pretrained_models(tmp_path):
    l_, g = llama(tmp_path / "llama"), gpt2(tmp_path / "gpt2")
    assert refusal({"kind": "llama", "init_from": l_, "size": "125M"}) == (
        f"r.yaml: model.init_from {l_} holds a model of n_layer 2, n_embd 64, n_head 4, n_kv_head 2, ffn_size 96 and tie_embeddings False, "
        "not n_layer 30, n_embd 576, n_head 9, n_kv_head 3, ffn_size 1536 and tie_embeddings True as the recipe states; "
        "a pretrained model keeps its own shape, so leave model.size unset."
    )
    # a preset whose values the set keys bring to the model's (tiny's n_kv_head 2 and rope base 10,000 are this model's)
    recipe_from_dict({"model": {"kind": "llama", "init_from": l_, "size": "tiny", "n_embd": 64, "ffn_size": 96, "tie_embeddings": False}})
    # gpt2_tiny's model section over a pretrained model of another width: every key that differs is named
    tiny = {"kind": "gpt2", "init_from": g, "size": "custom", "n_layer": 2, "n_embd": 128, "n_head": 8}
    assert refusal(tiny) == (
        f"r.yaml: model.init_from {g} holds a model of n_embd 64 and n_head 4, not n_embd 128 and n_head 8 as the recipe states; "
        "a pretrained model keeps its own shape, so leave model.n_embd and model.n_head unset."
    )
    assert (
        refusal({"kind": "llama", "init_from": l_, "size": "huge"})
        == "r.yaml: model.size 'huge' is not a llama preset; choose one of tiny, 125M, 1B, 8B or custom."
    )
    # what the recipe states and the model has, or nothing stated: accepted, and the model is the pretrained one
    recipe = recipe_from_dict({"model": {**tiny, "n_embd": 64, "n_head": 4, "dropout": 0.0}})
    model = create(recipe.model, ModelInputs(100, 64))
    torch.testing.assert_close(model.state_dict(), transformers.GPT2LMHeadModel.from_pretrained(g).state_dict())
    recipe_from_dict({"model": {"kind": "llama", "init_from": l_, "n_kv_head": 2, "tie_embeddings": False}})
    # a section that skipped the recipe's checks (a library caller, or a hub name: its config is first read then) is refused at build
    unchecked = dataclasses.replace(recipe.model, n_layer=12)
    with pytest.raises(UserError, match=rf"^model.init_from {g} holds a model of n_layer 2, not n_layer 12 as the recipe states; "):
        create(unchecked, ModelInputs(100, 64))


# ---- every hf_causal_lm model is causal ------------------------------------------------------------


def causal(model: torch.nn.Module, vocab: int = 100, length: int = 12, t: int = 6) -> bool:
    """Whether changing token t+1 leaves the logits at positions <= t as they were (and changes those after)."""
    model.eval()
    ids = torch.randint(5, vocab, (2, length), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, t + 1] = (ids[:, t + 1] - 4) % (vocab - 5) + 5
    assert not torch.equal(changed, ids)
    with torch.no_grad():
        before, after = model(input_ids=ids).logits, model(input_ids=changed).logits
    assert not torch.allclose(before[:, t + 1 :], after[:, t + 1 :])  # the change is seen where it may be
    return torch.allclose(before[:, : t + 1], after[:, : t + 1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["bert", "roberta", "gpt2", "llama"])
def test_every_hf_causal_lm_model_is_causal(tmp_path, family):
    """An encoder's causal-LM class (BertLMHeadModel, RobertaForCausalLM) attends both ways unless made a
    decoder: trained on next-token labels it would read the answer. Built fresh from hf_config and
    from a pretrained model in init_from, each is causal."""
    configs = {
        "bert": transformers.BertConfig(**SMALL),
        "roberta": transformers.RobertaConfig(**{**SMALL, "vocab_size": 104}, pad_token_id=1),
        "gpt2": transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100),
        "llama": transformers.LlamaConfig(**SMALL, num_key_value_heads=2),
    }
    config = configs[family]
    if family in ("bert", "roberta"):  # the check below can tell: the class as transformers builds it is not causal
        assert not causal(transformers.AutoModelForCausalLM.from_config(config))
    torch.manual_seed(0)
    inputs = ModelInputs(config.vocab_size, 64, pad_token_id=config.pad_token_id)  # RoBERTa numbers positions after its pad id
    fresh = create(recipe_from_dict({"model": {"kind": "hf_causal_lm", "hf_config": save(tmp_path / "config", config)}}).model, inputs)
    assert causal(fresh, vocab=config.vocab_size)
    pretrained = save(tmp_path / "pretrained", transformers.AutoModelForCausalLM.from_config(config))
    loaded = create(recipe_from_dict({"model": {"kind": "hf_causal_lm", "init_from": pretrained}}).model, ModelInputs(100, 64))
    assert causal(loaded, vocab=config.vocab_size)


@pytest.mark.parametrize("family", ["xlnet", "xlm", "cpmant"])
def test_a_causal_lm_class_that_sees_later_tokens_is_refused(tmp_path, family):
    configs = {
        "xlnet": transformers.XLNetConfig(d_model=32, n_layer=1, n_head=4, d_inner=64, vocab_size=100),
        "xlm": transformers.XLMConfig(emb_dim=32, n_layers=1, n_heads=4, vocab_size=100),
        "cpmant": transformers.CpmAntConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, dim_head=8, dim_ff=64, vocab_size=100),
    }
    config = configs[family]
    assert not causal(transformers.AutoModelForCausalLM.from_config(config))  # as transformers builds it, is_decoder or not
    directory = save(tmp_path / family, config)
    assert refusal({"kind": "hf_causal_lm", "hf_config": directory}) == (
        f"r.yaml: model.hf_config {directory} is a config of type {family}, whose causal-LM class in transformers sees later tokens too; give a causal LM's config."
    )
    assert refusal({"kind": "hf_causal_lm", "init_from": directory}).startswith(
        f"r.yaml: model.init_from {directory} holds a model of type {family}, whose causal-LM class in transformers sees later tokens too, and model.kind "
    )
    unchecked = dataclasses.replace(recipe_from_dict({"model": {"kind": "hf_causal_lm", "hf_config": "Qwen/Qwen2-0.5B"}}).model, hf_config=directory)
    with pytest.raises(UserError, match=f"^model.hf_config {directory} is of type {family}, whose causal-LM class in transformers sees later tokens too, so "):
        create(unchecked, ModelInputs(100, 64))  # as a hub name's config is first read


# ---- the recipe's dropout, float32, what the model can take ----------------------------------------


def test_a_pretrained_model_takes_the_recipes_dropout_and_trains_in_float32(tmp_path):
    path = tmp_path / "bf16"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100)).to(torch.bfloat16).save_pretrained(path)
    assert transformers.AutoModelForCausalLM.from_pretrained(path).dtype == torch.bfloat16  # what transformers 5 does by itself
    model = create(recipe_from_dict({"model": {"kind": "gpt2", "init_from": str(path), "dropout": 0.0}}).model, ModelInputs(100, 64))
    assert model.dtype == torch.float32 and (model.config.resid_pdrop, model.config.embd_pdrop, model.config.attn_pdrop) == (0.0, 0.0, 0.0)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    kept = create(recipe_from_dict({"model": {"kind": "gpt2", "init_from": str(path)}}).model, ModelInputs(100, 64))
    assert kept.config.resid_pdrop == 0.1  # unset: the model's own


def test_inputs_longer_than_a_pretrained_models_positions_are_refused(tmp_path):
    g = gpt2(tmp_path / "gpt2", n_positions=32)
    recipe = recipe_from_dict({"model": {"kind": "gpt2", "init_from": g}, "data": {"seq_len": 64}})
    with pytest.raises(UserError) as refused:
        create(recipe.model, ModelInputs(100, 64))
    assert str(refused.value) == f"data.seq_len 64 is longer than the 32 positions of the model in model.init_from {g}; set data.seq_len to at most 32."


# ---- a local directory that is not there -----------------------------------------------------------


def test_a_name_is_a_local_path_when_it_cannot_be_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").mkdir()
    assert local_path("gpt2") is None and local_path("Qwen/Qwen2-0.5B") is None and local_path("bert-base-uncased") is None
    assert local_path("here") == tmp_path.joinpath("here").relative_to(tmp_path)  # it exists: the directory wins
    for name in ("./my-model", "../m", "/models/m", "~/m", "models/qwen/2", "m@1", "a b"):
        assert local_path(name) is not None, name


@pytest.mark.parametrize(
    "section, key, holds",
    [
        ({"model": {"kind": "gpt2", "init_from": "./my-model"}}, "model.init_from ./my-model", "the model's config.json"),
        ({"model": {"kind": "llama", "init_from": "~/no/such/model"}}, "model.init_from ~/no/such/model", "the model's config.json"),
        ({"model": {"kind": "hf_causal_lm", "hf_config": "configs/qwen2/small"}}, "model.hf_config configs/qwen2/small", "the model's config.json"),
        (
            {"model": {"kind": "gpt2"}, "data": {"tokenizer": "./tok"}},
            "data.tokenizer ./tok",
            "the tokenizer's files, or leave data.tokenizer unset to train one on the corpus",
        ),
    ],
)
def test_a_local_directory_that_is_not_there_is_named_missing(tmp_path, monkeypatch, section, key, holds):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as refused:
        recipe_from_dict(section, "r.yaml")
    assert (
        str(refused.value)
        == f"r.yaml: {key} does not exist: it names a local directory (a hub name is name or owner/name); give the directory that holds {holds}."
    )


def test_a_resnets_init_from_is_a_state_dict_file_that_fits(tmp_path):
    digits = {"source": "digits"}
    with pytest.raises(
        UserError, match=r"^r.yaml: model.init_from ./w.pt does not exist; resnet18 takes a state-dict file \(a zoa-train model.pt or torchvision weights\).$"
    ):
        recipe_from_dict({"model": {"kind": "resnet18", "init_from": "./w.pt"}, "data": digits}, "r.yaml")
    import torchvision

    torch.save(torchvision.models.resnet34(num_classes=10).state_dict(), tmp_path / "resnet34.pt")
    recipe = recipe_from_dict({"model": {"kind": "resnet18", "init_from": str(tmp_path / "resnet34.pt")}, "data": digits})
    with pytest.raises(UserError) as refused:
        create(recipe.model, ModelInputs(num_classes=10))
    assert str(refused.value) == (
        f"model.init_from {tmp_path / 'resnet34.pt'} is not a resnet18 of 10 classes (0 tensors missing, 96 extra, 0 of another shape; "
        "layer1.2.conv1.weight is not in the model); give the weights of one."
    )


# ---- end to end: runs from init_from export and evaluate without it ---------------------------------


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def short(cache_dir) -> list[str]:
    return sets("train.steps=2", "train.nproc=1", "train.log_every=1", "train.val_batches=1", "train.val_every=0", "logging.wandb=disabled",
                "logging.tensorboard=false", f"data.cache_dir={cache_dir}")  # fmt: skip


@pytest.mark.slow
def test_runs_from_init_from_train_export_and_evaluate_without_it(tmp_path, cache_dir):
    """llama_tiny continued from a pretrained model of its own shape, and hf_causal_lm from a BERT masked
    LM (trained causal): each exports and evaluates after the pretrained directory is gone, since the
    run recorded the config of the model it trained."""
    import json

    import yaml
    from conftest import ROOT, refused, zoa

    pretrained = tmp_path / "pretrained"
    tiny = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 384}
    llama(pretrained / "llama", **tiny, vocab_size=4096, tie_word_embeddings=True)
    bert_config = transformers.BertConfig(**{**SMALL, "vocab_size": 4096}, max_position_embeddings=128)
    save(pretrained / "bert", transformers.BertForMaskedLM(bert_config))
    recipe = yaml.safe_load((ROOT / "recipes" / "gpt2_tiny.yaml").read_text())
    recipe["model"] = {"kind": "hf_causal_lm", "init_from": str(pretrained / "bert"), "dropout": 0.0}
    (tmp_path / "bert.yaml").write_text(yaml.safe_dump(recipe))
    init = f"model.init_from={pretrained / 'llama'}"
    refused(zoa("plan", "recipes/llama_tiny.yaml", *sets(init, "model.n_layer=3")), "holds a model of n_layer 2, not n_layer 3 as the recipe states")

    runs = {"llama": tmp_path / "llama-run", "bert": tmp_path / "bert-run"}
    for recipe_file, extra, run in (("recipes/llama_tiny.yaml", sets(init), runs["llama"]), (str(tmp_path / "bert.yaml"), [], runs["bert"])):
        done = zoa("run", recipe_file, "--out", str(run), *short(cache_dir), *extra)
        assert done.returncode == 0, done.stderr[-3000:]
    # a pretrained model that embeds fewer tokens than the tokenizer trained on the corpus has: refused by the rank that builds it
    llama(pretrained / "small-vocabulary", **tiny, vocab_size=100, tie_word_embeddings=True)
    done = zoa(
        "run", "recipes/llama_tiny.yaml", "--out", str(tmp_path / "refused"), *short(cache_dir), *sets(f"model.init_from={pretrained / 'small-vocabulary'}")
    )
    refused(
        done,
        "the tokenizer trained on the corpus has 4,096 tokens and the model in model.init_from",
        "embeds 100; set data.tokenizer to the model's own",
        alone=False,
    )
    shutil.rmtree(pretrained)  # what eval and export need is in the run directory

    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune must be in want of a wife.\n" * 4)
    for name, run in runs.items():
        out = tmp_path / f"{name}-hf"
        done = zoa("export", str(run), str(out))
        assert done.returncode == 0, done.stderr[-3000:]
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
        state = torch.load(run / "checkpoints" / "step_00000002" / "model.pt")
        assert sorted(model.state_dict()) == sorted(state) and all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
        assert causal(model, vocab=4096)
        perplexities = []
        for checkpoint in (run, out):  # the run and its export (a bert model type, recorded as hf_causal_lm) alike
            evaluated = tmp_path / f"{checkpoint.name}.json"
            done = zoa(
                "eval", "wikitext", "--checkpoint", str(checkpoint), "--data", str(text), "--raw", "--seq-len", "32", "--stride", "16", "--json", str(evaluated)
            )
            assert done.returncode == 0, done.stderr[-3000:]
            perplexities.append(json.loads(evaluated.read_text())["token_perplexity"])
        assert 1 < perplexities[0] < 4096 * 2 and perplexities[1] == pytest.approx(perplexities[0], rel=1e-5)
    assert type(model).__name__ == "BertLMHeadModel" and model.config.is_decoder  # the last: BERT, as the run trained it

    done = zoa("eval", "imagenet", "--checkpoint", str(runs["llama"]), "--data", str(tmp_path))
    refused(done)
    assert done.stderr.strip() == (
        f"error: {runs['llama']} trains a Llama model (a causal LM) and eval imagenet evaluates image classifiers (ResNet-18, ResNet-34, ResNet-50); "
        "evaluate it with zoa-train eval wikitext or zoa-train eval lambada."
    )


def test_a_run_directory_or_an_unreachable_hub_name_as_init_from_says_what_to_do(tmp_path):
    import os

    from conftest import ROOT, refused, zoa

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ROOT / "recipes" / "gpt2_tiny.yaml", run / "recipe.yaml")
    assert refusal({"kind": "gpt2", "init_from": str(run)}) == (
        f"r.yaml: model.init_from {run} is a zoa-train run directory; export it first (zoa-train export {run} OUT_DIR) and give model.init_from OUT_DIR."
    )
    assert refusal({"kind": "gpt2", "init_from": str(tmp_path)}) == (
        f"r.yaml: model.init_from {tmp_path} holds no config.json; give a directory that save_pretrained or zoa-train export wrote."
    )
    # A hub name is read when the model is built (here by plan's count), offline from the hub's cache alone.
    done = zoa("plan", "recipes/gpt2_tiny.yaml", "--set", "model.init_from=no-such-org/no-such-model", env={**os.environ, "HF_HUB_OFFLINE": "1"})
    refused(
        done,
        "model.init_from no-such-org/no-such-model is no local directory and could not be loaded from the hub (",
        "give a local directory, or a hub name when online",
    )

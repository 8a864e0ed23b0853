"""The model registry and the Llama family.

In this process: Llama's architecture as its entry says (RMSNorm, rotary positions, SwiGLU, grouped-query
attention, tied or untied embeddings), its presets' parameter counts against the published models', its
bad settings refused in one sentence, and the registry's own rules. End to end, each a real command in its
own process: a 2-rank llama_tiny run exported to a directory AutoModelForCausalLM loads, scored by `eval
wikitext` and `eval lambada`, planned and converted from DeepSpeed; and a family registered from the test
tree alone (tests/model_plugin.py, a Mistral-style decoder) trained, planned, exported and evaluated.
The plugin is only ever imported by those commands, never into this process.
"""

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import conftest
import pytest
import torch
import transformers
from conftest import ROOT, env_with_tests_on_path, refused

from zoa_train.config import recipe_from_dict
from zoa_train.errors import UserError
from zoa_train.models import ModelInputs, create
from zoa_train.models import registry as models
from zoa_train.plan.recipe import count_parameters

SENTENCE = "It is a truth universally acknowledged, that a single man in possession of a good fortune must be in want of a wife."
TEXT = "\n".join([SENTENCE, "She was the youngest of the two daughters of a most affectionate, indulgent father."] * 3) + "\n"
LAMBADA = [SENTENCE, "Mr. Darcy walked off; and Elizabeth remained with no very cordial feelings toward him"]


def zoa(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh process that can import tests/model_plugin.py."""
    return conftest.zoa(*args, env=env_with_tests_on_path())


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def short(cache_dir: Path, steps: int) -> list[str]:
    return sets(f"train.steps={steps}", "train.log_every=1", "train.val_batches=1", "train.val_every=0", "train.checkpoint_every=2",
                "logging.wandb=disabled", "logging.tensorboard=false", f"data.cache_dir={cache_dir}")  # fmt: skip


def llama(vocab_size: int = 4096, **model) -> torch.nn.Module:
    recipe = recipe_from_dict({"model": {"kind": "llama", **model}, "data": {"vocab_size": vocab_size, "seq_len": 64}})
    return create(recipe.model, ModelInputs(vocab_size, 64))


def planned_params(plan: dict, world: int) -> float:
    """The parameter count `plan --json` priced: Adam's bytes per rank are one bf16 ring allreduce a step."""
    adam = plan["adam"]
    return adam["bytes_per_rank"] / adam["steps"] / (2 * (world - 1) * 2 / world)


# ---- in this process -------------------------------------------------------------------------------


def test_llama_tiny_is_a_llama_style_decoder():
    torch.manual_seed(0)
    model = llama(size="tiny")
    layer = model.model.layers[0]
    assert type(model).__name__ == "LlamaForCausalLM" and len(model.model.layers) == 2
    assert type(layer.input_layernorm).__name__ == type(model.model.norm).__name__ == "LlamaRMSNorm"
    assert not any("position" in name for name, _ in model.named_parameters())  # rotary: no position table
    assert type(model.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
    mlp = layer.mlp  # SwiGLU: down(silu(gate(x)) * up(x))
    assert (mlp.gate_proj.out_features, mlp.up_proj.out_features, mlp.down_proj.in_features) == (384, 384, 384)
    x = torch.randn(3, 128)
    torch.testing.assert_close(mlp(x), mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
    attention = layer.self_attn  # 4 query heads of 32, 2 key/value heads
    assert (attention.q_proj.out_features, attention.k_proj.out_features, attention.v_proj.out_features) == (128, 64, 64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 918_144
    untied = llama(size="tiny", tie_embeddings=False)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert sum(p.numel() for p in untied.parameters()) == 918_144 + 4096 * 128
    assert llama(size="tiny", n_kv_head=4).model.layers[0].self_attn.k_proj.out_features == 128  # plain multi-head
    custom = llama(size="custom", n_layer=1, n_embd=64, n_head=2, ffn_size=96)  # LlamaConfig's defaults for the rest
    assert (custom.config.num_key_value_heads, custom.config.tie_word_embeddings, custom.config.max_position_embeddings) == (2, False, 2048)
    ids = torch.randint(0, 4096, (2, 16))
    assert model(input_ids=ids, labels=ids).loss.item() == pytest.approx(torch.log(torch.tensor(4096.0)).item(), rel=0.05)


@pytest.mark.parametrize(
    "size, vocab_size, published",
    [
        ("1B", 128_256, 1_235_814_400),  # Llama 3.2 1B (tied)
        ("8B", 128_256, 8_030_261_248),  # Llama 3 8B (untied)
        ("125M", 32_000, 124_635_456),  # MobileLLM-125M (tied): "124.6M"
    ],
)
def test_presets_have_the_published_models_parameter_counts(size, vocab_size, published):
    recipe = recipe_from_dict({"model": {"kind": "llama", "size": size}, "data": {"vocab_size": vocab_size, "seq_len": 2048}})
    assert count_parameters(recipe) == published  # as `plan` counts, on the meta device


@pytest.mark.parametrize(
    "model, message",
    [
        ({"n_kv_head": 3}, "model.n_head 4 must be divisible by model.n_kv_head 3"),
        ({"n_head": 8, "n_embd": 136}, "model.n_embd / model.n_head must be even for rotary positions, not 136 / 8"),
        ({"n_head": 3}, "model.n_embd 128 must be divisible by model.n_head 3"),
        ({"size": "70B"}, "model.size '70B' is not a llama preset; choose one of tiny, 125M, 1B, 8B or custom"),
        ({"size": "custom", "n_layer": 2, "n_embd": 64, "n_head": 4}, "model.size custom needs model.n_layer, model.n_embd, model.n_head and model.ffn_size"),
        ({"n_kv_head": 0}, "model.n_kv_head must be positive, not 0"),
        ({"rope_theta": -1.0}, "model.rope_theta must be positive, not -1.0"),
        ({"next_sentence": True}, "model.next_sentence is a BERT setting; llama has none, so leave it unset"),
    ],
)
def test_bad_llama_settings_are_refused_at_load_in_one_sentence(model, message):
    with pytest.raises(UserError) as refused:
        recipe_from_dict({"model": {"kind": "llama", **model}}, "r.yaml")
    assert str(refused.value) == f"r.yaml: {message}."


def test_another_familys_knob_is_refused_and_the_families_of_today_keep_their_shapes():
    with pytest.raises(UserError, match=r"^r.yaml: model.n_kv_head is a Llama setting; gpt2 has none, so leave it unset.$"):
        recipe_from_dict({"model": {"kind": "gpt2", "n_kv_head": 2}}, "r.yaml")
    gpt2 = recipe_from_dict({"model": {"kind": "gpt2"}}).model  # no size: the family's first preset
    assert models.get("gpt2").shape(gpt2) == {"n_layer": 12, "n_embd": 768, "n_head": 12}
    bert = recipe_from_dict({"model": {"kind": "bert", "size": "large", "n_layer": 3}}).model
    assert models.get("bert").shape(bert) == {"n_layer": 3, "n_embd": 1024, "n_head": 16}


def test_hf_causal_lm_needs_a_config_and_takes_its_sizes_from_it(tmp_path):
    with pytest.raises(UserError, match=r"^r.yaml: model.kind hf_causal_lm needs model.hf_config .* or model.init_from.$"):
        recipe_from_dict({"model": {"kind": "hf_causal_lm"}}, "r.yaml")
    with pytest.raises(UserError, match=r"^r.yaml: model.n_layer has no meaning for hf_causal_lm, whose sizes are its config's; leave it unset.$"):
        recipe_from_dict({"model": {"kind": "hf_causal_lm", "hf_config": str(tmp_path), "n_layer": 2}}, "r.yaml")
    with pytest.raises(UserError, match=r"^r.yaml: model.hf_config .*/none does not exist: it names a local directory"):
        recipe_from_dict({"model": {"kind": "hf_causal_lm", "hf_config": str(tmp_path / "none")}}, "r.yaml")
    with pytest.raises(UserError, match=r"^r.yaml: model.hf_config .* holds no config.json; give a directory that save_pretrained or zoa-train export wrote.$"):
        recipe_from_dict({"model": {"kind": "hf_causal_lm", "hf_config": str(tmp_path)}}, "r.yaml")  # empty: no config.json yet
    transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    model = create(recipe_from_dict({"model": {"kind": "hf_causal_lm", "hf_config": str(tmp_path)}}).model, ModelInputs(100, 64, eos_token_id=7))
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.vocab_size == 100 and model.config.eos_token_id == 7
    assert models.of_hf_model_type("qwen2").kind == "hf_causal_lm" and models.of_hf_model_type("llama").kind == "llama"
    assert models.of_hf_model_type("t5") is None  # no causal LM in transformers


def spec(kind: str, knobs: type = models.NoKnobs, **fields) -> models.ModelSpec:
    return models.ModelSpec(kind, kind, "causal_lm", build=lambda cfg, shape, inputs: None, knobs=knobs, **fields)


def test_clashing_names_and_knobs_are_refused_before_anything_is_registered():
    before = models.names()
    with pytest.raises(ValueError, match="registered already"):
        models.register(spec("llama"))
    with pytest.raises(ValueError, match="knob dropout is a key every family has"):
        models.register(spec("mine", dataclasses.make_dataclass("K", [("dropout", float, 0.5)])))
    with pytest.raises(ValueError, match="knob n_kv_head has another type or default"):
        models.register(spec("mine", dataclasses.make_dataclass("K", [("n_kv_head", int, 2)])))
    with pytest.raises(ValueError, match="names knobs it does not have: width"):
        models.register(spec("mine", presets={"small": {"width": 8}}))
    with pytest.raises(TypeError, match="must be a dataclass"):
        models.register(spec("mine", knobs=dict))
    assert models.names() == before and "mine" not in before
    with pytest.raises(UserError, match=f"unknown model kind 'mistral'; the registered ones are {', '.join(before)}"):
        models.get("mistral")


# ---- end to end: llama_tiny ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory, cache_dir) -> Path:
    """recipes/llama_tiny.yaml, 2 ranks, 0/1 Adam, 4 steps."""
    tmp = tmp_path_factory.mktemp("llama")
    done = zoa("run", "recipes/llama_tiny.yaml", "--out", str(tmp / "run"), *short(cache_dir, 4))
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "run"


@pytest.fixture(scope="module")
def text_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text")
    (root / "text.txt").write_text(TEXT)
    (root / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    return {"text": root / "text.txt", "lambada": root / "lambada.jsonl"}


def wikitext(checkpoint: Path, text: Path, out: Path) -> dict:
    done = zoa("eval", "wikitext", "--checkpoint", str(checkpoint), "--data", str(text), "--raw", "--seq-len", "32", "--stride", "16", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_llama_tiny_trains_exports_and_evaluates(llama_run, text_files, tmp_path):
    from zoa_train.evaluation.checkpoints import load_language_model

    records = [json.loads(line) for line in (llama_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["loss"] < 9 for r in records)
    out = tmp_path / "hf"
    done = zoa("export", str(llama_run), str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LlamaForCausalLM" in done.stdout and "AutoModelForCausalLM" in done.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2 and model.config.tie_word_embeddings
    reference = load_language_model(llama_run)
    state = torch.load(llama_run / "checkpoints" / "step_00000004" / "model.pt")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)
    ids = tokenizer(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(model(**ids).logits, reference.model(**ids).logits, rtol=0, atol=1e-6)

    from_run = wikitext(llama_run, text_files["text"], tmp_path / "run.json")
    from_export = wikitext(out, text_files["text"], tmp_path / "export.json")
    assert from_run["step"] == 4 and from_run["tokens"] == from_export["tokens"] > 32
    assert from_run["token_perplexity"] == pytest.approx(from_export["token_perplexity"], rel=1e-5)
    assert 1 < from_run["token_perplexity"] < 4096 * 2
    done = zoa("eval", "lambada", "--checkpoint", str(out), "--data", str(text_files["lambada"]), "--json", str(tmp_path / "lambada.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "lambada.json").read_text())["examples"] == 2


def test_plan_and_convert_deepspeed_know_llama(tmp_path):
    done = zoa("plan", "recipes/llama_1b.yaml", "--nodes", "16", "--gpus-per-node", "8", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(done.stdout)
    recipe = recipe_from_dict({"model": {"kind": "llama", "size": "1B"}, "data": {"vocab_size": 50257, "seq_len": 2048}})
    assert count_parameters(recipe) == 1_235_814_400 - (128_256 - 50_257) * 2048
    assert planned_params(plan, 128) == pytest.approx(count_parameters(recipe), abs=1)
    assert plan["zero_one_adam"]["bits_per_param"] < 1 < plan["onebit_adam"]["bits_per_param"] < plan["adam"]["bits_per_param"]
    out = tmp_path / "llama.yaml"
    done = zoa("convert-deepspeed", "tests/data/deepspeed/bert_large_seq128_zero_one_adam.json", "--model", "llama-1B", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "  kind: llama" in out.read_text() and "  size: 1B" in out.read_text()
    refused(zoa("convert-deepspeed", "tests/data/deepspeed/bert_large_seq128_zero_one_adam.json", "--model", "llama-70B"), "llama-1B", "'llama-70B'")
    refused(zoa("plan", "recipes/llama_tiny.yaml", "--set", "model.n_kv_head=3"), "llama_tiny.yaml: model.n_head 4 must be divisible by model.n_kv_head 3")


# ---- end to end: a family registered from the test tree alone ---------------------------------------

PLUGIN = sets("imports=[model_plugin]", "model.kind=mistral", "model.size=tiny")


@pytest.mark.slow
def test_a_plugin_family_trains_plans_exports_and_evaluates(tmp_path, cache_dir, text_files):
    run = tmp_path / "run"
    done = zoa("run", "recipes/gpt2_tiny.yaml", "--out", str(run), *PLUGIN, *short(cache_dir, 2))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    out = tmp_path / "hf"
    done = zoa("export", str(run), str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert (
        type(model).__name__ == "MistralForCausalLM" and model.config.sliding_window == 32 and model.config.hidden_size == 128
    )  # gpt2_tiny's n_embd over the preset
    state = torch.load(run / "checkpoints" / "step_00000002" / "model.pt")
    assert sorted(state) == sorted(model.state_dict()) and all(torch.equal(model.state_dict()[k], v) for k, v in state.items())

    done = zoa("plan", "recipes/gpt2_tiny.yaml", "--json", *PLUGIN)
    assert done.returncode == 0, done.stderr[-3000:]
    assert planned_params(json.loads(done.stdout), 64) == pytest.approx(sum(p.numel() for p in model.parameters()), abs=1)

    result = wikitext(run, text_files["text"], tmp_path / "wikitext.json")  # the run's recipe imports the plugin
    assert result["step"] == 2 and 1 < result["token_perplexity"] < 4096 * 2
    exported = wikitext(out, text_files["text"], tmp_path / "exported.json")  # no plugin: hf_causal_lm loads any causal LM
    assert exported["token_perplexity"] == pytest.approx(result["token_perplexity"], rel=1e-5)

    refused(zoa("plan", "recipes/gpt2_tiny.yaml", *PLUGIN, "--set", "model.sliding_window=0"), "model.sliding_window must be positive, not 0")
    refused(zoa("plan", "recipes/gpt2_tiny.yaml", *sets("model.kind=mistral")), "model.kind must be one of", "not 'mistral'")


@pytest.mark.slow
def test_a_causal_lm_from_a_hugging_face_config_trains_exports_and_evaluates(tmp_path, cache_dir, text_files):
    import yaml

    config = tmp_path / "qwen2"
    transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2).save_pretrained(config)
    recipe = yaml.safe_load((ROOT / "recipes" / "gpt2_tiny.yaml").read_text())
    recipe["model"] = {"kind": "hf_causal_lm", "hf_config": str(config), "dropout": 0.0}
    (tmp_path / "qwen2.yaml").write_text(yaml.safe_dump(recipe))
    run, out = tmp_path / "run", tmp_path / "hf"
    done = zoa("run", str(tmp_path / "qwen2.yaml"), "--out", str(run), *short(cache_dir, 2))
    assert done.returncode == 0, done.stderr[-3000:]
    done = zoa("export", str(run), str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.vocab_size == 4096 and model.config.num_key_value_heads == 2
    assert json.loads((out / "zoa_export.json").read_text())["model_kind"] == "hf_causal_lm"
    exported = wikitext(out, text_files["text"], tmp_path / "wikitext.json")["token_perplexity"]
    assert exported > 1
    shutil.rmtree(config)  # the run recorded the config it built its model from (model_config/): eval needs hf_config no more
    assert wikitext(run, text_files["text"], tmp_path / "run.json")["token_perplexity"] == pytest.approx(exported, rel=1e-5)

"""The built-in families' builders: GPT-2 (causal LM), BERT (masked LM) and Llama-style decoders (causal LM)
through transformers, ResNets through torchvision; nothing is downloaded unless `init_from` names a hub model.

Each builder takes the recipe's model section, its shape (the preset with the recipe's overrides,
resolved by the family's registry entry, zoa_train/models/registry.py, where the presets and where each
comes from are written) and ModelInputs (what the data says: vocabulary, sequence length, classes).
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from zoa_train import pretrained
from zoa_train.errors import UserError


@dataclass(frozen=True)
class ModelInputs:
    """What the data tells a builder: a language model's vocabulary, sequence length and special tokens;
    an image model's number of classes."""

    vocab_size: int = 0
    seq_len: int = 0
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    num_classes: int = 0

    @classmethod
    def of_tokenizer(cls, tokenizer, seq_len: int) -> "ModelInputs":
        return cls(len(tokenizer), seq_len, tokenizer.eos_token_id, tokenizer.pad_token_id)


def _dropout(cfg, *names: str) -> dict:
    """model.dropout as the config's keyword arguments `names`; none when it is unset (the config's default)."""
    return {name: cfg.dropout for name in names} if cfg.dropout is not None else {}


def _first_line(e: Exception) -> str:
    """The first sentence of a library's message, which may run to several lines of them."""
    return str(e).strip().splitlines()[0].split(". ")[0].rstrip(".") if str(e).strip() else type(e).__name__


def pretrained_config(name: str, key: str = "model.init_from"):
    """The Hugging Face config of the model `name` names (a local directory or a hub name), read alone:
    no weights. UserError of one sentence when there is none."""
    import transformers

    where = pretrained.existing(name, key, "the model's config.json")
    local = pretrained.local_path(name)
    if local is not None and not (local / "config.json").is_file():
        if (local / "recipe.yaml").is_file():
            raise UserError(f"{key} {name} is a zoa-train run directory; export it first (zoa-train export {name} OUT_DIR) and give {key} OUT_DIR.")
        raise UserError(f"{key} {name} holds no config.json; give a directory that save_pretrained or zoa-train export wrote.")
    try:
        return transformers.AutoConfig.from_pretrained(where)
    except (OSError, ValueError) as e:
        if local is not None:
            raise UserError(
                f"{key} {name} holds no loadable Hugging Face config ({_first_line(e)}); give a directory that save_pretrained or zoa-train export wrote."
            ) from None
        raise UserError(
            f"{key} {name} is no local directory and could not be loaded from the hub ({_first_line(e)}); give a local directory, or a hub name when online."
        ) from None


def _from_pretrained(cfg, auto_class, config) -> torch.nn.Module:
    """The weights of model.init_from as `config` (its own, with the recipe's dropout) says, in float32:
    transformers 5 would keep a bf16 checkpoint's weights in bf16, under the trainer's precision."""
    try:
        return auto_class.from_pretrained(pretrained.existing(cfg.init_from, "model.init_from", "the model"), config=config, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise UserError(
            f"model.init_from {cfg.init_from} could not be loaded ({_first_line(e)}); give a directory that save_pretrained or zoa-train export wrote."
        ) from None


def _with_dropout(cfg, config, *names: str):
    """`config` with model.dropout set on its dropout attributes `names` (none when it is unset)."""
    for key, value in _dropout(cfg, *names).items():
        setattr(config, key, value)
    return config


def _positions_hold(cfg, positions: int, inputs: ModelInputs) -> None:
    """A pretrained model with a table of `positions` learned positions cannot take longer inputs."""
    if positions < inputs.seq_len:
        raise UserError(
            f"data.seq_len {inputs.seq_len} is longer than the {positions} positions of the model in model.init_from {cfg.init_from}; "
            f"set data.seq_len to at most {positions}."
        )


def build_gpt2(cfg, shape: dict, inputs: ModelInputs) -> torch.nn.Module:
    """GPT2LMHeadModel of `shape` (n_layer, n_embd, n_head), sized for the vocabulary and at least seq_len positions."""
    import transformers

    if cfg.init_from:
        config = _with_dropout(cfg, pretrained_config(cfg.init_from), "resid_pdrop", "embd_pdrop", "attn_pdrop")
        _positions_hold(cfg, config.n_positions, inputs)
        return _causal_lm_loss(_from_pretrained(cfg, transformers.AutoModelForCausalLM, config))
    config = transformers.GPT2Config(
        vocab_size=inputs.vocab_size,
        n_positions=max(1024, inputs.seq_len),
        n_layer=shape["n_layer"],
        n_embd=shape["n_embd"],
        n_head=shape["n_head"],
        bos_token_id=inputs.eos_token_id,
        eos_token_id=inputs.eos_token_id,
        **_dropout(cfg, "resid_pdrop", "embd_pdrop", "attn_pdrop"),
    )
    return _causal_lm_loss(transformers.GPT2LMHeadModel(config))


def _causal_lm_loss(model: torch.nn.Module) -> torch.nn.Module:
    """Name the loss transformers would pick anyway (its causal-LM cross-entropy): a GPT2LMHeadModel's
    class name matches none of its loss names, so every rank would otherwise warn that it guessed.
    transformers 5 reads the model's attribute, 4.x the config's."""
    model.loss_type = model.config.loss_type = "ForCausalLM"
    return model


def build_bert(cfg, shape: dict, inputs: ModelInputs) -> torch.nn.Module:
    """BertForMaskedLM (BertForPreTraining with `next_sentence`) of `shape`, feed-forward 4 x n_embd."""
    import transformers

    if cfg.init_from:
        config = _with_dropout(cfg, pretrained_config(cfg.init_from), "hidden_dropout_prob", "attention_probs_dropout_prob")
        _positions_hold(cfg, config.max_position_embeddings, inputs)
        return _from_pretrained(cfg, transformers.AutoModelForPreTraining if cfg.next_sentence else transformers.AutoModelForMaskedLM, config)
    config = transformers.BertConfig(
        vocab_size=inputs.vocab_size,
        hidden_size=shape["n_embd"],
        num_hidden_layers=shape["n_layer"],
        num_attention_heads=shape["n_head"],
        intermediate_size=4 * shape["n_embd"],
        max_position_embeddings=max(512, inputs.seq_len),
        pad_token_id=inputs.pad_token_id or 0,
        **_dropout(cfg, "hidden_dropout_prob", "attention_probs_dropout_prob"),
    )
    return transformers.BertForPreTraining(config) if cfg.next_sentence else transformers.BertForMaskedLM(config)


def build_llama(cfg, shape: dict, inputs: ModelInputs) -> torch.nn.Module:
    """LlamaForCausalLM of `shape`: RMSNorm, rotary positions, SwiGLU, n_kv_head key/value heads. Values the
    shape leaves unset (a custom size) take LlamaConfig's defaults; Llama's only dropout is on attention."""
    import transformers

    if cfg.init_from:
        return _from_pretrained(cfg, transformers.AutoModelForCausalLM, _with_dropout(cfg, pretrained_config(cfg.init_from), "attention_dropout"))
    named = {
        "num_hidden_layers": shape["n_layer"],
        "hidden_size": shape["n_embd"],
        "num_attention_heads": shape["n_head"],
        "num_key_value_heads": shape["n_kv_head"],
        "intermediate_size": shape["ffn_size"],
        "tie_word_embeddings": shape["tie_embeddings"],
        "rope_theta": shape["rope_theta"],
    }
    context = max(shape["context"] or transformers.LlamaConfig().max_position_embeddings, inputs.seq_len)
    config = transformers.LlamaConfig(
        vocab_size=inputs.vocab_size,
        max_position_embeddings=context,
        bos_token_id=inputs.eos_token_id,  # a trained byte-level tokenizer has one special token, as GPT-2's
        eos_token_id=inputs.eos_token_id,
        pad_token_id=inputs.pad_token_id,
        **{key: value for key, value in named.items() if value is not None},
        **_dropout(cfg, "attention_dropout"),
    )
    return transformers.LlamaForCausalLM(config)


def build_hf_causal_lm(cfg, shape: dict, inputs: ModelInputs) -> torch.nn.Module:
    """AutoModelForCausalLM of the config `hf_config` names, fresh, with the tokenizer's vocabulary and
    special tokens and at least seq_len positions; or the pretrained model of `init_from`. Either way causal."""
    import transformers

    if cfg.init_from:
        config = _as_decoder(_with_dropout(cfg, pretrained_config(cfg.init_from), "attention_dropout"), f"model.init_from {cfg.init_from}")
        return _from_pretrained(cfg, transformers.AutoModelForCausalLM, config)
    config = _as_decoder(pretrained_config(cfg.hf_config, "model.hf_config"), f"model.hf_config {cfg.hf_config}")
    config.vocab_size = inputs.vocab_size
    config.bos_token_id = config.eos_token_id = inputs.eos_token_id
    config.pad_token_id = inputs.pad_token_id
    if getattr(config, "max_position_embeddings", inputs.seq_len) < inputs.seq_len:
        config.max_position_embeddings = inputs.seq_len
    _with_dropout(cfg, config, "attention_dropout")
    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise UserError(
            f"model.hf_config {cfg.hf_config!r} is a {config.model_type} config, which has no causal LM in transformers: {e}".splitlines()[0]
        ) from None


# Model types whose causal-LM class in transformers sees later tokens even as a decoder: XLNet (a permutation
# LM), XLM (causal only with its own flag), CPM-Ant (a prefix LM). Found by building each causal-LM class of
# transformers 5.25 small and changing one token: every other one that builds is causal with _as_decoder.
NOT_CAUSAL = ("cpmant", "xlm", "xlnet")


def _as_decoder(config, given: str):
    """An encoder's causal-LM class (BertLMHeadModel, RobertaForCausalLM, ...) attends both ways unless its
    config says is_decoder, and trained on next-token labels it would read the answer; decoders' configs
    have no such attribute. The few that no attribute makes causal (`given`: the key and value) are refused."""
    if config.model_type in NOT_CAUSAL:
        raise UserError(
            f"{given} is of type {config.model_type}, whose causal-LM class in transformers sees later tokens too, "
            "so model.kind hf_causal_lm would train it to read the answer; give a causal LM's config."
        )
    if hasattr(config, "is_decoder"):
        config.is_decoder = True
    return config


def build_resnet(cfg, shape: dict, inputs: ModelInputs) -> torch.nn.Module:
    """A torchvision ResNet (model.kind resnet18/34/50) with `num_classes` outputs, randomly initialised, or
    loaded from `init_from`: a file holding a state dict (a zoa-train model.pt or torchvision weights)."""
    import torchvision

    model = getattr(torchvision.models, cfg.kind)(weights=None, num_classes=inputs.num_classes)
    if cfg.init_from:
        try:
            state = torch.load(Path(cfg.init_from).expanduser(), map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, ValueError) as e:
            raise UserError(
                f"model.init_from {cfg.init_from} is not a readable state-dict file ({_first_line(e)}); give a zoa-train model.pt or torchvision weights."
            ) from None
        difference = state_difference(model.state_dict(), state) if isinstance(state, dict) else f"it holds a {type(state).__name__}, not a state dict"
        if difference:
            raise UserError(f"model.init_from {cfg.init_from} is not a {cfg.kind} of {inputs.num_classes} classes ({difference}); give the weights of one.")
        model.load_state_dict(state)
    return model


def state_difference(own: dict, state: dict) -> str | None:
    """How the state dict `state` (a file's) differs from `own` (the model's): counts and the first
    difference, e.g. "2 tensors missing, 0 extra, 1 of another shape; fc.weight is [10, 512] in the file
    and [1000, 512] in the model"; None when it fits."""
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    reshaped = [k for k in own if k in state and tuple(getattr(state[k], "shape", ())) != tuple(own[k].shape)]
    if not (missing or extra or reshaped):
        return None
    if reshaped:
        first = f"{reshaped[0]} is {list(getattr(state[reshaped[0]], 'shape', ()))} in the file and {list(own[reshaped[0]].shape)} in the model"
    else:
        first = f"{missing[0]} is not in the file" if missing else f"{extra[0]} is not in the model"
    return f"{len(missing)} tensors missing, {len(extra)} extra, {len(reshaped)} of another shape; {first}"

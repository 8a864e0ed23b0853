"""The built-in families' builders: GPT-2 (causal LM), BERT (masked LM) and Llama-style decoders (causal LM)
through transformers, ResNets through torchvision; nothing is downloaded unless `init_from` names a hub model.

Each builder takes the recipe's model section, its shape (the preset with the recipe's overrides,
resolved by the family's registry entry, zoa_train/models/registry.py, where the presets and where each
comes from are written) and ModelInputs (what the data says: vocabulary, sequence length, classes).
"""

from dataclasses import dataclass

import torch

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


def _from_pretrained(cfg, auto_class):
    try:
        return auto_class.from_pretrained(cfg.init_from)
    except OSError as e:
        raise UserError(f"model.init_from {cfg.init_from!r} could not be loaded (a local model directory, or a hub name when online): {e}") from None


def build_gpt2(cfg, shape: dict, inputs: ModelInputs) -> torch.nn.Module:
    """GPT2LMHeadModel of `shape` (n_layer, n_embd, n_head), sized for the vocabulary and at least seq_len positions."""
    import transformers

    if cfg.init_from:
        return _causal_lm_loss(_from_pretrained(cfg, transformers.AutoModelForCausalLM))
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
        return _from_pretrained(cfg, transformers.AutoModelForPreTraining if cfg.next_sentence else transformers.AutoModelForMaskedLM)
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
        return _from_pretrained(cfg, transformers.AutoModelForCausalLM)
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
    special tokens and at least seq_len positions; or the pretrained model of `init_from`."""
    import transformers

    if cfg.init_from:
        return _from_pretrained(cfg, transformers.AutoModelForCausalLM)
    try:
        config = transformers.AutoConfig.from_pretrained(cfg.hf_config)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"model.hf_config {cfg.hf_config!r} is not a loadable Hugging Face config (a directory with config.json): {first}") from None
    config.vocab_size = inputs.vocab_size
    config.bos_token_id = config.eos_token_id = inputs.eos_token_id
    config.pad_token_id = inputs.pad_token_id
    if getattr(config, "max_position_embeddings", inputs.seq_len) < inputs.seq_len:
        config.max_position_embeddings = inputs.seq_len
    for key, value in _dropout(cfg, "attention_dropout").items():
        setattr(config, key, value)
    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise UserError(
            f"model.hf_config {cfg.hf_config!r} is a {config.model_type} config, which has no causal LM in transformers: {e}".splitlines()[0]
        ) from None


def build_resnet(cfg, shape: dict, inputs: ModelInputs) -> torch.nn.Module:
    """A torchvision ResNet (model.kind resnet18/34/50) with `num_classes` outputs, randomly initialised, or
    loaded from `init_from`: a file holding a state dict (a zoa-train model.pt or torchvision weights)."""
    import torchvision

    model = getattr(torchvision.models, cfg.kind)(weights=None, num_classes=inputs.num_classes)
    if cfg.init_from:
        try:
            state = torch.load(cfg.init_from, map_location="cpu", weights_only=True)
            model.load_state_dict(state)
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"model.init_from {cfg.init_from!r} is not a {cfg.kind} state dict with {inputs.num_classes} classes: {first}") from None
    return model

"""GPT-2 (causal LM) and BERT (masked LM) from size presets or a local/hub checkpoint; torchvision ResNets.

Presets follow the published shapes: GPT-2 117M/medium/large/xl (12/24/36/48 layers of
768/1024/1280/1600 with 12/16/20/25 heads, context 1024) and BERT base/large (12/24 layers of
768/1024 with 12/16 heads, feed-forward 4x). `n_layer`, `n_embd`, `n_head` override a preset;
size "custom" needs all three. BERT with `next_sentence` is BertForPreTraining (MLM + next-sentence head).
"""

from dataclasses import dataclass
from typing import Literal

import torch

from zoa_train.errors import UserError


@dataclass
class ModelConfig:
    """A recipe's model section: which model and its size (the recipe schema, zoa_train/config.py, uses it)."""

    # The model family, and with it the task (zoa_train/tasks): gpt2 causal_lm, bert masked_lm,
    # resnet18/34/50 image_classification.
    kind: Literal["gpt2", "bert", "resnet18", "resnet34", "resnet50"] = "gpt2"
    size: str = "117M"  # transformers: a preset (gpt2: 117M/small, medium, large, xl; bert: base, large) or "custom"
    n_layer: int | None = None  # overrides of the preset
    n_embd: int | None = None
    n_head: int | None = None
    dropout: float = 0.1
    next_sentence: bool = False  # BERT: add the next-sentence head and train on sentence pairs
    init_from: str | None = None  # a local Hugging Face model directory or a hub name when online; ResNet: a state-dict file


MODEL_PRESETS = {
    "gpt2": {
        "117M": (12, 768, 12),
        "small": (12, 768, 12),
        "medium": (24, 1024, 16),
        "large": (36, 1280, 20),
        "xl": (48, 1600, 25),
    },
    "bert": {"base": (12, 768, 12), "large": (24, 1024, 16)},
}


def model_shape(cfg: ModelConfig) -> tuple[int, int, int]:
    """(n_layer, n_embd, n_head) of a transformer preset with its overrides; UserError for an impossible shape."""
    presets = MODEL_PRESETS[cfg.kind]
    if cfg.size == "custom":
        if None in (cfg.n_layer, cfg.n_embd, cfg.n_head):
            raise UserError("model.size custom needs model.n_layer, model.n_embd and model.n_head.")
        base = (0, 0, 0)
    elif cfg.size in presets:
        base = presets[cfg.size]
    else:
        raise UserError(f"model.size {cfg.size!r} is not a {cfg.kind} preset; choose one of {', '.join(presets)} or custom.")
    n_layer, n_embd, n_head = (v if v is not None else b for v, b in zip((cfg.n_layer, cfg.n_embd, cfg.n_head), base))
    if n_embd % n_head:
        raise UserError(f"model.n_embd {n_embd} must be divisible by model.n_head {n_head}.")
    return n_layer, n_embd, n_head


def _from_pretrained(cfg: ModelConfig, auto_class):
    try:
        return auto_class.from_pretrained(cfg.init_from)
    except OSError as e:
        raise UserError(f"model.init_from {cfg.init_from!r} could not be loaded (a local model directory, or a hub name when online): {e}") from None


def build_gpt2(cfg: ModelConfig, vocab_size: int, seq_len: int, eos_token_id: int | None = None) -> torch.nn.Module:
    """GPT2LMHeadModel for `cfg`, sized for `vocab_size` and at least `seq_len` positions."""
    import transformers

    if cfg.init_from:
        return _causal_lm_loss(_from_pretrained(cfg, transformers.AutoModelForCausalLM))
    n_layer, n_embd, n_head = model_shape(cfg)
    config = transformers.GPT2Config(
        vocab_size=vocab_size,
        n_positions=max(1024, seq_len),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
    )
    return _causal_lm_loss(transformers.GPT2LMHeadModel(config))


def _causal_lm_loss(model: torch.nn.Module) -> torch.nn.Module:
    """Name the loss transformers would pick anyway (its causal-LM cross-entropy): a GPT2LMHeadModel's
    class name matches none of its loss names, so every rank would otherwise warn that it guessed.
    transformers 5 reads the model's attribute, 4.x the config's."""
    model.loss_type = model.config.loss_type = "ForCausalLM"
    return model


def build_bert(cfg: ModelConfig, vocab_size: int, seq_len: int, pad_token_id: int | None = None) -> torch.nn.Module:
    """BertForMaskedLM (BertForPreTraining with `next_sentence`) for `cfg`."""
    import transformers

    if cfg.init_from:
        return _from_pretrained(cfg, transformers.AutoModelForPreTraining if cfg.next_sentence else transformers.AutoModelForMaskedLM)
    n_layer, n_embd, n_head = model_shape(cfg)
    config = transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=n_embd,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        intermediate_size=4 * n_embd,
        max_position_embeddings=max(512, seq_len),
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
        pad_token_id=pad_token_id or 0,
    )
    return transformers.BertForPreTraining(config) if cfg.next_sentence else transformers.BertForMaskedLM(config)


RESNETS = ("resnet18", "resnet34", "resnet50")


def build_resnet(cfg: ModelConfig, num_classes: int) -> torch.nn.Module:
    """A torchvision ResNet with `num_classes` outputs, randomly initialised, or loaded from
    `init_from`: a file holding a state dict (a zoa-train model.pt or torchvision weights)."""
    import torchvision

    model = getattr(torchvision.models, cfg.kind)(weights=None, num_classes=num_classes)
    if cfg.init_from:
        try:
            state = torch.load(cfg.init_from, map_location="cpu", weights_only=True)
            model.load_state_dict(state)
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"model.init_from {cfg.init_from!r} is not a {cfg.kind} state dict with {num_classes} classes: {first}") from None
    return model

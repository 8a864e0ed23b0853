"""A model family registered from outside zoa_train/, as a user's own module would: a Mistral-style
decoder (transformers' MistralForCausalLM: sliding-window attention, grouped-query attention), named
`mistral` in recipes that list this module under `imports`.

tests/test_models.py trains it with `zoa-train run`, counts it with `plan`, exports it and evaluates
it with `eval wikitext`, with no edit under zoa_train/; nothing in zoa_train knows its name.
"""

from dataclasses import dataclass

from zoa_train import checks
from zoa_train.errors import UserError
from zoa_train.models import registry


@dataclass
class MistralKnobs:
    sliding_window: int = 32  # each token attends to at most this many tokens before it


def build(cfg, shape: dict, inputs: registry.ModelInputs):
    import transformers

    config = transformers.MistralConfig(
        vocab_size=inputs.vocab_size,
        hidden_size=shape["n_embd"],
        num_hidden_layers=shape["n_layer"],
        num_attention_heads=shape["n_head"],
        num_key_value_heads=shape["n_head"] // 2,
        intermediate_size=3 * shape["n_embd"],
        max_position_embeddings=max(1024, inputs.seq_len),
        sliding_window=cfg.sliding_window,
        attention_dropout=cfg.dropout or 0.0,
        bos_token_id=inputs.eos_token_id,
        eos_token_id=inputs.eos_token_id,
    )
    return transformers.MistralForCausalLM(config)


def check_shape(cfg, shape: dict) -> None:
    if shape["n_embd"] % shape["n_head"] or shape["n_head"] % 2:
        raise UserError(f"model.n_head must be even and divide model.n_embd, not {shape['n_head']} of {shape['n_embd']}.")


SPEC = registry.register(
    registry.ModelSpec(
        kind="mistral",
        title="Mistral (plugin)",
        task="causal_lm",
        build=build,
        presets={"tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4}},
        check=check_shape,
        knobs=MistralKnobs,
        checks={"sliding_window": checks.positive},
        tokenizer="gpt2",
        hf_model_types=("mistral",),
        evaluations=("wikitext", "lambada"),
    )
)

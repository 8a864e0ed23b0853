"""The model families a recipe can name, one ModelSpec each: the one place that knows them by name.

Everything that names a model family reads this table: the recipe schema (zoa_train/config.py takes
every spec's knobs as keys of the model section and `kind` from the names), the tasks (which task a
family trains, which tokenizer it trains when none is given, the builder), `plan` (the parameter
count, from a model built on the meta device), `eval` and `export` (how a checkpoint is rebuilt, which
Hugging Face model types are which family, which evaluations accept it) and `convert-deepspeed`
(`--model KIND-SIZE`). Adding a family is its builder, its entry (a `register` call: at the end of
this file, or in a module of your own that a recipe lists under `imports`), and its tests;
tests/model_plugin.py registers one from outside the package.
"""

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zoa_train import checks, pretrained
from zoa_train.checks import Check
from zoa_train.comm.sharding import units
from zoa_train.errors import UserError
from zoa_train.models import builders
from zoa_train.models.builders import ModelInputs
from zoa_train.registry import Registry


@dataclass
class SharedKnobs:
    """The model section's keys that every family takes (a family without presets ignores the shape keys)."""

    size: str | None = None  # a preset of the family (model.kind), "custom", or null: the family's first preset
    n_layer: int | None = None  # overrides of the preset
    n_embd: int | None = None
    n_head: int | None = None
    dropout: float | None = None  # null: the family's own default (GPT-2, BERT: 0.1; Llama: 0.0; hf_causal_lm: its config's)
    init_from: str | None = None  # a local Hugging Face model directory or a hub name when online; ResNet: a state-dict file


SHARED_CHECKS: dict[str, Check] = {
    "dropout": checks.unset_or(checks.FRACTION),
    "n_layer": checks.unset_or(checks.positive),
    "n_embd": checks.unset_or(checks.positive),
    "n_head": checks.unset_or(checks.positive),
}


@dataclass
class NoKnobs:
    """The knobs of a family that has none beyond the shared ones."""


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # model.kind in a recipe
    title: str  # in messages and tables
    task: str  # the task it trains: a name in zoa_train.tasks.TASKS
    # (the recipe's model section, its shape (`shape`; empty without presets or with init_from), ModelInputs)
    # -> the model: fresh, or the weights of model.init_from
    build: Callable[[Any, dict, ModelInputs], torch.nn.Module]
    # model.size -> values of shape knobs (the first: the default size); overrides apply on top
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    custom_needs: tuple[str, ...] = ("n_layer", "n_embd", "n_head")  # what model.size custom must set
    # rules on the model section and its shape (`shape`; empty without presets or with init_from), across
    # values; UserError of one sentence
    check: Callable[[Any, dict], None] | None = None
    knobs: type = NoKnobs  # a dataclass of its own keys in the model section, with defaults
    checks: Mapping[str, Check] = field(default_factory=dict)  # knob -> constraint
    tokenizer: str | None = None  # the tokenizer family trained when data.tokenizer is unset (zoa_train/data/tokenizer.py)
    # config.model_type of the Hugging Face directories that hold this family; ANY_CAUSAL_LM: any other
    # that transformers' AutoModelForCausalLM loads
    hf_model_types: tuple[str, ...] = ()
    evaluations: tuple[str, ...] = ()  # the `zoa-train eval` commands that accept it
    # shape knob -> the attribute of the family's Hugging Face config that holds it: with init_from, what
    # the model section states of the shape (its preset, its keys) must be what the pretrained model has
    hf_shape: Mapping[str, str] = field(default_factory=dict)
    # the model -> its repeated blocks, in order: what train.activation_checkpointing recomputes and
    # train.compile compiles one by one (and comm.shard node shards one by one). The default: every
    # block of every outermost nn.ModuleList (a transformer's layers).
    blocks: Callable[[torch.nn.Module], list[torch.nn.Module]] = units

    def shape(self, cfg) -> dict:
        """The preset `cfg.size` names with cfg's set values over it ("custom": cfg's alone, each of
        `custom_needs` given); UserError of one sentence for an unknown size or an impossible shape."""
        size = cfg.size or next(iter(self.presets))
        if size == "custom":
            missing = [key for key in self.custom_needs if getattr(cfg, key) is None]
            if missing:
                raise UserError(f"model.size custom needs {_and(['model.' + key for key in self.custom_needs])}.")
            base = {}
        else:
            base = self.preset(size)
        keys = [*self.presets[next(iter(self.presets))], *self.custom_needs]
        return {key: getattr(cfg, key) if getattr(cfg, key) is not None else base.get(key) for key in dict.fromkeys(keys)}

    def preset(self, size: str) -> Mapping[str, Any]:
        if size not in self.presets:
            raise UserError(f"model.size {size!r} is not a {self.kind} preset; choose one of {', '.join(self.presets)} or custom.")
        return self.presets[size]

    def stated_shape(self, cfg) -> dict:
        """What the section itself says of the shape: its preset's values (a preset named) under the shape
        keys it sets; nothing of the default preset. With init_from, the model must be of this shape."""
        base = self.preset(cfg.size) if cfg.size not in (None, "custom") else {}
        return {**base, **{key: getattr(cfg, key) for key in self.hf_shape if getattr(cfg, key) is not None}}

    def shape_of(self, cfg) -> dict:
        """`shape(cfg)`, or {} for a family without presets or a model from init_from (its own shape)."""
        return self.shape(cfg) if self.presets and not cfg.init_from else {}


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


_SPECS: Registry[ModelSpec] = Registry("model family", key="kind", unknown="model kind", reserved=[f.name for f in dataclasses.fields(SharedKnobs)])
names, get, find, knob_fields = _SPECS.names, _SPECS.get, _SPECS.find, _SPECS.knob_fields


def register(spec: ModelSpec) -> ModelSpec:
    """Add a model family. Its knobs join the model section of every recipe, so a knob of the same name
    as another family's must mean the same (type and default), and none may be a shared one."""
    if dataclasses.is_dataclass(spec.knobs):
        own = {f.name for f in dataclasses.fields(spec.knobs)} | {f.name for f in dataclasses.fields(SharedKnobs)}
        unknown = (set(spec.checks) | {k for preset in spec.presets.values() for k in preset} | set(spec.custom_needs)) - own
        if unknown:
            raise ValueError(f"model family {spec.kind!r} names knobs it does not have: {', '.join(sorted(unknown))}")
    return _SPECS.register(spec)


ANY_CAUSAL_LM = "*"


def of_hf_model_type(model_type: str) -> ModelSpec | None:
    """The family whose Hugging Face directories have config.model_type `model_type` (one that names
    it, else one that takes ANY_CAUSAL_LM of a model type transformers has a causal LM for), or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    named = [spec for spec in _SPECS.values() if model_type in spec.hf_model_types]
    catch_all = [spec for spec in _SPECS.values() if ANY_CAUSAL_LM in spec.hf_model_types and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    return next(iter(named + catch_all), None)


def accepting(evaluation: str) -> list[ModelSpec]:
    """The families an evaluation (`eval wikitext`, ...) accepts."""
    return [spec for spec in _SPECS.values() if evaluation in spec.evaluations]


def create(section, inputs: ModelInputs) -> torch.nn.Module:
    """The model a recipe's model section names (timm's create_model, by recipe), for what the data says."""
    spec = get(section.kind)
    if section.init_from and spec.hf_model_types:  # a hub model's config is first seen here; a local one's at check_section too
        check_pretrained(spec, section, builders.pretrained_config(section.init_from))
    return spec.build(section, spec.shape_of(section), inputs)


def _not_causal(model_type: str) -> str | None:
    """Why a Hugging Face model of `model_type` cannot train as a causal LM, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "which transformers has no causal LM for"
    if model_type in builders.NOT_CAUSAL:
        return "whose causal-LM class in transformers sees later tokens too"
    return None


def _takes(spec: ModelSpec, model_type: str) -> bool:
    """Whether the family `spec` trains a Hugging Face model of `model_type`."""
    return model_type in spec.hf_model_types or (ANY_CAUSAL_LM in spec.hf_model_types and _not_causal(model_type) is None)


def _config_value(config, attribute: str):
    # transformers 5 keeps rope_theta in rope_parameters; older configs (and 4.x) at the top level
    value = getattr(config, attribute, None)
    return value if value is not None else (getattr(config, "rope_parameters", None) or {}).get(attribute)


def check_pretrained(spec: ModelSpec, cfg, config) -> None:
    """The model of model.init_from (its Hugging Face `config`) is one the family `spec` trains, and of
    the shape the model section states; UserError of one sentence otherwise."""
    model_type = config.model_type
    if not _takes(spec, model_type):
        if ANY_CAUSAL_LM in spec.hf_model_types:
            raise UserError(
                f"model.init_from {cfg.init_from} holds a model of type {model_type}, {_not_causal(model_type)}, "
                f"and model.kind {spec.kind} trains causal LMs; give it the directory of a causal LM."
            )
        other = of_hf_model_type(model_type)
        wanted = " or ".join(spec.hf_model_types)
        fix = (
            f"set model.kind {other.kind} to train it"
            if other is not None and other.task == spec.task
            else f"give it the directory of a model of type {wanted}"
        )
        raise UserError(f"model.init_from {cfg.init_from} holds a model of type {model_type} and model.kind {spec.kind} takes type {wanted}; {fix}.")
    stated = spec.stated_shape(cfg)
    differ = [key for key in spec.hf_shape if key in stated and stated[key] != _config_value(config, spec.hf_shape[key])]
    if differ:
        given = [f"model.{key}" for key in differ if getattr(cfg, key) is not None]
        if len(given) < len(differ):  # a value of the preset
            given.insert(0, "model.size")
        loaded = _and([f"{key} {_config_value(config, spec.hf_shape[key])}" for key in differ])
        said = _and([f"{key} {stated[key]}" for key in differ])
        raise UserError(
            f"model.init_from {cfg.init_from} holds a model of {loaded}, not {said} as the recipe states; "
            f"a pretrained model keeps its own shape, so leave {_and(given)} unset."
        )


def check_section(section, origin: str) -> None:
    """The family's rules on a recipe's model section: its shape (preset, custom's keys, the family's
    own rules; with init_from, the pretrained model's family and shape when it lies in a local directory),
    and no other family's knob set away from its default."""
    spec = get(section.kind)
    own = {f.name for f in dataclasses.fields(spec.knobs)}
    for f in knob_fields():
        if f.name not in own and getattr(section, f.name) != f.default:
            owners = _and([s.title for s in _SPECS.values() if f.name in {g.name for g in dataclasses.fields(s.knobs)}])
            raise UserError(f"{origin}: model.{f.name} is a {owners} setting; {section.kind} has none, so leave it unset.")
    try:
        shape = spec.shape_of(section)
        if spec.check is not None:
            spec.check(section, shape)
        if section.init_from and spec.hf_model_types:
            spec.stated_shape(section)  # a size that is no preset
            if pretrained.local_path(section.init_from) is not None:  # its config is cheap to read here; a hub name's is not
                check_pretrained(spec, section, builders.pretrained_config(section.init_from))
    except UserError as e:
        raise UserError(f"{origin}: {e}") from None


# ---- the built-in families ------------------------------------------------------------------------


def heads_divide_width(cfg, shape: dict) -> None:
    if shape and shape["n_embd"] % shape["n_head"]:
        raise UserError(f"model.n_embd {shape['n_embd']} must be divisible by model.n_head {shape['n_head']}.")


# GPT-2 117M/medium/large/xl (Radford et al. 2019, Table 2; the released configs): 12/24/36/48 layers of
# 768/1024/1280/1600 with 12/16/20/25 heads, context 1024.
GPT2_PRESETS = {
    "117M": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "small": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
    "large": {"n_layer": 36, "n_embd": 1280, "n_head": 20},
    "xl": {"n_layer": 48, "n_embd": 1600, "n_head": 25},
}
LANGUAGE_EVALUATIONS = ("wikitext", "lambada")

register(
    ModelSpec(
        "gpt2",
        "GPT-2",
        "causal_lm",
        builders.build_gpt2,
        GPT2_PRESETS,
        check=heads_divide_width,
        tokenizer="gpt2",
        hf_model_types=("gpt2",),
        evaluations=LANGUAGE_EVALUATIONS,
        hf_shape={"n_layer": "n_layer", "n_embd": "n_embd", "n_head": "n_head"},
    )
)


@dataclass
class BertKnobs:
    next_sentence: bool = False  # add the next-sentence head (BertForPreTraining) and train on sentence pairs


# BERT base/large (Devlin et al. 2019): 12/24 layers of 768/1024 with 12/16 heads, feed-forward 4x.
register(
    ModelSpec(
        "bert",
        "BERT",
        "masked_lm",
        builders.build_bert,
        {"base": {"n_layer": 12, "n_embd": 768, "n_head": 12}, "large": {"n_layer": 24, "n_embd": 1024, "n_head": 16}},
        check=heads_divide_width,
        knobs=BertKnobs,
        tokenizer="bert",
        hf_model_types=("bert",),
        evaluations=("glue",),
        hf_shape={"n_layer": "num_hidden_layers", "n_embd": "hidden_size", "n_head": "num_attention_heads"},
    )
)


def resnet_rules(cfg, shape: dict) -> None:
    # a ResNet's init_from is a state-dict file, never a hub name: one that is not there is missing
    if cfg.init_from and not Path(cfg.init_from).expanduser().is_file():
        problem = "is a directory" if Path(cfg.init_from).expanduser().is_dir() else "does not exist"
        raise UserError(f"model.init_from {cfg.init_from} {problem}; {cfg.kind} takes a state-dict file (a zoa-train model.pt or torchvision weights).")


def _resnet_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A torchvision ResNet's residual blocks (its stages are nn.Sequentials, not ModuleLists)."""
    return [block for stage in (model.layer1, model.layer2, model.layer3, model.layer4) for block in stage]


for _depth in (18, 34, 50):
    register(
        ModelSpec(
            f"resnet{_depth}",
            f"ResNet-{_depth}",
            "image_classification",
            builders.build_resnet,
            check=resnet_rules,
            evaluations=("imagenet",),
            blocks=_resnet_blocks,
        )
    )


@dataclass
class LlamaKnobs:
    n_kv_head: int | None = None  # key/value heads (grouped-query attention; n_head: plain multi-head); default the preset's
    ffn_size: int | None = None  # the SwiGLU hidden width; default the preset's
    tie_embeddings: bool | None = None  # the output layer shares the token embedding; default the preset's (custom: untied)
    rope_theta: float | None = None  # the rotary base; default the preset's (custom: 10,000)
    context: int | None = None  # the longest input (max_position_embeddings), at least data.seq_len; default the preset's (custom: 2,048)


def llama_shape_rules(cfg, shape: dict) -> None:
    if not shape:
        return
    heads_divide_width(cfg, shape)
    kv = shape["n_kv_head"] or shape["n_head"]
    if shape["n_head"] % kv:
        raise UserError(f"model.n_head {shape['n_head']} must be divisible by model.n_kv_head {kv}.")
    if (shape["n_embd"] // shape["n_head"]) % 2:
        raise UserError(f"model.n_embd / model.n_head must be even for rotary positions, not {shape['n_embd']} / {shape['n_head']}.")


# Llama-style decoders: RMSNorm, rotary positions, SwiGLU, grouped-query attention (transformers' LlamaForCausalLM).
LLAMA_PRESETS = {
    # CPU-sized, gpt2_tiny's width and depth (0.92M parameters with its 4,096-token vocabulary, tied): 2 query
    # heads per key/value head and the SwiGLU width 3 x n_embd (Llama's 8/3 x n_embd rounded up to 128).
    "tiny": {"n_layer": 2, "n_embd": 128, "n_head": 4, "n_kv_head": 2, "ffn_size": 384, "tie_embeddings": True, "rope_theta": 10000.0, "context": 2048},
    # MobileLLM-125M (Liu et al. 2024, Table 9) = SmolLM-135M's config.json: deep and thin, 3 query heads per
    # key/value head, tied embeddings; 125M parameters with a 32,000-token vocabulary.
    "125M": {"n_layer": 30, "n_embd": 576, "n_head": 9, "n_kv_head": 3, "ffn_size": 1536, "tie_embeddings": True, "rope_theta": 10000.0, "context": 2048},
    # Llama 3.2 1B's config.json (1.24B parameters with its 128,256-token vocabulary). Its 128K context is rope
    # scaling added after pre-training at 8K; this preset is the 8K pre-training shape.
    "1B": {"n_layer": 16, "n_embd": 2048, "n_head": 32, "n_kv_head": 8, "ffn_size": 8192, "tie_embeddings": True, "rope_theta": 500000.0, "context": 8192},
    # Llama 3 8B's config.json (Meta 2024): 8.03B parameters with its 128,256-token vocabulary, untied.
    "8B": {"n_layer": 32, "n_embd": 4096, "n_head": 32, "n_kv_head": 8, "ffn_size": 14336, "tie_embeddings": False, "rope_theta": 500000.0, "context": 8192},
}

register(
    ModelSpec(
        "llama",
        "Llama",
        "causal_lm",
        builders.build_llama,
        LLAMA_PRESETS,
        custom_needs=("n_layer", "n_embd", "n_head", "ffn_size"),
        check=llama_shape_rules,
        knobs=LlamaKnobs,
        checks={
            "n_kv_head": checks.unset_or(checks.positive),
            "ffn_size": checks.unset_or(checks.positive),
            "rope_theta": checks.unset_or(checks.positive),
            "context": checks.unset_or(checks.positive),
        },
        tokenizer="gpt2",  # byte-level BPE with one end-of-text token, as Llama 3's
        hf_model_types=("llama",),
        evaluations=LANGUAGE_EVALUATIONS,
        # not context: the builder raises it to data.seq_len, and a preset's may be shorter than the released model's (1B)
        hf_shape={
            "n_layer": "num_hidden_layers",
            "n_embd": "hidden_size",
            "n_head": "num_attention_heads",
            "n_kv_head": "num_key_value_heads",
            "ffn_size": "intermediate_size",
            "tie_embeddings": "tie_word_embeddings",
            "rope_theta": "rope_theta",
        },
    )
)


@dataclass
class HFCausalLMKnobs:
    # hf_causal_lm: the Hugging Face config of the architecture to build fresh (a directory holding
    # config.json, or a hub name when online), e.g. a Qwen2 or Mistral config; its sizes are the model's
    hf_config: str | None = None


def hf_causal_lm_rules(cfg, shape: dict) -> None:
    if not cfg.hf_config and not cfg.init_from:
        raise UserError("model.kind hf_causal_lm needs model.hf_config (a Hugging Face config: a directory with config.json) or model.init_from.")
    for key in ("size", "n_layer", "n_embd", "n_head"):
        if getattr(cfg, key) is not None:
            raise UserError(f"model.{key} has no meaning for hf_causal_lm, whose sizes are its config's; leave it unset.")
    if cfg.hf_config and cfg.init_from:
        raise UserError("model.hf_config and model.init_from both name the model; init_from brings its own config, so leave model.hf_config unset.")
    if cfg.hf_config and pretrained.local_path(cfg.hf_config) is not None:  # cheap to read here; a hub name's is read when the model is built
        config = builders.pretrained_config(cfg.hf_config, "model.hf_config")
        if not _takes(get(cfg.kind), config.model_type):
            raise UserError(
                f"model.hf_config {cfg.hf_config} is a config of type {config.model_type}, {_not_causal(config.model_type)}; give a causal LM's config."
            )


# Any other causal LM transformers has (Qwen2, Mistral, Phi, Gemma, OLMo, ...), from its config: one
# generic entry rather than one per architecture, so a new architecture needs no code; a family that
# wants presets, knobs or rules of its own (as llama) gets an entry of its own.
register(
    ModelSpec(
        "hf_causal_lm",
        "Hugging Face causal LM",
        "causal_lm",
        builders.build_hf_causal_lm,
        check=hf_causal_lm_rules,
        knobs=HFCausalLMKnobs,
        tokenizer="gpt2",
        hf_model_types=(ANY_CAUSAL_LM,),
        evaluations=LANGUAGE_EVALUATIONS,
    )
)

"""Recipes: a YAML file validated against typed dataclasses, with `--set section.key=value` overrides.

Unknown keys are refused with the closest valid key suggested; values are checked against the
field types and a few cross-field rules; every problem is a UserError of one sentence naming the
file and key (docs/bad-input.md lists them). A recipe file must at least name model.kind; an empty one is
refused rather than training every default. The resolved recipe is what the trainer uses and what it writes to the run directory.
"""

import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from zoa_train import checks
from zoa_train.comm import registry as collectives
from zoa_train.comm.kernels import CHOICES as KERNEL_CHOICES
from zoa_train.comm.sharding import SHARDINGS
from zoa_train.errors import UserError
from zoa_train.files import load_yaml
from zoa_train.models import registry as models
from zoa_train.optim import LRSchedule, registry


@dataclass
class DataConfig:
    # text: "bundled" (Austen), "files", or a hub dataset name (e.g. wikitext);
    # images: "digits" (bundled, 10 classes, 32x32) or "folder" (an ImageFolder tree at `root`)
    source: str = "bundled"
    config: str | None = None  # hub dataset config (e.g. wikitext-103-raw-v1)
    train_files: list[str] = field(default_factory=list)
    validation_files: list[str] = field(default_factory=list)
    text_field: str = "text"
    tokenizer: str | None = None  # a pretrained tokenizer (hub name or directory); none: train one on the corpus
    vocab_size: int = 8192  # of a trained tokenizer
    seq_len: int = 128
    cache_dir: str = "~/.cache/zoa-train"
    # read files or a hub dataset while training, each rank its own part, instead of tokenizing it whole
    # first; needs tokenizer, and validation_files for files (docs/data.md, "Streaming")
    streaming: bool = False
    shuffle_window: int = 0  # streaming: take each run of this many consecutive blocks of a rank in a seeded order; 0: the stream's order
    # images
    root: str | None = None  # source "folder": holds train/<class>/* and val/<class>/* (ImageNet as usually unpacked)
    crop_size: int = 224  # training: RandomResizedCrop to this; evaluation: centre crop
    resize_size: int = 256  # evaluation: shorter side resized to this before the centre crop
    min_crop_scale: float = 0.08  # smallest area fraction RandomResizedCrop keeps
    hflip: bool = True  # random horizontal flips in training
    workers: int = 4  # decoding processes per rank
    # source "megatron": Megatron-LM indexed datasets, mapped as they are (docs/data.md); needs tokenizer
    prefixes: list[str] = field(default_factory=list)  # paths of .bin/.idx pairs without the suffix
    weights: list[float] = field(default_factory=list)  # one per prefix: a blend, as Megatron's --data-path 0.3 A 0.7 B; none: each prefix whole
    validation_prefixes: list[str] = field(default_factory=list)  # none: the last 5% of each training prefix's documents are held out
    tokenize_workers: int = 0  # processes that tokenize text into the token cache (bundled, files, hub); 0: one per CPU core


class OptimizerConfig:
    """The optimizer section: `name`, the knobs every optimizer shares (registry.SharedKnobs), then
    every registered optimizer's own knobs, all at the same level so that switching `name` keeps
    the rest of a recipe. The dataclass is made from the registry (`optimizer_section()`), so an
    optimizer registered by a module the recipe imports brings its keys; this class is what its
    instances are."""

    def __reduce__(self):  # the made class has no importable name: pickle the values
        return _optimizer_config_from, (dataclasses.asdict(self),)


class ModelConfig:
    """The model section, made from the model registry as the optimizer section is from its own
    (`model_section()`): `kind`, the keys every family shares (models.SharedKnobs), then every
    registered family's own knobs; a family's rules refuse another family's knob set (models.check_section)."""

    def __reduce__(self):
        return _model_config_from, (dataclasses.asdict(self),)


def _optimizer_config_from(values: dict) -> OptimizerConfig:
    return optimizer_section()(**values)


def _model_config_from(values: dict) -> ModelConfig:
    return model_section()(**values)


_SECTION: dict[tuple, type] = {}


def _made_section(base: type, key: str, names: tuple[str, ...], default: str, knobs: list[dataclasses.Field]) -> type:
    """The dataclass of a section named by a registry: `key` (one of `names`), then `knobs`."""
    cache = (base, names)
    if cache not in _SECTION:
        fields = [(key, Literal[names], field(default=default))]
        fields += [(f.name, f.type, field(default=f.default)) for f in knobs]
        section = dataclasses.make_dataclass(base.__name__, fields, bases=(base,))
        section.__module__ = __name__
        _SECTION[cache] = section
    return _SECTION[cache]


def optimizer_section() -> type:
    """The optimizer section's dataclass for the optimizers registered now."""
    return _made_section(OptimizerConfig, "name", registry.names(), DEFAULT_OPTIMIZER, [*dataclasses.fields(registry.SharedKnobs), *registry.knob_fields()])


def comm_section() -> type:
    """The comm section's dataclass for the collectives registered now (comm.topology: auto or one of them)."""
    return _made_section(CommConfig, "topology", collectives.topologies(), collectives.AUTO, [])


def model_section() -> type:
    """The model section's dataclass for the model families registered now."""
    return _made_section(ModelConfig, "kind", models.names(), DEFAULT_MODEL, [*dataclasses.fields(models.SharedKnobs), *models.knob_fields()])


DEFAULT_MODEL = "gpt2"
DEFAULT_OPTIMIZER = "zero_one_adam"


@dataclass
class ScheduleConfig:
    name: Literal["constant", "exponential", "cosine"] = "constant"
    warmup_steps: int = 0
    decay_factor: float = 0.99  # exponential
    decay_every: int = 520  # exponential
    min_lr: float = 0.0  # cosine


@dataclass
class TrainConfig:
    steps: int = 1000
    global_batch_size: int = 32  # sequences per optimizer step over all ranks
    micro_batch_size: int = 16  # sequences per forward/backward on one rank
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    grad_clip: float = 0.0  # max norm of this rank's gradient (0: off)
    # global: clip by the whole gradient's norm after backward, so the 1-bit rounds start in step(); bucket:
    # clip each bucket by its share of grad_clip as soon as its gradients are final, so comm.overlap keeps
    # starting rounds during backward (docs/algorithm.md, "Clipping by bucket"; the optimizers that sync
    # themselves); auto: bucket where comm.overlap starts rounds during backward, global elsewhere
    grad_clip_rule: Literal["auto", "global", "bucket"] = "auto"
    skip_nonfinite: int = 0  # steps with a NaN/inf loss to skip (all ranks together, one scalar allreduce per step); 0: stop at the first
    seed: int = 0
    nproc: int = 2  # local ranks when not started by torchrun or srun
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: int = 1800  # how long a collective waits for the other ranks; must exceed the longest checkpoint write
    log_every: int = 10
    val_every: int = 100  # 0: only at the end
    val_batches: int = 8
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    # What a resume at another world size does (a node lost or added under torchrun's elastic agent, a
    # Slurm job requeued on the nodes it has): off refuses it unless --reshard; reshard continues there on
    # its own, from the newest checkpoint taken at a synchronised step, and takes the periodic checkpoints
    # at synchronised steps (docs/faults.md, "Elastic: a node leaves, the run goes on"); live (zoa-train run's
    # own ranks) drops a lost rank at the next collective and admits one that comes back at a later sync,
    # while the others go on (docs/faults.md, "Live: the others go on").
    elastic: Literal["off", "reshard", "live"] = "off"
    # Recompute each block's activations in backward instead of keeping them (torch's non-reentrant
    # checkpoint, per block of the model registry's ModelSpec.blocks): none, full (every block) or
    # selective (every other block: about half the saving for a quarter of the recompute).
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool = False  # torch.compile each block's forward (not the optimizer, not the communication hooks)
    # The device's peak dense TFLOPS at train.precision, for MFU; null: from zoa-train's table of known
    # devices (an unknown device logs no MFU, and says so once).
    peak_tflops: float | None = None


@dataclass
class CommConfig:
    # How the 1-bit optimizers' sync uses the cluster (docs/algorithm.md, "Node-aware sync"): auto is
    # hierarchical on several nodes of several ranks each, all of one size, flat otherwise.
    # Any collective of zoa_train/comm/registry.py (`comm_section()` makes the section that lists them).
    topology: str = "auto"
    ranks_per_node: int = 0  # 0: nodes found by hostname; G: ranks r*G..r*G+G-1 are node r (emulated nodes)
    # The 1-bit call's compute passes (zoa_train/comm/kernels): auto is fused (Triton on GPUs, C++ on
    # CPUs) where it runs, else torch ops; the choice changes speed, not the wire format.
    kernels: Literal[KERNEL_CHOICES] = "auto"
    # The 1-bit optimizers' rounds in buckets of whole tensors of at most this many MB of fp32
    # (docs/algorithm.md, "Overlap"); 0: one round per step for all parameter groups. A change of
    # bucketing is a change of layout: a resume refuses it, --reshard restarts the error buffers.
    bucket_cap_mb: float = 0.0
    # Start each bucket's round during backward, as soon as its gradients are final (buckets of
    # 100 MB when bucket_cap_mb is 0; with comm.shard node, as FSDP2 reduces each block's gradients).
    # Off for a run whose gradients change after backward (train.grad_clip by the global rule, fp16 loss
    # scaling, train.skip_nonfinite): its rounds start in step().
    overlap: bool = False
    # node: shard the model, its gradients and optimizer state over each node's ranks (FSDP2) and
    # send only the shard between nodes (docs/algorithm.md, "Sharded inside the node"); none: every
    # rank holds all of it.
    shard: Literal[SHARDINGS] = "none"


@dataclass
class LoggingConfig:
    wandb: Literal["offline", "online", "disabled"] = "offline"
    tensorboard: bool = True
    project: str = "zoa-train"


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=lambda: model_section()())
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=lambda: optimizer_section()())
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    comm: CommConfig = field(default_factory=lambda: comm_section()())
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Python modules imported before the rest of the recipe is read, by every process that reads it:
    # they register optimizers (zoa_train.optim.registry.register; docs/optimizers.md) or model families
    # (zoa_train.models.registry.register; docs/models.md) of your own.
    imports: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return _plain(dataclasses.asdict(self))

    def lr_schedule(self) -> LRSchedule:
        """The learning rate at each step, as the trainer sets it and `plan` assumes it."""
        s = self.schedule
        return LRSchedule(s.name, self.optimizer.lr, s.warmup_steps, s.decay_factor, s.decay_every, s.min_lr, self.train.steps)


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Read, override and validate a recipe file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe file {path} does not exist.")
    try:
        data = load_yaml(path.read_text(encoding="utf-8"), str(path)) or {}
    except UnicodeDecodeError:
        raise UserError(f"{path} is not a text file (YAML in UTF-8); is it the recipe?") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{path} is not valid YAML{where}.") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a mapping of sections (model, data, optimizer, ...).")
    _check_names_a_model(data, path)
    for override in overrides:
        apply_override(data, override)
    return recipe_from_dict(data, str(path))


def _check_names_a_model(data: dict, path: Path) -> None:
    """A recipe file must at least name model.kind: every other key has a default, and an empty file
    (or one of comments, or `{}`) would otherwise silently train the 117M GPT-2. Checked on the file
    itself, before --set overrides, so that what a recipe file trains is always written in it."""
    if not data:
        raise UserError(f"recipe file {path} is empty; a recipe must at least name model.kind (e.g. model: {{kind: gpt2}}).")
    model = data.get("model")
    if not isinstance(model, dict) or model.get("kind") is None:
        raise UserError(f"{path} does not name model.kind; a recipe must at least say which model it trains ({', '.join(models.names())}).")


def recipe_from_dict(data: dict, origin: str = "recipe") -> Recipe:
    """Validate a recipe given as a mapping (a resolved recipe, or a file's contents), after
    importing the modules it lists under `imports`."""
    if isinstance(data, dict) and data.get("imports") is not None:
        registry.import_modules(_coerce(data["imports"], list[str], origin, "imports"), origin)
    recipe = build_section(Recipe, data, origin)
    _check(recipe, origin)
    return recipe


def apply_override(data: dict, override: str) -> None:
    """Apply one `--set section.key=value` (the value read as YAML) to a recipe mapping, in place."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set {override!r} must look like section.key=value.")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"--set {override!r}: {part} is not a section.")
    try:
        node[parts[-1]] = load_yaml(text, f"--set {override!r}") if text.strip() else None
    except yaml.YAMLError:
        raise UserError(f"--set {override!r}: the value is not valid YAML.") from None


# Keys other trainers use to shard or split the model (DeepSpeed's zero_optimization, FSDP, Megatron's
# tensor/pipeline sizes). The 1-bit optimizers need each node to hold the whole model and optimizer state
# (among its ranks, with comm.shard: node), so there is no other such key; an unknown one is refused with that reason.
_MODEL_SPLITTING = re.compile(
    r"^zero$|zero_?(stage|optimi[sz]ation|\d)|fsdp|shard|tensor_?(model_?)?parallel|pipeline|model_?parallel|^[tp]p(_size|_degree)?$|deepspeed|megatron"
)


def build_section(cls, data, origin: str, prefix: str = ""):
    """An instance of the dataclass `cls` from a mapping, every value checked against its type;
    unknown keys are refused with the closest valid one. `prefix` names the section in messages."""
    if not isinstance(data, dict):
        raise UserError(f"{origin}: {prefix.rstrip('.') or 'the recipe'} must be a mapping, not {type(data).__name__}.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in data.items():
        if key not in names and _MODEL_SPLITTING.search(str(key).lower()):
            raise UserError(
                f"{origin}: unknown key {prefix}{key}; zoa-train shards only inside a node (FSDP2, comm.shard: node), so that each node "
                "holds the whole model and optimizer state among its ranks as 1-bit and 0/1 Adam need: ZeRO across nodes, tensor and "
                "pipeline parallelism are not supported."
            )
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys are {', '.join(names)}."
            raise UserError(f"{origin}: unknown key {prefix}{key}{hint}")
        made = {OptimizerConfig: optimizer_section, ModelConfig: model_section, CommConfig: comm_section}.get(hints[key])
        kind = made() if made else hints[key]
        if dataclasses.is_dataclass(kind):
            values[key] = build_section(kind, value if value is not None else {}, origin, f"{prefix}{key}.")
        else:
            values[key] = _coerce(value, kind, origin, f"{prefix}{key}")
    return cls(**values)


def _coerce(value, kind, origin: str, key: str):
    """Check `value` against the annotation `kind`; ints are accepted for floats, lists for tuples."""
    origin_type = typing.get_origin(kind)
    args = typing.get_args(kind)
    if origin_type in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], origin, key)
    if origin_type is Literal:
        if value is False and "off" in args:  # YAML 1.1 reads an unquoted off as false (train.elastic: off)
            value = "off"
        if value not in args:
            raise UserError(f"{origin}: {key} must be one of {', '.join(map(str, args))}, not {value!r}.")
        return value
    if origin_type in (list, tuple):
        if isinstance(value, str) and origin_type is list:
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{origin}: {key} must be a list, not {value!r}.")
        if origin_type is tuple and len(value) != len(args):
            raise UserError(f"{origin}: {key} must have {len(args)} values, not {len(value)}.")
        item_types = args if origin_type is tuple else args * len(value)
        items = [_coerce(v, t, origin, key) for v, t in zip(value, item_types)]
        return tuple(items) if origin_type is tuple else items
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-3 (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UserError(f"{origin}: {key} must be {kind.__name__}, not {value!r}.")
    if kind is int and not -(2**63) <= value < 2**63:  # what torch (seeds, step counters) and the C++ below it can hold
        raise UserError(f"{origin}: {key} must fit in 64 bits (at most {2**63 - 1:,}), not {value}.")
    if kind is float and not math.isfinite(value):
        raise UserError(f"{origin}: {key} must be a finite number, not {value}.")
    return value


# A collective's deadline is counted in nanoseconds in 64 bits (Gloo, NCCL): about 292 years from the
# clock's start can be held; a billion seconds (31 years) stays well inside it.
MAX_TIMEOUT_S = 10**9

# What each numeric key must be, checked in this order (each optimizer's registry entry adds its own
# knobs'); rules that involve several keys or a value's meaning are in _check.
CHECKS: dict[str, checks.Check] = {
    "train.steps": checks.positive,
    "train.global_batch_size": checks.positive,
    "train.micro_batch_size": checks.positive,
    "train.nproc": checks.positive,
    "train.log_every": checks.positive,
    "train.timeout_s": checks.from_to(1, MAX_TIMEOUT_S),
    "train.val_batches": checks.positive,
    "train.keep_checkpoints": checks.positive,
    "train.grad_clip": checks.non_negative,
    "train.skip_nonfinite": checks.non_negative,
    "train.val_every": checks.non_negative,
    "train.checkpoint_every": checks.non_negative,
    "train.seed": checks.non_negative,
    "train.peak_tflops": checks.positive_or_null,
    "data.seq_len": checks.positive,
    "data.vocab_size": checks.positive,
    "data.crop_size": checks.positive,
    "data.resize_size": checks.positive,
    "data.min_crop_scale": checks.within(0, 1, low_open=True, high_open=False),
    "data.workers": checks.non_negative,
    "data.shuffle_window": checks.non_negative,
    "schedule.decay_every": checks.positive,
    "schedule.warmup_steps": checks.non_negative,
    "schedule.decay_factor": checks.within(0, 1, low_open=True, high_open=False),
    "schedule.min_lr": checks.non_negative,
    "comm.ranks_per_node": checks.non_negative,
    "comm.bucket_cap_mb": checks.non_negative,
    "data.weights": checks.each(checks.positive),
    "data.tokenize_workers": checks.non_negative,
}


def _check(recipe: Recipe, origin: str) -> None:
    """The table of checks, then rules that involve a value's meaning or several fields."""
    o, d = recipe.optimizer, recipe.data
    table = {
        **CHECKS,
        **{f"model.{key}": check for key, check in models.SHARED_CHECKS.items()},
        **{f"model.{key}": check for kind in models.names() for key, check in models.get(kind).checks.items()},
    }
    for key, check in table.items():
        section, name = key.split(".")
        value = getattr(getattr(recipe, section), name)
        problem = check(value)
        if problem:
            raise checks.refusal(origin, key, problem, value)
    registry.check_section(o, origin, [o.name])  # every knob, and the rule across the named optimizer's knobs
    if recipe.schedule.name == "cosine" and recipe.schedule.min_lr > o.lr:
        raise UserError(f"{origin}: schedule.min_lr {recipe.schedule.min_lr} is above optimizer.lr {o.lr}; the cosine schedule decays from lr down to min_lr.")
    final_lr = recipe.lr_schedule()(recipe.train.steps - 1)
    if recipe.schedule.name == "exponential" and final_lr < sys.float_info.min:
        raise UserError(
            f"{origin}: the exponential schedule (schedule.decay_factor {recipe.schedule.decay_factor} every {recipe.schedule.decay_every:,} steps) "
            f"takes the lr from {o.lr} to {final_lr:.3g} by step {recipe.train.steps:,}, below the smallest normal float ({sys.float_info.min:.3g}); "
            "decay more slowly or train fewer steps."
        )
    models.check_section(recipe.model, origin)  # the preset, custom's sizes, the family's rules: before any rank starts
    for name in d.train_files + d.validation_files:
        if not any(ch in name for ch in "*?[") and Path(name).expanduser().is_dir():
            raise UserError(f"{origin}: data file {name} is a directory; data.train_files and data.validation_files name files or glob patterns.")
    if recipe.comm.shard == "node":
        _check_sharding(recipe, origin)
    if recipe.train.grad_clip_rule == "bucket" and not registry.get(o.name).syncs_itself:
        raise UserError(
            f"{origin}: train.grad_clip_rule bucket clips inside the optimizers that sync themselves ({', '.join(n for n in registry.names() if registry.get(n).syncs_itself)}); "
            f"{o.name} reduces its gradients with DDP or FSDP2, so set train.grad_clip_rule global."
        )
    if recipe.train.elastic == "live":
        _check_live(recipe, origin)
    if o.name in ("zero_one_adam", "diloco") and o.sync_delay:
        if recipe.comm.overlap:
            rounds = "1-bit round" if o.name == "zero_one_adam" else "outer round"
            raise UserError(
                f"{origin}: optimizer.sync_delay 1 lets each {rounds} run behind the whole next step, so its rounds start in step(), "
                "not during backward; set comm.overlap false."
            )
    from zoa_train.tasks import task_class  # imports nothing heavy

    task_class(recipe).check(recipe, origin)


def _check_live(recipe: Recipe, origin: str) -> None:
    """What train.elastic live does not (yet) combine with, refused before any rank starts."""
    o, c, t = recipe.optimizer, recipe.comm, recipe.train
    live = [n for n in registry.names() if registry.get(n).syncs_itself]
    refusal = None
    if not registry.get(o.name).syncs_itself:
        refusal = f"optimizer.name {o.name} reduces its gradients with DDP, whose group cannot change while it runs; live takes {', '.join(live)}"
    elif c.shard == "node":
        refusal = "comm.shard node shards the model over a node's ranks, which a lost rank would take with it; set comm.shard none"
    elif c.overlap:
        refusal = "comm.overlap starts rounds during backward, which a lost rank could leave half done outside the step; set comm.overlap false"
    elif c.topology != collectives.AUTO and collectives.get(c.topology).node_aware:
        refusal = f"comm.topology {c.topology} needs the same number of ranks on every node, which a lost rank breaks; set comm.topology auto (node-aware while the nodes are even)"
    elif c.ranks_per_node:
        refusal = f"comm.ranks_per_node {c.ranks_per_node} emulates nodes of a fixed size, which a lost rank would leave uneven; set comm.ranks_per_node 0"
    elif o.sync_delay:
        refusal = "optimizer.sync_delay lets a round run behind the next step, past the point where a lost rank is dropped; set optimizer.sync_delay 0"
    elif t.backend == "nccl" or (t.backend == "auto" and _cuda_available()):
        refusal = "it regroups the ranks over Gloo (CPU ranks) for now; set train.backend gloo"
    if refusal:
        raise UserError(f"{origin}: train.elastic live: {refusal}.")


def _check_sharding(recipe: Recipe, origin: str) -> None:
    """What comm.shard node does not combine with, refused before any rank starts."""
    c, o = recipe.comm, recipe.optimizer
    if not registry.get(o.name).shardable:
        raise UserError(f"{origin}: optimizer.name {o.name} does not train sharded; comm.shard node takes {', '.join(registry.shardable_names())}.")
    if c.topology != collectives.AUTO and collectives.get(c.topology).node_aware:
        raise UserError(
            f"{origin}: comm.shard node sends each shard between nodes already (the node-aware sync's inter-node part); set comm.topology auto or flat."
        )
    if recipe.train.precision == "fp16":
        raise UserError(
            f"{origin}: comm.shard node trains in fp32 or bf16, not fp16 (whose overflow check would see one shard's gradients); set train.precision bf16."
        )


def clip_rule(recipe: Recipe) -> str:
    """train.grad_clip_rule as it applies: auto is bucket where the 1-bit rounds start during backward
    (comm.overlap, an optimizer that syncs itself), global elsewhere."""
    rule = recipe.train.grad_clip_rule
    if rule == "auto":
        return "bucket" if recipe.comm.overlap and registry.get(recipe.optimizer.name).syncs_itself else "global"
    return rule


def rounds_kept_in_step(recipe: Recipe) -> str | None:
    """What in `recipe` changes the gradients after backward, so that its 1-bit rounds start in step()
    even with comm.overlap (the trainer's rule, which `plan` follows), or None."""
    t = recipe.train
    return (
        "train.grad_clip"
        if t.grad_clip > 0 and clip_rule(recipe) == "global"
        else "fp16 loss scaling"
        if t.precision == "fp16"
        else "train.skip_nonfinite"
        if t.skip_nonfinite
        else None
    )


def check_batch_layout(recipe: Recipe, world_size: int, origin: str = "recipe") -> int:
    """Gradient-accumulation steps for this world size; refuses a global batch, or emulated nodes
    (comm.ranks_per_node), that do not divide it."""
    t, g = recipe.train, recipe.comm.ranks_per_node
    if g and world_size % g:
        raise UserError(f"{origin}: comm.ranks_per_node {g} does not divide the {world_size} ranks into whole nodes.")
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size % per_step:
        raise UserError(
            f"{origin}: train.global_batch_size {t.global_batch_size} is not divisible by micro_batch_size x world size = {t.micro_batch_size} x {world_size}."
        )
    return t.global_batch_size // per_step


def live_shrink_warning(recipe: Recipe, world_size: int) -> str | None:
    """train.elastic live: the fewer ranks a run may drop to whose micro-batches cannot make up the global batch
    (the run stops there), in one sentence; None when every smaller world size works."""
    t = recipe.train
    fits = [n for n in range(1, world_size + 1) if t.global_batch_size % (t.micro_batch_size * n) == 0]
    stops = [n for n in range(world_size - 1, 0, -1) if n not in fits]
    if not stops:
        return None
    return (
        f"train.elastic live: train.global_batch_size {t.global_batch_size} in micro-batches of {t.micro_batch_size} splits over "
        f"{_listed(fits)} ranks, so a run that drops to {_listed(stops, 'or')} ranks stops there (its checkpoints resume at any size that fits)."
    )


def _listed(numbers: list[int], last: str = "and") -> str:
    words = [str(n) for n in numbers]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {last} {words[-1]}"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

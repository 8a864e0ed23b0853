"""The optimizers a recipe can name, one OptimizerSpec each: the one place that knows them by name.

Everything that names an optimizer reads this table: the recipe schema (zoa_train/config.py takes
every spec's knobs as keys of the optimizer section), the factory `create` (what the trainer
trains with), `plan` (what a whole run would send), `report` and `bench netsim` (titles, colours,
which optimizers there are). Adding an optimizer is its module, its entry (a `register` call: in
builtin.py, or in a module of your own that a recipe lists under `imports`), and its tests.

A spec's `build` returns a TrainingOptimizer (zoa_train/optim/training.py): DDPBacked for an optimizer
that lets DDP average the gradients, SelfSyncing around one that communicates itself. Knob defaults
are read from the optimizer classes' own signatures, so each default is written once.
"""

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from zoa_train import checks
from zoa_train.checks import Check
from zoa_train.comm import CollectiveFactory, OneBitAllReduce
from zoa_train.comm.sharding import is_sharded, shard_model
from zoa_train.comm.topology import NodeGroups
from zoa_train.errors import UserError
from zoa_train.optim.training import TrainingOptimizer, parameter_groups
from zoa_train.optim.zero_one_adam import ZeroOneAdam
from zoa_train.plan.counts import MemoryContext, MemoryCounts, PlanContext, PlanCounts
from zoa_train.precision import DTYPES
from zoa_train.registry import Registry

BASELINE = "adam"  # what speed-ups and time to target are measured against
OTHER_COLOUR = "#8e44ad"  # plots: an optimizer whose spec names no colour


def library_default(optimizer: Callable, name: str):
    """A knob's default as the library defines it (the signature of `optimizer`): never restated."""
    return inspect.signature(optimizer).parameters[name].default


@dataclass
class SharedKnobs:
    """The optimizer section's keys that every optimizer takes. Defaults are the library's
    (zoa_train.optim), which follow the authors' DeepSpeed defaults but bias_correction (on, as in
    torch.optim.Adam); docs/algorithm.md ("Defaults")
    lists them beside the authors' values."""

    lr: float = library_default(ZeroOneAdam, "lr")
    betas: tuple[float, float] = library_default(ZeroOneAdam, "betas")
    eps: float = library_default(ZeroOneAdam, "eps")
    weight_decay: float = library_default(ZeroOneAdam, "weight_decay")
    bias_correction: bool = library_default(ZeroOneAdam, "bias_correction")
    allreduce_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"  # full-precision collectives


SHARED_CHECKS: dict[str, Check] = {
    "lr": checks.positive,
    "betas": checks.each(checks.FRACTION),
    "eps": checks.positive,
    "weight_decay": checks.non_negative,
}

# What a resume may change (zoa_train/train/resume_rules.py): None, the knob applies from the next step; a
# string, why it cannot change during a run; a function of the change (a ResumeChange), either.
ResumeRule = None | str | Callable[[Any], str | None]

SHARED_RESUME: dict[str, ResumeRule] = {
    **dict.fromkeys(("lr", "betas", "eps", "weight_decay", "allreduce_dtype")),
    "bias_correction": "it decides what the saved moments and frozen variance hold (and, for adam, which torch optimizer keeps them)",
}


@dataclass
class NoKnobs:
    """The knobs of an optimizer that has none beyond the shared ones."""


@dataclass(frozen=True)
class BuildContext:
    """What a spec's `build` gets: the model on its device, the world size, the shared knobs, its own
    knobs (an instance of its `knobs` dataclass) and the collective its 1-bit rounds use."""

    model: torch.nn.Module
    device: torch.device
    world_size: int
    shared: SharedKnobs
    knobs: Any
    collective: CollectiveFactory = OneBitAllReduce
    sharding: NodeGroups | None = None  # comm.shard node: shard the model inside each node (specs that are `shardable`)

    def parameter_groups(self) -> list[dict]:
        """Weight decay on matrices and kernels only (zoa_train.optim.training.parameter_groups);
        sharded first inside the node when the run is, so that the groups hold this rank's shards."""
        if self.sharding is not None and not is_sharded(self.model):
            shard_model(self.model, self.sharding.mesh["local"], DTYPES[self.shared.allreduce_dtype])
        return parameter_groups(self.model, self.shared.weight_decay)

    @property
    def process_group(self):
        """What a self-syncing optimizer exchanges over: the world, or when sharded the ranks that hold its shard."""
        return self.sharding.inter if self.sharding is not None else None

    def optimizer_kwargs(self) -> dict:
        """The shared knobs as the library optimizers take them (weight decay is in the groups)."""
        s = self.shared
        return dict(lr=s.lr, betas=s.betas, eps=s.eps, bias_correction=s.bias_correction, allreduce_dtype=DTYPES[s.allreduce_dtype])


@dataclass(frozen=True)
class OptimizerSpec:
    name: str  # optimizer.name in a recipe
    title: str  # in tables and plots
    build: Callable[[BuildContext], TrainingOptimizer]
    plan: Callable[[PlanContext], PlanCounts]
    knobs: type = NoKnobs  # a dataclass of its own recipe keys in the optimizer section, with defaults
    checks: Mapping[str, Check] = field(default_factory=dict)  # knob -> constraint
    plan_note: Callable[[dict], str] | None = None  # a line under the plan table, from its plan record
    colour: str = OTHER_COLOUR
    uses_collective: bool = False  # its rounds go through BuildContext.collective, so comm.topology applies
    shardable: bool = False  # its build honours BuildContext.sharding (comm.shard node)
    syncs_itself: bool = False  # its build is a SelfSyncing optimizer (no DDP): it can clip by bucket (train.grad_clip_rule)
    # A rule across its knobs: None, or what is wrong in one sentence (checked at recipe load and by `create`).
    rule: Callable[[Any], str | None] | None = None
    # What its optimizer holds on one rank besides parameters and gradients (`plan`'s memory); None, or
    # None returned (e.g. sharded, for an optimizer that cannot be): not planned.
    memory: Callable[[MemoryContext], MemoryCounts | None] | None = None
    # Its knobs' rules on resume (SHARED_RESUME's form); a knob it leaves out is refused on resume.
    resume: Mapping[str, ResumeRule] = field(default_factory=dict)

    def check_rule(self, knobs: Any) -> str | None:
        """What its `rule` says of `knobs` (an instance of its knobs dataclass), None when it is kept."""
        return self.rule(knobs) if self.rule is not None else None

    def knobs_from(self, values: object | Mapping) -> Any:
        """Its knobs taken from an object (a recipe's optimizer section) or a mapping; missing ones keep their defaults."""
        get = _getter(values)
        return self.knobs(**{f.name: get(f.name, f.default) for f in dataclasses.fields(self.knobs)})


_SPECS: Registry[OptimizerSpec] = Registry("optimizer", reserved=[f.name for f in dataclasses.fields(SharedKnobs)])
names, get, find, knob_fields = _SPECS.names, _SPECS.get, _SPECS.find, _SPECS.knob_fields


def _getter(values: object | Mapping) -> Callable[[str, Any], Any]:
    """get(name, default) on a mapping of knobs or on an object with knobs as attributes (a recipe's section)."""
    return values.get if isinstance(values, Mapping) else lambda name, default: getattr(values, name, default)


def register(spec: OptimizerSpec) -> OptimizerSpec:
    """Add an optimizer. Its knobs join the optimizer section of every recipe, so a knob of the same
    name as another optimizer's must mean the same (type and default), and none may be a shared one."""
    if dataclasses.is_dataclass(spec.knobs):
        unknown = set(spec.checks) - {f.name for f in dataclasses.fields(spec.knobs)}
        if unknown:
            raise ValueError(f"optimizer {spec.name!r} checks knobs it does not have: {', '.join(sorted(unknown))}")
    return _SPECS.register(spec)


def knob_values(section: object) -> dict:
    """Every registered knob's value in a recipe's optimizer section (for `plan`, which plans them all)."""
    return {f.name: getattr(section, f.name) for f in knob_fields()}


def check_section(values: object | Mapping, origin: str, rules: Iterable[str] = ()) -> None:
    """Refuse, in one sentence that starts with `origin`, optimizer knobs (a recipe's optimizer section,
    or a mapping of some knobs; the others keep their defaults) of which one fails its check, or whose
    rule across its knobs fails for an optimizer named in `rules`. Every knob is checked: a recipe's
    section holds every registered one. The one check of optimizer knobs (recipes, the integrations,
    `plan`, `create`)."""
    get = _getter(values)
    table = {**SHARED_CHECKS, **{key: check for spec in _SPECS.values() for key, check in spec.checks.items()}}
    defaults = {f.name: f.default for f in [*dataclasses.fields(SharedKnobs), *knob_fields()]}
    for key, check in table.items():
        value = get(key, defaults[key])
        problem = check(value)
        if problem:
            raise checks.refusal(origin, f"optimizer.{key}", problem, value)
    for name in rules:
        spec = _SPECS.get(name)
        problem = spec.check_rule(spec.knobs_from(values))
        if problem:
            raise UserError(f"{origin}: {problem}.")


def create(
    section,
    model: torch.nn.Module,
    device: torch.device,
    world_size: int,
    collective: CollectiveFactory = OneBitAllReduce,
    sharding: NodeGroups | None = None,
) -> TrainingOptimizer:
    """The TrainingOptimizer a recipe's optimizer section names (timm's create_optimizer, by recipe);
    with `sharding`, the model sharded inside each node (the spec must be `shardable`)."""
    spec = get(section.name)
    check_section(section, f"optimizer {spec.name}", [spec.name])
    if sharding is not None and not spec.shardable:
        raise UserError(f"optimizer {spec.name} does not train sharded; comm.shard node takes {', '.join(shardable_names())}.")
    return spec.build(BuildContext(model, device, world_size, section, spec.knobs_from(section), collective, sharding))


def resume_rule(knob: str, optimizer: str) -> ResumeRule:
    """Whether optimizer knob `knob` may change when a run of `optimizer` resumes (SHARED_RESUME's form):
    a shared knob's rule, the optimizer's own rule for its knob, None for another optimizer's knob (this
    run does not use it)."""
    if knob in SHARED_RESUME:
        return SHARED_RESUME[knob]
    spec = find(optimizer)
    if spec is None or knob not in {f.name for f in dataclasses.fields(spec.knobs)}:
        return None
    return spec.resume.get(knob, f"optimizer {optimizer} does not say whether optimizer.{knob} can change during a run")


def uses_knob(optimizer: str, knob: str) -> bool:
    """Whether a run of `optimizer` reads optimizer knob `knob` (a shared one, or one of its own)."""
    spec = find(optimizer)
    return knob in SHARED_RESUME or knob == "name" or (spec is not None and knob in {f.name for f in dataclasses.fields(spec.knobs)})


def shardable_names() -> tuple[str, ...]:
    return tuple(name for name in names() if get(name).shardable)


def import_modules(modules: Iterable[str], origin: str) -> None:
    """Import modules that register optimizers (a recipe's `imports`); one sentence if one cannot be."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 -- whatever the module raises, the recipe cannot be used
            raise UserError(f"{origin}: imports: module {module} could not be imported ({type(e).__name__}: {e}).") from None

"""The built-in optimizers' registry entries (zoa_train/optim/registry.py holds the table and what it
does with them): for each, its knobs (recipe keys of the optimizer section), how to build it from a
recipe, what a whole run sends (`plan`), what one rank holds (`memory`), a note for `plan`'s table, and
which knobs may change on a resume. The package imports this module, so the table is full whenever
zoa_train.optim is imported.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from zoa_train import checks
from zoa_train.comm import CollectiveFactory, TopKAllReduce
from zoa_train.comm import registry as collectives
from zoa_train.comm.topk import TOPK_STATE, topk_buffers, topk_layout, topk_wire
from zoa_train.errors import UserError
from zoa_train.optim.adam import DataParallelAdam
from zoa_train.optim.diloco import DiLoCo, OuterSchedule, fragment_of
from zoa_train.optim.lr_schedules import LRSchedule
from zoa_train.optim.onebit_adam import OneBitAdam
from zoa_train.optim.powersgd import PowerSGDHook, powersgd_elements
from zoa_train.optim.registry import BuildContext, OptimizerSpec, check_section, library_default, register
from zoa_train.optim.schedules import LOCAL_STEP_POLICIES, StepDecision, ZeroOneSchedule, variance_update_bound
from zoa_train.optim.training import DDPBacked, HSDPBacked, SelfSyncing, TrainingOptimizer
from zoa_train.optim.zero_one_adam import VAR_UPDATE_WEIGHTINGS, ZeroOneAdam
from zoa_train.plan.counts import AllGathers, Allreduces, MemoryContext, MemoryCounts, PlanContext, PlanCounts, collective_memory, fp32
from zoa_train.precision import DTYPES
from zoa_train.step_kinds import LOCAL, ONEBIT, VARIANCE


def no_unfreezing(change) -> str | None:
    """The rule of a knob that ends the variance's updates (freeze_step, var_freeze_step): once the
    checkpoint is past it the optimizer holds the variance's denominator instead, so the knob may not move
    past the checkpoint's step; before that it may change either way."""
    if change.step >= change.was and change.now > change.step:
        return (
            f"the variance froze at step {change.was:,} and the optimizer has held its denominator since, not the "
            f"variance that more updates would need; set it to at most {change.step:,} (no further effect) or keep it"
        )
    return None


def adam_on_ddp(ctx: BuildContext) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """The Adam that DDP-backed optimizers put on the averaged gradients: torch.optim.AdamW (fused on
    CUDA), which always corrects bias; without bias correction DataParallelAdam over a one-rank group
    (DDP has averaged the gradients, so it only does the math, the same math as the 1-bit optimizers)."""
    s = ctx.shared

    def adam(groups: list[dict]) -> torch.optim.Optimizer:
        if s.bias_correction:
            fused = ctx.device.type == "cuda"
            return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, eps=s.eps, fused=fused, foreach=not fused)
        own, _ = dist.new_subgroups(group_size=1)  # a collective: every rank makes its one-rank group
        return DataParallelAdam(groups, lr=s.lr, betas=s.betas, eps=s.eps, bias_correction=False, process_group=own)

    return adam


def _build_adam(ctx: BuildContext) -> TrainingOptimizer:
    """What users run: DDP with Adam on top; sharded, torch's HSDP with AdamW."""
    s = ctx.shared
    if ctx.sharding is not None:
        if not s.bias_correction:
            raise UserError("optimizer adam sharded (comm.shard node) is torch's AdamW, which always corrects bias; set optimizer.bias_correction true.")
        return HSDPBacked(ctx.model, ctx.sharding, adam_on_ddp(ctx), name="adam", weight_decay=s.weight_decay, allreduce_dtype=DTYPES[s.allreduce_dtype])
    return DDPBacked(
        ctx.model, ctx.device, ctx.world_size, adam_on_ddp(ctx), name="adam", weight_decay=s.weight_decay, allreduce_dtype=DTYPES[s.allreduce_dtype]
    )


def _plan_adam(ctx: PlanContext) -> PlanCounts:
    return PlanCounts(fp_allreduces=ctx.steps, onebit_allreduces=0, rounds=ctx.steps, syncs=ctx.steps, variance_updates=ctx.steps)


def adamw_state(ctx: MemoryContext) -> dict[str, int]:
    """torch.optim.AdamW's state: exp_avg and exp_avg_sq like every parameter, and its step (a 0-d fp32
    tensor per parameter)."""
    sizes = [n for group in ctx.sizes for n in group]
    return fp32(exp_avg=sum(sizes), exp_avg_sq=sum(sizes), step=len(sizes))


def _memory_adam(ctx: MemoryContext) -> MemoryCounts:
    """AdamW's state (sharded: on each shard, torch's HSDP). DDP keeps no gradient copy: its buckets are
    the gradients (gradient_as_bucket_view). Without bias correction DataParallelAdam holds the same two
    moments, flat, and no step tensors."""
    return MemoryCounts(adamw_state(ctx))


register(OptimizerSpec("adam", "Adam", _build_adam, _plan_adam, colour="#444444", memory=_memory_adam, shardable=True))


def _memory_self_syncing(*buffers: str) -> Callable[[MemoryContext], MemoryCounts]:
    """The memory of an optimizer that keeps `buffers` flat, in its collective's layouts, and its
    collective's own buffers."""

    def memory(ctx: MemoryContext) -> MemoryCounts:
        comm = ctx.collective(ctx.sizes)
        return MemoryCounts({**fp32(**dict.fromkeys(buffers, ctx.padded())), **comm.state}, comm.scratch)

    return memory


@dataclass
class OneBitAdamKnobs:
    freeze_step: int = library_default(OneBitAdam, "freeze_step")  # full-precision warm-up steps


def _build_onebit_adam(ctx: BuildContext) -> TrainingOptimizer:
    optimizer = OneBitAdam(
        ctx.parameter_groups(), freeze_step=ctx.knobs.freeze_step, process_group=ctx.process_group, collective=ctx.collective, **ctx.optimizer_kwargs()
    )
    return SelfSyncing(ctx.model, optimizer, "onebit_adam")


def _plan_onebit_adam(ctx: PlanContext) -> PlanCounts:
    """Full precision for t < freeze_step, then one 1-bit allreduce per step."""
    warmup = min(ctx.knobs.freeze_step, ctx.steps)
    return PlanCounts(fp_allreduces=warmup, onebit_allreduces=ctx.steps - warmup, rounds=ctx.steps, syncs=ctx.steps, variance_updates=warmup)


register(
    OptimizerSpec(
        "onebit_adam",
        "1-bit Adam",
        _build_onebit_adam,
        _plan_onebit_adam,
        OneBitAdamKnobs,
        {"freeze_step": checks.positive},
        colour="#e07b00",
        uses_collective=True,
        shardable=True,
        syncs_itself=True,
        memory=_memory_self_syncing("exp_avg", "exp_avg_sq"),
        resume={"freeze_step": no_unfreezing},
    )
)


@dataclass
class ZeroOneAdamKnobs:
    var_freeze_step: int = library_default(ZeroOneAdam, "var_freeze_step")  # the last step that may update the variance
    var_update_scaler: int = library_default(ZeroOneAdam, "var_update_scaler")  # kappa: variance-update gaps double every kappa updates
    local_steps: Literal[LOCAL_STEP_POLICIES] = library_default(ZeroOneAdam, "local_steps")  # what sets the sync interval
    local_step_clip: int = library_default(ZeroOneAdam, "local_step_clip")  # H: the largest sync interval
    local_step_scaler: int = library_default(ZeroOneAdam, "local_step_scaler")  # "steps" policy: steps per doubling of the interval
    local_step_interval: int = library_default(ZeroOneAdam, "local_step_interval")  # "fixed" policy
    # the largest RMS of a tensor's m/d on steps with a stale v; null: none
    update_clip: float | None = library_default(ZeroOneAdam, "update_clip")
    var_update_weighting: Literal[VAR_UPDATE_WEIGHTINGS] = library_default(ZeroOneAdam, "var_update_weighting")  # what one variance update weighs
    sync_delay: int = library_default(ZeroOneAdam, "sync_delay")  # 1: a sync's 1-bit round runs behind the next step and lands there

    def schedule_knobs(self) -> dict:
        """The ZeroOneSchedule keyword arguments among them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("update_clip", "var_update_weighting", "sync_delay")}


def _build_zero_one_adam(ctx: BuildContext) -> TrainingOptimizer:
    optimizer = ZeroOneAdam(
        ctx.parameter_groups(), **dataclasses.asdict(ctx.knobs), process_group=ctx.process_group, collective=ctx.collective, **ctx.optimizer_kwargs()
    )
    return SelfSyncing(ctx.model, optimizer, "zero_one_adam")


def zero_one_step_kinds(steps: int, lr_schedule: LRSchedule, **schedule_knobs) -> Iterator[tuple[StepDecision, str]]:
    """(decision, step kind) for each of the first `steps` 0/1 Adam steps: a variance step (the
    full-precision gradient average is the sync, no 1-bit round), any other sync (one 1-bit round),
    a local step; ZeroOneAdam._step's branches.

    Drives a fresh ZeroOneSchedule of `schedule_knobs` (its keyword arguments; its defaults are the
    optimizer's) with lr_schedule(t), exactly what ZeroOneAdam does when its group lr follows the
    schedule, so plan and optimizer cannot disagree."""
    schedule = ZeroOneSchedule(**schedule_knobs)
    for t in range(steps):
        decision = schedule.advance(lr_schedule(t))
        yield decision, VARIANCE if decision.variance_update else ONEBIT if decision.sync else LOCAL


def _plan_zero_one_adam(ctx: PlanContext) -> PlanCounts:
    kinds = {VARIANCE: 0, ONEBIT: 0, LOCAL: 0}
    max_interval = delayed = 0
    try:
        decisions = zero_one_step_kinds(ctx.steps, ctx.lr_schedule, **ctx.knobs.schedule_knobs())
        for decision, kind in decisions:
            kinds[kind] += 1
            max_interval = max(max_interval, decision.interval)
            delayed += kind == ONEBIT and decision.interval > 1 and ctx.knobs.sync_delay > 0  # ZeroOneAdam._step's rule
    except ValueError as e:  # the schedule's own validation of its knobs
        raise UserError(f"{e}.") from e
    synced = kinds[VARIANCE] + kinds[ONEBIT]
    k = ctx.knobs
    warning = None
    if k.local_steps == "lr" and ctx.steps > k.var_freeze_step and not kinds[LOCAL]:
        warning = (
            f"optimizer.local_steps is lr and this run never takes a local step: after var_freeze_step ({k.var_freeze_step:,}) "
            "its lr never falls to half its peak, which the first doubling of the sync interval needs; use a decaying "
            "schedule (exponential, cosine) or local_steps fixed or steps."
        )
    return PlanCounts(
        fp_allreduces=kinds[VARIANCE],
        onebit_allreduces=kinds[ONEBIT],
        rounds=synced,
        syncs=synced,
        variance_updates=kinds[VARIANCE],
        delayed_onebit=delayed,
        extra={"variance_update_bound": variance_update_bound(*ctx.betas), "max_interval": max_interval},
        warning=warning,
    )


def _note_zero_one_adam(record: dict) -> str:
    return (
        f"0/1 Adam: |T_v| {record['variance_updates']:,} (bound log(1-b1)/log(b2) = {record['variance_update_bound']:,.0f}), "
        f"largest sync interval {record['max_interval']}"
    )


register(
    OptimizerSpec(
        "zero_one_adam",
        "0/1 Adam",
        _build_zero_one_adam,
        _plan_zero_one_adam,
        ZeroOneAdamKnobs,
        {
            "var_freeze_step": checks.positive,
            "var_update_scaler": checks.positive,
            "local_step_clip": checks.positive,
            "local_step_scaler": checks.positive,
            "local_step_interval": checks.positive,
            "update_clip": checks.positive_or_null,
            "sync_delay": checks.from_to(0, 1),
        },
        _note_zero_one_adam,
        colour="#1f6fc0",
        uses_collective=True,
        shardable=True,
        syncs_itself=True,
        memory=_memory_self_syncing("exp_avg", "exp_avg_sq", "anchor"),
        # the schedule continues from its progress under the new knobs (ZeroOneSchedule.load_state_dict)
        resume={
            "var_freeze_step": no_unfreezing,
            **dict.fromkeys(("var_update_scaler", "local_steps", "local_step_clip", "local_step_scaler", "local_step_interval")),
            **dict.fromkeys(("update_clip", "var_update_weighting")),
            "sync_delay": None,  # a round saved in flight was saved landed: it is applied at the next step either way
        },
    )
)


@dataclass
class PowerSGDKnobs:
    freeze_step: int = library_default(OneBitAdam, "freeze_step")  # full-precision steps before compressing, as 1-bit Adam's
    powersgd_rank: int = library_default(PowerSGDHook, "rank")  # r of each gradient matrix's P and Q
    powersgd_min_compression_rate: float = library_default(PowerSGDHook, "min_compression_rate")  # send a matrix whole unless r(n+m) x this < nm
    powersgd_error_feedback: bool = library_default(PowerSGDHook, "error_feedback")
    powersgd_warm_start: bool = library_default(PowerSGDHook, "warm_start")  # Q from the previous step


def _powersgd_rule(k: PowerSGDKnobs) -> str | None:
    if k.freeze_step < 2 and (k.powersgd_error_feedback or k.powersgd_warm_start):
        return (
            f"optimizer.freeze_step must be at least 2 for powersgd with error feedback or warm start, not {k.freeze_step}: "
            "DDP lays its buckets out anew after the first step, which torch's PowerSGD hook must not compress"
        )
    return None


def _build_powersgd(ctx: BuildContext) -> TrainingOptimizer:
    """DDP with torch's PowerSGD hook (zoa_train/optim/powersgd.py), Adam on top as `adam`'s."""
    s, k = ctx.shared, ctx.knobs
    hook = PowerSGDHook(
        ctx.model,
        rank=k.powersgd_rank,
        start_step=k.freeze_step,
        min_compression_rate=k.powersgd_min_compression_rate,
        error_feedback=k.powersgd_error_feedback,
        warm_start=k.powersgd_warm_start,
        warmup_dtype=DTYPES[s.allreduce_dtype],
    )
    return DDPBacked(
        ctx.model,
        ctx.device,
        ctx.world_size,
        adam_on_ddp(ctx),
        name="powersgd",
        weight_decay=s.weight_decay,
        allreduce_dtype=DTYPES[s.allreduce_dtype],
        comm_hook=hook,
    )


def _plan_powersgd(ctx: PlanContext) -> PlanCounts:
    """Full precision for t < freeze_step, then per step the tensors sent whole, the Ps and the Qs: three
    fp32 allreduces (per DDP bucket; planned as one bucket), sizes from the model's shapes scaled to
    num_params (a flat vector of num_params where the shapes are not known: nothing compressed)."""
    k = ctx.knobs
    warmup = min(k.freeze_step, ctx.steps)
    shapes = ctx.param_shapes or ((ctx.num_params,),)
    counted = sum(math.prod(shape) for shape in shapes)
    parts = [round(n * ctx.num_params / counted) for n in powersgd_elements(shapes, k.powersgd_rank, k.powersgd_min_compression_rate)]
    warning = None
    if ctx.steps and warmup == ctx.steps:
        warning = (
            f"optimizer.freeze_step ({k.freeze_step:,}) is not below train.steps ({ctx.steps:,}), so powersgd never compresses: every step "
            "is DDP's full-precision allreduce; set freeze_step to the end of the lr warm-up (the tiny recipes: 240)."
        )
    return PlanCounts(
        fp_allreduces=warmup,
        onebit_allreduces=0,
        rounds=ctx.steps,
        syncs=ctx.steps,
        variance_updates=ctx.steps,
        other_allreduces=tuple(Allreduces(ctx.steps - warmup, n, 32) for n in parts),
        extra={"compressed_elements_per_step": sum(parts)},
        warning=warning,
    )


def _memory_powersgd(ctx: MemoryContext) -> MemoryCounts | None:
    """AdamW's state and torch's PowerSGD hook's: the error feedback (one fp32 copy of the gradients) and
    the P and Q of every compressed matrix, which torch keeps per DDP bucket (the same totals however
    the buckets fall). A DDP hook: nothing to plan sharded."""
    if ctx.sharded:
        return None
    k = ctx.knobs
    shapes = [shape for group in ctx.shapes for shape in group]
    _, ps, qs = powersgd_elements(shapes, k.powersgd_rank, k.powersgd_min_compression_rate)
    errors = sum(map(math.prod, shapes)) if k.powersgd_error_feedback else 0
    return MemoryCounts(adamw_state(ctx) | fp32(powersgd_error=errors, powersgd_p=ps, powersgd_q=qs))


def _note_powersgd(record: dict) -> str:
    return f"PowerSGD: {record['compressed_elements_per_step']:,} elements (fp32) per compressed step"


register(
    OptimizerSpec(
        "powersgd",
        "PowerSGD",
        _build_powersgd,
        _plan_powersgd,
        PowerSGDKnobs,
        {"freeze_step": checks.positive, "powersgd_rank": checks.positive, "powersgd_min_compression_rate": checks.positive},
        _note_powersgd,
        colour="#16a085",
        rule=_powersgd_rule,
        memory=_memory_powersgd,
        resume={
            "freeze_step": None,  # the hook's start step: compression starts (or pauses) there
            **dict.fromkeys(
                ("powersgd_rank", "powersgd_min_compression_rate", "powersgd_error_feedback", "powersgd_warm_start"),
                "the saved error feedback and warm-start factors are laid out for it",
            ),
        },
    )
)


@dataclass(frozen=True)
class OuterCollective:
    """A collective DiLoCo's outer sync can average its pseudo-gradient with (optimizer.outer_collective)."""

    build: Callable[[BuildContext], CollectiveFactory | None]  # the factory DiLoCo takes; None: a full-precision allreduce
    plan: Callable[[PlanContext, int], dict]  # PlanCounts fields for `calls` outer averages (of a fragment each)


def _topk_factory(ctx: BuildContext) -> CollectiveFactory:
    k = ctx.knobs
    return functools.partial(TopKAllReduce, density=k.topk_density, chunk=k.topk_chunk, error_decay=k.topk_error_decay)


def _plan_topk(ctx: PlanContext, calls: int) -> dict:
    """One all-gather of each rank's message per call, laid out over the model's tensors where known."""
    sizes = [math.prod(shape) for shape in ctx.param_shapes]
    wire = topk_wire(sizes if sum(sizes) == ctx.num_params else [ctx.num_params], ctx.knobs.topk_density, ctx.knobs.topk_chunk)
    return {"allgathers": (AllGathers(calls, wire.message_bytes, wire.payload_bits),)}


OUTER_COLLECTIVES: dict[str, OuterCollective] = {
    "full": OuterCollective(lambda ctx: None, lambda ctx, calls: {"other_allreduces": (Allreduces(calls, -(-ctx.num_params // ctx.knobs.fragments)),)}),
    # the 1-bit optimizers' collective: the recipe's comm section, so node-aware where the nodes are
    "onebit": OuterCollective(lambda ctx: ctx.collective, lambda ctx, calls: {"onebit_allreduces": calls}),
    "topk": OuterCollective(_topk_factory, _plan_topk),  # SparseLoCo's compressor, zoa_train/comm/topk.py
}


@dataclass
class DiLoCoKnobs:
    sync_every: int = library_default(DiLoCo, "sync_every")  # H: inner steps between outer steps
    outer_lr: float = library_default(DiLoCo, "outer_lr")
    outer_momentum: float = library_default(DiLoCo, "outer_momentum")  # 0 with outer_lr 1: model averaging
    outer_nesterov: bool = library_default(DiLoCo, "outer_nesterov")
    fragments: int = library_default(DiLoCo, "fragments")  # Streaming DiLoCo above 1: one fragment's outer step every H/F steps
    # what averages the pseudo-gradient: full (allreduce_dtype), onebit (comm's 1-bit sync), topk (below); the last two with error feedback
    outer_collective: Literal[tuple(OUTER_COLLECTIVES)] = "full"
    topk_density: float = library_default(TopKAllReduce, "density")  # fraction of each chunk sent
    topk_chunk: int = library_default(TopKAllReduce, "chunk")  # elements per chunk, each chunk its own top-k and 2-bit levels
    topk_error_decay: float = library_default(TopKAllReduce, "error_decay")  # the error's decay between outer steps (SparseLoCo's beta)
    sync_delay: int = library_default(DiLoCo, "sync_delay")  # 1: an outer step's average runs behind the next inner step and is applied there

    def optimizer_knobs(self) -> dict:
        """The DiLoCo keyword arguments among them (the others choose and set its outer collective)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "outer_collective" and not f.name.startswith("topk_")}


def _diloco_rule(k: DiLoCoKnobs) -> str | None:
    if k.fragments > k.sync_every:
        return f"optimizer.fragments ({k.fragments}) must not exceed optimizer.sync_every ({k.sync_every}): each fragment needs a step of its own in a period"
    if k.outer_collective != "full" and k.fragments != 1:
        return f"optimizer.outer_collective {k.outer_collective} averages the whole model at once, so optimizer.fragments must be 1, not {k.fragments}"
    return None


def _build_diloco(ctx: BuildContext) -> TrainingOptimizer:
    topology = getattr(ctx.collective, "topology", collectives.AUTO)  # the comm section's (ClusterCollective's)
    if ctx.knobs.outer_collective == "onebit" and topology != collectives.AUTO and not collectives.get(topology).outer:
        raise UserError(f"optimizer.outer_collective onebit averages with comm.topology's collective, and {topology} cannot average DiLoCo's pseudo-gradient.")
    outer = OUTER_COLLECTIVES[ctx.knobs.outer_collective].build(ctx)
    optimizer = DiLoCo(ctx.parameter_groups(), **ctx.knobs.optimizer_knobs(), process_group=ctx.process_group, outer_collective=outer, **ctx.optimizer_kwargs())
    return SelfSyncing(ctx.model, optimizer, "diloco")


# Fewer outer steps than this in a whole run: warned of. The paper's H = 500 gives 2 on the tiny recipes'
# 1,200 steps (8% above Adam on gpt2_tiny); the fewest measured that trained were 9 (H = 128, docs/results/baselines.md).
MIN_OUTER_STEPS = 8


def _plan_diloco(ctx: PlanContext) -> PlanCounts:
    """One average of a fragment (1/F of the model, planned equal) at each fragment's outer step, by
    the outer collective (compressed ones: fragments is 1)."""
    k = ctx.knobs
    check_section(k, "plan", ["diloco"])
    try:
        schedule = OuterSchedule(k.sync_every, k.fragments)
    except ValueError as e:
        raise UserError(f"optimizer: {e}.") from None
    per_step = [len(schedule.due(t)) for t in range(1, ctx.steps + 1)]
    outer, rounds = sum(per_step), sum(1 for n in per_step if n)
    periods = ctx.steps // k.sync_every  # outer steps of each fragment
    warning = None
    if ctx.steps and periods < MIN_OUTER_STEPS:
        fits = ctx.steps // MIN_OUTER_STEPS  # the largest sync_every that gives enough outer steps; 0: none does
        advice = f"set sync_every to {fits:,} or less" if fits else f"train at least {MIN_OUTER_STEPS} steps (one outer step each at sync_every 1)"
        warning = (
            f"optimizer.sync_every ({k.sync_every:,}) leaves this run of {ctx.steps:,} steps {periods} outer step(s), too few to train "
            f"(2 ended 8% above Adam on gpt2_tiny; bert_tiny reached Adam's loss with 9, docs/results/baselines.md): {advice}."
        )
    sends = OUTER_COLLECTIVES[k.outer_collective].plan(ctx, outer)
    delayed = {"delayed_onebit": sends.get("onebit_allreduces", 0), "delayed_parts": True} if k.sync_delay else {}
    return PlanCounts(
        **{"fp_allreduces": 0, "onebit_allreduces": 0, **sends, **delayed},
        rounds=rounds,
        syncs=rounds if k.fragments == 1 else 0,
        variance_updates=ctx.steps,
        extra={"outer_steps": outer, "outer_collective": k.outer_collective},
        warning=warning,
    )


def _memory_diloco(ctx: MemoryContext) -> MemoryCounts | None:
    """Per group flat fp32 inner m and v, the anchor and the outer momentum; with an outer collective also
    the pseudo-gradient, all in its layouts, and its buffers (the 1-bit one as the plan prices it, flat
    here as its communication is); sharded, the same over the shard among the nodes."""
    k = ctx.knobs
    buffers = ["exp_avg", "exp_avg_sq", "anchor", "outer_momentum"]
    if k.outer_collective == "full":
        padded, comm = sum(map(sum, ctx.sizes)), MemoryCounts({})
    elif k.outer_collective == "topk":
        padded = sum(topk_layout(sizes, k.topk_chunk).padded for sizes in ctx.sizes)
        comm = collective_memory(topk_buffers(ctx.sizes, ctx.world_size, k.topk_density, k.topk_chunk), TOPK_STATE)
    else:
        padded, comm = ctx.padded(), ctx.collective(ctx.sizes)
    if k.outer_collective != "full":
        buffers.append("pseudo_gradient")
    state = fp32(**dict.fromkeys(buffers, padded))
    if k.outer_collective == "full" and k.sync_delay and ctx.world_size > 1:
        # A delayed outer round holds its fragment's pseudo-gradient through the next step (in step it
        # is a moment's temporary): the largest fragment's.
        numels = [n for sizes in ctx.sizes for n in sizes]
        per_fragment = [0] * k.fragments
        for n, f in zip(numels, fragment_of(numels, k.fragments)):
            per_fragment[f] += n
        state |= fp32(pseudo_gradient=max(per_fragment))
    return MemoryCounts({**state, **comm.state}, comm.scratch)


def _note_diloco(record: dict) -> str:
    return f"DiLoCo: {record['outer_steps']:,} outer steps (fragments' included), {record['rounds']:,} rounds, outer sync {record['outer_collective']}"


register(
    OptimizerSpec(
        "diloco",
        "DiLoCo",
        _build_diloco,
        _plan_diloco,
        DiLoCoKnobs,
        {
            "sync_every": checks.positive,
            "outer_lr": checks.positive,
            "outer_momentum": checks.FRACTION,
            "fragments": checks.positive,
            "topk_density": checks.within(0, 1, low_open=True, high_open=False),
            "topk_chunk": checks.positive,
            "topk_error_decay": checks.within(0, 1, high_open=False),
            "sync_delay": checks.from_to(0, 1),
        },
        _note_diloco,
        colour="#b8860b",
        rule=_diloco_rule,
        memory=_memory_diloco,
        shardable=True,
        syncs_itself=True,
        resume={
            **dict.fromkeys(("sync_every", "outer_lr", "outer_momentum", "outer_nesterov", "topk_density", "topk_error_decay")),
            "fragments": "the outer steps' state is kept per fragment as saved",
            "outer_collective": "the saved error feedback is that collective's",
            "topk_chunk": "the saved error feedback is laid out in chunks of that size",
            "sync_delay": None,  # an outer round saved in flight was saved landed: it is applied at the next step either way
        },
    )
)

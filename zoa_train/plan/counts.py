"""What the plan counts, as the registries' entries give it: a run's context and counts for an optimizer's
`plan` (PlanContext, PlanCounts, Allreduces, AllGathers), one rank's bytes for its `memory`
(MemoryContext, MemoryCounts), and the helpers that size them (collective_memory, fp32). An optimizer
of one's own (docs/optimizers.md) returns these; zoa_train/plan/model.py prices them.
"""

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from zoa_train.comm.onebit import onebit_layout


@dataclass(frozen=True)
class PlanContext:
    """What a spec's `plan` gets: a run's length, lr schedule, size and ranks, and its knobs;
    `param_shapes`, the model's tensors' shapes where known (empty: not known)."""

    steps: int
    lr_schedule: Any  # the recipe's LRSchedule (zoa_train/optim/lr_schedules.py; not imported: the optimizers import this module)
    world_size: int
    num_params: int
    allreduce_bits: int
    betas: tuple[float, float]
    knobs: Any
    param_shapes: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Allreduces:
    """`calls` full-precision allreduces of `elements` each over a run (not of the whole model)."""

    calls: int
    elements: int
    bits: int | None = None  # per element on the wire; None: the recipe's allreduce_dtype


@dataclass(frozen=True)
class AllGathers:
    """`calls` all-gathers in which every rank sends a message of `message_bytes`, `bits` of payload."""

    calls: int
    message_bytes: int
    bits: int


@dataclass(frozen=True)
class PlanCounts:
    """What a whole run of one optimizer sends, by collective (see zoa_train/plan/model.py for the bytes)."""

    fp_allreduces: int  # full-precision allreduces of every parameter (allreduce_bits each)
    onebit_allreduces: int  # 1-bit allreduce calls of every parameter
    rounds: int  # steps that communicate
    syncs: int  # steps after which every rank holds the same parameters
    variance_updates: int  # |T_v|
    other_allreduces: tuple[Allreduces, ...] = ()  # full-precision allreduces of parts of the model (PowerSGD's factors, DiLoCo's fragments)
    allgathers: tuple[AllGathers, ...] = ()  # messages all-gathered (DiLoCo's top-k outer sync)
    # Rounds that run behind the next step (sync_delay): how many of the 1-bit allreduces, and whether the
    # allreduces of parts and the all-gathers (DiLoCo's outer syncs) do.
    delayed_onebit: int = 0
    delayed_parts: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)  # more figures, kept in `plan --json`
    warning: str | None = None  # a setting that defeats the optimizer's purpose on this run, said once


@dataclass(frozen=True)
class MemoryCounts:
    """Bytes one rank's optimizer holds, by buffer name: `state` kept from step to step (moments,
    anchors, error feedback, a collective's accumulators), `scratch` what its collective keeps only to
    rewrite at every call (wire buffers, kernel scratch). Tensors made and freed inside a step are
    not counted."""

    state: Mapping[str, int]
    scratch: Mapping[str, int] = field(default_factory=dict)


def collective_memory(buffers: Mapping[str, tuple[int, torch.dtype]], state_names: Iterable[str]) -> MemoryCounts:
    """A collective's buffers as its sizing function gives them ((elements, dtype) by name: a collective
    entry's `buffers`, topk_buffers) in bytes, each named collective.<name>: state where it is one of
    `state_names` (carried from one call to the next: errors, accumulators), scratch where not
    (rewritten at every call)."""
    state, scratch = {}, {}
    for name, (elements, dtype) in buffers.items():
        (state if name in state_names else scratch)[f"collective.{name}"] = elements * dtype.itemsize
    return MemoryCounts(state, scratch)


@dataclass(frozen=True)
class MemoryContext:
    """What a spec's `memory` gets: the parameters its optimizer keeps state for on one rank, as shapes
    by parameter group (the trainer's two: matrices and kernels, then the rest), the whole model's or,
    `sharded`, this rank's FSDP2 shard of each; `world_size`, the ranks its exchange runs among (all of
    them, or sharded the N that hold the same shard, one a node); its knobs; and `collective(sizes)`,
    the MemoryCounts of the 1-bit collective the plan prices (flat or node-aware) for buffers of
    `sizes` (tensor sizes by group)."""

    shapes: tuple[tuple[tuple[int, ...], ...], ...]
    world_size: int
    knobs: Any
    collective: Callable[[list[list[int]]], MemoryCounts]
    sharded: bool = False

    @property
    def sizes(self) -> list[list[int]]:
        return [[math.prod(shape) for shape in group] for group in self.shapes]

    def padded(self) -> int:
        """Elements of a flat buffer of every group in the 1-bit layouts of this exchange (the layouts
        the self-syncing optimizers keep their state in, padding included)."""
        return sum(onebit_layout(sizes, self.world_size).padded for sizes in self.sizes)


def fp32(**elements: int) -> dict[str, int]:
    """Bytes of fp32 buffers of these elements, by name."""
    return {name: 4 * n for name, n in elements.items()}

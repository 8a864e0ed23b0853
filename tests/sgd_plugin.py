"""An optimizer registered from outside zoa_train/, as a user's own module would: SGD with momentum
on top of DDP, named `sgd` in recipes that list this module under `imports`.

tests/test_registry.py runs it through `zoa-train run`, `plan`, `report` and `bench netsim` with no
edit under zoa_train/; nothing in zoa_train knows its name.
"""

from dataclasses import dataclass

import torch

from zoa_train import checks
from zoa_train.optim import registry
from zoa_train.optim.training import DDPBacked
from zoa_train.plan.counts import MemoryContext, MemoryCounts, PlanContext, PlanCounts, fp32
from zoa_train.precision import DTYPES


@dataclass
class SGDKnobs:
    momentum: float = 0.9  # heavy-ball momentum
    nesterov: bool = False


def build(ctx: registry.BuildContext) -> DDPBacked:
    s, k = ctx.shared, ctx.knobs

    def sgd(groups):
        return torch.optim.SGD(groups, lr=s.lr, momentum=k.momentum, nesterov=k.nesterov)

    return DDPBacked(ctx.model, ctx.device, ctx.world_size, sgd, name="sgd", weight_decay=s.weight_decay,
                     allreduce_dtype=DTYPES[s.allreduce_dtype], second_moment=False)  # fmt: skip


def plan(ctx: PlanContext) -> PlanCounts:
    """DDP averages every gradient in full precision: one allreduce, one round, one sync per step."""
    return PlanCounts(fp_allreduces=ctx.steps, onebit_allreduces=0, rounds=ctx.steps, syncs=ctx.steps, variance_updates=0)


def memory(ctx: MemoryContext) -> MemoryCounts:
    """What plan counts per rank: torch's SGD keeps one momentum buffer like each parameter."""
    return MemoryCounts(fp32(momentum_buffer=sum(map(sum, ctx.sizes))))


SPEC = registry.register(
    registry.OptimizerSpec(
        name="sgd",
        title="SGD (plugin)",
        build=build,
        plan=plan,
        knobs=SGDKnobs,
        checks={"momentum": checks.non_negative},
        plan_note=lambda record: f"SGD (plugin): {record['rounds']:,} rounds",
        colour="#2ca02c",
        memory=memory,
    )
)

"""The collectives a recipe chooses from (comm.topology), in one table, as the kernels (zoa_train/comm/kernels)
and the optimizers (zoa_train/optim/registry.py) have theirs.

An entry (`CollectiveSpec`) says all that the rest of the package asks of a collective: how to build
its factory (zoa_train/comm/protocol.py) from the comm section's settings, what its calls cost on a
cluster and what buffers it holds (for `plan`), which of those buffers are state (carried from call to
call) and which scratch, and what it can do: run in buckets overlapped with backward, use the node
groups, average DiLoCo's pseudo-gradient (optimizer.outer_collective onebit). ClusterCollective, the
sharded path, `plan`, `bench comm` and `bench netsim` read the table and name no class. A collective
of your own is registered by a module a recipe lists under `imports` (docs/library.md, "Adding a
collective"; tests/collective_plugin.py).

    register(spec)     # ValueError for a name taken
    get("flat")        # UserError of one sentence for an unknown name, listing the registered ones
    names()            # in registration order
"""

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from zoa_train.comm.costs import CallCost, Cluster, allreduce_cost
from zoa_train.comm.hierarchical import HierarchicalOneBitAllReduce, hierarchical_allreduce_cost, hierarchical_buffers, hierarchical_onebit_cost
from zoa_train.comm.onebit import OneBitAllReduce, flat_onebit_cost, onebit_buffers
from zoa_train.comm.protocol import CollectiveFactory
from zoa_train.comm.topology import NodeGroups
from zoa_train.registry import Registry

AUTO = "auto"  # comm.topology auto: node-aware on several even nodes of several ranks, flat otherwise (topology.choose)


@dataclass(frozen=True)
class Settings:
    """What a recipe's comm section gives a collective's builder."""

    kernels: str = "auto"  # the 1-bit passes' backend (zoa_train/comm/kernels)
    intra_dtype: torch.dtype = torch.float32  # what a node-aware collective sends inside the node
    nodes: NodeGroups | None = None  # the node groups, made for the node-aware entries only


def ring_fp_cost(numel: int, cluster: Cluster, element_size: int, reduce_rate: float = math.inf) -> CallCost:
    """A full-precision round as a flat collective makes it: a ring allreduce over all ranks."""
    return allreduce_cost(numel, element_size, cluster, reduce_rate)


@dataclass(frozen=True)
class CollectiveSpec:
    name: str  # comm.topology in a recipe
    title: str  # in plan tables and the run's log
    build: Callable[[Settings], CollectiveFactory]
    # A 1-bit round of `numel` elements: (numel, cluster, allreduce element size, compress_rate, reduce_rate) -> CallCost
    onebit_cost: Callable[[int, Cluster, int, float, float], CallCost]
    # (elements, dtype) of each buffer it holds for parameter groups of these tensor sizes on nodes x
    # ranks per node, with the fused kernels (which keep no scratch): (sizes, nodes, ranks_per_node)
    buffers: Callable[[list[list[int]], int, int], Mapping[str, tuple[int, torch.dtype]]]
    state: tuple[str, ...]  # of `buffers`, those carried from one call to the next; the others are scratch
    # A full-precision round (variance steps, warm-up): (numel, cluster, element size, reduce_rate) -> CallCost
    fp_cost: Callable[[int, Cluster, int, float], CallCost] = ring_fp_cost
    bucketed: bool = True  # runs in BucketedCollective's buckets, overlapped with backward (comm.bucket_cap_mb, comm.overlap)
    node_aware: bool = False  # built with the node groups; needs several nodes of one size
    outer: bool = True  # DiLoCo may average its pseudo-gradient with it (optimizer.outer_collective onebit)

    def fits(self, nodes: int, ranks_per_node: int) -> bool:
        """Whether it is worth planning on nodes x ranks per node: a node-aware one needs several of each."""
        return not self.node_aware or (nodes > 1 and ranks_per_node > 1)


_COLLECTIVES: Registry[CollectiveSpec] = Registry("collective")
names, get = _COLLECTIVES.names, _COLLECTIVES.get


def register(spec: CollectiveSpec) -> CollectiveSpec:
    """Add `spec` (the same object twice is harmless); another under a name taken, or named auto, is refused."""
    if spec.name == AUTO:
        raise ValueError(f"a collective cannot be named {AUTO!r}: comm.topology auto chooses among the others")
    return _COLLECTIVES.register(spec)


def topologies() -> tuple[str, ...]:
    """What comm.topology takes: auto and every registered collective."""
    return (AUTO, *names())


def specs() -> tuple[CollectiveSpec, ...]:
    return tuple(_COLLECTIVES.values())


def default() -> CollectiveSpec:
    """The first entry (flat): what `plan` prices every optimizer with, and one process's collective."""
    return _COLLECTIVES.values()[0]


def for_shards(topology: str) -> CollectiveSpec:
    """What the sharded path (comm.shard node) exchanges each shard with among the nodes: comm.topology's
    collective, the default for auto (a node-aware one is refused at recipe load: config._check_sharding)."""
    return default() if topology == AUTO else get(topology)


def _flat(settings: Settings) -> CollectiveFactory:
    return functools.partial(OneBitAllReduce, kernels=settings.kernels)


def _hierarchical(settings: Settings) -> CollectiveFactory:
    return functools.partial(HierarchicalOneBitAllReduce, nodes=settings.nodes, intra_dtype=settings.intra_dtype, kernels=settings.kernels)


# The first entry is the default and the baseline: what `plan` prices every optimizer with, and what the
# sharded path exchanges shards with where comm.topology is auto.
register(
    CollectiveSpec(
        "flat",
        "flat",
        _flat,
        lambda numel, cluster, size, compress, reduce: flat_onebit_cost(numel, cluster, compress),
        lambda sizes, nodes, ranks_per_node: onebit_buffers(sizes, nodes * ranks_per_node, kernels=None),
        state=("_worker", "_server"),
    )
)
register(
    CollectiveSpec(
        "hierarchical",
        "node-aware",
        _hierarchical,
        lambda numel, cluster, size, compress, reduce: hierarchical_onebit_cost(numel, size, cluster, compress, reduce),
        lambda sizes, nodes, ranks_per_node: hierarchical_buffers(sizes, nodes, ranks_per_node, kernels=None),
        state=("_pending", "inter._worker", "inter._server"),
        fp_cost=lambda numel, cluster, size, reduce: hierarchical_allreduce_cost(numel, size, cluster, reduce),
        node_aware=True,
    )
)

"""The cost model's pieces that every collective prices its calls with (docs/algorithm.md, "Counting";
zoa_train/plan/model.py puts them together into a run's plan).

A `Cluster` is N nodes of G ranks: each node's link to the others carries `bandwidth` bytes/s each
way and costs `latency` per message; inside a node the ranks share `intra_bandwidth`. A collective's
call is a sequence of phases (`Cluster.phase`), and its `CallCost` the bytes and seconds of them. A
collective's registry entry (zoa_train/comm/registry.py) names the functions that price its calls;
the full-precision ring allreduce and the all-gather below are what most of them are made of.
"""

import math
from dataclasses import dataclass

from zoa_train.comm.collectives import ring_allreduce_bytes


@dataclass(frozen=True)
class Cluster:
    """Where a plan runs: `nodes` x `ranks_per_node` ranks, the nodes' link and the links inside a node."""

    nodes: int
    ranks_per_node: int = 1
    bandwidth: float = 1.25e9  # bytes/s of a node's link to the others, each way
    latency: float = 20e-6  # seconds per message between nodes
    intra_bandwidth: float = math.inf  # bytes/s inside a node, shared by its ranks
    backend: str = "nccl"

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def phase(self, inter_bytes: float, intra_bytes: float, messages: int) -> float:
        """Seconds of one phase: `inter_bytes` over each node's link, `intra_bytes` inside each node."""
        inter = inter_bytes / self.bandwidth if self.nodes > 1 else 0.0
        intra = intra_bytes / self.intra_bandwidth if self.ranks_per_node > 1 else 0.0
        return messages * (self.latency if self.nodes > 1 else 0.0) + max(inter, intra)


@dataclass(frozen=True)
class CallCost:
    """One collective of the whole buffer: bytes per rank, bytes over each node's link, seconds."""

    bytes_per_rank: float  # as the ledger's bytes_sent: all of a flat call, the part between nodes of a node-aware one
    inter_bytes_per_node: float
    seconds: float
    intra_bytes_per_rank: float = 0  # as the ledger's intra_bytes_sent: the node-aware call's full precision inside the node
    work_seconds: float = 0.0  # of `seconds`, the work on the ranks (encoding, sums): it competes with backward for the ranks

    @property
    def transfer_seconds(self) -> float:
        """The rest of `seconds`: what an overlapped round can hide behind backward."""
        return self.seconds - self.work_seconds


def allreduce_cost(numel: int, element_size: int, cluster: Cluster, reduce_rate: float = math.inf) -> CallCost:
    n, g = cluster.world, cluster.ranks_per_node
    if n == 1:
        return CallCost(0, 0, 0.0)
    volume = ring_allreduce_bytes(numel, element_size, n)  # what each link of the ring carries
    inter = volume if cluster.nodes > 1 else 0
    work = volume / element_size / reduce_rate  # the elements each rank sends and sums
    return CallCost(volume, inter, cluster.phase(inter, (g - 1) * volume, 2 * (n - 1)) + work, work_seconds=work)


def allgather_cost(segment: int, cluster: Cluster) -> CallCost:
    """An all-gather in which every rank sends `segment` bytes: a ring on NCCL (n-1 segments over
    every link of the ring), direct on Gloo (each rank's segment to every other rank)."""
    n, g, nodes = cluster.world, cluster.ranks_per_node, cluster.nodes
    if n == 1:
        return CallCost(0, 0, 0.0)
    if cluster.backend == "nccl":
        inter, intra = (n - 1) * segment if nodes > 1 else 0, (g - 1) * (n - 1) * segment
    else:
        inter, intra = g * g * (nodes - 1) * segment, g * (g - 1) * segment
    return CallCost((n - 1) * segment, inter, cluster.phase(inter, intra, n - 1))


def node_share(cost: CallCost, ranks_per_node: int) -> CallCost:
    """A call among the N ranks of one local rank, which the node's G local ranks make at once over the
    node's link: G times its bytes cross the link."""
    return CallCost(cost.bytes_per_rank, ranks_per_node * cost.inter_bytes_per_node, cost.seconds, cost.intra_bytes_per_rank, cost.work_seconds)

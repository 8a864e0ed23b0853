"""Which ranks share a node, and the two process groups of the node-aware 1-bit sync.

What is authoritative is an all-gather of each rank's node identity (its hostname): it needs no
launcher's variables and sees the real layout, even an uneven one or one where a node's ranks are
not numbered consecutively (srun's cyclic distribution). `comm.ranks_per_node` overrides it (ranks
r*G..r*G+G-1 form node r), for several emulated nodes on one machine, whose ranks all share a
hostname (`bench netsim --nodes`, tests). The groups are a DeviceMesh of shape (nodes, ranks per
node): along "local" the ranks of one node, along "node" the ranks of one local rank on each node.
"""

import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from zoa_train.errors import UserError


def nodes_from_names(names: Sequence[str]) -> list[list[int]]:
    """The ranks on each node, nodes in the order of their lowest rank, from every rank's node name."""
    nodes: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        nodes.setdefault(name, []).append(rank)
    return list(nodes.values())


def nodes_by_count(world_size: int, ranks_per_node: int) -> list[list[int]]:
    """Nodes of `ranks_per_node` consecutive ranks; a UserError if they do not divide the world."""
    if world_size % ranks_per_node:
        raise UserError(f"comm.ranks_per_node is {ranks_per_node} but the run has {world_size} ranks, which is not a whole number of such nodes.")
    return [list(range(start, start + ranks_per_node)) for start in range(0, world_size, ranks_per_node)]


def describe(nodes: Sequence[Sequence[int]]) -> str:
    counts = sorted({len(node) for node in nodes})
    per_node = "x".join(map(str, counts)) if len(counts) == 1 else "/".join(map(str, counts))
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} x {per_node} rank{'s' if counts != [1] else ''}"


def discover_nodes(ranks_per_node: int = 0) -> list[list[int]]:
    """The ranks on each node of the running world: `nodes_by_count` when `ranks_per_node` is set,
    else from an all-gather of hostnames (a collective: every rank calls it)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if ranks_per_node:
        return nodes_by_count(world, ranks_per_node)
    if world == 1:
        return [[0]]
    names: list[str | None] = [None] * world
    dist.all_gather_object(names, socket.gethostname())
    return nodes_from_names(names)


def choose(topology: str, nodes: Sequence[Sequence[int]], node_aware: bool | None = None) -> str:
    """The collective (a name in zoa_train/comm/registry.py) for a recipe's comm.topology on these
    nodes. `auto` is hierarchical when there are several nodes of several ranks each, all of one
    size, and flat otherwise (an uneven layout falls back to flat, which `auto` says in the run's
    log); a node-aware collective (`node_aware`; default: hierarchical is) on an uneven layout is
    refused, since its shards need the same number of ranks on every node; any other is itself."""
    even = len({len(node) for node in nodes}) == 1
    if node_aware if node_aware is not None else topology == "hierarchical":
        if not even:
            raise UserError(f"comm.topology is {topology} but the nodes have unequal numbers of ranks ({describe(nodes)}); use flat or auto.")
        return topology
    if topology == "auto":
        return "hierarchical" if even and len(nodes) > 1 and len(nodes[0]) > 1 else "flat"
    return topology


@dataclass
class NodeGroups:
    """The process groups of a node-aware collective on this rank."""

    nodes: int
    ranks_per_node: int
    node: int  # this rank's node, in the order of nodes_from_names
    local_rank: int  # its place among its node's ranks
    intra: object  # this node's ranks (a ProcessGroup)
    inter: object  # the ranks with this local rank, one per node
    mesh: object  # the DeviceMesh that holds both
    members: tuple[tuple[int, ...], ...] = ()  # the ranks of each node

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        return describe([[0] * self.ranks_per_node] * self.nodes)


def node_groups(nodes: Sequence[Sequence[int]], device_type: str | None = None) -> NodeGroups:
    """The DeviceMesh of `nodes` (each a list of ranks, all of one length) and this rank's two
    groups of it, on `device_type` (default: the backend's, cuda for NCCL: Gloo ranks may share a
    GPU). A collective over the world: every rank calls it with the same `nodes`."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    if len({len(node) for node in nodes}) != 1:
        raise ValueError(f"a node-aware collective needs the same number of ranks on every node, got {describe(nodes)}")
    device_type = device_type or ("cuda" if "nccl" in str(dist.get_backend()) else "cpu")
    mesh = DeviceMesh(device_type, torch.tensor([list(node) for node in nodes]), mesh_dim_names=("node", "local"))
    rank = dist.get_rank()
    node = next(i for i, ranks in enumerate(nodes) if rank in ranks)
    members = tuple(tuple(ranks) for ranks in nodes)
    return NodeGroups(len(nodes), len(nodes[0]), node, list(nodes[node]).index(rank), mesh.get_group("local"), mesh.get_group("node"), mesh, members)

"""The collective of a recipe's comm section: the registered collective that comm.topology names, on the
nodes found at run time, in buckets where comm.bucket_cap_mb or comm.overlap ask for them."""

import functools

import torch
import torch.distributed as dist

from zoa_train.comm import registry as collectives
from zoa_train.comm.agreement import check_same_on_every_rank, checked_by_caller
from zoa_train.comm.buckets import BUCKET_CAP_MB, BucketedCollective, TensorOrder
from zoa_train.comm.collectives import group_size_rank
from zoa_train.comm.kernels import CHOICES, select_kernels
from zoa_train.comm.layout import buffer_sizes, collective_device
from zoa_train.comm.protocol import CollectiveFactory
from zoa_train.comm.topology import NodeGroups, choose, describe, discover_nodes, node_groups
from zoa_train.errors import UserError


class ClusterCollective:
    """The CollectiveFactory of a recipe's comm section: on its first call (a collective, made when a
    1-bit optimizer is built) it finds which ranks share a node (zoa_train.comm.topology) and builds
    the collective `topology` names in zoa_train/comm/registry.py ("auto": node-aware or flat), in
    buckets of `bucket_cap_mb` MB (0: none) whose rounds start during backward with `overlap`
    (zoa_train/comm/buckets.py; 100 MB buckets when `bucket_cap_mb` is 0), cut and started in `order`
    (buckets.listing_order for a model's parameter groups). `chosen` then describes
    what it built, for the run's log."""

    def __init__(
        self,
        topology: str = "auto",
        ranks_per_node: int = 0,
        intra_dtype: torch.dtype = torch.float32,
        kernels: str = "auto",
        bucket_cap_mb: float = 0.0,
        overlap: bool = False,
        order: TensorOrder | None = None,
    ):
        # What a recipe's schema checks, checked again for code that builds one itself (a misspelt topology was flat).
        if topology not in collectives.topologies():
            raise ValueError(f"ClusterCollective: topology must be one of {', '.join(collectives.topologies())}, not {topology!r}")
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 0:
            raise ValueError(f"ClusterCollective: ranks_per_node must be a whole number >= 0 (0: nodes found by hostname), not {ranks_per_node!r}")
        if intra_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"ClusterCollective: intra_dtype must be torch.float32 or torch.bfloat16, not {intra_dtype}")
        if kernels not in CHOICES:
            raise ValueError(f"ClusterCollective: kernels must be one of {', '.join(CHOICES)}, not {kernels!r}")
        if not 0 <= bucket_cap_mb < float("inf"):
            raise ValueError(f"ClusterCollective: bucket_cap_mb must be a finite number of MB >= 0 (0: no buckets), not {bucket_cap_mb}")
        self.topology, self.ranks_per_node, self.intra_dtype, self.kernels = topology, ranks_per_node, intra_dtype, kernels
        self.bucket_cap_mb = bucket_cap_mb or (BUCKET_CAP_MB if overlap else 0.0)
        self.overlap = overlap
        self.order = order  # how the buckets are cut and started (BucketedCollective's order=)
        self.chosen: str | None = None
        self.spec: collectives.CollectiveSpec | None = None  # the registry's entry it built
        self.fell_back = False  # auto on an uneven layout: flat
        self._groups: dict[tuple, NodeGroups] = {}

    def forget_process_groups(self) -> None:
        """Drop the node groups made so far: the world they were made in is gone (train.elastic live)."""
        self._groups.clear()

    def __call__(self, sizes, *, group=None, device=None, ledger=None):
        world, _ = group_size_rank(group)
        if world > 1 and group is not None and world != dist.get_world_size():
            raise ValueError("ClusterCollective finds nodes among all ranks: use it with the world's process group")
        where = collective_device(device, group, "ClusterCollective")
        # Before finding the nodes: ranks of other settings would not even make the same process groups.
        settings = {
            "topology": self.topology,
            "ranks_per_node": self.ranks_per_node,
            "intra_dtype": str(self.intra_dtype).removeprefix("torch."),
            "bucket_cap_mb": self.bucket_cap_mb,
            "overlap": self.overlap,
        }
        check_same_on_every_rank("ClusterCollective", group, [[s] if isinstance(s, int) else list(s) for s in buffer_sizes(sizes)], settings)
        nodes = discover_nodes(self.ranks_per_node) if world > 1 else [[0]]
        spec = collectives.get(self.topology) if self.topology != collectives.AUTO else None
        # one process: nothing is sent either way, so the default (the first entry) serves
        kind = choose(self.topology, nodes, spec.node_aware if spec else None) if world > 1 else collectives.default().name
        spec = self.spec = collectives.get(kind)
        self.fell_back = self.topology == collectives.AUTO and not spec.node_aware and len({len(n) for n in nodes}) > 1
        self.chosen = f"{kind} 1-bit sync, {describe(nodes)}"
        try:
            select_kernels(self.kernels, where)
        except ValueError as error:
            raise UserError(f"comm.kernels: {error}.") from None
        if self.bucket_cap_mb and not spec.bucketed:
            raise UserError(f"comm.topology {kind} does not run in buckets; set comm.bucket_cap_mb 0 and comm.overlap false.")
        groups = None
        if spec.node_aware:
            # the mesh's device type follows the backend: Gloo ranks may share a GPU (gpu_check does).
            # Overlapped rounds run on a thread of their own, so they get node groups of their own.
            key = (tuple(map(tuple, nodes)), self.overlap)
            if key not in self._groups:
                self._groups[key] = node_groups(nodes)
            groups = self._groups[key]
        inner = spec.build(collectives.Settings(self.kernels, self.intra_dtype, groups))
        with checked_by_caller():  # compared above
            if not self.bucket_cap_mb:
                return inner(sizes, group=group, device=device, ledger=ledger)
            self.chosen += f", buckets of {self.bucket_cap_mb:g} MB{' overlapped with backward' if self.overlap else ''}"
            return BucketedCollective(sizes, group, device, ledger, inner=inner, bucket_cap_mb=self.bucket_cap_mb, overlap=self.overlap, order=self.order)


def shard_collective(topology: str, kernels: str, bucket_cap_mb: float, overlap: bool, order: TensorOrder) -> tuple[CollectiveFactory, str]:
    """The collective of comm.shard node, which exchanges each rank's shard among the ranks that hold it
    on the other nodes: comm.topology's (the registry's default for auto), in buckets cut and started
    in `order` (zoa_train.comm.sharding.gradient_order: alike on a node's ranks, each started as FSDP2
    reduces its unit's gradients with `overlap`) where `bucket_cap_mb` or `overlap` ask for them
    (100 MB buckets when bucket_cap_mb is 0). Returns it and what it is, in words, for the run's log."""
    spec = collectives.for_shards(topology)
    inner = spec.build(collectives.Settings(kernels))
    if not (bucket_cap_mb or overlap):
        return inner, f"{spec.name} 1-bit sync of each shard"
    if not spec.bucketed:
        raise UserError(f"comm.topology {spec.name} does not run in buckets; set comm.bucket_cap_mb 0 and comm.overlap false.")
    cap = bucket_cap_mb or BUCKET_CAP_MB
    factory = functools.partial(BucketedCollective, inner=inner, bucket_cap_mb=cap, overlap=overlap, order=order)
    return factory, f"{spec.name} 1-bit sync of each shard, buckets of {cap:g} MB{' overlapped with backward' if overlap else ''}"

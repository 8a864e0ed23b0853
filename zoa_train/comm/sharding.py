"""Sharding inside the node (`comm.shard: node`; docs/algorithm.md, "Sharded inside the node").

The model is sharded with PyTorch's FSDP2 (`fully_shard`) over the ranks of one node: parameters
are all-gathered for forward and backward and gradients reduce-scattered (averaged over the node's
ranks) on the fast link, so each rank holds 1/G of the parameters, gradients and optimizer state.
Between nodes the data-parallel optimizers exchange only their shard: each rank's optimizer runs
over the ranks that hold the same shard, one per node (the "node" dimension of the mesh). The node
is then one data-parallel worker: 0/1 Adam's local steps send nothing between nodes, and its 1-bit
and full-precision rounds carry the shard only.

`fully_shard` is applied to each block of every nn.ModuleList (a transformer's layers) and then to
the whole model, which keeps what is left (embeddings, a tied output layer, final norms); a model
without a ModuleList is one unit. Sharding is along each tensor's first dimension, FSDP2's.
"""

import torch
from torch.distributed.tensor import DTensor

from zoa_train.comm.ledger import CommLedger

SHARDINGS = ("none", "node")


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's elements of `tensor`: its local shard if it is a DTensor (FSDP2's parameters and
    their gradients), else the tensor itself. An alias: writing it writes the parameter."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():  # an alias outside autograd: the optimizer writes it in place
            return tensor.to_local()
    return tensor


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules `shard_model` shards one by one, before the whole model: every block of every
    nn.ModuleList that holds parameters (outermost lists only)."""
    found: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(child, torch.nn.ModuleList):
                found.extend(block for block in child if any(True for _ in block.parameters()))
            else:
                visit(child)

    visit(model)
    return found


def shard_model(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """Shard `model` in place with FSDP2 over `mesh` (the node's ranks, a 1-D DeviceMesh; or a 2-D
    (node, local) mesh for HSDP: replicated across nodes, sharded inside each). Returns the model."""
    from torch.distributed.fsdp import fully_shard

    for block in units(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def shard_numel(model: torch.nn.Module) -> int:
    """Elements of this rank's shards of the trainable parameters."""
    return sum(local_shard(p).numel() for p in model.parameters() if p.requires_grad)


def record_fsdp_traffic(ledger: CommLedger, elements: int, ranks_per_node: int, micro_batches: int) -> None:
    """Count FSDP2's collectives of one step inside the node (link "intra"), as it runs them: per
    micro-batch, an all-gather of the parameters for forward, another for backward (the blocks
    reshard after forward) and a reduce-scatter of the gradients, each sending (G-1) shards of
    `elements` fp32 values per rank (a ring's bytes). Nominal bits: 32 per element of each."""
    if ranks_per_node < 2:
        return
    nbytes = (ranks_per_node - 1) * elements * 4
    for kind in ("fsdp_all_gather", "fsdp_all_gather", "fsdp_reduce_scatter"):
        ledger.record(kind, payload_bits=32, elements=elements * micro_batches, bytes_sent=nbytes * micro_batches, calls=micro_batches, link="intra")


def release_caches() -> None:
    """Empty DTensor's global caches (sharding propagation, redistribution plans, mesh topology),
    which keep device meshes and so their process groups alive after the sharded model is gone:
    without this, Gloo's threads outlive destroy_process_group and may abort the process at exit.
    Private to torch, so each is cleared where this torch has it."""
    from torch.distributed.tensor import _collective_utils, _redistribute

    caches = (
        getattr(getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None), "propagate_op_sharding", None),
        getattr(_redistribute, "_gen_transform_infos", None),
        getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None),
    )
    for cache in caches:
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):  # the C++ dispatch's own cache
        torch._C._clear_DTensor_sharding_propagator_cache()

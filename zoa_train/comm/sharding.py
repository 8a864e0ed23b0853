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
from torch.distributed.tensor import DTensor, distribute_tensor

from zoa_train.comm.buckets import TensorOrder
from zoa_train.comm.ledger import CommLedger
from zoa_train.comm.topology import NodeGroups, describe, discover_nodes, node_groups
from zoa_train.errors import UserError

SHARDINGS = ("none", "node")


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's elements of `tensor`: its local shard if it is a DTensor (FSDP2's parameters and
    their gradients), else the tensor itself. An alias: writing it writes the parameter."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():  # an alias outside autograd: the optimizer writes it in place
            return tensor.to_local()
    return tensor


def sharded_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's elements, shaped as `param`'s shard) as a DTensor sharded as `param` is,
    sharing its storage; `local` itself where `param` is not sharded."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return local


def copy_whole(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy `whole` (a whole tensor, on every rank) into `target`: this rank's shard of it where
    `target` is a DTensor (cut here, nothing sent), all of it otherwise."""
    if isinstance(target, DTensor):
        whole = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
    local_shard(target).copy_(local_shard(whole))


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


def shard_model(model: torch.nn.Module, mesh, reduce_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Shard `model` in place with FSDP2 over `mesh` (the node's ranks, a 1-D DeviceMesh; or a 2-D
    (node, local) mesh for HSDP: replicated across nodes, sharded inside each). Gradients are reduced
    in `reduce_dtype` (None: the parameters' fp32), as the optimizer's `allreduce_dtype` is the dtype of
    its full-precision rounds; they are stored in fp32 either way. Returns the model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for block in units(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def gradient_order(model: torch.nn.Module, groups: list[dict]) -> TensorOrder:
    """When each tensor of `groups` (parameter groups of `model`, as an optimizer takes them) has its final
    gradient in a backward of `model` sharded by `shard_model`, for BucketedCollective's `order=`: FSDP2
    reduce-scatters a unit's gradients (and runs their hooks) when the unit's backward ends, so the last
    block's come first, the first block's next to last, and the whole model's own (embeddings, a tied
    head, final norms) last. Each tensor is counted at its whole size, which every rank of the node sees
    alike (its shard's may not be), so that the ranks cut the same buckets. The same before and after
    sharding."""
    blocks = units(model)
    unit = {id(p): k for k, block in enumerate(blocks) for p in block.parameters()}
    ready = lambda p: len(blocks) - 1 - unit[id(p)] if id(p) in unit else len(blocks)  # noqa: E731
    return TensorOrder([[p.numel() for p in g["params"]] for g in groups], [[ready(p) for p in g["params"]] for g in groups])


def shard_numel(model: torch.nn.Module) -> int:
    """Elements of this rank's shards of the trainable parameters."""
    return sum(local_shard(p).numel() for p in model.parameters() if p.requires_grad)


def node_sharding(ranks_per_node: int = 0) -> NodeGroups:
    """The (node, local) groups of the running world's nodes (found by hostname, or `ranks_per_node`
    consecutive ranks each) that comm.shard node shards over: FSDP2 over `mesh["local"]` (HSDP over
    `mesh`), the optimizers' exchange over `inter`. A UserError for nodes of unequal sizes; a
    collective: every rank calls it."""
    nodes = discover_nodes(ranks_per_node)
    if len({len(node) for node in nodes}) != 1:
        raise UserError(
            f"comm.shard node shards over each node's ranks, and these nodes have unequal numbers of them ({describe(nodes)}); use comm.shard none."
        )
    return node_groups(nodes)


def count_fsdp_traffic(model: torch.nn.Module, ledger: CommLedger, ranks_per_node: int, reduce_dtype: torch.dtype | None = None) -> None:
    """Record in `ledger`, at each training forward of `model` (one micro-batch), FSDP2's collectives
    inside the node (link "intra") as it runs them: an all-gather of the parameters for forward,
    another for backward (the blocks reshard after forward), both fp32, and a reduce-scatter of the
    gradients in `reduce_dtype` (shard_model's), each sending G-1 shards of this rank's elements (a
    ring's bytes). Evaluation forwards (no gradient) are not training steps: not counted."""
    if ranks_per_node < 2:
        return
    elements = shard_numel(model)
    reduce_bits = 8 * (reduce_dtype or torch.float32).itemsize
    sends = (("fsdp_all_gather", 32), ("fsdp_all_gather", 32), ("fsdp_reduce_scatter", reduce_bits))

    def record(module, args) -> None:
        if module.training and torch.is_grad_enabled():
            for kind, bits in sends:
                ledger.record(kind, payload_bits=bits, elements=elements, bytes_sent=(ranks_per_node - 1) * elements * bits // 8, link="intra")

    model.register_forward_pre_hook(record)


def load_full_model_state(model: torch.nn.Module, state: dict) -> None:
    """Load a whole model's state dict (every rank holds it) into the sharded `model`: each rank keeps its
    shards. For checkpoints written before sharded runs saved their model as shards (a gathered model.pt);
    a sharded run's checkpoint now holds every rank's shards (train/rundir.py, model/), read as they are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

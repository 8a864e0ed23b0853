"""Full-precision collectives that record themselves in a CommLedger."""

import math

import torch
import torch.distributed as dist

from zoa_train.comm.ledger import CommLedger

_DEFAULT_LEDGER = CommLedger()


def default_ledger() -> CommLedger:
    """The ledger used by calls that are not given one."""
    return _DEFAULT_LEDGER


def group_size_rank(group=None) -> tuple[int, int]:
    """(world size, rank) of `group`, or (1, 0) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def refuse_meta(tensor: torch.Tensor) -> None:
    """Refuse a tensor on the meta device: it holds no values, and Gloo "averages" it without a word."""
    if tensor.is_meta:
        raise ValueError("a full-precision allreduce cannot average a tensor on the meta device, which holds no values; pass a tensor on the CPU or a GPU")


def ring_allreduce_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce (reduce-scatter then all-gather)."""
    return 2 * (world_size - 1) * numel * element_size // world_size


_FP16_MAX = 65504.0


def _fp16_scale(tensor: torch.Tensor, world: int, group) -> float:
    """A power of two that puts the group's largest |value| times the world size just under fp16's
    maximum, so that the sum cannot overflow and small values (gradients of 1e-8, below fp16's
    smallest subnormal, 6e-8) are not flushed to zero. Costs one scalar MAX allreduce."""
    peak = tensor.detach().abs().max().float().reshape(1)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    peak = float(peak)
    if not peak > 0 or peak == float("inf"):
        return 1.0
    return 2.0 ** min(max(math.floor(math.log2(_FP16_MAX / (world * peak))), -126), 126)


def allreduce(
    tensor: torch.Tensor,
    group=None,
    ledger: CommLedger | None = None,
    comm_dtype: torch.dtype | None = None,
    average: bool = True,
    elements: int | None = None,
    in_step: bool = True,
) -> torch.Tensor:
    """Average (or sum) `tensor` in place over the group, sending it as `comm_dtype` (default: its own).

    `elements`: how many of its elements are parameters, for bits per parameter (default: all; a
    buffer with padding counts only its real elements, while bytes count everything sent).
    `in_step`: counted in the current optimizer step (False: in the totals only, not in a round).
    Gloo has no AVG reduction, so the sum is divided by the world size locally.
    """
    refuse_meta(tensor)
    world, _ = group_size_rank(group)
    if world == 1:
        return tensor
    ledger = ledger if ledger is not None else _DEFAULT_LEDGER
    scale = _fp16_scale(tensor, world, group) if comm_dtype == torch.float16 and tensor.dtype != torch.float16 else 1.0
    wire = tensor if comm_dtype in (None, tensor.dtype) else (tensor * scale if scale != 1.0 else tensor).to(comm_dtype)
    dist.all_reduce(wire, group=group)
    if wire is not tensor:
        tensor.copy_(wire)
    if average or scale != 1.0:
        tensor.div_((world if average else 1) * scale)
    if comm_dtype == torch.float16 and tensor.dtype != torch.float16:  # the scale's scalar: a call, no parameter bits
        ledger.record("allreduce_fp16_scale", payload_bits=32, elements=0, bytes_sent=ring_allreduce_bytes(1, 4, world))
    bits = torch.finfo(wire.dtype).bits if wire.is_floating_point() else wire.element_size() * 8
    ledger.record(
        f"allreduce_{str(wire.dtype).removeprefix('torch.')}",
        payload_bits=bits,
        elements=tensor.numel() if elements is None else elements,
        bytes_sent=ring_allreduce_bytes(tensor.numel(), wire.element_size(), world),
        in_step=in_step,
    )
    return tensor

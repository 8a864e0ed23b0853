"""Activation checkpointing and compilation, block by block (train.activation_checkpointing, train.compile).

A model family's blocks (ModelSpec.blocks: a transformer's layers) are where both act, as torchtitan
applies them. Each block's `forward` is replaced in place (an instance attribute), so the module tree,
its parameter names and its state dict stay as built: checkpoints load whichever options wrote them,
and FSDP2's hooks (comm.shard node, applied afterwards) still run around the whole block.

Checkpointing is torch's non-reentrant one (use_reentrant=False): backward recomputes the block's forward
from its input, with the random state it ran with (the same dropout masks), so gradients are the same to
the bit; and every parameter's gradient is still accumulated once, so the post-accumulate-grad hooks
that start the overlapped 1-bit rounds (comm.overlap) fire once per parameter as without it. Compilation
is torch.compile of the block's forward alone: the optimizer and the communication hooks stay eager.
"""

import functools

import torch
from torch.utils.checkpoint import checkpoint

from zoa_train.errors import UserError

CHECKPOINTING = ("none", "selective", "full")  # by recomputation: the first that fits is the one to use


def checkpointed_blocks(blocks: list[torch.nn.Module], mode: str) -> list[torch.nn.Module]:
    """The blocks `mode` recomputes: none, every block (full), or every other one from the first (selective)."""
    return {"none": [], "full": list(blocks), "selective": list(blocks[::2])}[mode]


def _recomputed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation keeps no activations for backward anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def prepare_blocks(model: torch.nn.Module, blocks: list[torch.nn.Module], checkpointing: str = "none", compile: bool = False) -> list[torch.nn.Module]:
    """Checkpoint (`checkpointing`: none, full, selective) and compile (`compile`) `blocks` of `model` in
    place; returns the blocks recomputed. A UserError for what cannot be: blocks with BatchNorm (its
    recomputed forward would update the running statistics twice), a model without blocks."""
    recomputed = checkpointed_blocks(blocks, checkpointing)
    if (checkpointing != "none" or compile) and not blocks:
        what = "train.activation_checkpointing" if checkpointing != "none" else "train.compile"
        raise UserError(f"{what} acts on a model's blocks and this {type(model).__name__} has none (no nn.ModuleList of layers); set it off.")
    for block in recomputed:
        norms = [type(m).__name__ for m in block.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats]
        if norms:
            raise UserError(
                f"train.activation_checkpointing {checkpointing} would recompute {type(block).__name__} blocks, whose {norms[0]} updates its running "
                "statistics at every forward (twice under recomputation); set train.activation_checkpointing none for this model."
            )
    for block in blocks:
        forward = _recomputed(block.forward) if any(block is r for r in recomputed) else block.forward
        block.forward = torch.compile(forward) if compile else forward
    return recomputed


def check_compiler(device: torch.device) -> None:
    """Refuse train.compile in one sentence where torch.compile cannot generate code for `device`:
    Triton on GPUs, a C++ compiler on CPUs."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise UserError("train.compile needs Triton on GPUs, which this Python cannot import (pip install triton); set train.compile false.")
        return
    from torch._inductor import cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()  # inductor's own search (CXX, then g++)
    except exc.InvalidCxxCompiler:
        raise UserError(
            f"train.compile on {device.type} needs a working C++ compiler and none was found (install g++, or set CXX to one); set train.compile false."
        ) from None

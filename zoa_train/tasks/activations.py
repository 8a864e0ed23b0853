"""The activations a training step keeps for backward, per rank, counted on fake tensors (what `plan` adds
to memory per rank; docs/algorithm.md, "Memory per rank").

The recipe's model and a micro-batch of its shape are built under torch's FakeTensorMode (shapes and
dtypes, no memory, no arithmetic: an 8B Llama in about a second), and its loss runs forward once under
the recipe's precision (autocast, as the trainer runs it) while autograd's saved-tensor hooks note every
tensor it keeps for backward, each storage once, attributed to the block (ModelSpec.blocks) running
then. What each train.activation_checkpointing mode keeps follows from that one pass:
  none       everything saved
  full       what is saved outside the blocks (embeddings, final norm, output layer and loss) plus each
             block's input, which the non-reentrant checkpoint holds to recompute from
  selective  as full for every other block (zoa_train/models/blocks.py), everything for the rest
and the peak adds, with recomputation, the largest recomputed block's own activations, which backward
rebuilds one block at a time. Not counted: the gradients of activations in flight during backward
(a few tensors of one block's size), the allocator's slack and the device runtime.
"""

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zoa_train.models import registry as models
from zoa_train.models.blocks import CHECKPOINTING, checkpointed_blocks
from zoa_train.precision import autocast


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes one rank's micro-batch keeps for backward, by train.activation_checkpointing mode (peak:
    with the largest recomputed block rebuilt)."""

    none: int
    selective: int
    full: int

    def __getitem__(self, mode: str) -> int:
        return getattr(self, mode)

    def as_dict(self) -> dict[str, int]:
        return {mode: self[mode] for mode in CHECKPOINTING}


def activation_memory(recipe, micro_batch_size: int | None = None) -> ActivationMemory:
    """What one rank keeps for backward training the recipe's model on a micro-batch (the recipe's
    train.micro_batch_size unless given), under each activation-checkpointing mode."""
    from zoa_train.tasks import task_class

    task = task_class(recipe)
    size = micro_batch_size or recipe.train.micro_batch_size
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = task.model_for_counting(recipe)
        model.train()
        blocks = models.get(recipe.model.kind).blocks(model)
        saved: dict[int, tuple[int, int | None]] = {}  # storage -> (bytes, the block that saved it first, or None outside)
        inputs: list[dict[int, int]] = [{} for _ in blocks]  # each block's input storages -> bytes
        running: list[int | None] = [None]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            saved.setdefault(storage._cdata, (storage.nbytes(), running[0]))
            return tensor

        def enter(index: int):
            def hook(module, args, kwargs):
                running[0] = index
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
                inputs[index] = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}

            return hook

        handles = [block.register_forward_pre_hook(enter(i), with_kwargs=True) for i, block in enumerate(blocks)]
        handles += [block.register_forward_hook(lambda *_: running.__setitem__(0, None)) for block in blocks]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(recipe.train.precision, torch.device("cpu")):
                task.loss(model, task.example_batch(recipe, size))
        finally:
            for handle in handles:
                handle.remove()
    own = [{key: size for key, (size, block) in saved.items() if block == i} for i in range(len(blocks))]
    outside = {key: size for key, (size, block) in saved.items() if block is None}

    def mode_bytes(mode: str) -> int:
        recomputed = [i for i, b in enumerate(blocks) if any(b is r for r in checkpointed_blocks(blocks, mode))]
        held = dict(outside)
        for i in range(len(blocks)):
            held |= inputs[i] if i in recomputed else own[i]
        rebuilt = max((sum(size for key, size in own[i].items() if key not in held) for i in recomputed), default=0)
        return sum(held.values()) + rebuilt

    return ActivationMemory(**{mode: mode_bytes(mode) for mode in CHECKPOINTING})

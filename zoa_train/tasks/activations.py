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
and the peak is the larger of what the end of forward keeps and, during backward (last block first),
what the blocks below a block keep plus that block's activations (rebuilt where it is recomputed) and as
many bytes again of their gradients. Not counted: the loss's gradient of the logits at the start of
backward, the allocator's slack and the device runtime (measured on CPU: docs/results/training-at-scale.md, "Activation
checkpointing").
"""

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zoa_train.models import registry as models
from zoa_train.models.blocks import CHECKPOINTING, checkpointed_blocks
from zoa_train.precision import autocast


@dataclass(frozen=True)
class ActivationMemory:
    """Bytes of one rank's micro-batch at its peak, by train.activation_checkpointing mode, and `saved`:
    every tensor the forward keeps for backward without recomputation."""

    none: int
    selective: int
    full: int
    saved: int

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
        saved: dict[int, tuple[int, int | str]] = {}  # storage -> (bytes, the block that saved it first, or before/after them)
        inputs: list[dict[int, int]] = [{} for _ in blocks]  # each block's input storages -> bytes
        running: list[int | str] = ["before"]

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
        handles += [block.register_forward_hook(lambda *_: running.__setitem__(0, "after")) for block in blocks]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(recipe.train.precision, torch.device("cpu")):
                task.loss(model, task.example_batch(recipe, size))
        finally:
            for handle in handles:
                handle.remove()
    own = [{key: size for key, (size, block) in saved.items() if block == i} for i in range(len(blocks))]
    before = {key: size for key, (size, block) in saved.items() if block == "before"}
    after = {key: size for key, (size, block) in saved.items() if block == "after"}

    def peak(mode: str) -> int:
        recomputed = [any(b is r for r in checkpointed_blocks(blocks, mode)) for b in blocks]
        kept = [inputs[i] if recomputed[i] else own[i] for i in range(len(blocks))]
        # the end of forward: everything kept; then backward, last block first, each block's activations
        # (rebuilt if recomputed) and their gradients over what the blocks before it keep
        live = [before | after | {k: v for held in kept for k, v in held.items()}]
        for i in range(len(blocks)):
            below = dict(before)
            for held in kept[:i]:
                below |= held
            live.append(below | inputs[i] | {(k, "grad"): v for k, v in own[i].items()} | own[i])
        return max(sum(held.values()) for held in live)

    return ActivationMemory(**{mode: peak(mode) for mode in CHECKPOINTING}, saved=sum(size for size, _ in saved.values()))

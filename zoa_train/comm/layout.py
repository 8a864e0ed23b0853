"""The buffer layout every collective of flat buffers uses, and what they share on top of it.

A collective averages one flat buffer per parameter group. `onebit_layout` lays a buffer out from its
tensors' sizes for a world size: scale rows of at most `scale_row` elements (a multiple of 32), each
tensor of at least a row starting on a row boundary, a run of smaller tensors sharing rows, and the
rows dealt out in one equal chunk per rank (docs/algorithm.md, "The 1-bit allreduce"). Optimizers keep
their flat state in these layouts, and `relayout` moves a saved buffer into another world size's.
`LaidOutCollective` is the base of the collectives of buffers in such layouts (flat, node-aware,
top-k): `op` on packed or laid-out tensors, the full-precision `allreduce`, `relayout`.
"""

from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple

import torch
import torch.distributed as dist

from zoa_train.comm.collectives import allreduce

SCALE_ROW = 1 << 12  # most elements sharing one scale: a power of two, so most layers fill whole rows
# Rows are a multiple of 32 elements, so a chunk's packed signs are a whole number of fp32 words
# and the scales behind them can be viewed as fp32 in place.
_ROW_ALIGN = 32
_SCALE_BYTES = 4


class OneBitLayout(NamedTuple):
    """Where each tensor lies in a 1-bit allreduce's buffer and how the buffer is cut up.

    Inactive (one rank or no elements): the tensors back to back, `padded == numel`, no rows."""

    sizes: tuple[int, ...]  # elements of each tensor, in buffer order
    offsets: tuple[int, ...]  # where each tensor starts
    padded: int  # elements of a buffer in this layout: world_size * chunk when active
    chunk: int  # elements per rank's chunk: rows * row
    rows: int  # scale rows per chunk
    row: int  # elements per scale row, a multiple of 32
    segment: int  # bytes of one wire segment: chunk/8 of signs + 4 per row of scales

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def active(self) -> bool:
        return self.row > 0

    def row_lengths(self) -> torch.Tensor:
        """Real (non-padding) elements at the start of each of the world_size * rows rows (the
        rest of a row is padding), int64."""
        valid = torch.zeros(self.padded // self.row, dtype=torch.int64)
        for offset, size in zip(self.offsets, self.sizes):
            if size:
                first, last = offset // self.row, (offset + size - 1) // self.row
                valid[first:last] = self.row
                valid[last] = max(int(valid[last]), offset + size - last * self.row)
        return valid


def onebit_layout(sizes: int | Sequence[int], world_size: int, scale_row: int = SCALE_ROW) -> OneBitLayout:
    """The layout of a 1-bit allreduce of tensors of `sizes` elements (or one of `sizes`) on
    `world_size` ranks.

    Rows hold at most `scale_row` elements and are a multiple of 32: either exactly `scale_row`
    (which fits the power-of-two sizes of most layers) or as equal as possible over the whole
    buffer (which fits one odd-sized buffer), whichever pads less. Each tensor of at least a row
    starts on a row boundary; a run of smaller tensors starts on one and shares rows. The rows are
    then dealt out in n equal chunks, padded with empty rows.
    """
    sizes = (int(sizes),) if isinstance(sizes, int) else tuple(int(size) for size in sizes)
    if any(size < 0 for size in sizes):
        raise ValueError(f"a 1-bit allreduce lays out tensors of 0 or more elements, not {min(sizes)}")
    numel = sum(sizes)
    if world_size < 2 or numel <= 0:
        return OneBitLayout(sizes, tuple(accumulate((0,) + sizes))[: len(sizes)], numel, 0, 0, 0, 0)
    need = -(-numel // world_size)
    limit = max(_ROW_ALIGN, scale_row // _ROW_ALIGN * _ROW_ALIGN)
    equal = -(-need // (-(-need // limit) * _ROW_ALIGN)) * _ROW_ALIGN
    return min((layout_with_rows(sizes, world_size, row) for row in (limit, equal)), key=lambda l: l.padded)


def layout_with_rows(sizes: tuple[int, ...], world_size: int, row: int) -> OneBitLayout:
    offsets, end, in_small_run = [], 0, False
    for size in sizes:
        small = size < row
        if not (small and in_small_run):
            end = -(-end // row) * row
        offsets.append(end)
        end += size
        in_small_run = small
    rows = -(-(-(-end // row)) // world_size)  # noqa: B002 -- nested ceiling divisions, not a decrement
    chunk = rows * row
    return OneBitLayout(sizes, tuple(offsets), world_size * chunk, chunk, rows, row, chunk // 8 + _SCALE_BYTES * rows)


def buffer_sizes(sizes) -> list:
    """`sizes` as a list of buffers' tensor sizes: an int or a list of ints is one buffer, a list of
    lists is several."""
    if isinstance(sizes, int) or not sizes or isinstance(sizes[0], int):
        return [sizes]
    return list(sizes)


def checked_accumulator(given: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """`given`, the storage a caller passed for a collective's accumulators, if it is like `own`."""
    if given.numel() != own.numel() or given.dtype != own.dtype or given.device != own.device or not given.is_contiguous():
        raise ValueError(f"the accumulator must be a contiguous {own.dtype} tensor of {own.numel()} elements on {own.device}")
    return given.view(-1)


def collective_device(device: torch.device | str | None, group, who: str = "a collective") -> torch.device:
    """Where a collective keeps its buffers: `device`, else the process group's; a CUDA device with its index."""
    device = torch.device(device) if device is not None else _group_device(group)
    if device.type == "meta":  # its buffers would hold nothing, and Gloo would "average" meta tensors without a word
        raise ValueError(
            f"{who} cannot keep its buffers on the meta device, which holds no values; "
            "build the model on a real device (e.g. module.to_empty(device='cpu'), then initialise it) before the optimizer"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _group_device(group) -> torch.device:
    """Where a process group's collectives want their tensors: the current CUDA device for NCCL."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


ONEBIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the 1-bit collectives average


def checked_buffers(who: str, tensors, layouts, device: torch.device, laid_out: bool = False) -> list[torch.Tensor]:
    """`tensors` (a tensor or a list) as a list of one tensor per layout, on `device`, of a dtype the
    1-bit collectives average; with `laid_out` each also a contiguous buffer in its layout."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if len(tensors) != len(layouts):
        raise ValueError(f"this {who} has {len(layouts)} buffers, got {len(tensors)} tensors")
    for t, layout in zip(tensors, layouts):
        if t.device != device:
            raise ValueError(f"{who}'s buffers are on {device}, got a tensor on {t.device}")
        if t.dtype not in ONEBIT_DTYPES:  # the math is fp32: any other dtype would come back wrong
            raise ValueError(f"{who} averages float32, bfloat16 or float16 tensors, not {t.dtype}")
        if laid_out and (t.numel() != layout.padded or not t.is_contiguous()):
            raise ValueError(f"{who}.exchange takes contiguous buffers in its layout ({layout.padded} elements), got a tensor of {t.numel()}")
    return tensors


class LaidOutCollective:
    """What a collective of buffers in 1-bit layouts does the same whatever its topology: `op` on
    buffers in the layouts or packed, the full-precision `allreduce`, and moving saved buffers
    between layouts. A subclass sets `group`, `ledger`, `layouts`, `device`, `world_size`,
    `scale_row` and `_scratch` (a dict) and defines `exchange`."""

    def op(self, tensor: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        """Average `tensor` in place over the group, error-compensated, and return it; a list of
        tensors for several buffers, one each.

        A tensor may hold just the buffer's `numel` elements (its tensors back to back, any length:
        it is padded and unpadded here, through a scratch buffer kept for the next call) or be a
        buffer already in the layout (`layout.padded` elements), which is the optimizers' fast path
        with no copy. Non-finite values make the output rows they fall in non-finite, on every rank
        alike, and those rows' errors restart at zero: the next finite call is unaffected."""
        tensors = self._per_buffer(tensor)
        for t, layout in zip(tensors, self.layouts):
            if t.numel() not in (layout.padded, layout.numel):
                raise ValueError(f"this {type(self).__name__} averages {layout.numel} elements (or {layout.padded} in its layout), got a tensor of {t.numel()}")
            if layout.active and not t.is_contiguous():
                raise ValueError(f"{type(self).__name__}.op needs a contiguous tensor")
        if self.world_size < 2:
            return tensor
        flat = [t.view(-1) if t.numel() == layout.padded else self._laid_out(t.view(-1), i) for i, (t, layout) in enumerate(zip(tensors, self.layouts))]
        self.exchange(out=flat, addend=flat)
        for i, (t, buffer) in enumerate(zip(tensors, flat)):
            if t.numel() != buffer.numel():
                torch._foreach_copy_(list(t.view(-1).split(self.layouts[i].sizes)), self._views(buffer, i))
        return tensor

    def allreduce(self, tensor: torch.Tensor, comm_dtype: torch.dtype | None = None, elements: int | None = None, in_step: bool = True) -> torch.Tensor:
        """Average `tensor` in place in full precision over the group (see the Collective protocol):
        here a flat allreduce; the node-aware collective overrides it."""
        return allreduce(tensor, group=self.group, ledger=self.ledger, comm_dtype=comm_dtype, elements=elements, in_step=in_step)

    def _laid_out(self, packed: torch.Tensor, index: int) -> torch.Tensor:
        """`packed` (buffer `index`'s tensors back to back) copied into a padded scratch buffer in its layout."""
        key = (index, packed.dtype)
        if key not in self._scratch:
            self._scratch[key] = torch.zeros(self.layouts[index].padded, dtype=packed.dtype, device=self.device)
        buffer = self._scratch[key]
        torch._foreach_copy_(self._views(buffer, index), list(packed.split(self.layouts[index].sizes)))
        return buffer

    def _views(self, buffer: torch.Tensor, index: int) -> list[torch.Tensor]:
        layout = self.layouts[index]
        return [buffer[offset : offset + size] for offset, size in zip(layout.offsets, layout.sizes)]

    def _per_buffer(self, tensors) -> list[torch.Tensor]:
        return checked_buffers(type(self).__name__, tensors, self.layouts, self.device)

    def _laid_out_buffers(self, tensors) -> list[torch.Tensor]:
        """`tensors` for `exchange`: one buffer in each layout (the kernels write whole rows into them)."""
        return checked_buffers(type(self).__name__, tensors, self.layouts, self.device, laid_out=True)

    def layout_state(self) -> list[dict]:
        """Where each buffer's tensors lie, per buffer: what `relayout` needs to read a buffer saved in
        this layout back at another world size (optimizers save it with their flat state)."""
        return [{"world_size": self.world_size, "offsets": list(l.offsets), "padded": l.padded} for l in self.layouts]

    def relayout(self, flat: torch.Tensor, index: int, saved: dict) -> torch.Tensor:
        """Buffer `index` as saved in another layout (an entry of `layout_state()` of that run), laid
        out anew in this one (see `relayout`)."""
        return relayout(flat, self.layouts[index], saved, self.scale_row)


def relayout(flat: torch.Tensor, layout: OneBitLayout, saved: dict, scale_row: int = SCALE_ROW) -> torch.Tensor:
    """A buffer saved in another layout of the same tensors (`saved`: an entry of a collective's
    `layout_state()` in that run, or of a checkpoint from before it was saved, just {"world_size",
    "padded"}) laid out anew in `layout`: each tensor moved to its offset here, padding zero. For
    --reshard: the error buffers themselves are not carried over (they start at zero, as built)."""
    old = saved if "offsets" in saved else onebit_layout(layout.sizes, saved["world_size"], scale_row)._asdict()
    offsets = old["offsets"]
    if not flat.numel() == saved["padded"] == old["padded"] or len(offsets) != len(layout.sizes):
        raise ValueError(
            f"a buffer of {flat.numel()} elements saved on {saved['world_size']} ranks is not in a 1-bit layout of these {len(layout.sizes)} tensors"
        )
    out = torch.zeros(layout.padded, dtype=flat.dtype)  # padding stays zero, as the optimizers keep it
    for size, old_offset, new_offset in zip(layout.sizes, offsets, layout.offsets):
        out[new_offset : new_offset + size] = flat[old_offset : old_offset + size]
    return out

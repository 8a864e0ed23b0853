"""Chunk-wise top-k with 2-bit values and error feedback, averaged by one all-gather: the compressor of
SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, arXiv 2508.15706), written from the paper's
description (docs/optimizers.md, "DiLoCo's outer sync"; what is this module's own choice is said there).

One call on each rank, for each buffer laid out in chunks of `chunk` elements (`topk_layout`: the
1-bit layout's rows on one rank, so chunks follow the tensors: every tensor of at least a chunk starts
on one, runs of smaller tensors share):
  y = e + x                                     (e: the error carried from the last call)
  per chunk, the k = round(density * chunk) elements of largest |y| (a tie goes to the lower index,
  padding comes last), kept in index order
  their values in 2 bits: the sign, and whether |y| reaches m, the mean |y| of the k; the decoded
  magnitude is lo or hi, the mean |y| of the selected below m and of those at or above it
  the message per chunk: lo and hi (fp32), and k slots, each the index in the chunk (ceil(log2 chunk)
  bits) and the 2-bit code, packed back to back, least significant bit first
  all-gather of the messages; every rank decodes every message and sums them in rank order, then
  divides by n, so all ranks hold the same average
  e <- error_decay * (y - what this rank's own message decodes to)
With error_decay 1 this is plain error feedback; below 1 it is SparseLoCo's decayed accumulator
(e <- beta e + pseudo-gradient), which the paper uses in place of DiLoCo's outer momentum.

The ledger counts every bit of the message as payload: 2 bits of value and the index bits of each
slot (`topk_allreduce`), and the two fp32 levels of each chunk (`topk_scales`); bytes are what the
all-gather sends, (n-1) messages per rank.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from zoa_train.comm.agreement import check_same_on_every_rank
from zoa_train.comm.collectives import default_ledger, group_size_rank
from zoa_train.comm.layout import LaidOutCollective, OneBitLayout, buffer_sizes, collective_device, layout_with_rows, onebit_layout
from zoa_train.comm.ledger import CommLedger

CHUNK = 1 << 12  # elements per chunk: 12 index bits
_CODE_BITS = 2
_LEVELS = 2  # fp32 levels (lo, hi) per chunk
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def topk_layout(sizes: int | Sequence[int], chunk: int = CHUNK) -> OneBitLayout:
    """Tensors of `sizes` in chunks of `chunk` elements that follow them (the 1-bit layout's rows, on
    one rank: nothing depends on the world size); no elements: the tensors back to back, no chunks."""
    sizes = (int(sizes),) if isinstance(sizes, int) else tuple(int(size) for size in sizes)
    if sum(sizes) <= 0 or min(sizes) < 0:  # onebit_layout refuses a negative size
        return onebit_layout(sizes, 1)
    return layout_with_rows(sizes, 1, chunk)


class TopKWire(NamedTuple):
    """What one rank's message of one call holds, for buffers of some layouts."""

    chunks: int
    k: int  # slots per chunk
    index_bits: int

    @property
    def slot_bits(self) -> int:
        return self.index_bits + _CODE_BITS

    @property
    def payload_bits(self) -> int:
        """Every bit of the message but the byte padding: slots and levels."""
        return self.chunks * (self.k * self.slot_bits + 32 * _LEVELS)

    @property
    def message_bytes(self) -> int:
        """Bytes of one rank's message: the levels, then the slots packed and padded to a byte."""
        return 4 * _LEVELS * self.chunks + -(-self.chunks * self.k * self.slot_bits // 8)


def topk_slots(density: float, chunk: int) -> int:
    """Slots per chunk: density * chunk rounded, at least 1."""
    return min(chunk, max(1, round(density * chunk)))


def topk_wire(sizes, density: float, chunk: int = CHUNK) -> TopKWire:
    """The message of a TopKAllReduce of `sizes` (as its `sizes`): one per rank and call."""
    chunks = sum(l.padded // l.row for l in (topk_layout(s, chunk) for s in buffer_sizes(sizes)) if l.active)
    return TopKWire(chunks, topk_slots(density, chunk), max(1, (chunk - 1).bit_length()))


TOPK_STATE = ("_error", "_real")  # of topk_buffers, those carried from call to call; the wire buffers are scratch


def topk_buffers(sizes, world_size: int, density: float, chunk: int = CHUNK) -> dict[str, tuple[int, torch.dtype]]:
    """(elements, dtype) of each buffer a TopKAllReduce of `sizes` on `world_size` ranks allocates:
    the error `_error` (the accumulators, in the layouts back to back), which of its elements are
    real (not padding) `_real`, this rank's message `_mine` and the all-gather's `_gathered` (one
    message per rank)."""
    message = topk_wire(sizes, density, chunk).message_bytes
    layouts = [topk_layout(s, chunk) for s in buffer_sizes(sizes)]
    return {
        "_error": (sum(l.padded for l in layouts), torch.float32),
        "_real": (sum(l.padded for l in layouts if l.active), torch.bool),
        "_mine": (message, torch.uint8),
        "_gathered": (world_size * message, torch.uint8),
    }


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below 2**width, `width` bits each, back to back, least significant bit
    first, in bytes (the last one padded with zeros)."""
    bits = ((values.reshape(-1, 1) >> torch.arange(width, device=values.device)) & 1).reshape(-1)
    bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)]).view(-1, 8)
    return (bits << torch.arange(8, device=values.device)).sum(1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The `count` integers of `width` bits that `pack_bits` wrote into `data`, as int64."""
    bits = ((data.to(torch.int64).reshape(-1, 1) >> torch.arange(8, device=data.device)) & 1).reshape(-1)
    return (bits[: count * width].view(count, width) << torch.arange(width, device=data.device)).sum(1)


class TopKAllReduce(LaidOutCollective):
    """A Collective (zoa_train/comm/protocol.py) that averages flat buffers over a process group as
    the module docstring says: chunk-wise top-k at `density` (a fraction in (0, 1]), values in 2 bits,
    error feedback decayed by `error_decay` (in [0, 1]), one all-gather per call for all buffers.

    `sizes` as OneBitAllReduce's (one buffer's tensor sizes, or a list of such lists); each buffer in
    its own `topk_layout`, which does not depend on the world size. Owns the error buffer (fp32, the
    accumulators, in the layouts back to back) and the wire buffers. With one rank `op` returns its
    input and `exchange` the accumulator exactly, sending nothing.
    """

    def __init__(
        self,
        sizes,
        group=None,
        device: torch.device | str | None = None,
        ledger: CommLedger | None = None,
        *,
        density: float = 0.01,
        chunk: int = CHUNK,
        error_decay: float = 1.0,
    ):
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1 element, got {chunk}")
        if not 0 <= error_decay <= 1:
            raise ValueError(f"error_decay must be in [0, 1], got {error_decay}")
        self.group = group
        self.world_size, self.rank = group_size_rank(group)
        self.device = collective_device(device, group, "TopKAllReduce")
        self.ledger = ledger if ledger is not None else default_ledger()
        self.density, self.error_decay = density, error_decay
        self.scale_row = chunk  # LaidOutCollective's name for the row (chunk) length
        self.layouts = [topk_layout(s, chunk) for s in buffer_sizes(sizes)]
        check_same_on_every_rank("TopKAllReduce", group, [l.sizes for l in self.layouts], {"density": density, "chunk": chunk})
        self.numel = sum(l.numel for l in self.layouts)
        self.wire = topk_wire(sizes, density, chunk)
        self._scratch: dict = {}  # LaidOutCollective.op's, for packed tensors
        for name, (size, dtype) in topk_buffers(sizes, self.world_size, density, chunk).items():
            setattr(self, name, torch.zeros(size, dtype=dtype, device=self.device))
        self._accumulators = list(self._error.split([l.padded for l in self.layouts]))
        # Per active buffer: its index, the real (non-padding) elements as (chunks, chunk) flags (in _real).
        self._active, start = [], 0
        for i, layout in enumerate(self.layouts):
            if layout.active:
                flags = self._real[start : start + layout.padded]
                flags.copy_(_real(layout))
                self._active.append((i, flags.view(-1, layout.row)))
                start += layout.padded

    @property
    def accumulators(self) -> list[torch.Tensor]:
        """Per buffer, the error carried to the next `exchange` (in its layout); adding into it between
        calls is the same as passing the sum. Its padding must stay zero."""
        return self._accumulators

    def held_buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer this collective holds, by the names `topk_buffers` sizes them by."""
        return {name: getattr(self, name) for name in ("_error", "_real", "_mine", "_gathered")}

    @property
    def bytes_per_call(self) -> int:
        """Bytes this rank sends in one call: its message to each of the n-1 others."""
        return (self.world_size - 1) * self.wire.message_bytes

    def exchange(self, out, addend=None):
        """Compress accumulator + addend (the error included), all-gather, write the average to `out`
        (buffers in the layouts; padding zero afterwards) and keep the decayed residual as the error."""
        outs = self._laid_out_buffers(out)
        addends = self._laid_out_buffers(addend) if addend is not None else [None] * len(outs)
        for acc, a in zip(self._accumulators, addends):
            if a is not None:
                acc.add_(a)  # before `out` is written: `op` passes the same buffers as both
        if self.world_size < 2:
            for acc, o in zip(self._accumulators, outs):
                o.copy_(acc)
            self._error.zero_()
            return out
        if not self._active:
            return out
        chunks = [real.shape[0] for _, real in self._active]
        slots, levels = zip(*(self._encode(self._accumulators[i].view(-1, real.shape[1]), real) for i, real in self._active))
        w = self.wire
        self._mine.copy_(torch.cat([torch.cat(levels).view(torch.uint8).view(-1), pack_bits(torch.cat(slots), w.slot_bits)]))
        _all_gather(self._gathered, self._mine, group=self.group)
        sums = None
        for message in self._gathered.view(self.world_size, -1):
            decoded = self._decode(message, chunks)
            sums = decoded if sums is None else [s.add_(d) for s, d in zip(sums, decoded)]
        mine = self._decode(self._mine, chunks)
        for (i, _), total, own in zip(self._active, sums, mine):
            acc = self._accumulators[i].view_as(own)
            acc.sub_(own).mul_(self.error_decay)
            outs[i].view_as(total).copy_(total.div_(self.world_size))
        # Every bit of the message is payload: the slots (index + value), and the two levels of each chunk.
        self.ledger.record("topk_allreduce", payload_bits=w.slot_bits, elements=w.chunks * w.k, bytes_sent=self.bytes_per_call)
        self.ledger.record("topk_scales", payload_bits=32, elements=_LEVELS * w.chunks, bytes_sent=0, calls=0)  # bytes and call: above
        return out

    def _encode(self, y: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots (chunks * k,), levels (chunks, 2) fp32) of `y` (chunks, chunk)."""
        k = self.wire.k
        magnitude = y.abs().masked_fill(~real, -1.0)  # padding is chosen last
        chosen = magnitude.sort(dim=1, descending=True, stable=True).indices[:, :k].sort(dim=1).values
        values, counted = y.gather(1, chosen), real.gather(1, chosen)
        size = values.abs() * counted
        mean = size.sum(1, keepdim=True) / counted.sum(1, keepdim=True).clamp(min=1)
        big = size >= mean
        lo = (size * ~big).sum(1) / (counted & ~big).sum(1).clamp(min=1)
        hi = (size * big).sum(1) / (counted & big).sum(1).clamp(min=1)
        code = (values < 0).long() * 2 + big.long()
        slots = chosen | (code << self.wire.index_bits)
        return slots.reshape(-1), torch.stack([lo, hi], dim=1)

    def _decode(self, message: torch.Tensor, chunks: list[int]) -> list[torch.Tensor]:
        """Each active buffer's (chunks, chunk) values that a message holds, padding zero."""
        w, total = self.wire, sum(chunks)
        levels = message[: 4 * _LEVELS * total].clone().view(torch.float32).view(total, _LEVELS)
        slots = unpack_bits(message[4 * _LEVELS * total :], w.slot_bits, total * w.k).view(total, w.k)
        index, code = slots & ((1 << w.index_bits) - 1), slots >> w.index_bits
        values = levels.gather(1, code & 1) * (1 - 2 * (code >> 1)).to(torch.float32)
        decoded = []
        for (_, real), start, rows in zip(self._active, [0, *torch.tensor(chunks).cumsum(0).tolist()], chunks):
            dense = torch.zeros(real.shape, device=self.device).scatter_(1, index[start : start + rows], values[start : start + rows])
            decoded.append(dense.masked_fill_(~real, 0.0))
        return decoded

    def state_dicts(self) -> list[dict]:
        """Per buffer, this rank's error (the residual the next call adds)."""
        return [
            {"topology": "topk", "numel": l.numel, "layout": (l.offsets, l.padded, l.row), "error": acc.clone()}
            for l, acc in zip(self.layouts, self._accumulators)
        ]

    def load_state_dicts(self, states: list[dict]) -> None:
        if len(states) != len(self.layouts):
            raise ValueError(f"top-k allreduce state is for {len(states)} buffers, this one has {len(self.layouts)}")
        for layout, acc, state in zip(self.layouts, self._accumulators, states):
            if state.get("topology") != "topk" or state["layout"] != (layout.offsets, layout.padded, layout.row):
                raise ValueError("the top-k error buffers were saved by another collective or in chunks of another size; resume with the same outer sync")
            acc.copy_(state["error"])


def _real(layout: OneBitLayout) -> torch.Tensor:
    """True at the elements of the layout's tensors, False at padding."""
    real = torch.zeros(layout.padded, dtype=torch.bool)
    for offset, size in zip(layout.offsets, layout.sizes):
        real[offset : offset + size] = True
    return real

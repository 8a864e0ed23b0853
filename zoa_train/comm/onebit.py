"""Error-compensated 1-bit allreduce (docs/algorithm.md, "The 1-bit allreduce").

Two passes over a flat buffer cut into rows of `row` elements, each row with its own scale:
  worker  y = x + e_w; per row send sign(y) and s = RMS(y); e_w <- y - s*sign(y)
  pass 1  all_to_all: rank j gets chunk j (a run of whole rows) of every rank's signs and scales
  server  c = mean_i(s_i*sign_i) + e_s; per row send sign(c) and s = RMS(c); e_s <- c - s*sign(c)
  pass 2  all_gather of the server signs and scales; every rank unpacks the same average
Each segment on the wire is the packed signs of one chunk followed by its fp32 row scales, so a
call is exactly two collectives.

Rows follow the tensors. The buffer is laid out from a list of tensor sizes (`onebit_layout`):
every tensor of at least a row starts on a row boundary, and a run of smaller tensors (biases,
norms) is packed from one, so no scale is shared by an embedding matrix and a dense layer, whose
magnitudes and sparsity differ. A sign costs no more for a zero than for a nonzero, so the scale is
what keeps a sparse embedding gradient from being drowned by (or drowning) its neighbours (on
gpt2_tiny, rows cut across tensors trained 0/1 Adam worse: docs/results.md, ablation 1). The
padding after each tensor run and at the end carries no value: it is excluded from the scales,
its error stays zero, and it is zero in the output, so optimizers keep their state in this layout.

Speed: a row's scale needs only that row, so each pass works on whole rows at once: the buffer
is viewed as (n chunks, rows, row), and a block of a pass is the same rows of all n chunks, so a
pass is a fixed handful of tensor ops per block (one strided copy puts a block's signs into all n
wire segments; one table lookup unpacks all n servers' rows) whatever the number of rows (scale
segments) and of ranks; the server adds the n ranks' terms one op per rank, in order. On CPU
blocks stay in cache (512K elements); on accelerators one block holds up to 128M elements, so a
call on most models is a few dozen kernels plus one per rank. The error buffers always hold the
errors themselves. The server adds each rank's term as flags times a per-row coefficient
(sign = 2*flag - 1), cheaper than a table lookup; the output is a table lookup with the row's
scale folded into the table.
Several buffers (an optimizer's parameter groups, each in its own layout) share one call: each
wire segment holds every buffer's part for that rank, so all groups cost two collectives.
"""

from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple

import torch
import torch.distributed as dist

from zoa_train.comm.collectives import default_ledger, group_size_rank
from zoa_train.comm.ledger import CommLedger
from zoa_train.comm.packing import BLOCK, pack_flags, unpack_flags, unpack_rows

SCALE_ROW = 1 << 12  # most elements sharing one scale: a power of two, so most layers fill whole rows
# Rows are a multiple of 32 elements, so a chunk's packed signs are a whole number of fp32 words
# and the scales behind them can be viewed as fp32 in place.
_ROW_ALIGN = 32
_SCALE_BYTES = 4
# Elements per block on accelerators at most: few, large kernels, and scratch (about 8.5 bytes per
# element of a block) of at most about 1 GiB.
DEVICE_BLOCK = 1 << 27
# And on every device at most this share of the call's buffers: the scratch then stays near 0.1 fp32
# copies of them (with the wire buffers, 0.2 + 1/(8n)), small models and accelerators alike, at
# about 20 blocks of 35 + n ops each per call (docs/results.md, "The 1-bit call's scratch").
BLOCK_SHARE = 1 / 20
# torch 2.14 documents all_gather_single and deprecates all_gather_into_tensor (a FutureWarning on
# every call); older releases have only the latter.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
    return min((_layout_with_rows(sizes, world_size, row) for row in (limit, equal)), key=lambda l: l.padded)


def _layout_with_rows(sizes: tuple[int, ...], world_size: int, row: int) -> OneBitLayout:
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


def _buffer_sizes(sizes) -> list:
    """`sizes` as a list of buffers' tensor sizes: an int or a list of ints is one buffer, a list of
    lists is several."""
    if isinstance(sizes, int) or not sizes or isinstance(sizes[0], int):
        return [sizes]
    return list(sizes)


def block_elements(layouts: Sequence[OneBitLayout], device: torch.device) -> int:
    """The default elements per block of a call's buffers: BLOCK_SHARE of all of them together (the
    scratch is shared by the call's buffers, so a small parameter group takes few, large blocks),
    and at most BLOCK on CPU (in cache) or DEVICE_BLOCK on accelerators."""
    cap = BLOCK if device.type == "cpu" else DEVICE_BLOCK
    return min(cap, int(sum(l.padded for l in layouts if l.active) * BLOCK_SHARE))


def _block_rows(layout: OneBitLayout, device: torch.device, block_size: int | None, default: int) -> int:
    """Rows of each chunk that one block of a pass holds: a block is those rows of all n chunks, at
    most `block_size` elements (`default` when None: on CPU also at most one chunk's worth). A pass is
    a few kernels per block whatever the number of rows or ranks."""
    if block_size is None:
        block_size = min(default, layout.chunk) if device.type == "cpu" else default
    n = layout.padded // layout.chunk
    return min(layout.rows, max(1, block_size // (n * layout.row)))


def onebit_buffers(
    sizes,
    world_size: int,
    device: torch.device | str = "cpu",
    block_size: int | None = None,
    scale_row: int = SCALE_ROW,
) -> dict[str, tuple[int, torch.dtype]]:
    """(elements, dtype) of each buffer a OneBitAllReduce of `sizes` (see OneBitAllReduce)
    allocates: the error buffers `_worker` (e_w, also the accumulator) and `_server` (e_s of this
    rank's chunks), the wire buffers `_send`, `_recv`, `_gathered` (n segments each) and `_mine`
    (one), the per-block scratch `_flags`, `_flag_bytes`, `_words`, `_index` and `_tables`, and the
    per-row `_server_coef`. Inactive (one rank or no elements): worker buffers of numel and all
    others empty."""
    return _allocations([onebit_layout(s, world_size, scale_row) for s in _buffer_sizes(sizes)], world_size, torch.device(device), block_size)


def _allocations(layouts: Sequence[OneBitLayout], world_size: int, device: torch.device, block_size: int | None) -> dict[str, tuple[int, torch.dtype]]:
    active = [l for l in layouts if l.active]
    n = world_size
    default = block_elements(active, device)
    block = max((world_size * l.row * _block_rows(l, device, block_size, default) for l in active), default=0)
    segment = sum(l.segment for l in active)
    return {
        "_worker": (sum(l.padded for l in layouts), torch.float32),
        "_server": (sum(l.chunk for l in active), torch.float32),
        "_send": (n * segment, torch.uint8),
        "_recv": (n * segment, torch.uint8),
        "_gathered": (n * segment, torch.uint8),
        "_mine": (segment, torch.uint8),
        "_flags": (block, torch.float32),
        "_flag_bytes": (block, torch.int8),
        "_words": (block // 8, torch.int64),
        "_index": (block // 8, torch.int32),
        "_tables": (max((block // l.row * 256 * 8 for l in active), default=0), torch.float32),
        "_server_coef": ((n + 1) * sum(l.rows for l in active), torch.float32),
    }


class _Block(NamedTuple):
    """Views of rows first..last of every chunk of one buffer, in every pass: (n, r, row) values,
    (n, r) scales and norms, (n, r*row/8) packed signs; the server's have one chunk (1, ...)."""

    first: int
    last: int
    worker: torch.Tensor  # y, in the worker buffer
    worker_padding: torch.Tensor | None  # positions of its padding in _worker
    norm: torch.Tensor  # sqrt of the number of real elements of each row
    send_signs: torch.Tensor
    send_scales: torch.Tensor
    recv_signs: torch.Tensor  # every rank's signs of these rows of this rank's chunk
    coef: torch.Tensor  # (n + 1, r, 1): 2*s_i/n of each source i, then sum_i s_i/n
    server: torch.Tensor  # c, in the server buffer
    server_padding: torch.Tensor | None  # positions of its padding in _server
    server_norm: torch.Tensor
    mine_signs: torch.Tensor
    mine_scales: torch.Tensor
    gathered_signs: torch.Tensor  # every server's signs and scales of these rows
    gathered_scales: torch.Tensor


class _Part(NamedTuple):
    """One buffer of the call (one optimizer parameter group) with its own layout."""

    layout: OneBitLayout
    worker: torch.Tensor  # its part of _worker (padded elements), its accumulator
    server: torch.Tensor  # its part of _server (one chunk)
    recv_scales: torch.Tensor  # (n, rows): every rank's scales of this rank's chunk
    coef: torch.Tensor  # (n + 1, rows)
    padding: torch.Tensor  # positions of all its padding, to zero the output's
    blocks: list[_Block]


def _padding_positions(valid: torch.Tensor, row: int, first: int, last: int, stride: int) -> torch.Tensor:
    """Flat positions of the padding in rows first..last of each chunk (a row of `valid`, the real
    elements at the start of each row), chunks `stride` elements apart."""
    padding = torch.arange(row) >= valid[:, first:last, None]
    chunk, rows, column = padding.nonzero(as_tuple=True)
    return chunk * stride + (first + rows) * row + column


def _wire_views(wire: torch.Tensor, column: int, layout: OneBitLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed signs (k, chunk/8), fp32 row scales (k, rows)) of one buffer in each of a wire
    buffer's k segments, where that buffer's part starts at byte `column` of a segment."""
    packed = layout.chunk // 8
    part = wire[:, column : column + layout.segment]
    return part[:, :packed], part[:, packed:].view(torch.float32)


def collective_device(device: torch.device | str | None, group) -> torch.device:
    """Where a collective keeps its buffers: `device`, else the process group's; a CUDA device with its index."""
    device = torch.device(device) if device is not None else _group_device(group)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _group_device(group) -> torch.device:
    """Where a process group's collectives want their tensors: the current CUDA device for NCCL."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


ONEBIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the 1-bit collectives average


class LaidOutCollective:
    """What a collective of buffers in 1-bit layouts does the same whatever its topology: `op` on
    buffers in the layouts or packed, and moving saved buffers between layouts. A subclass sets
    `layouts`, `device`, `world_size`, `scale_row` and `_scratch` (a dict) and defines `exchange`."""

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
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if len(tensors) != len(self.layouts):
            raise ValueError(f"this {type(self).__name__} has {len(self.layouts)} buffers, got {len(tensors)} tensors")
        for t in tensors:
            if t.device != self.device:
                raise ValueError(f"{type(self).__name__}'s buffers are on {self.device}, got a tensor on {t.device}")
            if t.dtype not in ONEBIT_DTYPES:  # the math is fp32: any other dtype would come back wrong
                raise ValueError(f"{type(self).__name__} averages float32, bfloat16 or float16 tensors, not {t.dtype}")
        return tensors

    def layout_state(self) -> list[dict]:
        """Where each buffer's tensors lie, per buffer: what `relayout` needs to read a buffer saved in
        this layout back at another world size (optimizers save it with their flat state)."""
        return [{"world_size": self.world_size, "offsets": list(l.offsets), "padded": l.padded} for l in self.layouts]

    def relayout(self, flat: torch.Tensor, index: int, saved: dict) -> torch.Tensor:
        """Buffer `index` as saved in another layout (an entry of `layout_state()` of that run), laid
        out anew in this one (see `relayout`)."""
        return relayout(flat, self.layouts[index], saved, self.scale_row)


class OneBitAllReduce(LaidOutCollective):
    """Averages flat buffers in their layouts over a process group with 1-bit error-compensated compression.

    `sizes`: the sizes of the tensors one buffer holds (or one size), or a list of such lists for
    several buffers (the parameter groups of an optimizer), each with its own layout
    (`layouts[i]`, `layout` when there is one) and all averaged by one call: one all_to_all and
    one all_gather whose segments hold every buffer's part. Owns the worker error (fp32, in the
    layouts, back to back) and the server error (this rank's chunks, fp32) and all communication
    buffers, allocated once on `device` (default: the process group's device, CUDA for NCCL).
    Math is fp32 whatever the input dtype. With a world size of 1, `op` returns its input
    unchanged and sends nothing, and `exchange` returns the accumulator exactly. `block_size`
    (elements per step of a pass; default 512K on CPU, the whole buffer up to 128M elsewhere)
    changes speed and scratch memory, never results; `scale_row` is part of the wire format and
    must be the same on every rank. `layouts` (instead of `sizes`): buffers already laid out for
    this group's size, such as the node-aware sync's shards (zoa_train/comm/hierarchical.py).
    """

    def __init__(
        self,
        sizes,
        group=None,
        device: torch.device | str | None = None,
        ledger: CommLedger | None = None,
        block_size: int | None = None,
        scale_row: int = SCALE_ROW,
        layouts: Sequence[OneBitLayout] | None = None,
    ):
        self.group = group
        self.world_size, self.rank = group_size_rank(group)
        self.device = collective_device(device, group)
        self.ledger = ledger if ledger is not None else default_ledger()
        self.scale_row = scale_row
        if layouts is None:
            layouts = [onebit_layout(s, self.world_size, scale_row) for s in _buffer_sizes(sizes)]
        elif any(l.active and l.padded != self.world_size * l.chunk for l in layouts):
            raise ValueError(f"these layouts are not cut into {self.world_size} chunks, one per rank of the group")
        self.layouts = list(layouts)
        self.numel = sum(l.numel for l in self.layouts)
        for name, (size, dtype) in _allocations(self.layouts, self.world_size, self.device, block_size).items():
            setattr(self, name, torch.zeros(size, dtype=dtype, device=self.device))
        self._accumulators = list(self._worker.split([l.padded for l in self.layouts]))
        self._scratch: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # see _laid_out
        self._segment = sum(l.segment for l in self.layouts if l.active)
        self._default_block = block_elements(self.layouts, self.device)
        self._parts: list[_Part | None] = []
        worker = server = column = coef = 0
        for layout in self.layouts:
            self._parts.append(self._part(layout, worker, server, column, coef, block_size) if layout.active else None)
            worker += layout.padded
            if layout.active:
                server, column, coef = server + layout.chunk, column + layout.segment, coef + (self.world_size + 1) * layout.rows

    def _part(self, layout: OneBitLayout, worker: int, server: int, column: int, coef: int, block_size: int | None) -> _Part:
        """The views of one buffer that starts at these offsets of _worker, _server, a wire segment
        and _server_coef. Made once: slicing in every call would cost as much as the ops on CPU."""
        n, rows, row, rank = self.world_size, layout.rows, layout.row, self.rank
        wires = [w.view(-1, self._segment) for w in (self._send, self._recv, self._gathered, self._mine)]
        (send_signs, send_scales), (recv_signs, recv_scales), (gathered_signs, gathered_scales), (mine_signs, mine_scales) = (
            _wire_views(w, column, layout) for w in wires
        )
        values = self._worker[worker : worker + layout.padded]
        chunk = self._server[server : server + layout.chunk]
        coefs = self._server_coef[coef : coef + (n + 1) * rows].view(n + 1, rows)
        valid = layout.row_lengths().view(n, rows)
        # sqrt of the number of real elements in each row, for the RMS; >= 1.
        norm = valid.clamp(min=1).to(torch.float32).sqrt().to(self.device)
        device_or_none = lambda index: index.to(self.device) if index.numel() else None  # noqa: E731
        blocks = []
        step = _block_rows(layout, self.device, block_size, self._default_block)
        for first in range(0, rows, step):
            last = min(first + step, rows)
            signs = slice(first * row // 8, last * row // 8)
            blocks.append(
                _Block(
                    first=first,
                    last=last,
                    worker=values.view(n, rows, row)[:, first:last],
                    worker_padding=device_or_none(worker + _padding_positions(valid, row, first, last, layout.chunk)),
                    norm=norm[:, first:last],
                    send_signs=send_signs[:, signs],
                    send_scales=send_scales[:, first:last],
                    recv_signs=recv_signs[:, signs],
                    coef=coefs[:, first:last].unsqueeze(2),
                    server=chunk.view(1, rows, row)[:, first:last],
                    server_padding=device_or_none(server + _padding_positions(valid[rank : rank + 1], row, first, last, 0)),
                    server_norm=norm[rank : rank + 1, first:last],
                    mine_signs=mine_signs[:, signs],
                    mine_scales=mine_scales[:, first:last],
                    gathered_signs=gathered_signs[:, signs],
                    gathered_scales=gathered_scales[:, first:last],
                )
            )
        padding = _padding_positions(valid, row, 0, rows, layout.chunk).to(self.device)
        return _Part(layout, values, chunk, recv_scales, coefs, padding, blocks)

    def _only(self) -> int:
        """0, the index of the only buffer (for the one-buffer interface)."""
        if len(self.layouts) != 1:
            raise ValueError(f"this OneBitAllReduce has {len(self.layouts)} buffers: use the per-buffer interface")
        return 0

    @property
    def layout(self) -> OneBitLayout:
        """The layout of the only buffer."""
        return self.layouts[self._only()]

    @property
    def blocks_per_call(self) -> int:
        """Blocks that each pass of a call works through, all buffers together (ops grow with them)."""
        return sum(len(part.blocks) for part in self._parts if part is not None)

    @property
    def bytes_per_call(self) -> int:
        """Bytes this rank sends in one call: (n-1) segments in each pass."""
        return 2 * (self.world_size - 1) * self._segment

    @property
    def accumulators(self) -> list[torch.Tensor]:
        """Each buffer's part of the worker buffer (in its layout) that the next `exchange()`
        compresses, the carried error included.

        Adding into it between calls is the same as passing the sum to `op`; optimizers use it to
        accumulate their update without a buffer of their own. Its padding must stay zero.
        """
        return self._accumulators

    @property
    def accumulator(self) -> torch.Tensor:
        """The accumulator of the only buffer (see `accumulators`)."""
        return self._accumulators[self._only()]

    @property
    def worker_error(self) -> torch.Tensor:
        """The worker error e_w (all buffers, padded, back to back), as a new tensor."""
        return self._worker.clone()

    @property
    def server_error(self) -> torch.Tensor:
        """The server error e_s of this rank's chunks, as a new tensor."""
        return self._server.clone()

    def exchange(self, out, addend=None):
        """Compress accumulator + error (+ addend), run both passes, write the average to `out`
        (each a buffer in the layout, or a list of them, one per buffer; the padding of `out` is
        zero afterwards), and return `out`."""
        outs = self._per_buffer(out)
        addends = self._per_buffer(addend) if addend is not None else [None] * len(outs)
        if self.world_size < 2:  # one rank: the average is the input itself
            for acc, o, a in zip(self._accumulators, outs, addends):
                torch.add(acc, a, out=o) if a is not None else o.copy_(acc)
            self._worker.zero_()
            return out
        active = [(part, o, a) for part, o, a in zip(self._parts, outs, addends) if part is not None]
        if not active:
            return out
        n = self.world_size

        # Worker: y = e_w + addend, compressed block by block into the send segments.
        for part, _, a in active:
            for b in part.blocks:
                if a is not None:
                    b.worker.add_(self._rows(a, part.layout, b))
                self._compress(b.worker, self._worker, b.worker_padding, b.norm, b.send_signs, b.send_scales)

        # Pass 1: rank j receives chunk j of everyone.
        dist.all_to_all_single(self._recv, self._send, group=self.group)

        # Server: c = e_s + mean_i(s_i*sign_i) over this rank's chunk, as
        # c = e_s + sum_i (2*s_i/n)*flag_i - sum_i s_i/n (sign = 2*flag - 1), summed over i in
        # order (one op per rank: a sum in one op would round differently).
        for part, _, _ in active:
            torch.mul(part.recv_scales, 2.0 / n, out=part.coef[:n])
            torch.sum(part.coef[:n], dim=0, out=part.coef[n]).mul_(0.5)
            for b in part.blocks:
                flags = self._flags[: b.recv_signs.numel() * 8].view(n, *b.worker.shape[1:])
                unpack_flags(b.recv_signs, self._words[: b.recv_signs.numel()].view(n, -1), flags)
                c = b.server[0]
                for i in range(n):
                    c.addcmul_(flags[i], b.coef[i])
                c.sub_(b.coef[n])
                self._compress(b.server, self._server, b.server_padding, b.server_norm, b.mine_signs, b.mine_scales)

        # Pass 2: everyone gathers every server chunk and unpacks the same average.
        _all_gather(self._gathered, self._mine, group=self.group)
        for part, o, _ in active:
            for b in part.blocks:
                rows = b.gathered_scales.numel()
                unpack_rows(
                    b.gathered_signs,
                    b.gathered_scales,
                    self._rows(o, part.layout, b),
                    self._index[: b.gathered_signs.numel()],
                    self._tables[: rows * 256 * 8],
                    self._flags,
                )
            o.index_fill_(0, part.padding, 0)

        self.ledger.record("onebit_allreduce", payload_bits=1, elements=self.numel, bytes_sent=self.bytes_per_call, calls=2)
        return out

    @staticmethod
    def _rows(flat: torch.Tensor, layout: OneBitLayout, block: _Block) -> torch.Tensor:
        """Rows first..last of every chunk of a buffer in `layout`, (n, r, row)."""
        rows = flat.view(-1, layout.rows, layout.row)
        return rows if block.last - block.first == layout.rows else rows[:, block.first : block.last]

    def _compress(self, values, base, padding, norm, signs, scales) -> None:
        """Compress a block of y, (k, r, row), in place: per row s = RMS into the wire's `scales`,
        the signs packed into the wire's `signs`, and y <- y - s*sign(y). Padding (positions in
        `base`, the buffer `values` views) counts as zero and its error stays zero."""
        if padding is not None:
            base.index_fill_(0, padding, 0)
        torch.linalg.vector_norm(values, dim=2, out=scales).div_(norm)
        flags = self._flags[: values.numel()].view(values.shape)
        torch.ge(values, 0, out=flags)
        # y - s*sign(y) with sign = 2*flag - 1: y + s - 2*s*flag
        column = scales.unsqueeze(2)
        values.add_(column).addcmul_(flags, column, value=-2)
        # A non-finite value makes its row's scale non-finite, which the wire carries to every rank's
        # output of that row; its error would carry it into every later call: it restarts at zero.
        values.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        pack_flags(flags.view(-1), self._flag_bytes[: values.numel()], signs)
        if padding is not None:
            base.index_fill_(0, padding, 0)  # the residual left -s there

    def state_dicts(self) -> list[dict]:
        """One state per buffer, each as a OneBitAllReduce of that buffer alone saves it."""
        states, server = [], 0
        for layout, accumulator in zip(self.layouts, self._accumulators):
            chunk = layout.chunk if layout.active else 0
            states.append(
                {
                    "topology": "flat",
                    "numel": layout.numel,
                    "world_size": self.world_size,
                    "layout": (layout.offsets, layout.padded, layout.row),
                    "worker_error": accumulator.clone(),
                    "server_error": self._server[server : server + chunk].clone(),
                }
            )
            server += chunk
        return states

    def load_state_dicts(self, states: list[dict]) -> None:
        if len(states) != len(self.layouts):
            raise ValueError(f"1-bit allreduce state is for {len(states)} buffers, this one has {len(self.layouts)}")
        server = 0
        for layout, accumulator, state in zip(self.layouts, self._accumulators, states):
            check_topology(state, "flat")
            if state["world_size"] != self.world_size or state["numel"] != layout.numel:
                raise ValueError(
                    f"1-bit allreduce state is for {state['numel']} elements on {state['world_size']} ranks, "
                    f"this one is for {layout.numel} on {self.world_size}"
                )
            if state.get("layout") != (layout.offsets, layout.padded, layout.row):
                raise ValueError("1-bit allreduce state was saved with another layout (an older zoa-train?); it cannot be resumed here")
            chunk = layout.chunk if layout.active else 0
            accumulator.copy_(state["worker_error"])
            self._server[server : server + chunk].copy_(state["server_error"])
            server += chunk

    def state_dict(self) -> dict:
        """The state of the only buffer (see `state_dicts`)."""
        return self.state_dicts()[self._only()]

    def load_state_dict(self, state: dict) -> None:
        self.load_state_dicts([state])


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


class TopologyChanged(ValueError):
    """The error buffers were saved by a collective of another topology (flat, or node-aware over
    another shape): their layouts differ, so they cannot be resumed; --reshard restarts them at zero."""


def describe_topology(topology) -> str:
    """A saved topology entry in words: "flat 1-bit sync" or "node-aware 1-bit sync over N nodes x G
    ranks (nodes [[0, 1], [2, 3]])"."""
    if topology == "flat":
        return "flat 1-bit sync"
    members = f" (nodes {topology['members']})" if "members" in topology else ""
    return f"node-aware 1-bit sync over {topology['nodes']} nodes x {topology['ranks_per_node']} ranks{members}"


def check_topology(state: dict, expected) -> None:
    """Refuse a collective's saved state whose topology is not `expected` (states saved before
    topologies existed are flat)."""
    saved = state.get("topology", "flat")
    if saved != expected:
        raise TopologyChanged(
            f"its 1-bit error buffers were saved by the {describe_topology(saved)} and this run uses the {describe_topology(expected)}; "
            "resume with the same comm.topology and node layout, or pass --reshard to continue with the error buffers at zero"
        )

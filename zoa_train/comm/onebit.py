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

Speed: a row's scale needs only that row, so the whole worker (and server) step -- add the input,
scale, residual, pack -- is one pass over memory, block by block while each block is in cache,
and the error buffers always hold the errors themselves. The server adds each rank's term as
flags times a per-row coefficient (sign = 2*flag - 1), cheaper than a table lookup; the output is
a table lookup with the row's scale folded into the table, this rank's own chunk unpacked while
the all-gather runs.
"""

from itertools import accumulate
from typing import NamedTuple, Sequence

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
_DEVICE_BLOCK = 1 << 22  # elements per block on accelerators: few, large kernels
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
    rows = -(-(-(-end // row)) // world_size)
    chunk = rows * row
    return OneBitLayout(sizes, tuple(offsets), world_size * chunk, chunk, rows, row, chunk // 8 + _SCALE_BYTES * rows)


def onebit_buffers(
    sizes: int | Sequence[int],
    world_size: int,
    device: torch.device | str = "cpu",
    block_size: int | None = None,
    scale_row: int = SCALE_ROW,
) -> dict[str, tuple[int, torch.dtype]]:
    """(elements, dtype) of each buffer a OneBitAllReduce allocates: the error buffers `_worker`
    (e_w, also the accumulator) and `_server` (e_s of this rank's chunk), the wire buffers `_send`,
    `_recv`, `_gathered` (n segments each) and `_mine` (one), the per-block scratch `_flags`,
    `_flag_bytes`, `_words`, `_index` and `_tables`, and the per-row `_server_coef`. Inactive
    (one rank or no elements): a worker buffer of numel and all others empty."""
    layout = onebit_layout(sizes, world_size, scale_row)
    active = layout.active
    block = layout.row * _rows_per_block(layout, torch.device(device), block_size) if active else 0
    n, segment = world_size, layout.segment
    return {
        "_worker": (layout.padded, torch.float32),
        "_server": (layout.chunk, torch.float32),
        "_send": (n * segment, torch.uint8),
        "_recv": (n * segment, torch.uint8),
        "_gathered": (n * segment, torch.uint8),
        "_mine": (segment, torch.uint8),
        "_flags": (block, torch.float32),
        "_flag_bytes": (block, torch.int8),
        "_words": (block // 8, torch.int64),
        "_index": (block // 8, torch.int32),
        "_tables": (block // layout.row * 256 * 8 if active else 0, torch.float32),
        "_server_coef": ((n + 1) * layout.rows, torch.float32),
    }


class _Block(NamedTuple):
    """Views of one block of whole rows of a chunk (the same rows in every chunk of a layout)."""

    offset: int  # first element within the chunk
    values: torch.Tensor  # y (worker) or c (server), 1-D
    rows: torch.Tensor  # the same, (rows, row)
    scales: torch.Tensor  # the row scales' place in the wire segment, (rows,)
    column: torch.Tensor  # the same, (rows, 1)
    norm: torch.Tensor  # sqrt of the number of real elements of each row
    signs: torch.Tensor  # the packed signs' place in the wire segment
    flags: torch.Tensor  # scratch: 1.0 where y >= 0
    flag_bytes: torch.Tensor  # scratch for packing
    padding: torch.Tensor | None  # indices of the padding within `values`, if any


def _padding_index(valid: torch.Tensor, row: int) -> torch.Tensor:
    """Positions of the padding in consecutive rows of `row` elements whose first `valid[r]` are real."""
    return (torch.arange(row).expand(valid.numel(), row) >= valid.view(-1, 1)).view(-1).nonzero().view(-1)


def _rows_per_block(layout: OneBitLayout, device: torch.device, block_size: int | None) -> int:
    if block_size is None:
        block_size = BLOCK if device.type == "cpu" else _DEVICE_BLOCK
    return min(layout.rows, max(1, block_size // layout.row))


class OneBitAllReduce:
    """Averages a flat buffer in its layout over a process group with 1-bit error-compensated compression.

    `sizes`: the sizes of the tensors the buffer holds (or one size); `layout` says where each
    lies in the buffer, which has `layout.padded` elements. Owns the worker error (fp32, in the
    layout) and the server error (this rank's chunk, fp32) and all communication buffers, allocated
    once. Math is fp32 whatever the input dtype. With a world size of 1, `op` returns its input
    unchanged and sends nothing, and `exchange` returns the accumulator exactly. `block_size`
    (elements processed per step of a pass; default 512K on CPU, 4M elsewhere) changes speed,
    never results; `scale_row` is part of the wire format and must be the same on every rank.
    """

    def __init__(
        self,
        sizes: int | Sequence[int],
        group=None,
        device: torch.device | str | None = None,
        ledger: CommLedger | None = None,
        block_size: int | None = None,
        scale_row: int = SCALE_ROW,
    ):
        self.group = group
        self.world_size, self.rank = group_size_rank(group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.ledger = ledger if ledger is not None else default_ledger()
        self.layout = onebit_layout(sizes, self.world_size, scale_row)
        self.numel = self.layout.numel
        for name, (size, dtype) in onebit_buffers(sizes, self.world_size, self.device, block_size, scale_row).items():
            setattr(self, name, torch.zeros(size, dtype=dtype, device=self.device))
        if not self.layout.active:
            return

        n, chunk, rows, row = self.world_size, self.layout.chunk, self.layout.rows, self.layout.row
        self._block_rows = _rows_per_block(self.layout, self.device, block_size)
        valid = self.layout.row_lengths().view(n, rows)
        # sqrt of the number of real elements in each row, for the RMS; >= 1.
        row_norm = valid.clamp(min=1).to(torch.float32).sqrt().to(self.device)
        # Every padding position of the buffer, to zero the output's padding after a call.
        self._padding = _padding_index(valid.view(-1), row).to(self.device)
        send = self._segments(self._send)
        recv = self._segments(self._recv)
        gathered = self._segments(self._gathered)
        (mine,) = self._segments(self._mine)
        self._recv_scales = [scales for _, scales in recv]
        # Server coefficients per row: 2*s_i/n for each rank i, then sum_i s_i/n.
        self._coef = self._server_coef.view(n + 1, rows)
        # Every view a pass touches, made once: a pass is a few hundred blocks of ~10 ops each,
        # and slicing inside the loop would cost about as much as the ops.
        self._worker_blocks = [self._blocks(self._worker[j * chunk : (j + 1) * chunk], *send[j], row_norm[j], valid[j]) for j in range(n)]
        self._server_blocks = self._blocks(self._server, *mine, row_norm[self.rank], valid[self.rank])
        self._server_terms = [
            ([(signs[b.offset // 8 : (b.offset + b.values.numel()) // 8], self._coef_rows(b, i)) for i, (signs, _) in enumerate(recv)], self._coef_rows(b, n))
            for b in self._server_blocks
        ]
        # This rank's own chunk is unpacked from its own segment, while the all-gather runs.
        self._gathered_blocks = [[self._packed_rows(b, *(mine if j == self.rank else gathered[j])) for b in self._server_blocks] for j in range(n)]

    def _segments(self, wire: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(packed signs, fp32 row scales) views of each segment of a wire buffer."""
        packed = self.layout.chunk // 8
        return [(s[:packed], s[packed:].view(torch.float32)) for s in wire.view(-1, self.layout.segment)]

    def _blocks(self, values: torch.Tensor, signs: torch.Tensor, scales: torch.Tensor, norm: torch.Tensor, valid: torch.Tensor) -> list[_Block]:
        row, blocks = self.layout.row, []
        for first in range(0, self.layout.rows, self._block_rows):
            last = min(first + self._block_rows, self.layout.rows)
            offset, length = first * row, (last - first) * row
            block_scales = scales[first:last]
            padding = _padding_index(valid[first:last], row)
            blocks.append(
                _Block(
                    offset=offset,
                    values=values[offset : offset + length],
                    rows=values[offset : offset + length].view(-1, row),
                    scales=block_scales,
                    column=block_scales.unsqueeze(1),
                    norm=norm[first:last],
                    signs=signs[offset // 8 : (offset + length) // 8],
                    flags=self._flags[:length],
                    flag_bytes=self._flag_bytes[:length],
                    padding=padding.to(self.device) if padding.numel() else None,
                )
            )
        return blocks

    def _packed_rows(self, block: _Block, signs: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `block` in another segment: packed signs (rows, row/8) and scales."""
        first, length = block.offset // self.layout.row, block.values.numel()
        return signs[block.offset // 8 : (block.offset + length) // 8].view(-1, self.layout.row // 8), scales[first : first + block.rows.shape[0]]

    def _coef_rows(self, block: _Block, i: int) -> torch.Tensor:
        first = block.offset // self.layout.row
        return self._coef[i, first : first + block.rows.shape[0]].unsqueeze(1)

    @property
    def bytes_per_call(self) -> int:
        """Bytes this rank sends in one call: (n-1) segments in each pass."""
        return 2 * (self.world_size - 1) * self.layout.segment

    @property
    def accumulator(self) -> torch.Tensor:
        """The buffer (in the layout) that the next `exchange()` compresses, the carried error included.

        Adding into it between calls is the same as passing the sum to `op`; optimizers use it to
        accumulate their update without a buffer of their own. Its padding must stay zero.
        """
        return self._worker

    @property
    def worker_error(self) -> torch.Tensor:
        """The worker error e_w (padded length), as a new tensor."""
        return self._worker.clone()

    @property
    def server_error(self) -> torch.Tensor:
        """The server error e_s of this rank's chunk, as a new tensor."""
        return self._server.clone()

    def op(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average `tensor` (a buffer in the layout) in place over the group, error-compensated,
        and return it."""
        if tensor.numel() != self.layout.padded:
            raise ValueError(f"OneBitAllReduce's layout has {self.layout.padded} elements, got a tensor of {tensor.numel()}")
        if not self.layout.active:
            return tensor
        if not tensor.is_contiguous():
            raise ValueError("OneBitAllReduce.op needs a contiguous tensor")
        flat = tensor.view(-1)
        self.exchange(out=flat, addend=flat)
        return tensor

    def exchange(self, out: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
        """Compress accumulator + error (+ addend), run both passes, write the average to `out`
        (all three in the layout; the padding of `out` is zero afterwards)."""
        if not self.layout.active:  # one rank: the average is the input itself
            torch.add(self._worker, addend, out=out) if addend is not None else out.copy_(self._worker)
            self._worker.zero_()
            return out
        n, chunk = self.world_size, self.layout.chunk

        # Worker: y = e_w + addend, compressed chunk by chunk into the send segments.
        for j, blocks in enumerate(self._worker_blocks):
            for block in blocks:
                if addend is not None:
                    start = j * chunk + block.offset
                    block.values.add_(addend[start : start + block.values.numel()])
                self._compress(block)

        # Pass 1: rank j receives chunk j of everyone.
        dist.all_to_all_single(self._recv, self._send, group=self.group)

        # Server: c = e_s + mean_i(s_i*sign_i) over this rank's chunk, as
        # c = e_s + sum_i (2*s_i/n)*flag_i - sum_i s_i/n (sign = 2*flag - 1).
        for i, scales in enumerate(self._recv_scales):
            torch.mul(scales, 2.0 / n, out=self._coef[i])
        torch.sum(self._coef[:n], dim=0, out=self._coef[n]).mul_(0.5)
        for block, (terms, mean) in zip(self._server_blocks, self._server_terms):
            flags = block.flags.view_as(block.rows)
            for signs, coef in terms:
                unpack_flags(signs, self._words[: signs.numel()], block.flags)
                block.rows.addcmul_(flags, coef)
            block.rows.sub_(mean)
            self._compress(block)

        # Pass 2: everyone gathers every server chunk and unpacks the same average.
        gather = _all_gather(self._gathered, self._mine, group=self.group, async_op=True)
        self._unpack_chunk(self.rank, out)  # from its own segment, while the all-gather runs
        gather.wait()
        for j in range(n):
            if j != self.rank:
                self._unpack_chunk(j, out)
        out.index_fill_(0, self._padding, 0)

        self.ledger.record("onebit_allreduce", payload_bits=1, elements=self.numel, bytes_sent=self.bytes_per_call, calls=2)
        return out

    def _compress(self, block: _Block) -> None:
        """Compress one block of y in place while it is in cache: per row s = RMS into the
        segment's scales, the signs packed into the segment, and y <- y - s*sign(y). Padding
        counts as zero and its error stays zero."""
        if block.padding is not None:
            block.values.index_fill_(0, block.padding, 0)
        torch.linalg.vector_norm(block.rows, dim=1, out=block.scales).div_(block.norm)
        torch.ge(block.values, 0, out=block.flags)
        # y - s*sign(y) with sign = 2*flag - 1: y + s - 2*s*flag
        block.rows.add_(block.column).addcmul_(block.flags.view_as(block.rows), block.column, value=-2)
        pack_flags(block.flags, block.flag_bytes, block.signs)
        if block.padding is not None:
            block.values.index_fill_(0, block.padding, 0)  # the residual left -s there

    def _unpack_chunk(self, j: int, out: torch.Tensor) -> None:
        """Write server chunk j's average (padding included) into its part of `out`."""
        for block, (signs, scales) in zip(self._server_blocks, self._gathered_blocks[j]):
            start = j * self.layout.chunk + block.offset
            rows = scales.numel()
            unpack_rows(signs, scales, out[start : start + block.values.numel()], self._index[: signs.numel()], self._tables[: rows * 256 * 8])

    def state_dict(self) -> dict:
        return {
            "numel": self.numel,
            "world_size": self.world_size,
            "layout": self._wire_shape(),
            "worker_error": self.worker_error,
            "server_error": self.server_error,
        }

    def _wire_shape(self) -> tuple:
        """What a saved state must match besides numel and world size: where tensors and rows lie."""
        return self.layout.offsets, self.layout.padded, self.layout.row

    def load_state_dict(self, state: dict) -> None:
        if state["world_size"] != self.world_size or state["numel"] != self.numel:
            raise ValueError(
                f"1-bit allreduce state is for {state['numel']} elements on {state['world_size']} ranks, "
                f"this one is for {self.numel} on {self.world_size}"
            )
        if state.get("layout") != self._wire_shape():
            raise ValueError("1-bit allreduce state was saved with another layout (an older zoa-train?); it cannot be resumed here")
        self._worker.copy_(state["worker_error"])
        self._server.copy_(state["server_error"])

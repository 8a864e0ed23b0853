"""The 1-bit call's passes as torch tensor ops: the reference backend, on any device.

A pass works on whole rows at once: a block of a pass is the same rows of all n chunks, so a pass
is a fixed handful of tensor ops per block whatever the number of rows (scale segments) and of
ranks (one strided copy puts a block's signs into all n wire segments; one table lookup unpacks
all n servers' rows); the server adds the n ranks' terms one op per rank, in order. On CPU blocks
stay in cache (512K elements); on accelerators one block holds up to 128M elements. The server
adds each rank's term as flags times a per-row coefficient (sign = 2*flag - 1), cheaper than a
table lookup; the output is a table lookup with the row's scale folded into the table.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch

from zoa_train.comm.kernels import PartViews
from zoa_train.comm.packing import BLOCK, pack_flags, unpack_flags, unpack_rows

# Elements per block on accelerators at most: few, large kernels, and scratch (about 8.5 bytes per
# element of a block) of at most about 1 GiB.
DEVICE_BLOCK = 1 << 27
# And on every device at most this share of the call's buffers: the scratch then stays near 0.1 fp32
# copies of them (with the wire buffers, 0.2 + 1/(8n)), small models and accelerators alike, at
# about 20 blocks of 35 + n ops each per call (docs/results/one-bit-call.md, "The 1-bit call's scratch").
BLOCK_SHARE = 1 / 20


def block_elements(shapes: Sequence[tuple[int, int, int]], device: torch.device) -> int:
    """The default elements per block of a call's buffers, each (n, rows, row): BLOCK_SHARE of all
    of them together (the scratch is shared by the call's buffers, so a small parameter group takes
    few, large blocks), and at most BLOCK on CPU (in cache) or DEVICE_BLOCK on accelerators."""
    cap = BLOCK if device.type == "cpu" else DEVICE_BLOCK
    return min(cap, int(sum(n * rows * row for n, rows, row in shapes) * BLOCK_SHARE))


def block_rows(shape: tuple[int, int, int], device: torch.device, block_size: int | None, default: int) -> int:
    """Rows of each chunk that one block of a pass holds: a block is those rows of all n chunks, at
    most `block_size` elements (`default` when None: on CPU also at most one chunk's worth)."""
    n, rows, row = shape
    if block_size is None:
        block_size = min(default, rows * row) if device.type == "cpu" else default
    return min(rows, max(1, block_size // (n * row)))


def _scratch(shapes: Sequence[tuple[int, int, int]], device: torch.device, block_size: int | None) -> dict[str, tuple[int, torch.dtype]]:
    default = block_elements(shapes, device)
    block = max((n * row * block_rows((n, rows, row), device, block_size, default) for n, rows, row in shapes), default=0)
    return {
        "_flags": (block, torch.float32),
        "_flag_bytes": (block, torch.int8),
        "_words": (block // 8, torch.int64),
        "_index": (block // 8, torch.int32),
        "_tables": (max((block // row * 256 * 8 for _, _, row in shapes), default=0), torch.float32),
        "_server_coef": (sum((n + 1) * rows for n, rows, _ in shapes), torch.float32),
    }


class _Block(NamedTuple):
    """Rows first..last of every chunk of one buffer, in every pass: (n, r, row) values, (n, r)
    scales and norms, (n, r*row/8) packed signs; the server's have one chunk (1, ...)."""

    first: int
    last: int
    worker: torch.Tensor
    worker_padding: torch.Tensor | None  # positions of its padding in the part's worker buffer
    norm: torch.Tensor
    send_signs: torch.Tensor
    send_scales: torch.Tensor
    recv_signs: torch.Tensor
    coef: torch.Tensor  # (n + 1, r, 1): 2*s_i/n of each source i, then sum_i s_i/n
    server: torch.Tensor
    server_padding: torch.Tensor | None  # positions of its padding in the part's server buffer
    server_norm: torch.Tensor
    mine_signs: torch.Tensor
    mine_scales: torch.Tensor
    gathered_signs: torch.Tensor
    gathered_scales: torch.Tensor


def _padding_positions(valid: torch.Tensor, row: int, first: int, last: int, stride: int) -> torch.Tensor:
    """Flat positions of the padding in rows first..last of each chunk (a row of `valid`, the real
    elements at the start of each row), chunks `stride` elements apart."""
    padding = torch.arange(row) >= valid[:, first:last, None]
    chunk, rows, column = padding.nonzero(as_tuple=True)
    return chunk * stride + (first + rows) * row + column


class Kernels:
    """The torch backend (zoa_train/comm/kernels/__init__.py)."""

    def __init__(self, parts: Sequence[PartViews], device: torch.device, block_size: int | None):
        self.device, self.parts = device, list(parts)
        shapes = [tuple(p.worker.shape) for p in parts]
        self._held = {name: torch.zeros(size, dtype=dtype, device=device) for name, (size, dtype) in _scratch(shapes, device, block_size).items()}
        for name, buffer in self._held.items():
            setattr(self, name, buffer)
        default = block_elements(shapes, device)
        self._coefs, self._blocks, self._padding, coef = [], [], [], 0
        for p in parts:
            n, rows, row = p.worker.shape
            coefs = self._server_coef[coef : coef + (n + 1) * rows].view(n + 1, rows)
            coef += (n + 1) * rows
            self._coefs.append(coefs)
            self._blocks.append(self._part_blocks(p, coefs, block_rows((n, rows, row), device, block_size, default)))
            self._padding.append(_padding_positions(p.valid.cpu(), row, 0, rows, rows * row).to(device))

    @staticmethod
    def scratch(layouts, world_size: int, device: torch.device, block_size: int | None) -> dict[str, tuple[int, torch.dtype]]:
        return _scratch([(world_size, l.rows, l.row) for l in layouts if l.active], device, block_size)

    @staticmethod
    def unavailable(device: torch.device) -> str | None:
        return None

    def held_buffers(self) -> dict[str, torch.Tensor]:
        return dict(self._held)

    @property
    def blocks_per_call(self) -> int:
        """Blocks each pass of a call works through, all buffers together (ops grow with them)."""
        return sum(map(len, self._blocks))

    def _part_blocks(self, p: PartViews, coefs: torch.Tensor, step: int) -> list[_Block]:
        """The views of every block of one buffer. Made once: slicing in every call would cost as much
        as the ops on CPU."""
        n, rows, row = p.worker.shape
        valid = p.valid.cpu()
        device_or_none = lambda index: index.to(self.device) if index.numel() else None  # noqa: E731
        blocks = []
        for first in range(0, rows, step):
            last = min(first + step, rows)
            signs = slice(first * row // 8, last * row // 8)
            blocks.append(
                _Block(
                    first=first,
                    last=last,
                    worker=p.worker[:, first:last],
                    worker_padding=device_or_none(_padding_positions(valid, row, first, last, rows * row)),
                    norm=p.norm[:, first:last],
                    send_signs=p.send_signs[:, signs],
                    send_scales=p.send_scales[:, first:last],
                    recv_signs=p.recv_signs[:, signs],
                    coef=coefs[:, first:last].unsqueeze(2),
                    server=p.server[:, first:last],
                    server_padding=device_or_none(_padding_positions(valid[p.rank : p.rank + 1], row, first, last, 0)),
                    server_norm=p.norm[p.rank : p.rank + 1, first:last],
                    mine_signs=p.mine_signs[:, signs],
                    mine_scales=p.mine_scales[:, first:last],
                    gathered_signs=p.gathered_signs[:, signs],
                    gathered_scales=p.gathered_scales[:, first:last],
                )
            )
        return blocks

    def worker(self, part: int, addend: torch.Tensor | None) -> None:
        base = self.parts[part].worker.view(-1)
        for b in self._blocks[part]:
            if addend is not None:
                b.worker.add_(self._rows(addend, part, b))
            self._compress(b.worker, base, b.worker_padding, b.norm, b.send_signs, b.send_scales)

    def server(self, part: int) -> None:
        # c = e_s + sum_i (2*s_i/n)*flag_i - sum_i s_i/n (sign = 2*flag - 1), summed over i in order
        # (one op per rank: a sum in one op would round differently).
        coefs, base = self._coefs[part], self.parts[part].server.view(-1)
        n = coefs.shape[0] - 1
        torch.mul(self.parts[part].recv_scales, 2.0 / n, out=coefs[:n])
        torch.sum(coefs[:n], dim=0, out=coefs[n]).mul_(0.5)
        for b in self._blocks[part]:
            flags = self._flags[: b.recv_signs.numel() * 8].view(n, *b.worker.shape[1:])
            unpack_flags(b.recv_signs, self._words[: b.recv_signs.numel()].view(n, -1), flags)
            c = b.server[0]
            for i in range(n):
                c.addcmul_(flags[i], b.coef[i])
            c.sub_(b.coef[n])
            self._compress(b.server, base, b.server_padding, b.server_norm, b.mine_signs, b.mine_scales)

    def output(self, part: int, out: torch.Tensor) -> None:
        for b in self._blocks[part]:
            rows = b.gathered_scales.numel()
            unpack_rows(
                b.gathered_signs,
                b.gathered_scales,
                self._rows(out, part, b),
                self._index[: b.gathered_signs.numel()],
                self._tables[: rows * 256 * 8],
                self._flags,
            )
        out.index_fill_(0, self._padding[part], 0)

    def _rows(self, flat: torch.Tensor, part: int, block: _Block) -> torch.Tensor:
        """Rows first..last of every chunk of a buffer in the part's layout, (n, r, row)."""
        _, rows, row = self.parts[part].worker.shape
        view = flat.view(-1, rows, row)
        return view if block.last - block.first == rows else view[:, block.first : block.last]

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

"""The 1-bit call's passes as fused Triton kernels on GPUs: one program per scale row (at most
SCALE_ROW = 4096 elements, held in registers), so each pass reads its inputs once and writes its
outputs once: the worker reads y and writes the error, signs and scale; the server reads the n
sources' signs and e_s and writes e_s, signs and scale; the output reads signs and writes values.

Triton ships with torch. Without a GPU the same kernels run on CPU tensors under
TRITON_INTERPRET=1 (set before Triton is imported): the test suite checks them that way against
the torch path. The row's sum of squares is a tree reduction in fp32 (the other backends sum in
another order), so scales can differ from theirs in the last bits; all ranks of a run use the same
backend, so they agree with each other exactly.
"""

import os
from collections.abc import Sequence

import torch

from zoa_train.comm.kernels import FusedKernels, PartViews, profiled

try:
    import triton
    import triton.language as tl
except ImportError:  # torch without Triton (some CPU-only builds): the torch path runs
    triton = None

PACK_BLOCK = 8192  # elements per program of pack_signs / unpack_signs


def _warps(block: int) -> int:
    """Warps per program: 4 for a row of 4,096 (on an H200, 2 to 8 ran within a few percent of each
    other and 16 or more slower: docs/results/one-bit-call.md, "The 1-bit call at memory speed"). Fixed, not
    tuned per run: the row's sum of squares is a tree over the warps, so their number moves a scale
    in its last bit, and every rank must round alike."""
    return max(1, min(4, block // 1024))


if triton is not None:
    _FLT_MAX = tl.constexpr(3.4028234663852886e38)  # |e| <= this: finite (false for inf and NaN)

    @triton.jit
    def _compress_row(y, cols, row, valid, norm, signs_ptr, scale_ptr, BLOCK: tl.constexpr):
        """Compress one row, y (BLOCK,) fp32 with zeros past `valid`: store its packed signs (bit k of
        byte q is element 8q+k >= 0) and its scale RMS(y); return its error y - s*sign(y), zero
        where not finite and at padding."""
        s = tl.div_rn(tl.sqrt_rn(tl.sum(y * y, axis=0)), norm)
        flag = y >= 0
        t = y + s
        e = tl.where(flag, t - 2.0 * s, t)
        e = tl.where((tl.abs(e) <= _FLT_MAX) & (cols < valid), e, 0.0)
        bits = tl.reshape(flag.to(tl.int32), (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :]
        q = tl.arange(0, BLOCK // 8)
        tl.store(signs_ptr + q, tl.sum(bits, axis=1).to(tl.uint8), mask=q < row // 8)
        tl.store(scale_ptr, s)
        return e

    @triton.jit
    def _flags(bytes_ptr, row, BLOCK: tl.constexpr):
        """The BLOCK bits of a row's packed signs (past `row`: zero), as int32 0/1: each byte
        loaded once and spread over its 8 elements."""
        q = tl.arange(0, BLOCK // 8)
        byte = tl.load(bytes_ptr + q, mask=q < row // 8, other=0).to(tl.int32)
        return tl.reshape((byte[:, None] >> tl.arange(0, 8)[None, :]) & 1, (BLOCK,))

    @triton.jit
    def _worker_kernel(
        values_ptr, addend_ptr, valid_ptr, norm_ptr, signs_ptr, scales_ptr, rows, row, sign_stride, scale_stride, HAS_ADDEND: tl.constexpr, BLOCK: tl.constexpr
    ):
        r = tl.program_id(0)
        chunk, i = r // rows, r % rows
        cols = tl.arange(0, BLOCK)
        valid = tl.load(valid_ptr + r)
        base = r.to(tl.int64) * row
        y = tl.load(values_ptr + base + cols, mask=cols < valid, other=0.0)
        if HAS_ADDEND:
            y += tl.load(addend_ptr + base + cols, mask=cols < valid, other=0.0).to(tl.float32)
        signs = signs_ptr + chunk.to(tl.int64) * sign_stride + i * (row // 8)
        e = _compress_row(y, cols, row, valid, tl.load(norm_ptr + r), signs, scales_ptr + chunk * scale_stride + i, BLOCK)
        tl.store(values_ptr + base + cols, e, mask=cols < row)

    @triton.jit
    def _server_kernel(
        recv_signs_ptr,
        recv_scales_ptr,
        values_ptr,
        valid_ptr,
        norm_ptr,
        signs_ptr,
        scales_ptr,
        factor,
        row,
        sign_stride,
        scale_stride,
        SOURCES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # c = e_s + sum_i (2*s_i/n)*flag_i - sum_i s_i/n (sign = 2*flag - 1), sources in order. The
        # loop over sources is unrolled (SOURCES a constant) so all their loads are in flight at once.
        r = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < row
        base = r.to(tl.int64) * row
        c = tl.load(values_ptr + base + cols, mask=inside, other=0.0)
        coef_sum = tl.zeros((), tl.float32)
        for i in tl.static_range(SOURCES):
            coef = tl.load(recv_scales_ptr + i * scale_stride + r) * factor
            coef_sum += coef
            c += _flags(recv_signs_ptr + i * sign_stride + r * (row // 8), row, BLOCK).to(tl.float32) * coef
        c -= coef_sum * 0.5
        valid = tl.load(valid_ptr + r)
        y = tl.where(cols < valid, c, 0.0)
        e = _compress_row(y, cols, row, valid, tl.load(norm_ptr + r), signs_ptr + r * (row // 8), scales_ptr + r, BLOCK)
        tl.store(values_ptr + base + cols, e, mask=inside)

    @triton.jit
    def _to_bfloat16(x):
        """fp32 -> bf16 rounded to nearest even, in integer ops (Triton's interpreter truncates)."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _output_kernel(signs_ptr, scales_ptr, valid_ptr, out_ptr, rows, row, sign_stride, scale_stride, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        chunk, i = r // rows, r % rows
        cols = tl.arange(0, BLOCK)
        inside = cols < row
        s = tl.load(scales_ptr + chunk * scale_stride + i)
        value = tl.where(_flags(signs_ptr + chunk.to(tl.int64) * sign_stride + i * (row // 8), row, BLOCK) != 0, s, -s)
        value = tl.where(cols < tl.load(valid_ptr + r), value, 0.0)
        if out_ptr.dtype.element_ty == tl.bfloat16:
            value = _to_bfloat16(value)
        tl.store(out_ptr + r.to(tl.int64) * row + cols, value.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _pack_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)  # past the end: 0, a set bit
        bits = tl.reshape((x >= 0).to(tl.int32), (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :]
        q = start // 8 + tl.arange(0, BLOCK // 8)
        tl.store(out_ptr + q, tl.sum(bits, axis=1).to(tl.uint8), mask=q < (n + 7) // 8)

    @triton.jit
    def _unpack_kernel(packed_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        byte = tl.load(packed_ptr + offsets // 8, mask=offsets < n, other=0)
        value = tl.where(((byte.to(tl.int32) >> (offsets % 8).to(tl.int32)) & 1) != 0, scale, -scale)
        tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=offsets < n)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class Kernels(FusedKernels):
    """The triton backend (zoa_train/comm/kernels/__init__.py)."""

    def __init__(self, parts: Sequence[PartViews], device: torch.device, block_size: int | None):
        super().__init__(parts, device, block_size)
        self._block = [triton.next_power_of_2(p.worker.shape[2]) for p in self.parts]

    @staticmethod
    def unavailable(device: torch.device) -> str | None:
        if triton is None:
            return "Triton is not installed"
        if device.type == "cuda":
            return None
        if device.type == "cpu" and _interpreted():
            return None
        return "Triton runs on GPUs (on CPU tensors only under TRITON_INTERPRET=1)"

    def worker(self, part: int, addend: torch.Tensor | None) -> None:
        p, block = self.parts[part], self._block[part]
        n, rows, row = p.worker.shape
        with profiled("zoa::onebit_worker"):
            _worker_kernel[(n * rows,)](
                p.worker, addend if addend is not None else p.worker, self._valid[part], self._norm[part], p.send_signs, p.send_scales,
                rows, row, p.send_signs.stride(0), p.send_scales.stride(0), HAS_ADDEND=addend is not None, BLOCK=block, num_warps=_warps(block),
            )  # fmt: skip

    def server(self, part: int) -> None:
        p, block = self.parts[part], self._block[part]
        _, rows, row = p.server.shape
        valid, norm = self._server_rows[part]
        sources = p.recv_signs.shape[0]
        with profiled("zoa::onebit_server"):
            _server_kernel[(rows,)](
                p.recv_signs, p.recv_scales, p.server, valid, norm, p.mine_signs, p.mine_scales, 2.0 / sources,
                row, p.recv_signs.stride(0), p.recv_scales.stride(0), SOURCES=sources, BLOCK=block, num_warps=_warps(block),
            )  # fmt: skip

    def output(self, part: int, out: torch.Tensor) -> None:
        p, block = self.parts[part], self._block[part]
        n, rows, row = p.worker.shape
        with profiled("zoa::onebit_output"):
            _output_kernel[(n * rows,)](
                p.gathered_signs, p.gathered_scales, self._valid[part], out, rows, row, p.gathered_signs.stride(0), p.gathered_scales.stride(0),
                BLOCK=block, num_warps=_warps(block),
            )  # fmt: skip


def pack(x: torch.Tensor, out: torch.Tensor) -> None:
    """The signs of fp32 `x` (contiguous) packed into `out`, as packing.pack_signs."""
    _pack_kernel[(triton.cdiv(x.numel(), PACK_BLOCK),)](x, out, x.numel(), BLOCK=PACK_BLOCK, num_warps=8)


def unpack(packed: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out (contiguous) <- +scale / -scale by the bits of `packed`, as packing.unpack_signs."""
    _unpack_kernel[(triton.cdiv(out.numel(), PACK_BLOCK),)](packed, out, out.numel(), scale, BLOCK=PACK_BLOCK, num_warps=8)

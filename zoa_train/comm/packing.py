"""Sign packing: 8 signs per byte, bit k of byte i is element 8*i+k, bit set means >= 0.

`pack_signs` and `unpack_signs` use the device's fused kernel where it has one (zoa_train/comm/kernels);
the torch path below is the reference. Both directions there are plain vectorised torch ops (no Python loop over elements), so the same code
runs on CPU and CUDA. Packing multiplies each group of 8 one-byte flags, read as one int64, by a
constant that gathers their low bits into the top byte; unpacking is a lookup in a table of 256
rows x 8 values, which also folds in the scale (one scaled table per row of a 2-D unpack).
"""

import torch

from zoa_train.comm.kernels import fused_codec

# Byte k of the int64 word (value 0 or 1) lands on bit 56 + k of the product.
_GATHER_BITS = 0x0102040810204080
_SPREAD = 0x0101010101010101  # times a byte value: that byte in all 8 bytes of the int64
_BIT_K_OF_BYTE_K = 0x8040201008040201 - (1 << 64)  # (as a signed int64)
BLOCK = 1 << 19  # elements per block on CPU (2 MiB of fp32, in L3; smaller blocks pay more per-op overhead)
_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_OFFSETS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def sign_table(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of 8 signs (+1 / -1) for every byte value: row b, column k is +1 when bit k of b is set."""
    key = (torch.device(device), dtype)
    if key not in _TABLES:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        _TABLES[key] = (bits * 2 - 1).to(device=device, dtype=dtype)
    return _TABLES[key]


def pack_flags(flags: torch.Tensor, flag_bytes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Pack float flags (1.0 = sign +1, 0.0 = sign -1; 1-D, length a multiple of 8) into `out`
    (len/8 bytes in any shape, e.g. a strided view of several wire segments).

    `flag_bytes` is int8 scratch of the same length. A float compare writing 1.0/0.0 and a
    float -> int8 conversion are vectorised kernels (a bool or uint8 output is not: 5-10x slower).
    """
    flag_bytes.copy_(flags)
    words = flag_bytes.view(torch.int64)
    words.mul_(_GATHER_BITS).bitwise_right_shift_(56)
    return out.copy_(words.view(out.shape))  # `out` may be a strided view: one copy into the wire


def unpack_flags(packed: torch.Tensor, words: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The bits of `packed` as float 1.0 (sign +1) / 0.0 (sign -1) into `out`, 8 per byte, the
    inverse of pack_flags. `words` is int64 scratch of packed.numel(). Cheaper than a table
    lookup where the caller combines the flags with its own scales anyway. `words` has the shape
    of `packed` (which may be strided); `out` any shape of 8 times as many elements."""
    words.copy_(packed)
    words.mul_(_SPREAD).bitwise_and_(_BIT_K_OF_BYTE_K)
    return torch.ne(words.view(torch.uint8).view(out.shape), 0, out=out)


def pack_signs(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack the signs of `x` (flattened) into ceil(len/8) bytes; sign(0) = +1, padding bits are +1.
    An fp32 `x` goes through the device's fused kernel where it has one (zoa_train/comm/kernels)."""
    x = x.reshape(-1)
    n = x.numel()
    if out is None:
        out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    fused = fused_codec(x.device) if x.dtype == torch.float32 and out.is_contiguous() else None
    if fused is not None:
        fused.pack(x.contiguous(), out)
        return out
    length = min(BLOCK, (n + 7) // 8 * 8)
    flags = torch.empty(length, dtype=torch.float32, device=x.device)
    flag_bytes = torch.empty(length, dtype=torch.int8, device=x.device)
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        length = -(-(stop - start) // 8) * 8
        torch.ge(x[start:stop], 0, out=flags[: stop - start])
        flags[stop - start : length] = 1.0
        pack_flags(flags[:length], flag_bytes[:length], out[start // 8 : start // 8 + length // 8])
    return out


def unpack_rows(
    packed: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    index: torch.Tensor | None = None,
    tables: torch.Tensor | None = None,
    staging: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unpack R rows of signs, each times its own scale, into `out` (R*row elements, row % 8 == 0).

    `scales` holds the R scales in any shape, e.g. (n, r) for r rows of each of n segments;
    `packed` the rows' R*row/8 bytes, shaped (n, r*row/8) then; `out` the rows, e.g. (n, r, row).
    Any of them may be a strided view. Each row indexes its own scaled copy of the table, so the
    scale costs a 256x8 multiply per row, not a pass over `out`. `index` (int32, R*row/8),
    `tables` (fp32, R*256*8) and `staging` (fp32, R*row, used when `out` is not contiguous) are
    optional scratch, for hot loops that should not allocate.
    """
    rows = scales.numel()
    if tables is None:
        tables = torch.empty(rows * 256 * 8, dtype=torch.float32, device=packed.device)
    if index is None:
        index = torch.empty(packed.numel(), dtype=torch.int32, device=packed.device)
    tables = torch.mul(scales[..., None, None], sign_table(packed.device), out=tables.view(*scales.shape, 256, 8))
    tables = tables.view(rows * 256, 8)
    index = index.view(packed.shape)
    index.copy_(packed)
    if rows > 1:
        index.view(rows, -1).add_(_row_offsets(rows, packed.device))
    if out.is_contiguous():
        torch.index_select(tables.to(out.dtype), 0, index.view(-1), out=out.view(-1, 8))
        return out
    # A strided `out` (rows of several chunks): unpack to contiguous scratch, then one copy (which
    # casts the exact +-scale to out's dtype, as a table in that dtype would).
    staged = staging[: out.numel()] if staging is not None else torch.empty(out.numel(), dtype=torch.float32, device=out.device)
    torch.index_select(tables, 0, index.view(-1), out=staged.view(-1, 8))
    return out.copy_(staged.view(out.shape))


def _row_offsets(rows: int, device: torch.device) -> torch.Tensor:
    """Column of 0, 256, 512, ...: row r of a 2-D unpack reads table rows 256r..256r+255."""
    key = (device, torch.int32)
    if key not in _OFFSETS or _OFFSETS[key].numel() < rows:
        _OFFSETS[key] = torch.arange(0, max(rows, 64) * 256, 256, dtype=torch.int32, device=device).unsqueeze(1)
    return _OFFSETS[key][:rows]


def unpack_signs(
    packed: torch.Tensor,
    n: int,
    scale: torch.Tensor | float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unpack the first n signs of `packed` as +scale / -scale (float32 unless `out` says otherwise)."""
    if n > packed.numel() * 8:
        raise ValueError(f"cannot unpack {n} signs from {packed.numel()} bytes")
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=packed.device)
    fused = fused_codec(packed.device) if out.dtype == torch.float32 and out.is_contiguous() and packed.is_contiguous() else None
    if fused is not None:
        fused.unpack(packed, float(scale), out.view(-1))
        return out
    scale = torch.as_tensor(scale, dtype=torch.float32, device=packed.device).reshape(1)
    index = torch.empty(min(BLOCK, n + 7) // 8, dtype=torch.int32, device=packed.device)
    tables = torch.empty(256 * 8, dtype=torch.float32, device=packed.device)
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        length = -(-(stop - start) // 8) * 8
        signs = packed[start // 8 : start // 8 + length // 8]
        scratch = dict(index=index[: length // 8], tables=tables)
        if length == stop - start and out.is_contiguous():
            unpack_rows(signs, scale, out[start:stop], **scratch)
        else:
            whole = torch.empty(length, dtype=out.dtype, device=out.device)
            unpack_rows(signs, scale, whole, **scratch)
            out[start:stop].copy_(whole[: stop - start])
    return out

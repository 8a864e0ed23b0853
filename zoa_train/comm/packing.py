"""Sign packing: 8 signs per byte, bit k of byte i is element 8*i+k, bit set means >= 0.

Both directions are plain vectorised torch ops (no Python loop over elements), so the same code
runs on CPU and CUDA. Packing multiplies each group of 8 one-byte flags, read as one int64, by a
constant that gathers their low bits into the top byte; unpacking is a table lookup of 256 rows
x 8 values, which also folds in the scale for free.
"""

import torch

# Byte k of the int64 word (value 0 or 1) lands on bit 56 + k of the product.
_GATHER_BITS = 0x0102040810204080
BLOCK = 1 << 18  # elements per block (1 MiB of fp32: stays in L2/L3); a multiple of 8
_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def sign_table(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of 8 signs (+1 / -1) for every byte value: row b, column k is +1 when bit k of b is set."""
    key = (torch.device(device), dtype)
    if key not in _TABLES:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        _TABLES[key] = (bits * 2 - 1).to(device=device, dtype=dtype)
    return _TABLES[key]


def pack_signs(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack the signs of `x` (flattened) into ceil(len/8) bytes; sign(0) = +1, padding bits are +1."""
    x = x.reshape(-1)
    n = x.numel()
    if out is None:
        out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    # Blocks keep the scratch small and in cache. The comparison writes float 1.0/0.0 (a vectorised
    # kernel, unlike a bool output); 1.0 is 0x3F800000, so bits 29.. of its int32 view are 0b1.
    length = min(BLOCK, (n + 7) // 8 * 8)
    flags = torch.empty(length, dtype=torch.float32, device=x.device)
    flag_bytes = torch.empty(length, dtype=torch.uint8, device=x.device)
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        length = -(-(stop - start) // 8) * 8
        torch.ge(x[start:stop], 0, out=flags[: stop - start])
        flags[stop - start : length] = 1.0
        ints = flags[:length].view(torch.int32)
        block_bytes = flag_bytes[:length]
        block_bytes.copy_(ints.bitwise_right_shift_(29))
        words = block_bytes.view(torch.int64)
        words.mul_(_GATHER_BITS).bitwise_right_shift_(56)
        out[start // 8 : start // 8 + length // 8].copy_(words)
    return out


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
    table = sign_table(packed.device, torch.float32)
    if not (isinstance(scale, float) and scale == 1.0):
        table = table * scale
    direct = out.dtype == torch.float32 and out.is_contiguous()
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        index = packed[start // 8 : (stop + 7) // 8].to(torch.int32)
        if direct and (stop - start) % 8 == 0:
            torch.index_select(table, 0, index, out=out[start:stop].view(-1, 8))
        else:
            out[start:stop].copy_(torch.index_select(table, 0, index).view(-1)[: stop - start])
    return out

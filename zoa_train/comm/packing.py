"""Sign packing: 8 signs per byte, bit k of byte i is element 8*i+k, bit set means >= 0.

Both directions are plain vectorised torch ops (no Python loop over elements), so the same code
runs on CPU and CUDA. Packing multiplies each group of 8 one-byte booleans, read as one int64,
by a constant that gathers their low bits into the top byte; unpacking is a table lookup of
256 rows x 8 values, which also folds in the scale for free.
"""

import torch

# Byte k of the int64 word (value 0 or 1) lands on bit 56 + k of the product.
_GATHER_BITS = 0x0102040810204080
_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def sign_table(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of 8 signs (+1 / -1) for every byte value: row b, column k is +1 when bit k of b is set."""
    key = (torch.device(device), dtype)
    if key not in _TABLES:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        _TABLES[key] = (bits * 2 - 1).to(device=device, dtype=dtype)
    return _TABLES[key]


def pack_signs(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack the signs of a 1-D tensor into ceil(len/8) bytes; sign(0) = +1, padding bits are +1."""
    x = x.reshape(-1)
    nbytes = (x.numel() + 7) // 8
    bits = torch.empty(nbytes * 8, dtype=torch.bool, device=x.device)
    torch.ge(x, 0, out=bits[: x.numel()])
    bits[x.numel():] = True
    words = bits.view(torch.uint8).view(torch.int64)
    words.mul_(_GATHER_BITS).bitwise_right_shift_(56)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    out.copy_(words)
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
    nbytes = (n + 7) // 8
    dtype = out.dtype if out is not None else torch.float32
    table = sign_table(packed.device, torch.float32)
    if not (isinstance(scale, float) and scale == 1.0):
        table = table * scale
    index = packed[:nbytes].to(torch.int32)
    direct = out is not None and n % 8 == 0 and out.dtype == torch.float32 and out.is_contiguous()
    if direct:
        torch.index_select(table, 0, index, out=out.view(-1, 8))
        return out
    values = torch.index_select(table, 0, index).view(-1)[:n]
    if out is None:
        return values.to(dtype)
    out.copy_(values)
    return out

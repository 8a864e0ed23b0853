"""Refuse, on every rank alike, a collective that the ranks built differently.

Each rank of a collective sends messages whose sizes follow from its own sizes and settings; ranks that
disagree send messages of different sizes, at which Gloo aborts the process (SIGABRT) and NCCL hangs.
The optimizers compare the ranks' models when they are built (zoa_train/optim/base.py); a collective
used directly compares, when it is built, what sets its messages: one all-gather of a few hundred
bytes, once, never per call. A collective built by another (a bucket's, the node-aware one's between
nodes) is built inside `checked_by_caller`, so a set-up costs one all-gather in all.
"""

import contextlib
import hashlib
import struct
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

_SETTINGS_BYTES = 224  # "name=value name=value ...", padded: every rank must send the same number of bytes
_inside = threading.local()


@contextlib.contextmanager
def checked_by_caller():
    """Collectives built inside skip `check_same_on_every_rank`: their builder compared the ranks already."""
    depth = getattr(_inside, "depth", 0)
    _inside.depth = depth + 1
    try:
        yield
    finally:
        _inside.depth = depth


def _fingerprint(sizes: Sequence[Sequence[int]], settings: dict, layout) -> bytes:
    digest = hashlib.sha256(repr((sizes, layout)).encode()).digest()[:8]
    counts = struct.pack("<3q", len(sizes), sum(map(len, sizes)), sum(map(sum, sizes)))
    text = " ".join(f"{name}={value}" for name, value in settings.items()).encode()
    return digest + counts + text[:_SETTINGS_BYTES].ljust(_SETTINGS_BYTES)


def check_same_on_every_rank(who: str, group, sizes: Sequence[Sequence[int]], settings: dict, layout=None) -> None:
    """Raise the same ValueError on every rank of `group` if some rank's `sizes` (the tensor sizes of each
    buffer), `settings` (name: a value without spaces, each what sets the messages' sizes) or `layout`
    (anything else that does, compared by its repr) differ from rank 0's. Nothing with one rank, or
    inside `checked_by_caller`."""
    if getattr(_inside, "depth", 0) or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return
    sizes = [[int(size) for size in buffer] for buffer in sizes]
    nccl = "nccl" in str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    mine = torch.frombuffer(bytearray(_fingerprint(sizes, settings, layout)), dtype=torch.uint8).to(device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    other = next((rank for rank, theirs in enumerate(every) if not torch.equal(theirs, every[0])), None)
    if other is None:
        return
    first, theirs = every[0].cpu().numpy().tobytes(), every[other].cpu().numpy().tobytes()
    named = [dict(pair.split("=", 1) for pair in f[32:].decode(errors="replace").split() if "=" in pair) for f in (first, theirs)]
    differing = next((name for name in named[0] if named[0][name] != named[1].get(name)), None)
    if differing is not None:
        raise ValueError(
            f"{who}: the ranks were built with different {differing}: {named[0][differing]} on rank 0 and {named[1].get(differing)} on rank {other}; "
            "build it with the same settings on every rank"
        )
    (b0, t0, e0), (b1, t1, e1) = struct.unpack("<3q", first[8:32]), struct.unpack("<3q", theirs[8:32])
    raise ValueError(
        f"{who}: the ranks were given different sizes: rank 0 has {b0} buffers of {t0} tensors ({e0:,} elements), rank {other} {b1} of {t1} ({e1:,} elements)"
        f"{' of other sizes' if (b0, t0, e0) == (b1, t1, e1) else ''}; build it with the same sizes on every rank"
    )

"""The three compute passes of the 1-bit allreduce, one module per backend, chosen in one place.

A 1-bit call (zoa_train/comm/onebit.py) is two collectives around three passes over rows of a
buffer in a 1-bit layout, each row with its own scale:
  worker  y = e_w (+ addend); per row s = RMS(y), signs packed into the wire, e_w <- y - s*sign(y)
  server  c = e_s + mean_i(s_i*sign_i) over this rank's rows; compressed as the worker's y, into e_s
  output  the gathered signs times their row scales written into the destination, padding zero
Backends (`KERNELS`, each a class in its own module with the interface of `OneBitKernels`):
  torch   the reference: tensor ops on any device, a few dozen per pass in cache-sized blocks, with
          per-block scratch (~0.1 fp32 copies of the buffers)
  native  one fused C++ loop per pass on CPUs (built at first use by torch.utils.cpp_extension and
          cached; docs/algorithm.md, "Fused kernels"), no scratch
  triton  one fused Triton kernel per pass on GPUs (Triton ships with torch), no scratch; on CPU
          tensors only under TRITON_INTERPRET=1 (the test suite's way to run them without a GPU)
`select_kernels("auto", device)` picks triton on CUDA, native on CPU, and torch where those cannot
run, saying why once in the log (by the first rank of each host: the others meet the same reason). Row padding: a row's first `valid` elements are real, the rest is
padding (the layout only pads at the end of a row); padding counts as zero, its sign bit is set (as
sign(0) = +1), its error stays zero and it is zero in the output.
"""

import contextlib
import importlib
import logging
import os
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

log = logging.getLogger(__name__)

KERNELS = {"torch": "zoa_train.comm.kernels.torch_ops", "native": "zoa_train.comm.kernels.native", "triton": "zoa_train.comm.kernels.triton_ops"}
CHOICES = ("auto", *KERNELS)
_AUTO = {"cuda": ("triton", "torch"), "cpu": ("native", "torch")}
_told: set[tuple[str, str]] = set()


class PartViews(NamedTuple):
    """One buffer of a 1-bit call (an optimizer parameter group) seen by the passes, made once per
    collective: n chunks of `rows` rows of `row` elements. Wire views are strided: chunk k's packed
    signs and fp32 scales sit in wire segment k."""

    worker: torch.Tensor  # (n, rows, row) fp32: e_w, y during the worker pass
    valid: torch.Tensor  # (n, rows) int32: real elements at the start of each row
    norm: torch.Tensor  # (n, rows) fp32: sqrt(max(valid, 1)), the RMS's divisor
    send_signs: torch.Tensor  # (n, rows*row/8) uint8
    send_scales: torch.Tensor  # (n, rows) fp32
    recv_signs: torch.Tensor  # (n, rows*row/8): every rank's signs of this rank's chunk
    recv_scales: torch.Tensor  # (n, rows)
    server: torch.Tensor  # (1, rows, row) fp32: e_s of this rank's chunk, c during the server pass
    rank: int  # this rank's chunk: its rows' valid and norm are valid[rank], norm[rank]
    mine_signs: torch.Tensor  # (1, rows*row/8)
    mine_scales: torch.Tensor  # (1, rows)
    gathered_signs: torch.Tensor  # (n, rows*row/8): every server's signs
    gathered_scales: torch.Tensor  # (n, rows)


class OneBitKernels(Protocol):
    """A backend: built once per collective over its buffers' views, then called every 1-bit call."""

    def __init__(self, parts: Sequence[PartViews], device: torch.device, block_size: int | None): ...

    def worker(self, part: int, addend: torch.Tensor | None) -> None:
        """y = worker (+ addend, a buffer in the part's layout, any float dtype) compressed into the
        send segments; the worker buffer then holds the new error."""

    def server(self, part: int) -> None:
        """c = server + mean over the n sources of the received scaled signs, compressed into the
        `mine` segment; the server buffer then holds the new error."""

    def output(self, part: int, out: torch.Tensor) -> None:
        """The gathered signs times their scales into `out` (a buffer in the part's layout, any float
        dtype), its padding zero."""

    @staticmethod
    def scratch(layouts, world_size: int, device: torch.device, block_size: int | None) -> dict[str, tuple[int, torch.dtype]]:
        """(elements, dtype) of each scratch buffer a collective of `layouts` gets from this backend."""

    def held_buffers(self) -> dict[str, torch.Tensor]:
        """The scratch buffers this instance holds, by the names `scratch` sizes them by."""

    @staticmethod
    def unavailable(device: torch.device) -> str | None:
        """Why this backend cannot run on `device` here (None: it can)."""


class FusedKernels:
    """What the fused backends share: a kernel per pass over whole rows, so no scratch, and each row's
    real length and RMS divisor flat (the server's: this rank's chunk's rows)."""

    def __init__(self, parts: Sequence[PartViews], device: torch.device, block_size: int | None):
        self.parts = list(parts)
        self._valid = [p.valid.contiguous().view(-1) for p in self.parts]
        self._norm = [p.norm.contiguous().view(-1) for p in self.parts]
        self._server_rows = [(p.valid[p.rank].contiguous(), p.norm[p.rank].contiguous()) for p in self.parts]

    @staticmethod
    def scratch(layouts, world_size: int, device: torch.device, block_size: int | None) -> dict[str, tuple[int, torch.dtype]]:
        return {}

    def held_buffers(self) -> dict[str, torch.Tensor]:
        return {}


def profiled(name: str):
    """A profiler range around a fused pass, so profiles and op counts show it (a torch op each, as a
    pass of the torch path is several); nothing while no profiler runs."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def backend(name: str):
    """The backend class of `name` (a key of KERNELS)."""
    return importlib.import_module(KERNELS[name]).Kernels


def fused_codec(device: torch.device | str):
    """The module of the fused backend "auto" picks on `device` (its `pack` and `unpack` serve
    zoa_train.comm.pack_signs / unpack_signs), or None where the torch path runs."""
    chosen = select_kernels("auto", device)
    return None if chosen is backend("torch") else importlib.import_module(chosen.__module__)


def fused_sync_finish(device: torch.device | str):
    """0/1 Adam's end of a sync as one fused pass where the fused backend on `device` has one (the
    native module's `finish_sync` on CPUs; zoa_train/optim/zero_one_adam.py), else None: torch ops."""
    return getattr(fused_codec(device), "finish_sync", None)


def select_kernels(choice: str, device: torch.device | str):
    """The backend class for `choice` ("auto" or a name in KERNELS) on `device`. "auto" takes the
    first that can run there (triton on CUDA, native on CPU, torch anywhere) and logs once why a
    fused one could not; a named backend that cannot run is refused with the reason."""
    device = torch.device(device)
    if choice not in CHOICES:
        raise ValueError(f"unknown 1-bit kernels {choice!r}: expected one of {', '.join(CHOICES)}")
    if choice != "auto":
        reason = backend(choice).unavailable(device)
        if reason:
            raise ValueError(f"the {choice} 1-bit kernels cannot run on {device.type} here: {reason}")
        return backend(choice)
    for name in _AUTO.get(device.type, ("torch",)):
        reason = backend(name).unavailable(device)
        if reason is None:
            return backend(name)
        if (name, device.type) not in _told:
            _told.add((name, device.type))
            level = logging.WARNING if _local_rank() == 0 else logging.DEBUG
            log.log(level, "the 1-bit allreduce runs the unfused torch path on %s instead of the %s kernels: %s", device.type, name, reason)
    return backend("torch")


def _local_rank() -> int:
    """This process's place among its host's ranks: LOCAL_RANK where a launcher set it, else the rank in
    the process group (0 without one)."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

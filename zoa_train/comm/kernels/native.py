"""The 1-bit call's passes as fused C++ loops on CPUs (native.cpp beside this file), and 0/1 Adam's
end of a sync, which follows them.

Built at first use with torch.utils.cpp_extension (g++ and torch's headers; about 30 s once, then
cached under TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions, and shared by every rank
and run; `make install` builds it ahead). The build targets this machine's processor (-march=native),
so its name carries a fingerprint of the processor's features: a cache shared by several kinds of
machine (a home directory on a cluster) holds one build per kind. Where it cannot be built (no
compiler), the torch path runs and the log says why, once per host: the compiler that is missing, or
the first line of the build's log that names an error, and the host.

`python -m zoa_train.comm.kernels.native` builds it and says where it is, or why it could not.
"""

import hashlib
import logging
import platform
import re
import shlex
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path

import torch

from zoa_train.comm.kernels import FusedKernels, PartViews, profiled

SOURCE = Path(__file__).with_name("native.cpp")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off"]  # no fused multiply-add: the torch path's rounding
_built: dict[str, object] = {}  # "module" or "error"


def _processor_fingerprint() -> str:
    """A short hash of what -march=native compiles for: the processor's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        facts = [line for line in text.splitlines() if line.startswith(("flags", "model name", "Features", "CPU part"))][:4]
    except OSError:
        facts = []
    facts.append(platform.machine())
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:10]


def first_error(log: str) -> str:
    """The line of a failed build's output that says why: the first with an "error:" (a compiler's, a
    missing header's, the linker's), else the last. cpp_extension's own first line ("Error building
    extension ...: [1/2] <the whole command>") and ninja's last ("ninja: build stopped") say neither."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    said = [line for line in lines if re.search(r"\berror:", line, re.IGNORECASE)]
    return (said or lines or ["failed"])[0 if said else -1]


def build():
    """The compiled module (built or loaded from the cache on the first call); raises where it cannot be built."""
    if "module" not in _built and "error" not in _built:
        # Importing cpp_extension on a machine without CUDA logs a warning about CUDA_HOME: not ours to show.
        quiet = logging.getLogger("torch.utils.cpp_extension")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        host = socket.gethostname()
        try:
            from torch.utils import cpp_extension

            compiler = cpp_extension.get_cxx_compiler()  # CXX, else c++
            if shutil.which(shlex.split(compiler)[0] if compiler.strip() else "c++") is None:
                _built["error"] = (
                    f"they could not be built on host {host}: the C++ compiler {compiler} was not found (install g++, or set CXX to a C++ compiler)"
                )
            else:
                name = f"zoa_onebit_{_processor_fingerprint()}"
                _built["module"] = cpp_extension.load(name, sources=[str(SOURCE)], extra_cflags=FLAGS, verbose=False)
        except Exception as error:  # no headers, a read-only cache, a compiler that fails: the torch path runs
            _built["error"] = f"they could not be built on host {host}: {first_error(str(error))}"
        finally:
            quiet.setLevel(level)
    if "error" in _built:
        raise RuntimeError(_built["error"])
    return _built["module"]


class Kernels(FusedKernels):
    """The native backend (zoa_train/comm/kernels/__init__.py)."""

    def __init__(self, parts: Sequence[PartViews], device: torch.device, block_size: int | None):
        super().__init__(parts, device, block_size)
        self.module = build()

    @staticmethod
    def unavailable(device: torch.device) -> str | None:
        if device.type != "cpu":
            return "CPU only"
        try:
            build()
        except RuntimeError as error:
            return str(error)
        return None

    def worker(self, part: int, addend: torch.Tensor | None) -> None:
        p = self.parts[part]
        if addend is not None and addend.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            p.worker.view(-1).add_(addend)
            addend = None
        with profiled("zoa::onebit_worker"):
            self.module.compress(p.worker, addend, self._valid[part], self._norm[part], p.send_signs, p.send_scales)

    def server(self, part: int) -> None:
        p = self.parts[part]
        valid, norm = self._server_rows[part]
        with profiled("zoa::onebit_server"):
            self.module.server(p.recv_signs, p.recv_scales, 2.0 / p.recv_signs.shape[0], p.server, valid, norm, p.mine_signs, p.mine_scales)

    def output(self, part: int, out: torch.Tensor) -> None:
        p = self.parts[part]
        with profiled("zoa::onebit_output"):
            self.module.decompress(p.gathered_signs, p.gathered_scales, self._valid[part], out.view(p.worker.shape))


def pack(x: torch.Tensor, out: torch.Tensor) -> None:
    """The signs of fp32 `x` (contiguous) packed into `out`, as packing.pack_signs."""
    build().pack(x, out)


def unpack(packed: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out (contiguous fp32) <- +scale / -scale by the bits of `packed`, as packing.unpack_signs."""
    build().unpack(packed, scale, out)


def finish_sync(
    m: torch.Tensor, anchor: torch.Tensor, denom: torch.Tensor, decay: float, lr_sum: float, params: Sequence[torch.Tensor], offsets: Sequence[int]
) -> None:
    """0/1 Adam's end of a sync in one pass (native.cpp, finish_sync): m holds w_bar on entry and the
    rebuilt momentum after; the anchor and `params` (fp32 contiguous, at ascending `offsets`) the new
    point. Bit-identical to ZeroOneAdam's torch ops."""
    build().finish_sync(m, anchor, denom, decay, lr_sum, list(params), list(offsets))


if __name__ == "__main__":
    try:
        module = build()
    except RuntimeError as error:
        raise SystemExit(f"the native 1-bit kernels are not used: {error}; the torch path runs instead") from None
    print(f"native 1-bit kernels: {module.__file__}")

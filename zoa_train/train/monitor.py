"""Memory and MFU of each log window, per rank (as torchtitan's memory monitor and MFU): what the trainer
adds to a log step's record. docs/metrics.md says what each key measures on each device.

Memory: this rank's peak in the window. CUDA: the caching allocator's active and reserved peaks
(`torch.cuda.memory_stats`), reset each window. CPU: the process's peak resident set (VmHWM), reset each
window through /proc/self/clear_refs; where the kernel refuses that (or there is no /proc), the lifetime
peak (getrusage) under keys of its own name, never as a window's. Each rank's few numbers are gathered
at log steps only (one small all-gather): ranks differ under sharding, and the record holds them all.

MFU: tokens per second per rank x the task's model FLOPs per token / the device's peak FLOPS, from the
table below or `train.peak_tflops`. A device without a known peak (every CPU, an unlisted GPU) logs no
MFU and says so once: a default would be a silently wrong number.
"""

import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DevicePeak:
    """One device's peak dense TFLOPS by matmul format, from its vendor's datasheet or architecture
    whitepaper. Datasheets lead with the figure with 2:4 sparsity; dense is half of it. None: the
    device has no such tensor format (V100: no bf16, no tf32)."""

    title: str
    names: tuple[frozenset[str], ...]  # the significant words of torch.cuda.get_device_name() (_words) that name it
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float | None  # without tensor cores


def _names(*names: str) -> tuple[frozenset[str], ...]:
    return tuple(frozenset(name.split()) for name in names)


PEAK_TFLOPS = (
    DevicePeak("H100 SXM", _names("H100"), 989.5, 989.5, 494.5, 67.0),  # "NVIDIA H100 80GB HBM3"
    DevicePeak("H100 PCIe", _names("H100 PCIE"), 756.5, 756.5, 378.0, 51.0),
    DevicePeak("H100 NVL", _names("H100 NVL"), 835.5, 835.5, 417.5, 60.0),
    DevicePeak("H200 SXM", _names("H200"), 989.5, 989.5, 494.5, 67.0),
    DevicePeak("H200 NVL", _names("H200 NVL"), 835.5, 835.5, 417.5, 60.0),
    DevicePeak("GH200", _names("GH200"), 989.5, 989.5, 494.5, 67.0),
    DevicePeak("B200", _names("B200"), 2250.0, 2250.0, 1125.0, 75.0),  # HGX B200's 8-GPU figures / 8
    DevicePeak("A100", _names("A100", "A100 PCIE"), 312.0, 312.0, 156.0, 19.5),  # SXM4 and PCIe, 40 and 80 GB alike
    DevicePeak("L40S", _names("L40S"), 362.05, 362.05, 183.0, 91.6),
    DevicePeak("L40", _names("L40"), 181.05, 181.05, 90.5, 90.5),
    DevicePeak("L4", _names("L4"), 121.0, 121.0, 60.0, 30.3),
    DevicePeak("A10", _names("A10"), 125.0, 125.0, 62.5, 31.2),
    DevicePeak("V100 SXM2", _names("V100 SXM2"), None, 125.0, None, 15.7),
    DevicePeak("V100 PCIe", _names("V100 PCIE"), None, 112.0, None, 14.0),
    DevicePeak("V100S PCIe", _names("V100S PCIE"), None, 130.0, None, 16.4),
    DevicePeak("RTX 4090", _names("RTX 4090"), 165.2, 165.2, 82.6, 82.6),  # with fp32 accumulation, as torch's matmuls
    DevicePeak("RTX 3090", _names("RTX 3090"), 71.0, 71.0, 35.6, 35.6),
)

# Words of a device name that tell nothing about its compute: the vendor, the line, the memory size and
# the form factor of the parts whose figures do not depend on it (H100 and A100 say PCIe; V100 says SXM2).
_NOISE = {"NVIDIA", "TESLA", "GEFORCE", "SXM", "SXM4", "SXM5", "HBM3", "HBM3E"}


def _words(device_name: str) -> frozenset[str]:
    words = re.split(r"[^A-Z0-9]+", device_name.upper())
    return frozenset(w for w in words if w and w not in _NOISE and not re.fullmatch(r"\d+GB", w))


def device_peak(device_name: str) -> DevicePeak | None:
    """The table's entry for a device as torch.cuda.get_device_name() names it, or None. Every word of
    the name that tells its compute must match: an RTX 3090 Ti or an A10G is not an RTX 3090 or an A10."""
    words = _words(device_name)
    return next((peak for peak in PEAK_TFLOPS if words in peak.names), None)


def matmul_format(precision: str) -> str:
    """What train.precision's matmuls run in: bf16 and fp16 under autocast; fp32 as torch's float32 matmul
    precision allows (highest: fp32; high: tf32; medium: bf16), so the peak is never below what runs."""
    if precision != "fp32":
        return precision
    return {"highest": "fp32", "high": "tf32", "medium": "bf16"}[torch.get_float32_matmul_precision()]


def peak_flops(device: torch.device, precision: str, peak_tflops: float | None) -> tuple[float | None, str]:
    """One device's peak FLOPS for MFU (train.peak_tflops, else the table's) and, where none is known, why."""
    if peak_tflops is not None:
        return peak_tflops * 1e12, ""
    fmt = matmul_format(precision)
    if device.type != "cuda":
        return None, f"zoa-train knows no peak FLOPS of a {device.type.upper()}"
    name = torch.cuda.get_device_name(device)
    entry = device_peak(name)
    if entry is None:
        return None, f"{name} is not in zoa-train's table of peak FLOPS"
    tflops = getattr(entry, fmt)
    return (tflops * 1e12, "") if tflops is not None else (None, f"the {entry.title} has no {fmt} tensor figure in zoa-train's table")


class MemoryPeaks:
    """This process's peak memory since the last `read_and_reset`, in bytes: on CUDA the allocator's active
    and reserved peaks; on CPU the resident set's peak (VmHWM), or its lifetime peak where it cannot be reset."""

    def __init__(self, device: torch.device, proc: Path = Path("/proc/self")):
        self.device, self._proc = device, proc
        self.windowed = device.type == "cuda" or self._reset_resident_peak()

    def _reset_resident_peak(self) -> bool:
        """Reset VmHWM to the present resident set (Linux 4.0 and later); False where that is refused."""
        try:
            (self._proc / "clear_refs").write_text("5")
            return self._resident_peak() is not None
        except OSError:
            return False

    def _resident_peak(self) -> int | None:
        match = re.search(r"^VmHWM:\s+(\d+) kB", (self._proc / "status").read_text(), re.MULTILINE)
        return int(match.group(1)) * 1024 if match else None

    def read_and_reset(self) -> list[int]:
        """[peak] (CPU) or [active peak, reserved peak] (CUDA) since the last call, and a new window."""
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return [stats.get("active_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0)]
        if not self.windowed:
            import resource

            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return [maxrss if sys.platform == "darwin" else maxrss * 1024]  # bytes on macOS, KiB on Linux
        peak = self._resident_peak()
        self._reset_resident_peak()
        return [peak]


class RankMonitor:
    """Memory and MFU for the records of one run: `record(units_per_s)` at each log step, on every rank
    (it gathers each rank's memory peaks). `flops_per_unit`: the task's model FLOPs per unit of
    throughput (Task.flops_per_unit), None where not counted."""

    def __init__(self, device: torch.device, flops_per_unit: float | None, precision: str, peak_tflops: float | None, world: int, is_main: bool):
        self.device, self.world, self.flops_per_unit = device, world, flops_per_unit
        self.peak = None
        if flops_per_unit is not None:
            self.peak, unknown = peak_flops(device, precision, peak_tflops)
            if self.peak is None and is_main:
                log.warning(
                    "MFU is not logged: %s; set train.peak_tflops to one device's peak dense TFLOPS at train.precision %s to log it (docs/metrics.md)",
                    unknown,
                    precision,
                )
        self.memory = MemoryPeaks(device)
        if not self.memory.windowed and is_main:
            log.warning(
                "the kernel does not let this process reset its peak resident memory (/proc/self/clear_refs), so metrics.jsonl "
                "logs each rank's lifetime peak (mem_lifetime_peak_bytes) instead of each log window's"
            )
        self.memory.read_and_reset()  # the first window starts here

    def record(self, units_per_s: float) -> dict:
        """The window's memory keys (the maximum over ranks, and each rank's) and MFU where known."""
        mine = torch.tensor(self.memory.read_and_reset(), dtype=torch.int64, device=self.device)
        gathered = [mine]
        if dist.is_initialized():  # always in the trainer; a unit test may call it alone
            gathered = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(gathered, mine)
        by_rank = torch.stack(gathered).tolist()  # ranks x [peak] or [active, reserved]
        peaks = [rank[0] for rank in by_rank]
        name = "mem_peak_bytes" if self.memory.windowed else "mem_lifetime_peak_bytes"
        record = {name: max(peaks), f"{name}_by_rank": peaks}
        if self.device.type == "cuda":
            record["mem_reserved_peak_bytes"] = max(rank[1] for rank in by_rank)
        if self.peak is not None:
            record["mfu_percent"] = 100 * units_per_s / self.world * self.flops_per_unit / self.peak
        return record

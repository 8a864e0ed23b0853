"""What the `bench` commands check of their numbers before they start or allocate anything: each count
within bounds, and what the run will hold within this machine's memory. A refusal is a UserError of
one sentence (exit 2)."""

import math
import os

from zoa_train.errors import UserError

MAX_REPEATS = 10_000  # timed repeats, calls or batches: a median is steady long before; more only runs for hours
# A rank is a Python process with torch imported and a process group: about 400 MB (PSS) measured here.
RANK_PROCESS_BYTES = 512 * 2**20


def available_memory() -> int:
    """Bytes of memory this machine can give new processes (Linux's MemAvailable: free and reclaimable)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_count(option: str, value: int, low: int = 1, high: int = MAX_REPEATS) -> None:
    if not low <= value <= high:
        raise UserError(f"{option} must be from {low:,} to {high:,}, not {value:,}.")


def check_fits(what: str, need: float, remedy: str, room: int | None = None, where: str = "of memory available on this machine") -> None:
    """Refuse `what` (a plural subject that "needs about N") if it needs more than `room` bytes (default:
    the memory available)."""
    from zoa_train.plan.units import format_bytes

    room = available_memory() if room is None else room
    if need > room:
        raise UserError(f"{what} need about {format_bytes(need)} and there are {format_bytes(room)} {where}; {remedy}.")


def check_local_ranks(nproc: int) -> None:
    """At least 2 ranks (a 1-rank allreduce sends nothing), and processes this machine has memory for."""
    if nproc < 2:
        raise UserError("--nproc must be at least 2: a 1-rank allreduce sends nothing.")
    check_fits(f"--nproc {nproc:,} ranks", nproc * RANK_PROCESS_BYTES, "pass a smaller --nproc")


def check_positive_finite(option: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{option} must be a positive finite number, not {value}.")

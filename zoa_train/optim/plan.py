"""Communication plan: what each registered optimizer would send over a whole run, without running it.

Each optimizer's registry entry (zoa_train/optim/registry.py) counts its full-precision and 1-bit
allreduces, rounds, syncs and variance updates from the recipe's knobs, following docs/algorithm.md
"Counting" and the optimizers' own ledgers, so a plan can be checked against a real run (0/1 Adam's
counts come from the same ZeroOneSchedule the optimizer runs). Every optimizer's parameters are
treated as one flat buffer (the optimizers send one buffer per param group, so a multi-group model
pays a little more padding and latency than planned).

Bytes are what one rank sends: ring_allreduce_bytes for full precision, and for a 1-bit call
2*(n-1) segments of packed signs plus fp32 row scales, sized by onebit_layout exactly as
OneBitAllReduce sends them. Time uses an alpha-beta model (latency alpha per message, bandwidth
beta per rank): a ring allreduce costs
2(n-1)*alpha + bytes/beta; a 1-bit call is an all-to-all ((n-1)*alpha + its bytes/beta) followed by
a ring all-gather ((n-1)*alpha + its bytes/beta). With one rank nothing is sent: bytes and time are
zero, while bits, rounds and syncs stay the schedule's nominal counts.
"""

import math
import re
from collections.abc import Callable

from rich.table import Table

from zoa_train.comm.collectives import ring_allreduce_bytes
from zoa_train.comm.onebit import onebit_layout
from zoa_train.errors import UserError
from zoa_train.optim import registry
from zoa_train.optim.lr_schedules import LRSchedule
from zoa_train.optim.registry import PlanContext, PlanCounts

ALLREDUCE_BITS = (16, 32)


def onebit_call_bytes(num_params: int, world_size: int) -> int:
    """Bytes one rank sends in one OneBitAllReduce call: 2(n-1) segments (signs and row scales)."""
    return 2 * (world_size - 1) * onebit_layout(num_params, world_size).segment


def _summary(counts: PlanCounts, *, steps: int, num_params: int, world_size: int, allreduce_bits: int, bandwidth_bytes_per_s: float, latency_s: float) -> dict:
    """Totals of one optimizer from its counts of full-precision and 1-bit allreduces."""
    n = world_size
    fp_bytes = ring_allreduce_bytes(num_params, allreduce_bits // 8, n)
    ob_bytes = onebit_call_bytes(num_params, n)
    messages = 2 * (n - 1)  # per ring allreduce, and per 1-bit call (two passes of n-1)
    fp_time = messages * latency_s + fp_bytes / bandwidth_bytes_per_s if n > 1 else 0.0
    ob_time = messages * latency_s + ob_bytes / bandwidth_bytes_per_s if n > 1 else 0.0
    fp, ob = counts.fp_allreduces, counts.onebit_allreduces
    return {
        "steps": steps,
        "bits_per_param": (fp * allreduce_bits + ob) / steps if steps else 0.0,
        "rounds": counts.rounds,
        "syncs": counts.syncs,
        "variance_updates": counts.variance_updates,
        "fp_allreduces": fp,
        "onebit_allreduces": ob,
        "collective_calls": fp + 2 * ob if n > 1 else 0,
        "bytes_per_rank": fp * fp_bytes + ob * ob_bytes,
        "comm_time_s": fp * fp_time + ob * ob_time,
        **counts.extra,
        **({"warning": counts.warning} if counts.warning else {}),
    }


def plan(
    steps: int,
    lr_schedule: LRSchedule,
    world_size: int,
    num_params: int,
    *,
    allreduce_bits: int = 32,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    betas: tuple[float, float] = (0.9, 0.999),
    **knobs,
) -> dict[str, dict]:
    """Per registered optimizer name, the run's communication totals.

    Each value holds bits_per_param (nominal, averaged over steps), rounds, syncs, variance_updates
    (|T_v|), fp_allreduces, onebit_allreduces, collective_calls, bytes_per_rank and comm_time_s, and
    whatever its registry entry adds (zero_one_adam: variance_update_bound, the paper's
    log(1-b1)/log(b2), and max_interval). `knobs` are optimizer knobs by name, as in a recipe's
    optimizer section; each optimizer takes its own, and the library's defaults stand for the rest."""
    _check(steps >= 0, f"steps must be >= 0, got {steps}.")
    _check(world_size >= 1, f"world size must be at least 1, got {world_size}.")
    _check(num_params >= 1, f"the number of parameters must be at least 1, got {num_params}.")
    _check(allreduce_bits in ALLREDUCE_BITS, f"allreduce bits must be 16 or 32, got {allreduce_bits}.")
    _check(bandwidth_bytes_per_s > 0 and math.isfinite(bandwidth_bytes_per_s), f"bandwidth must be a positive number of bytes/s, got {bandwidth_bytes_per_s}.")
    _check(latency_s >= 0 and math.isfinite(latency_s), f"latency must be a non-negative number of seconds, got {latency_s}.")
    unknown = set(knobs) - {f.name for f in registry.knob_fields()}
    _check(not unknown, f"no optimizer has the knob {', '.join(sorted(unknown))}.")
    for spec in map(registry.get, registry.names()):
        for name, check in spec.checks.items():
            problem = name in knobs and check(knobs[name])
            _check(not problem, f"{name} {problem}, got {knobs.get(name)}.")
    result = {}
    for name in registry.names():
        spec = registry.get(name)
        context = PlanContext(steps, lr_schedule, world_size, num_params, allreduce_bits, betas, spec.knobs_from(knobs))
        result[name] = _summary(
            spec.plan(context),
            steps=steps,
            num_params=num_params,
            world_size=world_size,
            allreduce_bits=allreduce_bits,
            bandwidth_bytes_per_s=bandwidth_bytes_per_s,
            latency_s=latency_s,
        )
    return result


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


_QUANTITY = re.compile(r"^\s*((?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([^\s/]*)\s*(/s)?\s*$")
# Decimal units, as network bandwidth is quoted; "bit" units are divided by 8.
_BANDWIDTH_UNITS = {
    "": 1.0, "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9,
    "bit": 1 / 8, "Kbit": 1e3 / 8, "Mbit": 1e6 / 8, "Gbit": 1e9 / 8,
}  # fmt: skip
_LATENCY_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str | float) -> float:
    """Bandwidth per rank in bytes/s from e.g. "10Gbit", "100 Mbit/s", "1.25GB/s" or "5e8" (bytes/s).

    Units are decimal and case-sensitive in B vs bit ("Gb" is refused as ambiguous)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, scale = float(text), 1.0
    else:
        match = _QUANTITY.match(str(text))
        unit = match.group(2) if match else None
        if unit is not None and unit.lower().endswith("bit"):
            unit = {u.lower(): u for u in _BANDWIDTH_UNITS}.get(unit.lower(), unit)
        if match is None or unit not in _BANDWIDTH_UNITS:
            raise UserError(
                f"bandwidth {text!r} is not understood: expected a positive number with an optional unit "
                "Gbit, Mbit, GB or MB (optionally followed by /s), e.g. 10Gbit or 1.25GB/s, plain numbers being bytes/s."
            )
        value, scale = float(match.group(1)), _BANDWIDTH_UNITS[unit]
    if not (value > 0 and math.isfinite(value)):
        raise UserError(f"bandwidth {text!r} must be a positive finite amount, e.g. 10Gbit.")
    return value * scale


def parse_latency(text: str | float) -> float:
    """Per-message latency in seconds from e.g. "20us", "5 ms", "800ns", "0.001s" or "0.001" (seconds)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, scale = float(text), 1.0
    else:
        match = _QUANTITY.match(str(text))
        if match is None or match.group(3) or match.group(2) not in _LATENCY_UNITS:
            raise UserError(
                f"latency {text!r} is not understood: expected a non-negative number with a unit ns, us, ms or s, e.g. 20us, plain numbers being seconds."
            )
        value, scale = float(match.group(1)), _LATENCY_UNITS[match.group(2)]
    if not (value >= 0 and math.isfinite(value)):
        raise UserError(f"latency {text!r} must be a non-negative finite time, e.g. 20us.")
    return value * scale


def format_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    if s >= 1 or s == 0:
        return f"{s:.2f} s"
    return f"{s * 1e3:.3f} ms"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.3f}x" if base else "-"


def format_plan(result: dict[str, dict]) -> Table:
    """The optimizers side by side, with ratios against Adam, for the CLI to print."""
    names = [name for name in registry.names() if name in result]
    title = f"Communication plan, {result[names[0]]['steps']:,} steps"
    notes = [spec.plan_note(result[spec.name]) for spec in map(registry.get, names) if spec.plan_note is not None]
    caption = "; ".join(notes) or None
    base = result.get(registry.BASELINE)
    rows = [
        ("|T_v| (variance updates)", lambda r: f"{r['variance_updates']:,}"),
        ("rounds", lambda r: f"{r['rounds']:,}"),
        ("syncs", lambda r: f"{r['syncs']:,}"),
        ("bits / param / step", lambda r: f"{r['bits_per_param']:.3f}"),
        ("bytes / rank", lambda r: format_bytes(r["bytes_per_rank"])),
        ("predicted comm time", lambda r: _seconds(r["comm_time_s"])),
    ]
    if base:
        rows += [
            ("rounds vs Adam", lambda r: _ratio(r["rounds"], base["rounds"])),
            ("bits vs Adam", lambda r: _ratio(r["bits_per_param"], base["bits_per_param"])),
            ("bytes vs Adam", lambda r: _ratio(r["bytes_per_rank"], base["bytes_per_rank"])),
            ("comm time vs Adam", lambda r: _ratio(r["comm_time_s"], base["comm_time_s"])),
        ]
    return optimizer_table(title, caption, [(name, result[name]) for name in names], rows)


def optimizer_table(title: str, caption: str | None, columns: list[tuple], lines: list[tuple[str, Callable[[dict], str]]]) -> Table:
    """Optimizers side by side: one column per (optimizer name, its record[, its sync topology]), one
    row per (label, cell formatter)."""
    table = Table(title=title, caption=caption)
    table.add_column("")
    for name, _, *topology in columns:
        variant = f" ({topology[0]})" if topology and topology[0] else ""
        table.add_column(registry.get(name).title + variant, justify="right")
    for label, cell in lines:
        table.add_row(label, *(cell(record) for _, record, *_ in columns))
    return table

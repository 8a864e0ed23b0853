"""Communication plan: what Adam, 1-bit Adam and 0/1 Adam would send over a whole run, without running it.

The counts follow docs/algorithm.md "Counting" and the optimizers' own ledgers, so a plan can be
checked against a real run:
  adam          one full-precision allreduce every step (allreduce_bits each), |T_v| = steps
  onebit_adam   full precision for t < freeze_step, then one 1-bit allreduce per step; |T_v| = min(freeze_step, steps)
  zero_one_adam driven by the same ZeroOneSchedule as ZeroOneAdam: a variance step is one full-precision
                allreduce (it is itself the sync), any other sync step one 1-bit allreduce, all else local
Every optimizer's parameters are treated as one flat buffer (the optimizers send one buffer per
param group, so a multi-group model pays a little more padding and latency than planned).

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
from collections.abc import Callable, Iterator

from rich.table import Table

from zoa_train.comm.collectives import ring_allreduce_bytes
from zoa_train.comm.onebit import onebit_layout
from zoa_train.errors import UserError
from zoa_train.optim.lr_schedules import LRSchedule
from zoa_train.optim.schedules import StepDecision, ZeroOneSchedule, variance_update_bound

OPTIMIZERS = ("adam", "onebit_adam", "zero_one_adam")
TITLES = {"adam": "Adam", "onebit_adam": "1-bit Adam", "zero_one_adam": "0/1 Adam"}
ALLREDUCE_BITS = (16, 32)

# What a 0/1 Adam step sends.
FULL_PRECISION = "full_precision"
ONE_BIT = "one_bit"
LOCAL = "local"


def step_kind(decision: StepDecision) -> str:
    """FULL_PRECISION for a variance step (the full-precision gradient average is the sync, no
    1-bit round), ONE_BIT for any other sync, LOCAL otherwise: ZeroOneAdam._step's branches."""
    if decision.variance_update:
        return FULL_PRECISION
    return ONE_BIT if decision.sync else LOCAL


def zero_one_step_kinds(steps: int, lr_schedule: LRSchedule, **schedule_knobs) -> Iterator[tuple[StepDecision, str]]:
    """(decision, step_kind) for each of the first `steps` 0/1 Adam steps.

    Drives a fresh ZeroOneSchedule with lr_schedule(t), exactly what ZeroOneAdam does when its
    group lr follows the schedule, so plan and optimizer cannot disagree on the schedule.
    `schedule_knobs` are ZeroOneSchedule's keyword arguments (its defaults are the optimizer's)."""
    schedule = ZeroOneSchedule(**schedule_knobs)
    advance = schedule.advance
    for t in range(steps):
        decision = advance(lr_schedule(t))
        yield decision, step_kind(decision)


def onebit_call_bytes(num_params: int, world_size: int) -> int:
    """Bytes one rank sends in one OneBitAllReduce call: 2(n-1) segments (signs and row scales)."""
    return 2 * (world_size - 1) * onebit_layout(num_params, world_size).segment


def _summary(
    *,
    steps: int,
    num_params: int,
    world_size: int,
    allreduce_bits: int,
    fp_allreduces: int,
    onebit_allreduces: int,
    rounds: int,
    syncs: int,
    variance_updates: int,
    bandwidth_bytes_per_s: float,
    latency_s: float,
) -> dict:
    """Totals of one optimizer from its counts of full-precision and 1-bit allreduces."""
    n = world_size
    fp_bytes = ring_allreduce_bytes(num_params, allreduce_bits // 8, n)
    ob_bytes = onebit_call_bytes(num_params, n)
    messages = 2 * (n - 1)  # per ring allreduce, and per 1-bit call (two passes of n-1)
    fp_time = messages * latency_s + fp_bytes / bandwidth_bytes_per_s if n > 1 else 0.0
    ob_time = messages * latency_s + ob_bytes / bandwidth_bytes_per_s if n > 1 else 0.0
    nominal_bits = fp_allreduces * allreduce_bits + onebit_allreduces
    return {
        "steps": steps,
        "bits_per_param": nominal_bits / steps if steps else 0.0,
        "rounds": rounds,
        "syncs": syncs,
        "variance_updates": variance_updates,
        "fp_allreduces": fp_allreduces,
        "onebit_allreduces": onebit_allreduces,
        "collective_calls": fp_allreduces + 2 * onebit_allreduces if n > 1 else 0,
        "bytes_per_rank": fp_allreduces * fp_bytes + onebit_allreduces * ob_bytes,
        "comm_time_s": fp_allreduces * fp_time + onebit_allreduces * ob_time,
    }


def plan(
    steps: int,
    lr_schedule: LRSchedule,
    world_size: int,
    num_params: int,
    *,
    freeze_step: int = 100_000,
    allreduce_bits: int = 32,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    betas: tuple[float, float] = (0.9, 0.999),
    **schedule_knobs,
) -> dict[str, dict]:
    """Per optimizer name ("adam", "onebit_adam", "zero_one_adam"), the run's communication totals.

    Each value holds bits_per_param (nominal, averaged over steps), rounds, syncs, variance_updates
    (|T_v|), fp_allreduces, onebit_allreduces, collective_calls, bytes_per_rank and comm_time_s;
    zero_one_adam adds variance_update_bound (the paper's log(1-b1)/log(b2)) and max_interval.
    Defaults of the schedule knobs are those of ZeroOneAdam and OneBitAdam."""
    _check(steps >= 0, f"steps must be >= 0, got {steps}.")
    _check(world_size >= 1, f"world size must be at least 1, got {world_size}.")
    _check(num_params >= 1, f"the number of parameters must be at least 1, got {num_params}.")
    _check(freeze_step >= 0, f"freeze_step must be >= 0, got {freeze_step}.")
    _check(allreduce_bits in ALLREDUCE_BITS, f"allreduce bits must be 16 or 32, got {allreduce_bits}.")
    _check(bandwidth_bytes_per_s > 0 and math.isfinite(bandwidth_bytes_per_s), f"bandwidth must be a positive number of bytes/s, got {bandwidth_bytes_per_s}.")
    _check(latency_s >= 0 and math.isfinite(latency_s), f"latency must be a non-negative number of seconds, got {latency_s}.")
    common = dict(
        steps=steps,
        num_params=num_params,
        world_size=world_size,
        allreduce_bits=allreduce_bits,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        latency_s=latency_s,
    )
    result = {
        "adam": _summary(fp_allreduces=steps, onebit_allreduces=0, rounds=steps, syncs=steps, variance_updates=steps, **common)
    }
    warmup = min(freeze_step, steps)
    result["onebit_adam"] = _summary(
        fp_allreduces=warmup, onebit_allreduces=steps - warmup, rounds=steps, syncs=steps, variance_updates=warmup, **common
    )

    kinds = {FULL_PRECISION: 0, ONE_BIT: 0, LOCAL: 0}
    max_interval = 0
    try:
        decisions = zero_one_step_kinds(steps, lr_schedule, **schedule_knobs)
        for decision, kind in decisions:
            kinds[kind] += 1
            if decision.interval > max_interval:
                max_interval = decision.interval
    except ValueError as e:  # the schedule's own validation of its knobs
        raise UserError(f"{e}.") from e
    synced = kinds[FULL_PRECISION] + kinds[ONE_BIT]
    result["zero_one_adam"] = _summary(
        fp_allreduces=kinds[FULL_PRECISION],
        onebit_allreduces=kinds[ONE_BIT],
        rounds=synced,
        syncs=synced,
        variance_updates=kinds[FULL_PRECISION],
        **common,
    )
    result["zero_one_adam"]["variance_update_bound"] = variance_update_bound(*betas)
    result["zero_one_adam"]["max_interval"] = max_interval
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
                f"latency {text!r} is not understood: expected a non-negative number with a unit ns, us, ms or s, "
                "e.g. 20us, plain numbers being seconds."
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
    """The three optimizers side by side, with ratios against Adam, for the CLI to print."""
    names = [name for name in OPTIMIZERS if name in result]
    zoa = result.get("zero_one_adam", {})
    title = f"Communication plan, {result[names[0]]['steps']:,} steps"
    caption = None
    if zoa:
        caption = (
            f"0/1 Adam: |T_v| {zoa['variance_updates']:,} (bound log(1-b1)/log(b2) = {zoa['variance_update_bound']:,.0f}), "
            f"largest sync interval {zoa['max_interval']}"
        )
    base = result.get("adam")
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


def optimizer_table(title: str, caption: str | None, columns: list[tuple[str, dict]], lines: list[tuple[str, Callable[[dict], str]]]) -> Table:
    """Optimizers side by side: one column per (optimizer name, its record), one row per (label, cell formatter)."""
    table = Table(title=title, caption=caption)
    table.add_column("")
    for name, _ in columns:
        table.add_column(TITLES[name], justify="right")
    for label, cell in lines:
        table.add_row(label, *(cell(record) for _, record in columns))
    return table

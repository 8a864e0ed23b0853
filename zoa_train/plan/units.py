"""Quantities as `plan` and `bench` read and print them: bandwidths, latencies and memory sizes from
text ("100Gbit/s", "5us", "80GB"), bytes in words."""

import math
import re

from zoa_train.errors import UserError

_QUANTITY = re.compile(r"^\s*((?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([^\s/]*)\s*(/s)?\s*$")
# Decimal units, as network bandwidth is quoted; "bit" units are divided by 8.
_BANDWIDTH_UNITS = {
    "": 1.0, "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "bit": 1 / 8, "Kbit": 1e3 / 8, "Mbit": 1e6 / 8, "Gbit": 1e9 / 8, "Tbit": 1e12 / 8,
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
                "Tbit, Gbit, Mbit, TB, GB or MB (optionally followed by /s), e.g. 10Gbit or 1.25GB/s, plain numbers being bytes/s."
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


_MEMORY_UNITS = {"": 1, "B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_memory(text: str | float) -> float:
    """Bytes of memory from e.g. "80GB", "141 GB", "80GiB" or "8e10" (bytes); GB is 1e9 bytes, GiB 2^30."""
    match = _QUANTITY.match(str(text))
    if match is None or match.group(3) or match.group(2) not in _MEMORY_UNITS:
        raise UserError(
            f"GPU memory {text!r} is not understood: expected a positive amount with a unit GB, GiB, TB or MB, e.g. 80GB, plain numbers being bytes."
        )
    value = float(match.group(1)) * _MEMORY_UNITS[match.group(2)]
    if not (value > 0 and math.isfinite(value)):
        raise UserError(f"GPU memory {text!r} must be a positive finite amount, e.g. 80GB.")
    return value


def format_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"

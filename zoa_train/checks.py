"""Constraints on recipe values, each a function that returns None for a good value, else what is
expected of it ("must be positive"); the recipe schema's table of them is in zoa_train/config.py,
and each optimizer's registry entry names those of its own knobs. Floats are also refused when they
are NaN or infinite, for every key, where the schema reads them."""

from collections.abc import Callable

from zoa_train.errors import UserError

Check = Callable[[object], str | None]


def refusal(origin: str, key: str, problem: str, value) -> UserError:
    """The one sentence that refuses `value` of `key`, which failed its check with `problem`."""
    return UserError(f"{origin}: {key} {problem}, not {list(value) if isinstance(value, tuple) else value}.")


def positive(value) -> str | None:
    return None if value > 0 else "must be positive"


def non_negative(value) -> str | None:
    return None if value >= 0 else "must be >= 0"


def positive_or_null(value) -> str | None:
    return None if value is None or value > 0 else "must be positive or null"


def from_to(low: int, high: int) -> Check:
    """An integer from `low` to `high`, both included: "must be from 1 to 1,000,000,000"."""
    return lambda value: None if low <= value <= high else f"must be from {low:,} to {high:,}"


def unset_or(check: Check) -> Check:
    """`check`, for a value that may also be null (not set)."""
    return lambda value: None if value is None else check(value)


def within(low: float, high: float, low_open: bool = False, high_open: bool = True) -> Check:
    """A value in an interval, [low, high) by default: "must be in [0, 1)"."""
    text = f"must be in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def check(value) -> str | None:
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        return None if above and below else text

    return check


def each(check: Check) -> Check:
    """`check` on every item of a list or tuple: "must each be in [0, 1)"."""

    def check_items(values) -> str | None:
        problems = [check(v) for v in values]
        first = next((p for p in problems if p), None)
        return first.replace("must be", "must each be", 1) if first else None

    return check_items


FRACTION = within(0, 1)  # [0, 1): a probability that must leave something (dropout), a decay rate (betas)

"""Constraints on recipe values, each a function that returns None for a good value, else what is
expected of it ("must be positive"); the recipe schema's table of them is in zoa_train/config.py,
and each optimizer's registry entry names those of its own knobs."""

from collections.abc import Callable

Check = Callable[[object], str | None]


def positive(value) -> str | None:
    return None if value > 0 else "must be positive"


def non_negative(value) -> str | None:
    return None if value >= 0 else "must be >= 0"


def positive_or_null(value) -> str | None:
    return None if value is None or value > 0 else "must be positive or null"


def unset_or(check: Check) -> Check:
    """`check`, for a value that may also be null (not set)."""
    return lambda value: None if value is None else check(value)

"""Registry: a table of named entries that a recipe chooses from (optimizers, model families, ...).

The machinery only; each table keeps its spec class and built-in entries in its own module
(zoa_train/optim/registry.py, zoa_train/models/registry.py). An entry is any object whose name is its
attribute `key`. Entries may carry `knobs`, a dataclass of their own recipe keys: every entry's knobs
join one recipe section, so a knob two entries share must mean the same (type and default), and none
may be one of the section's keys for every entry (`reserved`).

    OPTIMIZERS = Registry("optimizer", reserved=("name", "lr"))
    OPTIMIZERS.register(spec)      # ValueError/TypeError for a clash: a programming error
    OPTIMIZERS.get("adam")         # UserError of one sentence for an unknown name: a user's error
    OPTIMIZERS.find("adam")        # or None
    OPTIMIZERS.names()             # in registration order
"""

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from zoa_train.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, what: str, *, key: str = "name", unknown: str | None = None, reserved: Iterable[str] = ()):
        self.what = what  # in messages: "optimizer", "model family"
        self.member = what.split()[-1]  # "every family has ..."
        self.unknown = unknown or what  # the user's word for a name: "unknown model kind 'x'"
        self.key = key
        self.reserved = tuple(reserved)
        self._entries: dict[str, T] = {}

    def register(self, entry: T) -> T:
        """Add `entry` (registering the same object twice is harmless); a clash of names or knobs is refused."""
        name = getattr(entry, self.key)
        if self._entries.get(name, entry) is not entry:
            article = "an" if self.what[0] in "aeiou" else "a"
            raise ValueError(f"{article} {self.what} named {name!r} is registered already")
        knobs = getattr(entry, "knobs", None)
        if knobs is not None:
            self._check_knobs(name, knobs)
        self._entries[name] = entry
        return entry

    def _check_knobs(self, name: str, knobs: type) -> None:
        if not dataclasses.is_dataclass(knobs):
            raise TypeError(f"the knobs of {self.what} {name!r} must be a dataclass")
        known = {f.name: (f.type, f.default) for f in self.knob_fields()}
        for f in dataclasses.fields(knobs):
            if f.name in (self.key, *self.reserved):
                raise ValueError(f"{self.what} {name!r}: its knob {f.name} is a key every {self.member} has already")
            if f.name in known and known[f.name] != (f.type, f.default):
                raise ValueError(f"{self.what} {name!r}: knob {f.name} has another type or default than another {self.member}'s")

    def names(self) -> tuple[str, ...]:
        """The registered names, in the order they were registered."""
        return tuple(self._entries)

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise UserError(f"unknown {self.unknown} {name!r}; the registered ones are {', '.join(self._entries)}.") from None

    def find(self, name: str) -> T | None:
        """The entry `name`, or None (e.g. a run of an entry whose module this process has not imported)."""
        return self._entries.get(name)

    def values(self) -> list[T]:
        return list(self._entries.values())

    def __iter__(self) -> Iterator[T]:
        return iter(self.values())

    def knob_fields(self) -> list[dataclasses.Field]:
        """Every entry's own knobs, each once, in registration order."""
        seen: dict[str, dataclasses.Field] = {}
        for entry in self._entries.values():
            if getattr(entry, "knobs", None) is not None:
                for f in dataclasses.fields(entry.knobs):
                    seen.setdefault(f.name, f)
        return list(seen.values())

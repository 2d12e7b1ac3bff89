"""One registry type for everything chosen by name: methods, models, datasets, layouts.

A `Registry` maps names to entries and refuses a second entry under a name it holds
(a silent overwrite would make the first registration dead code that still reads as
live). `lookup` raises `ConfigError` naming the registered names, so a misspelt name in a
config fails with the list to choose from.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Generic, Iterator, Mapping, TypeVar

from cdpjax.errors import ConfigError

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Name -> entry, for one kind of thing (`kind` words the error messages)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered ({self._entries[name]!r}); "
                             f"choose another name")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`: `@REGISTRY.register("name")`."""
        return lambda entry: self.add(name, entry)

    def remove(self, name: str) -> T:
        return self._entries.pop(name)

    @contextlib.contextmanager
    def temporarily(self, name: str, entry: T):
        """`name` registered for the duration of a `with` block (tests, notebooks)."""
        self.add(name, entry)
        try:
            yield entry
        finally:
            self._entries.pop(name, None)

    def lookup(self, name: str) -> T:
        """The entry of `name`, or a ConfigError listing the registered names."""
        if name not in self._entries:
            raise ConfigError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._entries))}")
        return self._entries[name]

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


__all__ = ["Registry"]

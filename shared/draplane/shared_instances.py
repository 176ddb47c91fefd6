"""One object for values that compare equal, so that what a process holds many times over (the
same GPU model's attributes on every node, the same adminAccess result in many reservations) is
held once. Only for values nothing changes once made: the instance handed out is everybody's.

Bounded: when full, the table is emptied. That only ends the sharing of what was in it (whoever
holds those objects keeps them), so a stream of unique values costs at most `limit` entries.
Pure, no I/O."""

from __future__ import annotations

from collections.abc import Callable, Hashable


class SharedInstances:
    __slots__ = ("limit", "_instances")

    def __init__(self, limit: int):
        self.limit = limit
        self._instances: dict = {}

    def __len__(self) -> int:
        return len(self._instances)

    def get(self, key: Hashable, make: Callable[[Hashable], object] | None = None):
        """The one instance for `key`: made by `make(key)` the first time (`key` itself without it)."""
        found = self._instances.get(key)
        if found is None:
            if len(self._instances) >= self.limit:
                self._instances.clear()
            found = self._instances[key] = key if make is None else make(key)
        return found

"""How scarce a device is: which DeviceClasses can use it, and how few devices serve them.

A generic GPU request can take any GPU, but the cluster's classes say that some GPUs are wanted by
requests that cannot go elsewhere: `high-memory-gpu` matches only the H100s, `mig.nvidia.com`
only the GPUs that can be partitioned. Taking an H100 for a request an L4 would serve leaves the
next high-memory request waiting. So the `draplane` policy counts, for each device a placement
newly takes, what it is worth to the classes that could use it (`DraplanePolicy.SCARCITY_WEIGHT`).

The unit is the physical device: a device that consumes counters belongs to the counter set it
draws from (a GPU, whose whole device and MIG partitions are one unit), any other device is its own
unit. For each class, `share` is the fraction of the units its kind of device spans that have a
device the class matches: the units reached by the classes that share a unit with it, or with one
that does (the GPU classes among themselves, a NIC class among the NIC classes). A class for
another kind of device is no competitor: counting the NICs into the GPU classes' units made every
GPU look scarce to the generic GPU class, and the NICs scarce to their own. A unit's scarcity is

    1 - product of the shares of the classes that can use it

between 0 (only classes that can use every unit, or none) and 1: one class that reaches few units,
or many classes, make it high. A class that matches every unit carries no information and
changes nothing, so a cluster with one generic class scores as before.

Shares are rounded to 1/32 so that a cluster that grows or shrinks in the same mix keeps its scores
(`version` changes only when a rounded share does, and the allocator's caches are then rebuilt).
The counts are kept per slice and updated when slices change, so a refresh costs one pass over the
slices, not over the devices.
"""

from __future__ import annotations

from typing import Iterable

from draplane.api.resource import DeviceClass

SHARE_STEPS = 32

Unit = tuple  # (driver, pool, counter set) for a device that consumes counters, else its DeviceID


def unit_of(record) -> Unit:
    """The physical device a device record is a view of (see the module's doc)."""
    if record.consumes:
        return (record.driver, record.pool, record.consumes[0][0])
    return record.id


class DeviceScarcity:
    def __init__(self, inventory, matcher) -> None:
        self._inventory = inventory
        self._matcher = matcher
        self._class_selectors: list[tuple[str, tuple[str, ...]]] = []  # (class, its CEL expressions)
        self._classes_changed = True
        self._seen_changes = -1
        # slice name -> (the entry counted, [(unit, indexes of the classes its device matches)])
        self._counted: dict[str, tuple[object, list[tuple[Unit, tuple[int, ...]]]]] = {}
        self._unit_counts: dict[Unit, dict[int, int]] = {}  # unit -> class index -> devices matching
        self._reaching: list[int] = []  # class index -> units it reaches
        # the classes a unit's devices match, as a sorted tuple -> units matched by exactly those
        self._units_by_classes: dict[tuple[int, ...], int] = {}
        self._shares: tuple[int, ...] = ()  # class index -> rounded share, in 1/SHARE_STEPS
        self._values: dict[Unit, float] = {}
        self.version = 0

    def set_classes(self, classes: Iterable[DeviceClass]) -> None:
        selectors = []
        for device_class in classes:
            expressions = tuple(s.cel.expression for s in (device_class.spec.selectors or []) if s.cel is not None)
            selectors.append((device_class.metadata.name or "", expressions))
        selectors.sort()
        if selectors != self._class_selectors:
            self._class_selectors = selectors
            self._classes_changed = True

    def of(self, record) -> float:
        """The scarcity of the unit this device belongs to, 0 to 1."""
        self.refresh()
        unit = unit_of(record)
        value = self._values.get(unit)
        if value is None:
            value = 1.0
            counts = self._unit_counts.get(unit)
            if counts:
                for index in counts:
                    value *= self._shares[index] / SHARE_STEPS
            value = self._values[unit] = 1.0 - value if counts else 0.0
        return value

    def refresh(self) -> None:
        """Count the slices that changed since the last call; a new `version` when shares moved."""
        if self._seen_changes == self._inventory.changes and not self._classes_changed:
            return
        if self._classes_changed:
            self._counted.clear()
            self._unit_counts.clear()
            self._reaching = [0] * len(self._class_selectors)
            self._units_by_classes.clear()
            self._classes_changed = False
        self._seen_changes = self._inventory.changes
        entries = self._inventory.slice_entries()
        for name in [n for n in self._counted if n not in entries]:
            self._uncount(self._counted.pop(name)[1])
        for name, entry in entries.items():
            counted = self._counted.get(name)
            if counted is not None and counted[0] is entry:
                continue
            if counted is not None:
                self._uncount(counted[1])
            devices = [(unit_of(r), self._matching(r)) for r in entry.devices]
            self._count(devices)
            self._counted[name] = (entry, devices)
        spans = self._spans()
        shares = tuple(0 if not reached else max(1, round(SHARE_STEPS * reached / spans[index]))
                       for index, reached in enumerate(self._reaching))
        if shares != self._shares:
            self._shares = shares
            self._values.clear()
            self.version += 1

    def _spans(self) -> list[int]:
        """Class index -> the units reached by the classes connected to it through shared units
        (its own kind of device). A few distinct class sets, whatever the number of units."""
        group = list(range(len(self._class_selectors)))

        def root(index: int) -> int:
            while group[index] != index:
                group[index] = group[group[index]]
                index = group[index]
            return index

        for classes in self._units_by_classes:
            first = root(classes[0])
            for other in classes[1:]:
                group[root(other)] = first
        units: dict[int, int] = {}
        for classes, count in self._units_by_classes.items():
            units[root(classes[0])] = units.get(root(classes[0]), 0) + count
        return [units.get(root(index), 0) for index in range(len(group))]

    def _regroup(self, before: tuple[int, ...], after: tuple[int, ...]) -> None:
        """A unit's class set went from `before` to `after` (either may be empty)."""
        if before == after:
            return
        if before:
            left = self._units_by_classes[before] - 1
            if left:
                self._units_by_classes[before] = left
            else:
                del self._units_by_classes[before]
        if after:
            self._units_by_classes[after] = self._units_by_classes.get(after, 0) + 1

    def _matching(self, record) -> tuple[int, ...]:
        evaluate = self._matcher.evaluate
        matching = []
        for index, (_, expressions) in enumerate(self._class_selectors):
            try:
                if all(evaluate(e, record) is True for e in expressions):
                    matching.append(index)
            except Exception:  # a class whose CEL does not compile: requests for it get the error
                continue
        return tuple(matching)

    def _count(self, devices) -> None:
        for unit, matching in devices:
            if not matching:
                continue
            counts = self._unit_counts.get(unit)
            if counts is None:
                counts = self._unit_counts[unit] = {}
            before = tuple(sorted(counts))
            for index in matching:
                if index not in counts:
                    self._reaching[index] += 1
                    counts[index] = 0
                counts[index] += 1
            self._regroup(before, tuple(sorted(counts)))
            self._values.pop(unit, None)

    def _uncount(self, devices) -> None:
        for unit, matching in devices:
            counts = self._unit_counts.get(unit)
            if counts is None:
                continue
            before = tuple(sorted(counts))
            for index in matching:
                counts[index] -= 1
                if not counts[index]:
                    del counts[index]
                    self._reaching[index] -= 1
            self._regroup(before, tuple(sorted(counts)))
            if not counts:
                del self._unit_counts[unit]
            self._values.pop(unit, None)

    def describe(self) -> dict[str, float]:
        """Each class's share of the units of its kind, rounded as scores use it (for logs and tests)."""
        self.refresh()
        return {name: self._shares[i] / SHARE_STEPS for i, (name, _) in enumerate(self._class_selectors)}

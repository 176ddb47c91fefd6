"""Per-seed arrival sequences and the allocation curve, measured as the FGD paper measures them.

The procedure (from the simulator that produced the published figures, as the data's SOURCE.md
describes it): sort the pod list by name, shuffle it with the seed, then tune it to `inflate` x the
cluster's GPU capacity — drop random pods while demand is above that, or append random copies while
the next copy still fits under it. Pods arrive in that order and never leave.

The curve: after each pod, arrived and allocated GPU milli are known; the point at x% is the mean
allocated share over the pods at which arrived demand was x% of capacity (floored).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Sequence

from draplane.simulation.trace import TracePod


def arrival_sequence(pods: Sequence[TracePod], capacity_milli: int, seed: int, inflate: float) -> list[TracePod]:
    """The seed's pods in arrival order, their GPU demand tuned to `inflate` x capacity."""
    if not pods:
        return []
    rng = random.Random(seed)
    ordered = sorted(pods, key=lambda p: p.name)
    rng.shuffle(ordered)
    target = inflate * capacity_milli
    demand = sum(p.gpu_demand_milli for p in ordered)
    if demand > target:
        while demand > target and ordered:
            demand -= ordered.pop(rng.randrange(len(ordered))).gpu_demand_milli
        return ordered
    originals = list(ordered)
    if not any(p.gpu_demand_milli for p in originals):
        return ordered  # no GPU demand to tune
    copies = 0
    while True:
        pick = originals[rng.randrange(len(originals))]
        if demand + pick.gpu_demand_milli > target:
            break
        copies += 1
        ordered.append(replace(pick, name=f"{pick.name}-copy{copies}"))
        demand += pick.gpu_demand_milli
    return ordered


@dataclass(slots=True)
class AllocationCurve:
    """Mean allocated share per whole percent of arrived demand."""

    capacity_milli: int
    _sums: dict[int, float]
    _counts: dict[int, int]

    @classmethod
    def empty(cls, capacity_milli: int) -> "AllocationCurve":
        return cls(capacity_milli, {}, {})

    def record(self, arrived_milli: int, allocated_milli: int) -> None:
        bucket = arrived_milli * 100 // self.capacity_milli
        self._sums[bucket] = self._sums.get(bucket, 0.0) + 100.0 * allocated_milli / self.capacity_milli
        self._counts[bucket] = self._counts.get(bucket, 0) + 1

    def points(self) -> list[tuple[int, float]]:
        """(arrived %, mean allocated %) in increasing arrived %."""
        return [(b, self._sums[b] / self._counts[b]) for b in sorted(self._sums)]

    def final_allocated_pct(self) -> float:
        points = self.points()
        return points[-1][1] if points else 0.0

"""The inventory service's counters, rendered in the Prometheus text format. Pure."""

from __future__ import annotations

import collections


class Metrics:
    """Counters with labels, rendered in the Prometheus text format."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, tuple[tuple[str, str], ...]]] = collections.Counter()

    def inc(self, name: str, amount: int = 1, **labels: str) -> None:
        self.counts[(name, tuple(sorted(labels.items())))] += amount

    def get(self, name: str, **labels: str) -> int:
        return self.counts[(name, tuple(sorted(labels.items())))]

    def total(self, name: str) -> int:
        return sum(v for (n, _), v in self.counts.items() if n == name)

    def render(self) -> str:
        lines = []
        for (name, labels), value in sorted(self.counts.items()):
            label_text = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"draplane_inventory_{name}{{{label_text}}} {value}")
        return "\n".join(lines) + "\n"

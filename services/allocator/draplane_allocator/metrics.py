"""The allocator process's metrics: every shard it runs, told apart by the `shard` label.

Counters say what the shards did (placements, unschedulable answers, reservation conflicts, lease
lapses, errors); `draplane_allocator_placement_seconds` is how long a pod took from being fetched
to its placement being published, conflicts and retries included. Shard 0 also exports the
fragmentation gauge: every shard holds the same cluster, so one is enough, and the one shard every
deployment has is 0.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from draplane.metrics import ConsumerLag
from draplane.scheduling.placing import SchedulingState

log = logging.getLogger(__name__)

# From a batch's fetch to its placements being published: milliseconds when nothing contends,
# seconds when a node's reservation keeps losing races.
PLACEMENT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FRAGMENTED_DEVICES = "draplane_allocator_fragmented_devices"


class ShardMetrics:
    """One shard's children of the process' metrics."""

    __slots__ = ("placed", "republished", "unschedulable", "conflicts_on_write", "conflicts_in_view",
                 "lapses_released", "lapses_confirmed", "errors", "gone", "placement_seconds")

    def __init__(self, metrics: "AllocatorMetrics", shard: int):
        label = str(shard)
        self.placed = metrics.placements.labels(label)
        self.republished = metrics.republished.labels(label)
        self.unschedulable = metrics.unschedulable.labels(label)
        self.conflicts_on_write = metrics.conflicts.labels(label, "compare_and_set")
        self.conflicts_in_view = metrics.conflicts.labels(label, "stale_view")
        self.lapses_released = metrics.lease_lapses.labels(label, "released")
        self.lapses_confirmed = metrics.lease_lapses.labels(label, "confirmed")
        self.errors = metrics.errors.labels(label)
        self.gone = metrics.pods_gone.labels(label)
        self.placement_seconds = metrics.placement_seconds.labels(label)


class AllocatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.placements = Counter("draplane_allocator_placements", "Placements published for the binder",
                                  ["shard"], registry=r)
        self.republished = Counter("draplane_allocator_placements_republished",
                                   "Placements published again for claims already reserved (redeliveries)",
                                   ["shard"], registry=r)
        self.unschedulable = Counter("draplane_allocator_unschedulable",
                                     "Pods answered as unschedulable (the binder retries them with backoff, "
                                     "so one pod may count many times)", ["shard"], registry=r)
        self.conflicts = Counter("draplane_allocator_reservation_conflicts",
                                 "Reservations that lost to another writer of the node's entry: a "
                                 "compare-and-set write refused (kind=compare_and_set, one per node write), "
                                 "or a device found taken in the shard's view of the bucket (kind=stale_view)",
                                 ["shard", "kind"], registry=r)
        self.lease_lapses = Counter("draplane_allocator_lease_lapses",
                                    "Claim reservations whose lease ran out before the binder confirmed them, "
                                    "written out by this shard: released (the claim was never allocated) or "
                                    "confirmed (it was)", ["shard", "outcome"], registry=r)
        self.errors = Counter("draplane_allocator_errors", "Unexpected errors (logged, retried with backoff)",
                              ["shard"], registry=r)
        self.pods_gone = Counter("draplane_allocator_pods_gone", "Pending pods found deleted before placing",
                                 ["shard"], registry=r)
        self.placement_seconds = Histogram("draplane_allocator_placement_seconds",
                                           "From fetching a pending pod to publishing its placement",
                                           ["shard"], buckets=PLACEMENT_BUCKETS, registry=r)
        self.consumer_lag = ConsumerLag(r)
        self._fragmentation_of: SchedulingState | None = None

    def shard(self, index: int) -> ShardMetrics:
        return ShardMetrics(self, index)

    def export_fragmentation(self, state: SchedulingState) -> None:
        """Publish `state`'s fragmented devices per DeviceClass, computed at each scrape."""
        if self._fragmentation_of is None:
            self.registry.register(_FragmentationCollector(self))
        self._fragmentation_of = state

    def fragmentation_family(self) -> GaugeMetricFamily:
        family = GaugeMetricFamily(FRAGMENTED_DEVICES,
                                   "Partly used devices of the class whose free part no pending or allocated "
                                   "claim of the class could use (draplane.allocation.fragmented_devices)",
                                   labels=["device_class"])
        if self._fragmentation_of is not None:
            for name, count in sorted(self._fragmentation_of.fragmented_devices().items()):
                family.add_metric([name], count)
        return family


class _FragmentationCollector:
    def __init__(self, metrics: AllocatorMetrics):
        self.metrics = metrics

    def describe(self):
        return [GaugeMetricFamily(FRAGMENTED_DEVICES, "", labels=["device_class"])]

    def collect(self):
        yield self.metrics.fragmentation_family()

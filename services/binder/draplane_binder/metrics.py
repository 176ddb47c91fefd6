"""The binder's metrics: what it wrote to Kubernetes, and the claims still waiting.

Counters count the binder's own writes (bindings, allocations, PodScheduled=False conditions,
claims made from templates, releases); `draplane_binder_create_to_bound_seconds` is a pod's wait
from its creation (metadata.creationTimestamp, which has whole seconds) to its binding. The
gauges are read from the binder's caches at each scrape, for the pods it schedules:

- `draplane_binder_claims_pending`: claims of pending pods not allocated yet (a template's claim
  not made yet counts);
- `draplane_binder_claims_failed{reason}`: of those, the claims of pods whose last attempt failed,
  by why (draplane.scheduling.unschedulable.failure_label, or SchedulerError).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from draplane.metrics import ConsumerLag

# Seconds to minutes: a pod bound at once waits well under a second, one that waited for devices
# to be freed may wait for hours (the last bucket).
CREATE_TO_BOUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


def seconds_since(timestamp: str | None, now: datetime.datetime) -> float | None:
    """Seconds from an RFC 3339 timestamp as the apiserver writes it to `now`; None if unreadable."""
    if not timestamp:
        return None
    try:
        moment = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return max(0.0, (now - moment).total_seconds())


class BinderMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.pods_bound = Counter("draplane_binder_pods_bound", "Pods bound to a node (pods/binding created)",
                                  registry=r)
        self.claims_allocated = Counter("draplane_binder_claims_allocated",
                                        "Claims whose allocation the binder wrote (status.allocation)", registry=r)
        self.failures = Counter("draplane_binder_scheduling_failures",
                                "PodScheduled=False conditions written, by why (a pod counts again only "
                                "when the message changes)", ["reason"], registry=r)
        self.placements_abandoned = Counter("draplane_binder_placements_abandoned",
                                            "Placements not written (pod gone, claim taken, lease lapsed); their "
                                            "reservations are released and the pod is placed again", registry=r)
        self.lease_lapses = Counter("draplane_binder_lease_lapses",
                                    "Placements found with their reservation's lease run out before the binder "
                                    "wrote them", registry=r)
        self.claims_created = Counter("draplane_binder_claims_created", "Claims made from ResourceClaimTemplates",
                                      registry=r)
        self.claims_released = Counter("draplane_binder_claims_released",
                                       "Claims whose allocation went (deleted or deallocated): reservation freed",
                                       registry=r)
        self.preemption_evictions = Counter("draplane_binder_preemption_evictions",
                                            "Pods evicted so that a higher-priority pod fits", registry=r)
        self.pending_published = Counter("draplane_binder_pending_published", "PendingPods sent to the shards",
                                         registry=r)
        self.pending_publish_failures = Counter("draplane_binder_pending_publish_failures",
                                                "PendingPods JetStream did not take (retried)", registry=r)
        self.pending_withdrawn = Counter("draplane_binder_pending_withdrawn",
                                         "PendingPods deleted from a shard's queue: their pod went first",
                                         registry=r)
        self.errors = Counter("draplane_binder_errors", "Unexpected errors (logged, retried with backoff)",
                              registry=r)
        self.events_dropped = Counter("draplane_binder_events_dropped",
                                      "Scheduled Events not written: the queue of events to write was full",
                                      registry=r)
        self.double_allocations = Counter("draplane_binder_double_allocations",
                                          "Devices found allocated to two claims beyond what adminAccess and shares "
                                          "allow (another scheduler over the same slices); each pair counts once",
                                          registry=r)
        self.create_to_bound = Histogram("draplane_binder_create_to_bound_seconds",
                                         "From the pod's creationTimestamp to its binding",
                                         buckets=CREATE_TO_BOUND_BUCKETS, registry=r)
        self.consumer_lag = ConsumerLag(r)

    def export_claims(self, waiting: Callable[[], Iterable[tuple[int, str | None]]]) -> None:
        """`waiting()` yields, per pending pod, (its claims not allocated, why its last attempt
        failed or None); read at each scrape."""
        self.registry.register(_WaitingClaims(waiting))


class _WaitingClaims:
    def __init__(self, waiting):
        self.waiting = waiting

    def _families(self):
        pending = GaugeMetricFamily("draplane_binder_claims_pending",
                                    "Claims of pending pods not allocated yet")
        failed = GaugeMetricFamily("draplane_binder_claims_failed",
                                   "Claims of pending pods whose last attempt failed, by why", labels=["reason"])
        return pending, failed

    def describe(self):
        return list(self._families())

    def collect(self):
        pending, failed = self._families()
        total = 0
        by_reason: dict[str, int] = {}
        for claims, reason in self.waiting():
            total += claims
            if reason is not None and claims:
                by_reason[reason] = by_reason.get(reason, 0) + claims
        pending.add_metric([], total)
        for reason, count in sorted(by_reason.items()):
            failed.add_metric([reason], count)
        yield pending
        yield failed

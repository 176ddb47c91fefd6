"""What draplane-audit serves on /metrics: its own counters, and the cluster's DRA devices.

Everything lives in one CollectorRegistry of this process (never the global default one), so
tests can run several subscribers in one interpreter and each /metrics shows only its own.

The cluster metrics are computed from NATS alone (the inventory feed and the reservation bucket,
see draplane.device_view), so nobody needs to scrape every service to see the cluster:
- ``draplane_cluster_devices{device_class,node,state}``: devices by state (free, allocated,
  shared, tainted, blocked: counters used by other partitions);
- ``draplane_cluster_devices_free_whole{device_class,node}``: one-device claims that still fit;
- ``draplane_cluster_partitions_free{device_class,node,profile}``: MIG placements still possible;
- ``draplane_cluster_shared_capacity_{total,left}{device_class,node,capacity}``;
- ``draplane_cluster_claims_reserved`` and ``draplane_cluster_nodes_stale``;
- ``draplane_cluster_allocations_total{node}``, ``..._releases_total{node}``,
  ``..._rejections_total``, ``..._taints_total{kind}``: allocations over time, from the audit stream.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from draplane.allocation.free_capacity import FreeCapacity


class AuditMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.events = Counter("draplane_audit_events_total", "Audit events written to the log, by kind",
                              ["kind"], registry=registry)
        self.unreadable = Counter("draplane_audit_unreadable_total",
                                  "Messages on the audit stream that were not audit events (recorded, terminated)",
                                  registry=registry)
        self.duplicates = Counter("draplane_audit_duplicates_total",
                                  "Events not written again: redelivered, or published twice", ["why"], registry=registry)
        self.gaps = Counter("draplane_audit_sequence_gaps_total",
                            "Stream sequences gone before they were read (expired while the subscriber was down)",
                            registry=registry)
        self.errors = Counter("draplane_audit_errors_total", "Failed reads of the stream and writes of the log",
                              ["what"], registry=registry)
        self.last_sequence = Gauge("draplane_audit_last_sequence", "Stream sequence of the last event in the log",
                                   registry=registry)
        self.consumer_pending = Gauge("draplane_audit_consumer_pending",
                                      "Events in the audit stream not yet read (consumer lag)", registry=registry)


class ClusterMetrics(Collector):
    """Gauges from the latest free-capacity answer, made at scrape time (nodes come and go, so
    their label sets are not kept between answers), and counters from the audit events."""

    def __init__(self, registry: CollectorRegistry):
        self.latest: FreeCapacity | None = None
        self.claims_reserved = 0
        self.stale_nodes = 0
        registry.register(self)
        self.allocations = Counter("draplane_cluster_allocations_total", "Claims allocated (pods placed), by node",
                                   ["node"], registry=registry)
        self.releases = Counter("draplane_cluster_releases_total", "Claims whose devices were freed, by node",
                                ["node"], registry=registry)
        self.rejections = Counter("draplane_cluster_rejections_total", "Pods found unschedulable", registry=registry)
        self.taints = Counter("draplane_cluster_taints_total", "Devices tainted or untainted, by event kind",
                              ["kind"], registry=registry)
        self.computations = Counter("draplane_cluster_free_computations_total",
                                    "Free-capacity computations from NATS", registry=registry)

    def count(self, events) -> None:
        for event in events:
            if event.kind == "placed":
                self.allocations.labels(node=event.node or "").inc(len(event.claims))
            elif event.kind == "released":
                self.releases.labels(node=event.node or "").inc(len(event.claims))
            elif event.kind == "rejected":
                self.rejections.inc()
            elif event.kind in ("tainted", "untainted", "removed"):
                self.taints.labels(kind=event.kind).inc(event.device_count or len(event.devices))

    def collect(self):
        devices = GaugeMetricFamily("draplane_cluster_devices", "Devices by DeviceClass, node and state",
                                    labels=["device_class", "node", "state"])
        whole = GaugeMetricFamily("draplane_cluster_devices_free_whole",
                                  "One-device claims of the class that still fit on the node",
                                  labels=["device_class", "node"])
        partitions = GaugeMetricFamily("draplane_cluster_partitions_free",
                                       "Partitions (MIG placements) of a profile that still fit on the node",
                                       labels=["device_class", "node", "profile"])
        shared_total = GaugeMetricFamily("draplane_cluster_shared_capacity_total",
                                         "Capacity of devices that allow multiple allocations",
                                         labels=["device_class", "node", "capacity"])
        shared_left = GaugeMetricFamily("draplane_cluster_shared_capacity_left",
                                        "Capacity left on devices that allow multiple allocations",
                                        labels=["device_class", "node", "capacity"])
        for row in self.latest.nodes if self.latest is not None else ():
            for state, count in row.states.items():
                devices.add_metric([row.device_class, row.node, state], count)
            whole.add_metric([row.device_class, row.node], row.whole_free)
            for profile, count in row.partitions.items():
                partitions.add_metric([row.device_class, row.node, profile], count)
            for s in row.shared:
                shared_total.add_metric([row.device_class, row.node, s.capacity], float(s.total))
                shared_left.add_metric([row.device_class, row.node, s.capacity], float(s.left))
        yield from (devices, whole, partitions, shared_total, shared_left)
        yield GaugeMetricFamily("draplane_cluster_claims_reserved", "Claims holding devices in the reservation bucket",
                                value=self.claims_reserved)
        yield GaugeMetricFamily("draplane_cluster_nodes_stale", "Nodes whose agent stopped heartbeating (tainted)",
                                value=self.stale_nodes)

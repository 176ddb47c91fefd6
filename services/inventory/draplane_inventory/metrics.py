"""The inventory service's metrics, in a registry of its own (served at /metrics).

`draplane_inventory_slice_writes_total{verb}` counts the ResourceSlice writes (create, update,
delete): its rate() is the write rate. The nodes gauge is read from the liveness table at each
scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily

from draplane.metrics import ConsumerLag


class InventoryMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.messages_received = Counter("draplane_inventory_messages_received",
                                         "Messages from node agents (kind=snapshot|heartbeat)", ["kind"], registry=r)
        self.messages_rejected = Counter("draplane_inventory_messages_rejected",
                                         "Messages rejected, by why (version, malformed, node-mismatch...)",
                                         ["reason"], registry=r)
        self.snapshots_applied = Counter("draplane_inventory_snapshots_applied",
                                         "Snapshots newer than what the node had, applied", registry=r)
        self.heartbeat_digest_mismatches = Counter("draplane_inventory_heartbeat_digest_mismatches",
                                                   "Heartbeats vouching for a snapshot not applied (yet)", registry=r)
        self.stale_transitions = Counter("draplane_inventory_stale_transitions",
                                         "Nodes whose agent stopped heartbeating: devices tainted, then removed",
                                         ["to"], registry=r)
        self.slice_writes = Counter("draplane_inventory_slice_writes", "ResourceSlice writes to the apiserver",
                                    ["verb"], registry=r)
        self.sync_failures = Counter("draplane_inventory_sync_failures",
                                     "Failed writes of a node's slices (retried)", registry=r)
        self.nodes_without_node_object = Counter("draplane_inventory_nodes_without_node_object",
                                                 "Syncs of a node with devices but no Node object (no slices "
                                                 "published until it exists)", registry=r)
        self.feed_updates = Counter("draplane_inventory_feed_updates", "Inventory feed entries written (kind=put|delete)",
                                    ["kind"], registry=r)
        self.jetstream_recreated = Counter("draplane_inventory_jetstream_recreated",
                                           "Times NATS had lost the stream, consumer or feed bucket and they were made "
                                           "again", registry=r)
        self.drivers_refused = Gauge("draplane_inventory_drivers_refused",
                                     "(node, driver) pairs not published because another publisher uses the driver "
                                     "name on that node", registry=r)
        self.consumer_lag = ConsumerLag(r)

    def export_nodes(self, nodes_by_state: Callable[[], Mapping[str, int]]) -> None:
        """Nodes known from their agents, by liveness state, read at each scrape."""
        self.registry.register(_NodesByState(nodes_by_state))


class _NodesByState:
    def __init__(self, nodes_by_state):
        self.nodes_by_state = nodes_by_state

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily("draplane_inventory_nodes", "Nodes known from their agents, by liveness",
                                 labels=["state"])

    def describe(self):
        return [self._family()]

    def collect(self):
        family = self._family()
        for state, count in sorted(self.nodes_by_state().items()):
            family.add_metric([state], count)
        yield family

"""The node agent's metrics, read from its fleet at each scrape (served at /metrics with --listen).

One process may run one agent (a DaemonSet pod) or a thousand simulated ones; the figures are the
process' totals, so a simulated fleet is one scrape target, not a thousand.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from draplane_node_agent.agent import AgentFleet


def fleet_registry(fleet: AgentFleet) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_FleetCollector(fleet))
    return registry


class _FleetCollector:
    def __init__(self, fleet: AgentFleet):
        self.fleet = fleet

    def collect(self):
        fleet = self.fleet
        yield _counter("snapshots_published", "Snapshots JetStream acknowledged", fleet.snapshots_sent)
        yield _counter("snapshot_failures", "Snapshots not acknowledged (sent again with backoff)",
                       fleet.snapshot_failures)
        yield _counter("heartbeats_published", "Heartbeats sent", fleet.heartbeats_sent)
        yield _counter("reconnects", "NATS connections made again after one was lost", fleet.reconnects)
        connected = GaugeMetricFamily("draplane_node_agent_nats_connected", "1 while connected to NATS")
        connected.add_metric([], 1 if fleet.connected.is_set() else 0)
        yield connected
        nodes = GaugeMetricFamily("draplane_node_agent_nodes", "Nodes this process speaks for")
        nodes.add_metric([], len(fleet.agents))
        yield nodes
        devices = GaugeMetricFamily("draplane_node_agent_devices", "Devices discovered, over every node of the process",
                                    labels=["driver"])
        by_driver: dict[str, int] = {}
        for agent in fleet.agents:
            for driver in agent.state.drivers or ():
                by_driver[driver.driver] = by_driver.get(driver.driver, 0) + len(driver.devices)
        for driver, count in sorted(by_driver.items()):
            devices.add_metric([driver], count)
        yield devices


def _counter(name: str, documentation: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(f"draplane_node_agent_{name}", documentation, value=value)

"""Scraping and the dashboard: every pod says where its /metrics is, the PodMonitor finds the same
pods, and every metric the Grafana dashboard queries is one a service exports."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client import CollectorRegistry

from draplane.kube.metrics import ApiserverMetrics
from draplane.localenv import kustomize
from draplane.localenv.kustomize import object_id
from draplane.scheduling.placing import SchedulingState
from draplane_allocator.metrics import AllocatorMetrics
from draplane_binder.metrics import BinderMetrics
from draplane_inventory.metrics import InventoryMetrics
from draplane_node_agent.agent import AgentFleet
from draplane_node_agent.metrics import fleet_registry
from test_manifests import DEPLOY, by_kind, container_args, pod_spec, workloads

MONITORING = DEPLOY / "monitoring"
DASHBOARD = MONITORING / "draplane-dashboard.json"
SERVICES = {"draplane-inventory", "draplane-allocator", "draplane-binder", "draplane-node-agent", "draplane-audit"}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exported_names() -> set[str]:
    """Every sample name the four services can export, read from their registries."""
    allocator = AllocatorMetrics()
    allocator.export_fragmentation(SchedulingState())
    binder = BinderMetrics()
    binder.export_claims(lambda: [])
    inventory = InventoryMetrics()
    inventory.export_nodes(lambda: {})
    registries = [allocator.registry, binder.registry, inventory.registry, fleet_registry(AgentFleet("nats://x", []))]
    ApiserverMetrics(binder.registry)  # the binder and the inventory talk to the apiserver; shards do not
    names = set()
    for registry in registries:
        for family in registry.collect():
            names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]


def test_every_metric_the_dashboard_queries_is_exported():
    exported = exported_names()
    queried = {name for expr in dashboard_expressions() for name in re.findall(r"\bdraplane_[a-z_]+", expr)}
    assert queried, "the dashboard queries nothing"
    assert queried <= exported, f"not exported by any service: {sorted(queried - exported)}"
    # and each family of the services is on the dashboard somewhere, but for a few kept for debugging
    families = {re.sub(r"_(total|bucket|count|sum)$", "", name) for name in exported}
    shown = {re.sub(r"_(total|bucket|count|sum)$", "", name) for name in queried}
    not_shown = families - shown
    assert not_shown <= {
        "draplane_allocator_placements_republished", "draplane_allocator_pods_gone",
        "draplane_binder_placements_abandoned", "draplane_binder_claims_created", "draplane_binder_pending_published",
        "draplane_binder_pending_publish_failures", "draplane_binder_pending_withdrawn",
        "draplane_inventory_messages_received",
        "draplane_inventory_messages_rejected", "draplane_inventory_snapshots_applied",
        "draplane_inventory_heartbeat_digest_mismatches", "draplane_inventory_stale_transitions",
        "draplane_inventory_nodes_without_node_object", "draplane_inventory_feed_updates",
        "draplane_inventory_jetstream_recreated", "draplane_node_agent_snapshots_published",
        "draplane_node_agent_snapshot_failures", "draplane_node_agent_heartbeats_published",
        "draplane_node_agent_reconnects", "draplane_node_agent_nats_connected", "draplane_node_agent_nodes",
    }, sorted(not_shown)


def test_dashboard_panels_have_unique_ids_and_a_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] == "draplane"
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


@pytest.mark.integration  # kubectl, from `make servers`
def test_every_service_pod_is_annotated_for_scraping_and_logs_json():
    objects = kustomize.build(DEPLOY)
    services = [o for o in workloads(objects) if o["metadata"]["name"] in SERVICES]
    assert {o["metadata"]["name"] for o in services} == SERVICES
    for obj in services:
        annotations = obj["spec"]["template"]["metadata"]["annotations"]
        (container,) = pod_spec(obj)["containers"]
        ports = {p["containerPort"] for p in container["ports"]}
        assert annotations["prometheus.io/scrape"] == "true", object_id(obj)
        assert int(annotations["prometheus.io/port"]) in ports, object_id(obj)
        assert annotations["prometheus.io/path"] == "/metrics", object_id(obj)
        assert container_args(obj)["log-format"] == "json", object_id(obj)
    # the default kustomization stays free of CRD kinds a plain cluster lacks
    assert not by_kind(objects, "PodMonitor") and not by_kind(objects, "ServiceMonitor")


@pytest.mark.integration
def test_the_monitoring_overlay_selects_the_services_pods_and_ships_the_dashboard():
    deployed = kustomize.build(DEPLOY)
    objects = kustomize.build(MONITORING)
    (monitor,) = by_kind(objects, "PodMonitor").values()
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    assert expression["key"] == "app.kubernetes.io/name" and expression["operator"] == "In"
    assert set(expression["values"]) == SERVICES
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for obj in workloads(deployed):
        if obj["metadata"]["name"] in SERVICES:
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert labels["app.kubernetes.io/name"] in expression["values"]
            (container,) = pod_spec(obj)["containers"]
            assert endpoint["port"] in {p["name"] for p in container["ports"]}, object_id(obj)
    (config_map,) = by_kind(objects, "ConfigMap").values()
    assert config_map["metadata"]["name"] == "draplane-grafana-dashboard"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["draplane-dashboard.json"]) == json.loads(DASHBOARD.read_text())

"""kube-scheduler's InterPodAffinity and PodTopologySpread scores, pure (the differential against
its framework is test_kube_scheduler_parity.py), and their place in the shard's ranking."""

from __future__ import annotations

import msgspec
import pytest

from draplane.api.core import Node, Pod
from draplane.scheduling import pod_scores
from draplane.simulation import scenario
from draplane.scheduling.placed_pods import PlacedPod, PlacedPods
from draplane.scheduling.placing import SchedulingState, Placed

NODES = {n.metadata.name: n for n in (
    msgspec.convert({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "zone": zone}}}, Node)
    for name, zone in (("a1", "a"), ("a2", "a"), ("b1", "b")))}


def pod(spec: dict, labels=None) -> Pod:
    return msgspec.convert({"metadata": {"name": "p", "namespace": "ns", "uid": "p", "labels": labels or {"app": "web"}},
                            "spec": {"containers": [{"name": "c"}], **spec}}, Pod)


def soft_anti(key: str) -> dict:
    return {"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": {"topologyKey": key, "labelSelector": {"matchLabels": {"app": "web"}}}}]}}}


def web(node: str, uid: str) -> PlacedPod:
    return PlacedPod(uid=uid, namespace="ns", labels={"app": "web"}, node=node)


def test_a_soft_anti_affinity_scores_the_nodes_away_from_the_replicas():
    placed = PlacedPods.of([web("a1", "w0")])
    assert pod_scores.inter_pod_affinity(pod(soft_anti("kubernetes.io/hostname")), NODES, placed, now=0) == \
        {"a1": 0.0, "a2": 100.0, "b1": 100.0}
    assert pod_scores.inter_pod_affinity(pod(soft_anti("zone")), NODES, placed, now=0) == \
        {"a1": 0.0, "a2": 0.0, "b1": 100.0}
    # nothing selected: no score at all
    assert pod_scores.inter_pod_affinity(pod(soft_anti("zone")), NODES, PlacedPods(), now=0) is None


def test_a_schedule_anyway_spread_prefers_the_emptier_domain():
    constraint = {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway",
                                                 "labelSelector": {"matchLabels": {"app": "web"}}}]}
    placed = PlacedPods.of([web("a1", "w0"), web("a2", "w1")])
    # zone a holds 2: 2 * log(2 + 2) = 2.77 -> 3; zone b 0; normalized (max + min - s) / max
    assert pod_scores.topology_spread(pod(constraint), NODES, placed, now=0) == {"a1": 0.0, "a2": 0.0, "b1": 100.0}
    assert pod_scores.preferences(pod(constraint), NODES, placed, now=0) == {"a1": 0.0, "a2": 0.0, "b1": 200.0}
    assert pod_scores.node_bonus({"a1": 0.0, "b1": 200.0}) == {"b1": 2.0}


@pytest.mark.parametrize("policy", ["draplane", "first-fit"])
def test_the_shard_ranks_by_the_preference_whatever_the_policy(policy):
    state = SchedulingState(policy=policy)
    state.set_class(scenario.device_class("gpu.nvidia.com"))
    for name in ("node-0", "node-1"):
        state.set_node(scenario.gpu_node(name))
        state.set_feed_entry(f"node.{name}", [scenario.gpu_slice(name, 8, "80Gi")])
    first = scenario.pod("ns", "web-0", claim_name="gpu-0")
    first.metadata.uid, first.metadata.labels = "u0", {"app": "web"}
    claim = scenario.claim("ns", "gpu-0", "gpu.nvidia.com")
    claim.metadata.uid = "c0"
    placed = state.place_pod(first, [claim])
    assert isinstance(placed, Placed)
    first.spec.node_name = placed.node
    state.set_pod(first)
    second = scenario.pod("ns", "web-1", claim_name="gpu-1")
    second.metadata.uid, second.metadata.labels = "u1", {"app": "web"}
    second.spec.affinity = pod(soft_anti("kubernetes.io/hostname")).spec.affinity
    claim = scenario.claim("ns", "gpu-1", "gpu.nvidia.com")
    claim.metadata.uid = "c1"
    assert state.place_pod(second, [claim]).node != placed.node
    # and a pod without claims too
    third = pod(soft_anti("kubernetes.io/hostname"))
    assert state.place_pod(third, []).node != placed.node

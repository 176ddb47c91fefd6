"""kube-scheduler's InterPodAffinity and PodTopologySpread scores, pure (the differential against
its framework is test_kube_scheduler_parity.py), and their place in the shard's ranking."""

from __future__ import annotations

import msgspec
import pytest

from draplane.api.core import Node, Pod, PodSpec
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


def two_gpu_nodes(policy: str) -> SchedulingState:
    """A shard's state with node-0 and node-1, 8 GPUs each."""
    state = SchedulingState(policy=policy)
    state.set_class(scenario.device_class("gpu.nvidia.com"))
    for name in ("node-0", "node-1"):
        state.set_node(scenario.gpu_node(name))
        state.set_feed_entry(f"node.{name}", [scenario.gpu_slice(name, 8, "80Gi")])
    return state


@pytest.mark.parametrize("policy", ["draplane", "first-fit"])
def test_the_shard_ranks_by_the_preference_whatever_the_policy(policy):
    state = two_gpu_nodes(policy)
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


# --- the placed pods' own terms towards the incoming pod (kube-scheduler's processExistingPod) -------


def holder(node: str, uid: str, affinity: dict, namespace: str = "ns") -> PlacedPod:
    spec = msgspec.convert({"containers": [{"name": "c"}], "affinity": affinity}, PodSpec)
    return PlacedPod(uid=uid, namespace=namespace, labels={"app": "cache"}, node=node,
                     score_terms=pod_scores.score_terms(spec))


def term(key: str, weight: int | None = None, app: str = "web") -> dict:
    affinity_term = {"topologyKey": key, "labelSelector": {"matchLabels": {"app": app}}}
    return affinity_term if weight is None else {"weight": weight, "podAffinityTerm": affinity_term}


def plain(labels=None) -> Pod:
    """An incoming pod with no terms of its own."""
    return pod({}, labels)


def test_a_placed_pods_preferred_affinity_draws_the_pod_to_its_domain():
    placed = PlacedPods.of([holder("a1", "c0", {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        term("zone", 30)]}})])
    assert pod_scores.inter_pod_affinity(plain(), NODES, placed, now=0) == {"a1": 100.0, "a2": 100.0, "b1": 0.0}
    # a pod its selector does not match is not drawn
    assert pod_scores.inter_pod_affinity(plain({"app": "batch"}), NODES, placed, now=0) is None


def test_a_placed_pods_preferred_anti_affinity_keeps_the_pod_from_its_domain():
    placed = PlacedPods.of([holder("a1", "c0", {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        term("kubernetes.io/hostname", 80)]}})])
    assert pod_scores.inter_pod_affinity(plain(), NODES, placed, now=0) == {"a1": 0.0, "a2": 100.0, "b1": 100.0}


def test_a_placed_pods_required_affinity_weighs_hard_pod_affinity_weight():
    # alone it draws the pod like a preferred term of any weight (normalized); beside a preferred
    # anti-affinity of weight 1 on the same domain it cancels out, as weight 1 against -1
    required = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term("zone")]}}
    placed = PlacedPods.of([holder("b1", "c0", required)])
    assert pod_scores.inter_pod_affinity(plain(), NODES, placed, now=0) == {"a1": 0.0, "a2": 0.0, "b1": 100.0}
    against = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [term("zone", 1)]}}
    placed = PlacedPods.of([holder("b1", "c0", required), holder("b1", "c1", against)])
    assert pod_scores.inter_pod_affinity(plain(), NODES, placed, now=0) is None


def test_placed_terms_add_to_the_pods_own_and_are_weighed_per_holder():
    # the pod's own soft anti-affinity to web pods (weight 100, hostname) against two cache pods on
    # b1 each preferring web pods in zone b (weight 30 each): a1 -100 (a web pod there), a2 0, b1 +60
    placed = PlacedPods.of([web("a1", "w0"),
                            *(holder("b1", f"c{i}", {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                                term("zone", 30)]}}) for i in range(2))])
    scores = pod_scores.inter_pod_affinity(pod(soft_anti("kubernetes.io/hostname")), NODES, placed, now=0)
    assert scores == {"a1": 0.0, "a2": float(int(100 * 100 / 160)), "b1": 100.0}


def test_a_placed_pods_term_looks_in_its_own_namespace_unless_it_names_others():
    affinity = {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [term("zone", 30)]}}
    elsewhere = PlacedPods.of([holder("a1", "c0", affinity, namespace="other")])
    assert pod_scores.inter_pod_affinity(plain(), NODES, elsewhere, now=0) is None
    named = {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 30, "podAffinityTerm": {**term("zone"), "namespaces": ["ns"]}}]}}
    placed = PlacedPods.of([holder("a1", "c0", named, namespace="other")])
    assert pod_scores.inter_pod_affinity(plain(), NODES, placed, now=0) == {"a1": 100.0, "a2": 100.0, "b1": 0.0}


def test_the_shard_places_a_plain_pod_by_a_bound_pods_preferred_affinity():
    state = two_gpu_nodes("draplane")
    web_pod = scenario.pod("ns", "web", claim_name="gpu-web")
    web_pod.metadata.uid, web_pod.metadata.labels = "u-web", {"app": "web"}
    claim = scenario.claim("ns", "gpu-web", "gpu.nvidia.com")
    claim.metadata.uid = "c-web"
    alone = state.place_pod(web_pod, [claim]).node
    # a bound pod without devices on the other node prefers web pods beside it
    cache = pod({"nodeName": "node-1" if alone == "node-0" else "node-0", "affinity": {"podAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [term("kubernetes.io/hostname", 100)]}}}, {"app": "cache"})
    cache.metadata.uid = "u-cache"
    state.set_pod(cache)
    assert state.place_pod(web_pod, [claim]).node == cache.spec.node_name
    # a pod its term does not select is placed as before
    batch = scenario.pod("ns", "batch", claim_name="gpu-web")
    batch.metadata.uid, batch.metadata.labels = "u-batch", {"app": "batch"}
    assert state.place_pod(batch, [claim]).node == alone
    # gone with the pod
    state.set_pod(cache, deleted=True)
    assert state.place_pod(web_pod, [claim]).node == alone

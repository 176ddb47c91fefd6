"""kube-scheduler's PodTopologySpread filter (DoNotSchedule), pure: domains, skew, minDomains,
node inclusion policies, selectors, and its reasons."""

from __future__ import annotations

import msgspec

from draplane.api.apps import Service, ServiceSpec
from draplane.api.core import Node, Pod
from draplane.scheduling.framework.plugins import pod_topology_spread as spread
from draplane.scheduling.placed_pods import PlacedPod, PlacedPods

NODES = [
    msgspec.convert({"metadata": {"name": n, "labels": labels}, **extra}, Node) for n, labels, extra in (
        ("a1", {"zone": "a", "kubernetes.io/hostname": "a1"}, {}),
        ("a2", {"zone": "a", "kubernetes.io/hostname": "a2"}, {}),
        ("b1", {"zone": "b", "kubernetes.io/hostname": "b1", "gpu": "none"}, {}),
        ("c1", {"zone": "c", "kubernetes.io/hostname": "c1"},
         {"spec": {"taints": [{"key": "maintenance", "effect": "NoSchedule"}]}}),
        ("bare", {"kubernetes.io/hostname": "bare"}, {}),
    )
]


def pod(constraints: list[dict], labels=None, **spec) -> Pod:
    return msgspec.convert({"metadata": {"name": "p", "namespace": "ns", "labels": labels or {"app": "web"}},
                            "spec": {"containers": [{"name": "c"}], "topologySpreadConstraints": constraints, **spec}},
                           Pod)


def zone(max_skew=1, **extra) -> dict:
    return {"maxSkew": max_skew, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": "web"}}, **extra}


def web(node: str, namespace="ns", app="web", terminating=False) -> PlacedPod:
    return PlacedPod(uid=f"{node}-{app}-{namespace}-{terminating}", namespace=namespace, labels={"app": app}, node=node,
                     terminating=terminating)


def pre_filter(p: Pod, nodes, placed):
    return spread.pre_filter(p, spread.NodeDomains.of(nodes), PlacedPods.of(placed))


def verdicts(p: Pod, placed) -> dict:
    state = pre_filter(p, NODES, placed)
    return {n.metadata.name: spread.filter_node(state, n.metadata.labels) for n in NODES} if state else None


def test_skew_over_zones():
    got = verdicts(pod([zone()]), [web("a1"), web("a2")])  # a: 2, b: 0, c: 0
    assert got == {"a1": spread.REASON, "a2": spread.REASON, "b1": None, "c1": None,
                   "bare": spread.REASON_MISSING_LABEL}
    # max skew 2: zone a may take one more... no: 2 + 1 - 0 = 3 > 2
    assert verdicts(pod([zone(2)]), [web("a1"), web("a2")])["a1"] == spread.REASON
    assert verdicts(pod([zone(3)]), [web("a1"), web("a2")])["a1"] is None


def test_only_matching_pods_of_the_namespace_that_are_not_terminating_count():
    placed = [web("a1", namespace="other"), web("a1", app="db"), web("a2", terminating=True)]
    assert verdicts(pod([zone()]), placed)["a1"] is None


def test_a_pod_that_its_selector_does_not_match_adds_nothing():
    assert verdicts(pod([zone()], labels={"app": "batch"}), [web("a1")])["a1"] is None  # 1 + 0 - 0 = 1


def test_node_inclusion_policies():
    # nodeSelector: only zone b's node is eligible, so zone a is no domain and the minimum is b's
    selected = pod([zone()], nodeSelector={"gpu": "none"})
    state = pre_filter(selected, NODES, [web("a1"), web("a2")])
    assert state.counts == [{"b": 0}]
    # taints are ignored by default; honoured, zone c (its only node tainted) is no domain
    assert pre_filter(pod([zone()]), NODES, []).counts == [{"a": 0, "b": 0, "c": 0}]
    honor = pod([zone(nodeTaintsPolicy="Honor")])
    assert pre_filter(honor, NODES, []).counts == [{"a": 0, "b": 0}]


def test_min_domains_makes_the_minimum_zero_while_domains_are_few():
    placed = [web("a1"), web("b1")]  # a: 1, b: 1, c: 0
    assert verdicts(pod([zone()]), placed)["a1"] == spread.REASON  # min is c's 0
    only_ab = [n for n in NODES if n.metadata.name != "c1"]
    state = pre_filter(pod([zone()]), only_ab, placed)
    assert spread.filter_node(state, {"zone": "a"}) is None  # 1 + 1 - 1
    state = pre_filter(pod([zone(minDomains=3)]), only_ab, placed)
    assert spread.filter_node(state, {"zone": "a"}) == spread.REASON  # 2 domains < 3: min 0


def test_match_label_keys_narrow_the_selector_to_the_pods_revision():
    constraint = zone(matchLabelKeys=["rev"])
    p = pod([constraint], labels={"app": "web", "rev": "2"})
    old = PlacedPod(uid="o", namespace="ns", labels={"app": "web", "rev": "1"}, node="a1")
    assert verdicts(p, [old])["a1"] is None  # the old revision's pod is not counted


def test_schedule_anyway_is_no_filter_and_empty_selectors_count_nothing():
    assert pre_filter(pod([{**zone(), "whenUnsatisfiable": "ScheduleAnyway"}]), NODES, [web("a1")]) is None
    empty = pod([{**zone(), "labelSelector": {}}])
    state = pre_filter(empty, NODES, [web("a1"), web("a1")])
    assert state.counts == [{"a": 0, "b": 0, "c": 0}] and state.self_match == [True]


# --- the default selector kube-scheduler's system default constraints spread by ------------------


def owned(kind: str, api_version: str = "apps/v1", labels=None) -> Pod:
    return msgspec.convert({"metadata": {"name": "p", "namespace": "ns", "labels": labels or {"app": "web", "rev": "2"},
                                         "ownerReferences": [{"apiVersion": api_version, "kind": kind, "name": "o",
                                                              "uid": "u", "controller": True}]},
                            "spec": {"containers": [{"name": "c"}]}}, Pod)


def service(selector) -> Service:
    return Service(spec=ServiceSpec(selector=selector))


def test_the_default_selector_merges_the_services_that_select_the_pod_and_adds_its_controllers():
    from draplane.api.policy import LabelSelector, LabelSelectorRequirement

    services = [service({"app": "web"}), service({"app": "db"}), service(None), service({"rev": "2"})]
    rs = LabelSelector(match_labels={"app": "web"},
                       match_expressions=[LabelSelectorRequirement(key="rev", operator="In", values=["2", "3"])])
    found = spread.default_selector(owned("ReplicaSet"), services, {("ReplicaSet", "o"): rs})
    assert found.match_labels == {"app": "web", "rev": "2"}  # the db service and the selectorless one do not count
    assert [(e.key, e.operator, e.values) for e in found.match_expressions] == [
        ("app", "In", ["web"]), ("rev", "In", ["2", "3"])]
    # a ReplicationController's selector is labels, merged
    rc = spread.default_selector(owned("ReplicationController", "v1"), [], {("ReplicationController", "o"): {"tier": "x"}})
    assert rc.match_labels == {"tier": "x"} and rc.match_expressions is None


def test_no_default_selector_for_an_owner_kube_scheduler_does_not_read_or_that_is_gone():
    rs = {("ReplicaSet", "o"): {"app": "web"}}
    assert spread.default_selector(owned("Job", "batch/v1"), [], rs) is None
    assert spread.default_selector(owned("ReplicaSet", "extensions/v1beta1"), [], rs) is None
    assert spread.default_selector(owned("ReplicaSet"), [], {}) is None  # the ReplicaSet is gone
    assert spread.default_selector(owned("ReplicaSet"), [service({"app": "db"})], {}) is None


def test_default_constraints_score_nodes_without_a_zone_by_their_hostname_alone():
    from draplane.api.policy import LabelSelector
    from draplane.scheduling import pod_scores

    nodes = {n.metadata.name: msgspec.structs.replace(
        n, metadata=msgspec.structs.replace(n.metadata, labels={
            **({"topology.kubernetes.io/zone": n.metadata.labels["zone"]} if "zone" in n.metadata.labels else {}),
            "kubernetes.io/hostname": n.metadata.name})) for n in NODES[:3] + NODES[4:]}
    placed = PlacedPods.of([web("a1"), web("a1"), web("bare")])
    plain = msgspec.convert({"metadata": {"name": "p", "namespace": "ns", "labels": {"app": "web"}},
                             "spec": {"containers": [{"name": "c"}]}}, Pod)
    assert pod_scores.topology_spread(plain, nodes, placed, now=0.0) is None  # nothing selects it: no default
    scores = pod_scores.topology_spread(plain, nodes, placed, now=0.0,
                                        default_spread=LabelSelector(match_labels={"app": "web"}))
    # fewer replicas on the node and in its zone score higher; a node without a zone label is
    # scored by its hostname alone (its pod counts there, no zone term is added), so it comes first
    assert scores["a1"] < scores["a2"] < scores["b1"] < scores["bare"] == 100.0
    # a pod's own constraints replace the defaults, and only ScheduleAnyway ones score
    own = pod([zone()])
    assert pod_scores.topology_spread(own, nodes, placed, now=0.0,
                                      default_spread=LabelSelector(match_labels={"app": "web"})) is None

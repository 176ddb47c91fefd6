"""kube-scheduler's PodTopologySpread filter (DoNotSchedule), pure: domains, skew, minDomains,
node inclusion policies, selectors, and its reasons."""

from __future__ import annotations

import msgspec

from draplane.api.core import Node, Pod
from draplane.scheduling import pod_topology_spread as spread
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

"""kube-scheduler's InterPodAffinity filter (required terms), pure: the counts of pre_filter and
the reasons of filter_node, in kube-scheduler's order and words."""

from __future__ import annotations

import msgspec
import pytest

from draplane.api.core import PodSpec
from draplane.scheduling.framework.plugins import inter_pod_affinity as ipa
from draplane.scheduling.placed_pods import PlacedPods

NODES = {
    "a1": {"kubernetes.io/hostname": "a1", "zone": "a"},
    "a2": {"kubernetes.io/hostname": "a2", "zone": "a"},
    "b1": {"kubernetes.io/hostname": "b1", "zone": "b"},
    "bare": {"kubernetes.io/hostname": "bare"},  # no zone label
}


def spec(affinity=None, anti=None) -> PodSpec:
    raw: dict = {"containers": [{"name": "c"}], "affinity": {}}
    if affinity:
        raw["affinity"]["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": affinity}
    if anti:
        raw["affinity"]["podAntiAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": anti}
    return msgspec.convert(raw, PodSpec)


def term(key: str, labels: dict | None, **extra) -> dict:
    return {"topologyKey": key, **({"labelSelector": {"matchLabels": labels}} if labels is not None else {}), **extra}


def placed(uid, node, labels, namespace="ns", anti=()) -> ipa.PlacedPod:
    return ipa.PlacedPod(uid=uid, namespace=namespace, labels=labels, node=node,
                         anti_affinity=tuple(spec(anti=list(anti)).affinity.pod_anti_affinity
                                             .required_during_scheduling_ignored_during_execution) if anti else ())


def verdicts(pod_spec: PodSpec, pods, labels=None, namespace="ns") -> dict:
    state = ipa.pre_filter(namespace, labels or {}, pod_spec, PlacedPods.of(pods), NODES.get)
    if state is None:
        return {node: None for node in NODES}
    return {node: ipa.filter_node(state, node_labels) for node, node_labels in NODES.items()}


def test_anti_affinity_on_the_hostname_keeps_replicas_apart():
    pods = [placed("w0", "a1", {"app": "web"})]
    got = verdicts(spec(anti=[term("kubernetes.io/hostname", {"app": "web"})]), pods, {"app": "web"})
    assert got == {"a1": ipa.REASON_ANTI_AFFINITY, "a2": None, "b1": None, "bare": None}


def test_anti_affinity_on_a_zone_keeps_the_whole_zone_and_ignores_nodes_without_the_label():
    pods = [placed("w0", "a1", {"app": "web"})]
    got = verdicts(spec(anti=[term("zone", {"app": "web"})]), pods, {"app": "web"})
    assert got == {"a1": ipa.REASON_ANTI_AFFINITY, "a2": ipa.REASON_ANTI_AFFINITY, "b1": None, "bare": None}


def test_affinity_needs_a_selected_pod_in_the_domain_and_the_label_on_the_node():
    pods = [placed("db", "a2", {"app": "db"})]
    got = verdicts(spec(affinity=[term("zone", {"app": "db"})]), pods, {"app": "web"})
    assert got == {"a1": None, "a2": None, "b1": ipa.REASON_AFFINITY, "bare": ipa.REASON_AFFINITY}


def test_the_first_pod_of_a_group_with_affinity_to_itself_may_go_where_the_label_is():
    own = spec(affinity=[term("zone", {"app": "web"})])
    assert verdicts(own, [], {"app": "web"}) == {"a1": None, "a2": None, "b1": None, "bare": ipa.REASON_AFFINITY}
    # not itself selected: no exception
    assert verdicts(own, [], {"app": "other"})["a1"] == ipa.REASON_AFFINITY
    # once one exists, only its domain
    got = verdicts(own, [placed("w0", "b1", {"app": "web"})], {"app": "web"})
    assert got == {"a1": ipa.REASON_AFFINITY, "a2": ipa.REASON_AFFINITY, "b1": None, "bare": ipa.REASON_AFFINITY}


def test_an_existing_pods_anti_affinity_is_kept_both_ways():
    guard = placed("g", "a1", {"app": "guard"}, anti=[term("zone", {"app": "web"})])
    got = verdicts(spec(), [guard], {"app": "web"})
    assert got == {"a1": ipa.REASON_EXISTING_ANTI_AFFINITY, "a2": ipa.REASON_EXISTING_ANTI_AFFINITY,
                   "b1": None, "bare": None}
    assert verdicts(spec(), [guard], {"app": "other"})["a1"] is None


def test_the_reasons_come_in_kube_schedulers_order():
    guard = placed("g", "a1", {"app": "guard"}, anti=[term("kubernetes.io/hostname", {"app": "web"})])
    pods = [guard, placed("w0", "a1", {"app": "web"})]
    both = spec(affinity=[term("zone", {"app": "db"})], anti=[term("kubernetes.io/hostname", {"app": "web"})])
    # affinity first (no db anywhere, not itself a db), then its anti-affinity, then the existing pods'
    assert verdicts(both, pods, {"app": "web"})["a1"] == ipa.REASON_AFFINITY
    only_anti = spec(anti=[term("kubernetes.io/hostname", {"app": "web"})])
    assert verdicts(only_anti, pods, {"app": "web"})["a1"] == ipa.REASON_ANTI_AFFINITY


def test_namespaces_no_selector_and_namespace_selectors():
    pods = [placed("w0", "a1", {"app": "web"}, namespace="other")]
    # the term owner's namespace by default: a pod of another namespace is not selected
    assert verdicts(spec(anti=[term("kubernetes.io/hostname", {"app": "web"})]), pods)["a1"] is None
    listed = term("kubernetes.io/hostname", {"app": "web"}, namespaces=["other"])
    assert verdicts(spec(anti=[listed]), pods)["a1"] == ipa.REASON_ANTI_AFFINITY
    every = term("kubernetes.io/hostname", {"app": "web"}, namespaceSelector={})
    assert verdicts(spec(anti=[every]), pods)["a1"] == ipa.REASON_ANTI_AFFINITY
    # no label selector: no pod
    assert verdicts(spec(anti=[term("kubernetes.io/hostname", None)]), pods)["a1"] is None
    # a namespaceSelector with labels: every namespace for anti-affinity (never too lax) ...
    labelled = term("kubernetes.io/hostname", {"app": "web"}, namespaceSelector={"matchLabels": {"team": "x"}})
    assert verdicts(spec(anti=[labelled]), pods)["a1"] == ipa.REASON_ANTI_AFFINITY
    # ... and refused, by name, for affinity
    with pytest.raises(ipa.PodAffinityError, match=r"podAffinity.requiredDuringSchedulingIgnoredDuringExecution\[0\]"
                                                    r".namespaceSelector"):
        verdicts(spec(affinity=[labelled]), pods)


def test_a_bad_selector_names_the_field():
    bad = {"topologyKey": "zone", "labelSelector": {"matchExpressions": [{"key": "app", "operator": "Near"}]}}
    with pytest.raises(ipa.PodAffinityError, match="unknown operator 'Near'"):
        verdicts(spec(anti=[bad]), [placed("w0", "a1", {"app": "web"})])


def test_one_node_conflicts_for_a_commit():
    web = spec(anti=[term("kubernetes.io/hostname", {"app": "web"})])
    anti = ipa.required_anti_affinity(web)
    assert ipa.conflicts_on_one_node("ns", {"app": "web"}, anti, [placed("w0", "a1", {"app": "web"})])
    assert not ipa.conflicts_on_one_node("ns", {"app": "web"}, anti, [placed("d", "a1", {"app": "db"})])
    # the other way round: the reserved pod's term selects the newcomer
    guard = placed("g", "a1", {"app": "guard"}, anti=[term("kubernetes.io/hostname", {"app": "web"})])
    assert ipa.conflicts_on_one_node("ns", {"app": "web"}, (), [guard])
    # zone terms are not a one-node matter
    zone = ipa.required_anti_affinity(spec(anti=[term("zone", {"app": "web"})]))
    assert not ipa.conflicts_on_one_node("ns", {"app": "web"}, zone, [placed("w0", "a1", {"app": "web"})])

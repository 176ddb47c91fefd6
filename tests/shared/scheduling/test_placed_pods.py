"""The placed-pod index against a plain walk: InterPodAffinity's and PodTopologySpread's PreFilters,
reading only the candidates the index gives, must count exactly what a walk over every placed pod
and every node counts (the walk is written here, as the filters did it before the index).

Random placed pods (bound, reserved with live or lapsed leases, gone, terminating, several
namespaces, anti-affinity terms with and without matchLabels) and a random incoming pod with
affinity, anti-affinity and spread constraints."""

from __future__ import annotations

from collections import Counter

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from draplane.component_helpers.errors import SpecError
from draplane.component_helpers.node_affinity import matches_node_affinity
from draplane.component_helpers.taints import untolerated_taint
from draplane.api.core import Node, Pod, PodAffinityTerm
from draplane.scheduling.framework.plugins import inter_pod_affinity as ipa
from draplane.scheduling.framework.plugins import pod_topology_spread as spread
from draplane.scheduling.placed_pods import PlacedPod, PlacedPods

NOW = 1000.0
NODES = [
    msgspec.convert({"metadata": {"name": name, "labels": labels}, **extra}, Node) for name, labels, extra in (
        ("a1", {"kubernetes.io/hostname": "a1", "zone": "a", "gpu": "h100"}, {}),
        ("a2", {"kubernetes.io/hostname": "a2", "zone": "a"}, {}),
        ("b1", {"kubernetes.io/hostname": "b1", "zone": "b", "gpu": "h100"},
         {"spec": {"taints": [{"key": "maintenance", "effect": "NoSchedule"}]}}),
        ("b2", {"kubernetes.io/hostname": "b2", "zone": "b"}, {}),
        ("c1", {"kubernetes.io/hostname": "c1", "zone": "c"}, {}),
        ("bare", {"kubernetes.io/hostname": "bare"}, {}),
    )
]
NODE_LABELS = {n.metadata.name: n.metadata.labels for n in NODES}
NAMES = list(NODE_LABELS) + ["unknown"]  # a pod may sit on a node the shard has no object for
KEYS = ["kubernetes.io/hostname", "zone"]

label_sets = st.dictionaries(st.sampled_from(["app", "tier"]), st.sampled_from(["web", "db", "x"]), max_size=2)
selectors = st.one_of(
    st.none(),
    st.builds(lambda labels: {"matchLabels": labels}, label_sets),
    st.builds(lambda key, op: {"matchExpressions": [{"key": key, "operator": op}]},
              st.sampled_from(["app", "tier"]), st.sampled_from(["Exists", "DoesNotExist"])),
    st.builds(lambda labels, key: {"matchLabels": labels, "matchExpressions": [
        {"key": key, "operator": "In", "values": ["web", "db"]}]}, label_sets, st.sampled_from(["app", "tier"])),
)


@st.composite
def terms(draw) -> dict:
    raw = {"topologyKey": draw(st.sampled_from(KEYS))}
    selector = draw(selectors)
    if selector is not None:
        raw["labelSelector"] = selector
    scope = draw(st.sampled_from(["own", "listed", "every"]))
    if scope == "listed":
        raw["namespaces"] = draw(st.lists(st.sampled_from(["ns", "other"]), min_size=1, max_size=2))
    elif scope == "every":
        raw["namespaceSelector"] = {}
    return raw


def as_terms(raw: list[dict]) -> tuple[PodAffinityTerm, ...]:
    return tuple(msgspec.convert(t, PodAffinityTerm) for t in raw)


@st.composite
def placed_pods(draw) -> tuple[list[tuple[PlacedPod, str, float]], set[str]]:
    """(pod, how it is placed: bound or reserved, lease end) and the uids seen gone."""
    found = []
    for i in range(draw(st.integers(0, 14))):
        pod = PlacedPod(uid=f"p{i}", namespace=draw(st.sampled_from(["ns", "other"])), labels=draw(label_sets),
                        node=draw(st.sampled_from(NAMES)), anti_affinity=as_terms(draw(st.lists(terms(), max_size=2))),
                        terminating=draw(st.booleans()))
        how = draw(st.sampled_from(["bound", "reserved", "both"]))
        lease_end = draw(st.sampled_from([NOW - 1, NOW + 30]))
        found.append((pod, how, lease_end))
    gone = {pod.uid for pod, _, _ in found if draw(st.integers(0, 5)) == 0}
    return found, gone


def index_of(found, gone) -> PlacedPods:
    placed = PlacedPods(gone=gone)
    by_node: dict[str, dict] = {}
    for pod, how, lease_end in found:
        if how in ("bound", "both"):
            placed.set_bound(pod)
        if how in ("reserved", "both"):
            by_node.setdefault(pod.node, {})[pod.uid] = (pod, lease_end)
    for node, pods in by_node.items():
        placed.set_reserved(node, pods)
    return placed


def walk_of(found, gone, without) -> list[PlacedPod]:
    """Every placed pod, as the filters walked them: bound ones, then live reservations of the others."""
    bound = {pod.uid: pod for pod, how, _ in found if how in ("bound", "both")}
    placed = dict(bound)
    for pod, how, lease_end in found:
        if how in ("reserved", "both") and lease_end > NOW and pod.uid not in gone and pod.uid not in placed:
            placed[pod.uid] = pod
    placed.pop(without, None)
    return list(placed.values())


def affinity_by_walk(namespace, labels, spec, pods) -> ipa.PreFilterState | None:
    affinity, anti = ipa.required_affinity(spec), ipa.required_anti_affinity(spec)
    existing = Counter()
    for other in pods:
        other_labels = NODE_LABELS.get(other.node)
        if other_labels is None:
            continue
        for term in other.anti_affinity:
            value = other_labels.get(term.topology_key)
            if value is not None and ipa.term_selects(term, other.namespace, namespace, labels):
                existing[(term.topology_key, value)] += 1
    if not affinity and not anti:
        return None if not existing else ipa.PreFilterState((), (), Counter(), Counter(), existing, False)
    affinity_counts, anti_counts = Counter(), Counter()
    for other in pods:
        other_labels = NODE_LABELS.get(other.node)
        if other_labels is None:
            continue
        if affinity and all(ipa.term_selects(t, namespace, other.namespace, other.labels) for t in affinity):
            for t in affinity:
                if t.topology_key in other_labels:
                    affinity_counts[(t.topology_key, other_labels[t.topology_key])] += 1
        for t in anti:
            value = other_labels.get(t.topology_key)
            if value is not None and ipa.term_selects(t, namespace, other.namespace, other.labels):
                anti_counts[(t.topology_key, value)] += 1
    itself = bool(affinity) and all(ipa.term_selects(t, namespace, namespace, labels) for t in affinity)
    return ipa.PreFilterState(affinity, anti, affinity_counts, anti_counts, existing, itself)


def spread_by_walk(pod: Pod, pods) -> list[dict[str, int]]:
    constraints = spread.constraints_of(pod)
    counts: list[dict[str, int]] = [{} for _ in constraints]
    for node in NODES:
        labels = node.metadata.labels
        if any(c.topology_key not in labels for c in constraints):
            continue
        for i, c in enumerate(constraints):
            try:
                if c.honor_node_affinity and not matches_node_affinity(pod, node):
                    continue
            except SpecError:
                continue
            if c.honor_taints and untolerated_taint(pod.spec.tolerations or [], node.spec.taints if node.spec else []):
                continue
            here = sum(1 for other in pods if other.node == node.metadata.name and other.namespace == "ns"
                       and not other.terminating and c.counts_pods and c.selects(other.labels, "s"))
            counts[i][labels[c.topology_key]] = counts[i].get(labels[c.topology_key], 0) + here
    return counts


@st.composite
def incoming(draw) -> Pod:
    spec: dict = {"containers": [{"name": "c"}], "affinity": {}}
    affinity = draw(st.lists(terms(), max_size=2))
    anti = draw(st.lists(terms(), max_size=2))
    if affinity:
        # a namespaceSelector with labels is refused in affinity terms; {} and lists are not
        spec["affinity"]["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": affinity}
    if anti:
        spec["affinity"]["podAntiAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": anti}
    constraints = []
    for _ in range(draw(st.integers(0, 2))):
        constraint = {"maxSkew": 1, "topologyKey": draw(st.sampled_from(KEYS)), "whenUnsatisfiable": "DoNotSchedule",
                      "nodeTaintsPolicy": draw(st.sampled_from(["Honor", "Ignore"])),
                      "nodeAffinityPolicy": draw(st.sampled_from(["Honor", "Ignore"]))}
        selector = draw(selectors)
        if selector is not None:
            constraint["labelSelector"] = selector
        constraints.append(constraint)
    spec["topologySpreadConstraints"] = constraints
    if draw(st.booleans()):
        spec["nodeSelector"] = {"gpu": "h100"}
    return msgspec.convert({"metadata": {"name": "in", "namespace": "ns", "uid": draw(st.sampled_from(["p0", "new"])),
                                         "labels": draw(label_sets)}, "spec": spec}, Pod)


@settings(max_examples=400, deadline=None)
@given(placed_pods(), incoming())
def test_the_indexed_prefilters_count_what_a_walk_over_every_pod_counts(placement, pod):
    found, gone = placement
    placed = index_of(found, gone)
    uid = pod.metadata.uid
    walked = walk_of(found, gone, uid)
    assert sorted(p.uid for p in placed.all(NOW, without=uid)) == sorted(p.uid for p in walked)

    labels = pod.metadata.labels or {}
    got = ipa.pre_filter("ns", labels, pod.spec, placed, NODE_LABELS.get, now=NOW, without=uid)
    want = affinity_by_walk("ns", labels, pod.spec, walked)
    assert (got is None) == (want is None)
    if got is not None:
        assert (+got.affinity_counts, +got.anti_affinity_counts, +got.existing_anti_affinity_counts,
                got.matches_itself) == (+want.affinity_counts, +want.anti_affinity_counts,
                                        +want.existing_anti_affinity_counts, want.matches_itself)
        for labels_of_node in NODE_LABELS.values():
            assert ipa.filter_node(got, labels_of_node) == ipa.filter_node(want, labels_of_node)
    assert (got is None) == (not (ipa.required_affinity(pod.spec) or ipa.required_anti_affinity(pod.spec))
                             and not want)

    state = spread.pre_filter(pod, spread.NodeDomains.of(NODES), placed, now=NOW)
    if not spread.constraints_of(pod):
        assert state is None
        return
    assert state.counts == spread_by_walk(pod, walked)


def test_a_pod_placed_again_or_gone_leaves_no_trace_in_the_index():
    term = as_terms([{"topologyKey": "zone", "labelSelector": {"matchLabels": {"app": "web"}}}])
    placed = PlacedPods()
    placed.set_bound(PlacedPod(uid="g", namespace="ns", labels={"app": "guard"}, node="a1", anti_affinity=term))
    assert placed.has_anti_affinity()
    # relabelled and without its term: it is found by its new labels only, and selects nobody
    placed.set_bound(PlacedPod(uid="g", namespace="ns", labels={"app": "db"}, node="a1"))
    assert not placed.has_anti_affinity()
    assert [p.uid for p in placed.candidates(("ns",), term[0].label_selector, NOW)] == []
    placed.forget_bound("g")
    assert placed.all(NOW) == []
    # a reservation the node's entry no longer holds is gone; one its pod moved to another node stays
    pod = PlacedPod(uid="r", namespace="ns", labels={"app": "web"}, node="a1", anti_affinity=term)
    placed.set_reserved("a1", {"r": (pod, NOW + 30)})
    moved = PlacedPod(uid="r", namespace="ns", labels={"app": "web"}, node="b2", anti_affinity=term)
    placed.set_reserved("b2", {"r": (moved, NOW + 30)})
    placed.set_reserved("a1", {})
    assert [(p.uid, p.node) for p in placed.all(NOW)] == [("r", "b2")]
    placed.set_reserved("b2", {})
    assert placed.all(NOW) == [] and not placed.has_anti_affinity()

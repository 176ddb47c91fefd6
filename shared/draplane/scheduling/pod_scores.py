"""kube-scheduler's Score for the pod's soft constraints: InterPodAffinity's preferred terms and
PodTopologySpread's ScheduleAnyway constraints. Pure: no I/O.

Each plugin scores a node as kube-scheduler does, then normalizes to 0..100 as its NormalizeScore
does, and the default profile weighs both by 2: `preferences` gives 0..400 per node. The shard adds
it to its own ranking (lower is better) as PREFERENCE_WEIGHT times that, so a full preference is
worth 4: more than packing and fragmentation tie-breakers and scarcity (a few tenths each), less
than one extra PCIe root (10). A soft anti-affinity spreads replicas over nodes that busy-first
packing would have stacked; it does not split a multi-GPU claim across roots.

InterPodAffinity: each placed pod that a preferred affinity term of the pod selects adds the term's
weight to every node in its topology domain, one a preferred anti-affinity term selects takes it
away (kube-scheduler's processTerm). The placed pods' own terms count the other way round, as
kube-scheduler's processExistingPod counts them: a placed pod whose preferred affinity term
selects the pod adds its weight to the domain of the placed pod's node, a preferred anti-affinity
term takes it away, and a required affinity term adds hardPodAffinityWeight (1, the default
profile's). Normalized as (score - min) / (max - min).
PodTopologySpread: per ScheduleAnyway constraint, the matching pods in the node's domain (on the
node itself for kubernetes.io/hostname) times log(domains + 2), plus maxSkew - 1; nodes without
every constraint's key score 0; normalized as (max + min - score) / max, so emptier domains score
higher.

Where draplane differs: kube-scheduler normalizes over the nodes that passed the filters; this
normalizes over every node (the shard filters lazily, best first). The order of nodes within a
plugin is the same; only the scale between the two plugins can differ. A placed pod's terms are
read from the bound pods in the cluster bucket; a pod reserved by a shard but not bound yet scores
with its labels only (its reservation carries no terms). A namespaceSelector with labels in a
placed pod's term is taken as every namespace (shards hold no Namespace objects).

Default spreading: a pod with no topologySpreadConstraints of its own is spread as kube-scheduler's
default profile spreads it (maxSkew 3 over kubernetes.io/hostname, 5 over topology.kubernetes.io/
zone, ScheduleAnyway) among the pods its Services and its ReplicaSet, StatefulSet or
ReplicationController select: the binder, which watches those, puts that selector in the
PendingPod (pod_topology_spread.default_selector). Unlike a pod's own constraints, a node without
a key still scores, by the constraints whose key it has.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

from draplane.api.core import Node, Pod, PodAffinityTerm, PodSpec, WeightedPodAffinityTerm
from draplane.api.policy import LabelSelector
from draplane.scheduling.framework.plugins import pod_topology_spread as spread
from draplane.scheduling.framework.plugins.inter_pod_affinity import PodAffinityError, term_selects
from draplane.scheduling.placed_pods import PlacedPods, term_namespaces

MAX_NODE_SCORE = 100
PLUGIN_WEIGHT = 2  # InterPodAffinity's and PodTopologySpread's weight in the default profile
HARD_POD_AFFINITY_WEIGHT = 1  # InterPodAffinityArgs.hardPodAffinityWeight, the default profile's
PREFERENCE_WEIGHT = 0.01  # per point of the weighted sum, against the device score
HOSTNAME = "kubernetes.io/hostname"


def preferred_terms(pod: Pod) -> tuple[list[WeightedPodAffinityTerm], list[WeightedPodAffinityTerm]]:
    affinity = pod.spec.affinity
    if affinity is None:
        return [], []
    wanted = affinity.pod_affinity.preferred_during_scheduling_ignored_during_execution \
        if affinity.pod_affinity is not None else None
    avoided = affinity.pod_anti_affinity.preferred_during_scheduling_ignored_during_execution \
        if affinity.pod_anti_affinity is not None else None
    return list(wanted or ()), list(avoided or ())


def score_terms(spec: PodSpec) -> tuple[tuple[int, PodAffinityTerm], ...]:
    """The terms with which a placed pod scores another pod's nodes, each with its signed weight
    (PlacedPod.score_terms)."""
    affinity = spec.affinity
    if affinity is None:
        return ()
    found: list[tuple[int, PodAffinityTerm]] = []
    if affinity.pod_affinity is not None:
        found += [(HARD_POD_AFFINITY_WEIGHT, term)
                  for term in affinity.pod_affinity.required_during_scheduling_ignored_during_execution or ()]
        found += [(w.weight, w.pod_affinity_term)
                  for w in affinity.pod_affinity.preferred_during_scheduling_ignored_during_execution or ()]
    if affinity.pod_anti_affinity is not None:
        found += [(-w.weight, w.pod_affinity_term)
                  for w in affinity.pod_anti_affinity.preferred_during_scheduling_ignored_during_execution or ()]
    return tuple(found)


def has_preferences(pod: Pod) -> bool:
    wanted, avoided = preferred_terms(pod)
    return bool(wanted or avoided) or any(
        c.when_unsatisfiable == "ScheduleAnyway" for c in pod.spec.topology_spread_constraints or ())


def inter_pod_affinity(pod: Pod, nodes: Mapping[str, Node], placed: PlacedPods, *, now: float,
                       where: str = "pod") -> dict[str, float] | None:
    """0..100 per node, None when neither the pod's preferred terms nor the placed pods' terms
    select anything."""
    wanted, avoided = preferred_terms(pod)
    namespace = pod.metadata.namespace or "default"
    uid = pod.metadata.uid
    topology: Counter = Counter()
    for weighted_terms, sign in ((wanted, 1), (avoided, -1)):
        for weighted in weighted_terms:
            term = weighted.pod_affinity_term
            for other in placed.candidates(term_namespaces(term, namespace), term.label_selector, now, without=uid):
                node = nodes.get(other.node)
                value = (node.metadata.labels or {}).get(term.topology_key) if node is not None else None
                if value is not None and term_selects(term, namespace, other.namespace, other.labels, where):
                    topology[(term.topology_key, value)] += sign * weighted.weight
    labels = pod.metadata.labels or {}
    for group, holders in placed.score_term_groups(labels, now, without=uid):
        term = group.term
        try:
            selects = term_selects(term, group.namespace, namespace, labels)
        except PodAffinityError:
            # the apiserver validated the placed pod's selector; one that still cannot be read
            # scores nothing rather than keep every other pod from being placed
            continue
        if not selects:
            continue
        for other, times in holders:
            node = nodes.get(other.node)
            value = (node.metadata.labels or {}).get(term.topology_key) if node is not None else None
            if value is not None:
                topology[(term.topology_key, value)] += group.weight * times
    if not any(topology.values()):
        return None
    raw = {name: sum(topology.get(pair, 0) for pair in (node.metadata.labels or {}).items())
           for name, node in nodes.items()}
    low, high = min(raw.values()), max(raw.values())
    if high == low:
        return dict.fromkeys(raw, 0.0)
    return {name: float(int(MAX_NODE_SCORE * ((score - low) / (high - low)))) for name, score in raw.items()}


def topology_spread(pod: Pod, nodes: Mapping[str, Node], placed: PlacedPods, *, now: float,
                    domains: spread.NodeDomains | None = None,
                    default_spread: LabelSelector | None = None) -> dict[str, float] | None:
    """0..100 per node for the pod's ScheduleAnyway constraints, None without any. `domains`: the
    caller's NodeDomains over the same nodes, whose eligible nodes are kept between pods;
    `default_spread`: the pod's default selector, spread by when it has no constraints."""
    if pod.spec.topology_spread_constraints:
        constraints = spread.constraints_of(pod, "ScheduleAnyway")
        require_all_keys = True
    else:
        constraints = spread.default_constraints(default_spread) if default_spread is not None else []
        require_all_keys = False
    if not constraints:
        return None
    namespace = pod.metadata.namespace or "default"
    uid = pod.metadata.uid
    where = f"pod {namespace}/{pod.metadata.name}: spec.topologySpreadConstraints"
    counted = [n for n, node in nodes.items() if not require_all_keys
               or all(c.topology_key in (node.metadata.labels or {}) for c in constraints)]
    ignored = set(nodes) - set(counted)
    per_constraint: list[tuple[spread.Constraint, float, dict[str, int]]] = []
    eligibility = domains if domains is not None else spread.NodeDomains(nodes)
    keys = tuple(dict.fromkeys(c.topology_key for c in constraints)) if require_all_keys else ()
    for i, c in enumerate(constraints):
        labels_of = {n: nodes[n].metadata.labels or {} for n in counted}
        values = {labels_of[n].get(c.topology_key, "") for n in counted}
        size = len(counted) if c.topology_key == HOSTNAME else len(values)
        weight = math.log(size + 2)
        # pods per domain, over the nodes the inclusion policies keep (on the node alone for the
        # hostname, whatever the policies, as kube-scheduler's Score counts it)
        eligible, _ = eligibility.eligible(pod, c, keys)
        per_node: Counter = Counter()
        if c.counts_pods:
            for other in placed.candidates((namespace,), c.selector, now, without=uid):
                if not other.terminating and other.node in nodes and c.selects(other.labels, f"{where}[{i}].labelSelector"):
                    per_node[other.node] += 1
        if c.topology_key == HOSTNAME:
            counts = {n: per_node[n] for n in counted}
        else:
            by_value: Counter = Counter()
            for n, count in per_node.items():
                if n in eligible and eligible[n] in values:
                    by_value[eligible[n]] += count
            counts = {n: by_value[labels_of[n].get(c.topology_key, "")] for n in counted}
        per_constraint.append((c, weight, counts))
    raw: dict[str, int] = {}
    for n in counted:
        labels = nodes[n].metadata.labels or {}
        # (with the pod's own constraints every counted node has every key)
        score = sum(count[n] * weight + (c.max_skew - 1) for c, weight, count in per_constraint
                    if c.topology_key in labels)
        raw[n] = int(math.floor(score + 0.5))  # Go's math.Round for these non-negative scores
    found = dict.fromkeys(ignored, 0.0)
    if raw:
        low, high = min(raw.values()), max(raw.values())
        for n, score in raw.items():
            found[n] = float(MAX_NODE_SCORE if high == 0 else MAX_NODE_SCORE * (high + low - score) // high)
    return found


def preferences(pod: Pod, nodes: Mapping[str, Node], placed: PlacedPods, *, now: float,
                where: str = "pod", domains: spread.NodeDomains | None = None,
                default_spread: LabelSelector | None = None) -> dict[str, float] | None:
    """The weighted sum of both plugins' normalized scores per node (0..400), None when the pod has
    no soft constraints."""
    scores = [s for s in (inter_pod_affinity(pod, nodes, placed, now=now, where=where),
                          topology_spread(pod, nodes, placed, now=now, domains=domains,
                                          default_spread=default_spread)) if s is not None]
    if not scores:
        return None
    return {name: float(sum(PLUGIN_WEIGHT * s.get(name, 0.0) for s in scores)) for name in nodes}


def node_bonus(scores: Mapping[str, float] | None) -> dict[str, float] | None:
    """What the shard takes off each node's score (lower is better) for the preferences."""
    if not scores:
        return None
    return {name: PREFERENCE_WEIGHT * value for name, value in scores.items() if value}

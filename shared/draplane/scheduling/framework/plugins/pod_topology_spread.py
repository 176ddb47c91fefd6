"""kube-scheduler's PodTopologySpread filter: the pod's `whenUnsatisfiable: DoNotSchedule`
constraints. Pure: no I/O.

For each constraint, the domains are the values of its topology key on the eligible nodes: those
that carry every constraint's key and pass its node inclusion policies (the pod's required node
affinity and nodeSelector unless nodeAffinityPolicy is Ignore; the node's NoSchedule/NoExecute
taints only when nodeTaintsPolicy is Honor). A domain counts the pods there in the pod's namespace
that the constraint's selector matches (its labelSelector, with matchLabelKeys' values from the
pod's own labels; no selector, or an empty one, counts none), terminating pods left out. A node
passes when its domain's count, plus one if the pod matches the selector itself, exceeds the
smallest domain's count (0 while there are fewer domains than minDomains) by at most maxSkew.
Reasons: kube-scheduler's "node(s) didn't match pod topology spread constraints", with
" (missing required label)" for a node without the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import msgspec

from draplane.component_helpers.errors import SpecError
from draplane.component_helpers.node_affinity import matches_node_affinity
from draplane.component_helpers.taints import untolerated_taint
from draplane.api.apps import Service
from draplane.api.core import Node, Pod
from draplane.api.policy import LabelSelector, LabelSelectorError, LabelSelectorRequirement, label_selector_matches
from draplane.scheduling.placed_pods import PlacedPods

NAME = "PodTopologySpread"
REASON = "node(s) didn't match pod topology spread constraints"
REASON_MISSING_LABEL = REASON + " (missing required label)"


class SpreadError(ValueError):
    """A constraint that cannot be evaluated; the text names the pod and the field."""


@dataclasses.dataclass(frozen=True, slots=True)
class Constraint:
    max_skew: int
    topology_key: str
    selector: LabelSelector | None
    min_domains: int
    honor_node_affinity: bool
    honor_taints: bool

    def selects(self, labels: Mapping[str, str], where: str) -> bool:
        """The selector as kube-scheduler reads it: none matches no pod, {} every pod."""
        if self.selector is None:
            return False
        try:
            return label_selector_matches(self.selector, labels, where)
        except LabelSelectorError as exc:
            raise SpreadError(str(exc)) from None

    @property
    def counts_pods(self) -> bool:
        """kube-scheduler counts no pod for an empty selector (though the pod matches it itself)."""
        s = self.selector
        return s is not None and bool(s.match_labels or s.match_expressions)


def constraints_of(pod: Pod, when_unsatisfiable: str = "DoNotSchedule") -> list[Constraint]:
    """The pod's DoNotSchedule constraints, which filter (or its ScheduleAnyway ones, which score)."""
    labels = pod.metadata.labels or {}
    found = []
    for c in pod.spec.topology_spread_constraints or ():
        if c.when_unsatisfiable != when_unsatisfiable:
            continue
        selector = c.label_selector
        keys = {k: labels[k] for k in c.match_label_keys or () if k in labels}
        if keys and selector is not None:
            selector = LabelSelector(match_labels={**(selector.match_labels or {}), **keys},
                                     match_expressions=selector.match_expressions)
        found.append(Constraint(max_skew=c.max_skew, topology_key=c.topology_key, selector=selector,
                                min_domains=c.min_domains if c.min_domains is not None else 1,
                                honor_node_affinity=(c.node_affinity_policy or "Honor") == "Honor",
                                honor_taints=(c.node_taints_policy or "Ignore") == "Honor"))
    return found


# kube-scheduler's default profile (defaultingType System): for a pod with no constraints of its
# own, these spread it among the pods its services and controller select, in Score only.
SYSTEM_DEFAULT_SPREAD = (("kubernetes.io/hostname", 3), ("topology.kubernetes.io/zone", 5))

_CONTROLLER_KINDS = {("v1", "ReplicationController"), ("apps/v1", "ReplicaSet"), ("apps/v1", "StatefulSet")}


def default_constraints(selector: LabelSelector) -> list[Constraint]:
    """The system default constraints over the pod's default selector (ScheduleAnyway)."""
    return [Constraint(max_skew=skew, topology_key=key, selector=selector, min_domains=1, honor_node_affinity=True,
                       honor_taints=False) for key, skew in SYSTEM_DEFAULT_SPREAD]


def default_selector(pod: Pod, services: Iterable[Service], controllers: Mapping[tuple[str, str], LabelSelector | dict]
                     ) -> LabelSelector | None:
    """kube-scheduler's DefaultSelector: the labels of every service in the pod's namespace whose
    selector matches the pod, merged, and its controller's selector (a ReplicationController's
    labels merged too; a ReplicaSet's or StatefulSet's requirements added). `controllers`:
    (kind, name) -> selector, of the pod's namespace. None when that selects nothing (no default
    spreading then)."""
    labels = pod.metadata.labels or {}
    merged: dict[str, str] = {}
    for service in services:
        wanted = service.spec.selector
        if wanted is not None and all(labels.get(k) == v for k, v in wanted.items()):
            merged.update(wanted)
    expressions: list[LabelSelectorRequirement] = []
    owner = next((ref for ref in pod.metadata.owner_references or () if ref.controller), None)
    if owner is not None and (owner.api_version, owner.kind) in _CONTROLLER_KINDS:
        found = controllers.get((owner.kind, owner.name))
        if isinstance(found, dict):
            merged.update(found)
        elif found is not None:
            if not _valid(found):
                found = LabelSelector()  # kube-scheduler skips a selector it cannot parse
            expressions += [LabelSelectorRequirement(key=k, operator="In", values=[v])
                            for k, v in sorted((found.match_labels or {}).items())]
            expressions += found.match_expressions or []
    if not merged and not expressions:
        return None
    return LabelSelector(match_labels=merged or None, match_expressions=expressions or None)


def _valid(selector: LabelSelector) -> bool:
    try:
        label_selector_matches(selector, {})
    except LabelSelectorError:
        return False
    return True


@dataclasses.dataclass(slots=True)
class PreFilterState:
    constraints: list[Constraint]
    counts: list[dict[str, int]]  # per constraint: domain value -> matching pods
    self_match: list[bool]
    # per constraint: the count a domain is compared with (kube-scheduler's critical path), or None
    # when no node is eligible; computed once here rather than for every node in filter_node
    smallest: list[int | None] = dataclasses.field(default_factory=list)


_encode = msgspec.json.Encoder().encode


class NodeDomains:
    """The eligible nodes of a constraint and their domains, kept between pods: which nodes count
    depends only on the constraints' keys, the pod's nodeSelector and required node affinity (when
    nodeAffinityPolicy is Honor) and its tolerations (when nodeTaintsPolicy is Honor), so pods alike
    in those share one walk over the nodes. `nodes_changed` forgets them all, for a node added,
    removed, relabelled or retainted."""

    KEPT = 256

    def __init__(self, nodes: Mapping[str, Node]) -> None:
        self._nodes = nodes
        self._eligible: dict[tuple, tuple[dict[str, str], tuple[str, ...]]] = {}

    @classmethod
    def of(cls, nodes: Iterable[Node]) -> NodeDomains:
        return cls({node.metadata.name or "": node for node in nodes})

    def nodes_changed(self) -> None:
        self._eligible.clear()

    def eligible(self, pod: Pod, constraint: Constraint, keys: tuple[str, ...]) -> tuple[dict[str, str], tuple[str, ...]]:
        """(node name -> its domain, the domains) over the nodes that carry every key in `keys` and
        pass the constraint's inclusion policies for the pod."""
        spec = pod.spec
        affinity_key = None
        if constraint.honor_node_affinity:
            node_affinity = spec.affinity.node_affinity if spec.affinity is not None else None
            affinity_key = _encode((spec.node_selector, node_affinity.required_during_scheduling_ignored_during_execution
                                    if node_affinity is not None else None))
        taints_key = _encode(spec.tolerations) if constraint.honor_taints else None
        cache_key = (keys, constraint.topology_key, affinity_key, taints_key)
        found = self._eligible.get(cache_key)
        if found is not None:
            return found
        eligible: dict[str, str] = {}
        for name, node in self._nodes.items():
            labels = node.metadata.labels or {}
            if any(key not in labels for key in keys):
                continue
            try:
                if constraint.honor_node_affinity and not matches_node_affinity(pod, node):
                    continue
            except SpecError:
                continue
            if constraint.honor_taints and untolerated_taint(spec.tolerations or [], (node.spec.taints or []) if node.spec else []):
                continue
            eligible[name] = labels.get(constraint.topology_key, "")  # "": no key (default spreading)
        if len(self._eligible) >= self.KEPT:
            self._eligible.clear()
        found = self._eligible[cache_key] = (eligible, tuple(dict.fromkeys(eligible.values())))
        return found


def pre_filter(pod: Pod, domains: NodeDomains, placed: PlacedPods, *, now: float = 0.0) -> PreFilterState | None:
    """Counts the pods each constraint selects per domain of its eligible nodes. `placed`: the
    placed pods as of `now`; only those a constraint's selector can match are read."""
    constraints = constraints_of(pod)
    if not constraints:
        return None
    namespace = pod.metadata.namespace or "default"
    uid = pod.metadata.uid
    where = f"pod {namespace}/{pod.metadata.name}: spec.topologySpreadConstraints"
    keys = tuple(dict.fromkeys(c.topology_key for c in constraints))
    counts: list[dict[str, int]] = []
    smallest: list[int | None] = []
    for i, c in enumerate(constraints):
        eligible, values = domains.eligible(pod, c, keys)
        here = dict.fromkeys(values, 0)
        if c.counts_pods:
            for other in placed.candidates((namespace,), c.selector, now, without=uid):
                if other.terminating:
                    continue
                value = eligible.get(other.node)
                if value is not None and c.selects(other.labels, f"{where}[{i}].labelSelector"):
                    here[value] += 1
        counts.append(here)
        least = min(here.values()) if here else None
        smallest.append(0 if len(here) < c.min_domains else least)
    own = pod.metadata.labels or {}
    return PreFilterState(constraints, counts,
                          [c.selects(own, f"{where}[{i}].labelSelector") for i, c in enumerate(constraints)],
                          smallest)


def filter_node(state: PreFilterState, node_labels: Mapping[str, str]) -> str | None:
    for i, c in enumerate(state.constraints):
        value = node_labels.get(c.topology_key)
        if value is None:
            return REASON_MISSING_LABEL
        domains = state.counts[i]
        smallest = state.smallest[i]
        if smallest is None:
            continue  # no eligible domain anywhere: kube-scheduler's minimum is then beyond reach
        if domains.get(value, 0) + (1 if state.self_match[i] else 0) - smallest > c.max_skew:
            return REASON
    return None

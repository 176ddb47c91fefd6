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

from draplane.allocation.nodefit import NodeFitError, matches_node_affinity, untolerated_taint
from draplane.api.core import Node, Pod
from draplane.api.policy import LabelSelector, LabelSelectorError, label_selector_matches
from draplane.scheduling.inter_pod_affinity import PlacedPod

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


def constraints_of(pod: Pod) -> list[Constraint]:
    """The pod's DoNotSchedule constraints (ScheduleAnyway ones only score)."""
    labels = pod.metadata.labels or {}
    found = []
    for c in pod.spec.topology_spread_constraints or ():
        if c.when_unsatisfiable != "DoNotSchedule":
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


@dataclasses.dataclass(slots=True)
class PreFilterState:
    constraints: list[Constraint]
    counts: list[dict[str, int]]  # per constraint: domain value -> matching pods
    self_match: list[bool]


def pre_filter(pod: Pod, nodes: Iterable[Node], placed: Iterable[PlacedPod]) -> PreFilterState | None:
    constraints = constraints_of(pod)
    if not constraints:
        return None
    namespace = pod.metadata.namespace or "default"
    where = f"pod {namespace}/{pod.metadata.name}: spec.topologySpreadConstraints"
    per_node: dict[str, list[PlacedPod]] = {}
    for other in placed:
        if other.namespace == namespace and not other.terminating:
            per_node.setdefault(other.node, []).append(other)
    counts: list[dict[str, int]] = [{} for _ in constraints]
    for node in nodes:
        labels = node.metadata.labels or {}
        if any(c.topology_key not in labels for c in constraints):
            continue
        for i, c in enumerate(constraints):
            try:
                if c.honor_node_affinity and not matches_node_affinity(pod, node):
                    continue
            except NodeFitError:
                continue
            if c.honor_taints and untolerated_taint(pod.spec.tolerations or [], (node.spec.taints or []) if node.spec else []):
                continue
            value = labels[c.topology_key]
            here = sum(1 for other in per_node.get(node.metadata.name or "", ())
                       if c.counts_pods and c.selects(other.labels, f"{where}[{i}].labelSelector"))
            counts[i][value] = counts[i].get(value, 0) + here
    own = pod.metadata.labels or {}
    return PreFilterState(constraints, counts,
                          [c.selects(own, f"{where}[{i}].labelSelector") for i, c in enumerate(constraints)])


def filter_node(state: PreFilterState, node_labels: Mapping[str, str]) -> str | None:
    for i, c in enumerate(state.constraints):
        value = node_labels.get(c.topology_key)
        if value is None:
            return REASON_MISSING_LABEL
        domains = state.counts[i]
        smallest = min(domains.values()) if domains else None
        if len(domains) < c.min_domains:
            smallest = 0
        if smallest is None:
            continue  # no eligible domain anywhere: kube-scheduler's minimum is then beyond reach
        if domains.get(value, 0) + (1 if state.self_match[i] else 0) - smallest > c.max_skew:
            return REASON
    return None

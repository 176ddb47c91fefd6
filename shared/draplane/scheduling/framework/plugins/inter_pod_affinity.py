"""kube-scheduler's InterPodAffinity filter, required terms: where a pod may go given the pods
already placed. Pure: no I/O.

Three checks, in kube-scheduler's order, each with its reason string:

1. the pod's required `podAffinity`: every term's topology domain of the node (the value of the
   node's `topologyKey` label) must hold a pod that every term selects; a node without the label
   fails. The first pod of a group that has affinity to itself passes where no pod anywhere
   matches yet (kube-scheduler's self-affinity rule).
2. the pod's required `podAntiAffinity`: no term's domain of the node may hold a pod the term
   selects.
3. the existing pods' required anti-affinity: no pod whose term selects this pod may be in that
   term's domain of the node.

The work is split as kube-scheduler splits it: `pre_filter` counts, once per pod, the matching pods
per (topology key, value); `filter_node` is dictionary lookups per node.

A term selects a pod when the pod is in one of the term's namespaces and its labels match the
term's label selector (no selector: no pod). Namespaces: `namespaces`, or the term owner's own
when neither it nor `namespaceSelector` is set; an empty `namespaceSelector` ({}) is every
namespace. A `namespaceSelector` with labels needs the Namespace objects, which shards do not hold:
in an existing pod's anti-affinity term, or in the pod's own, it is taken as every namespace (it
may keep the pod off a node it could use, never puts it where a rule forbids it); in the pod's own
affinity term, where that would not be safe, the pod is refused with a message naming the field.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from draplane.api.core import PodAffinityTerm, PodSpec
from draplane.api.policy import LabelSelectorError, label_selector_matches
from draplane.scheduling.placed_pods import PlacedPod, PlacedPods, term_namespaces

NAME = "InterPodAffinity"
REASON_AFFINITY = "node(s) didn't match pod affinity rules"
REASON_ANTI_AFFINITY = "node(s) didn't match pod anti-affinity rules"
REASON_EXISTING_ANTI_AFFINITY = "node(s) didn't satisfy existing pods anti-affinity rules"
REASONS = (REASON_AFFINITY, REASON_ANTI_AFFINITY, REASON_EXISTING_ANTI_AFFINITY)


class PodAffinityError(ValueError):
    """A term that cannot be evaluated (a malformed selector, a namespaceSelector with labels in a
    required affinity term); the text names the pod and the field."""


def required_affinity(spec: PodSpec) -> tuple[PodAffinityTerm, ...]:
    affinity = spec.affinity.pod_affinity if spec.affinity is not None else None
    return tuple(affinity.required_during_scheduling_ignored_during_execution or ()) if affinity else ()


def required_anti_affinity(spec: PodSpec) -> tuple[PodAffinityTerm, ...]:
    anti = spec.affinity.pod_anti_affinity if spec.affinity is not None else None
    return tuple(anti.required_during_scheduling_ignored_during_execution or ()) if anti else ()


def term_selects(term: PodAffinityTerm, owner_namespace: str, namespace: str, labels: Mapping[str, str],
                 where: str = "term") -> bool:
    """Whether the term of a pod in `owner_namespace` selects a pod in `namespace` with `labels`."""
    if term.namespace_selector is not None:
        # `namespaces` or the selector: {} is every namespace; one with labels is taken as every
        # namespace too, conservatively (see the module)
        in_scope = True
    else:
        in_scope = namespace in (term.namespaces or (owner_namespace,))
    if not in_scope or term.label_selector is None:
        return False
    try:
        return label_selector_matches(term.label_selector, labels, f"{where}.labelSelector")
    except LabelSelectorError as exc:
        raise PodAffinityError(str(exc)) from None


def _check_affinity_namespaces(terms: tuple[PodAffinityTerm, ...], where: str) -> None:
    for i, term in enumerate(terms):
        selector = term.namespace_selector
        if selector is not None and (selector.match_labels or selector.match_expressions):
            raise PodAffinityError(
                f"{where}.podAffinity.requiredDuringSchedulingIgnoredDuringExecution[{i}].namespaceSelector: "
                "selecting namespaces by their labels is not supported by draplane yet (list them in "
                "`namespaces`, or use {} for every namespace)")


@dataclasses.dataclass(slots=True)
class PreFilterState:
    """What `filter_node` reads, counted once per pod."""

    affinity: tuple[PodAffinityTerm, ...]
    anti_affinity: tuple[PodAffinityTerm, ...]
    # (topology key, value) -> pods there that every affinity term selects (one count per term)
    affinity_counts: Counter
    # (topology key, value) -> pods there that an anti-affinity term of the pod selects
    anti_affinity_counts: Counter
    # (topology key, value) -> existing pods there whose anti-affinity term selects the pod
    existing_anti_affinity_counts: Counter
    # the pod matches its own affinity terms (the first of a group with affinity to itself)
    matches_itself: bool


def pre_filter(namespace: str, labels: Mapping[str, str], spec: PodSpec, placed: PlacedPods,
               node_labels: Callable[[str], Mapping[str, str] | None], where: str = "pod", *,
               now: float = 0.0, without: str | None = None) -> PreFilterState | None:
    """None when there is nothing to check (the pod has no required terms and no placed pod's
    anti-affinity selects it). `placed`: the placed pods, as of `now`, `without` the pod itself;
    only those a term can select are read (`PlacedPods.candidates`)."""
    affinity = required_affinity(spec)
    anti_affinity = required_anti_affinity(spec)
    _check_affinity_namespaces(affinity, f"{where}: spec.affinity")
    existing = Counter()
    for group, holders in placed.anti_affinity_groups(labels, now, without=without):
        first_uid, index = group.first
        if not term_selects(group.term, group.namespace, namespace, labels,
                            f"pod {group.namespace}/{first_uid}: podAntiAffinity term {index}"):
            continue
        key = group.term.topology_key
        for other, times in holders:
            other_labels = node_labels(other.node)
            value = other_labels.get(key) if other_labels is not None else None
            if value is not None:
                existing[(key, value)] += times
    if not affinity and not anti_affinity:
        if not existing:
            return None
        return PreFilterState((), (), Counter(), Counter(), existing, False)
    affinity_counts: Counter = Counter()
    anti_counts: Counter = Counter()
    if affinity:
        # a pod every term selects is among the first term's candidates
        first = affinity[0]
        for other in placed.candidates(term_namespaces(first, namespace), first.label_selector, now, without=without):
            other_labels = node_labels(other.node)
            if other_labels is None:
                continue
            if all(term_selects(term, namespace, other.namespace, other.labels, where) for term in affinity):
                for term in affinity:
                    value = other_labels.get(term.topology_key)
                    if value is not None:
                        affinity_counts[(term.topology_key, value)] += 1
    for term in anti_affinity:
        for other in placed.candidates(term_namespaces(term, namespace), term.label_selector, now, without=without):
            other_labels = node_labels(other.node)
            value = other_labels.get(term.topology_key) if other_labels is not None else None
            if value is not None and term_selects(term, namespace, other.namespace, other.labels, where):
                anti_counts[(term.topology_key, value)] += 1
    matches_itself = bool(affinity) and all(term_selects(term, namespace, namespace, labels, where) for term in affinity)
    return PreFilterState(affinity, anti_affinity, affinity_counts, anti_counts, existing, matches_itself)


def filter_node(state: PreFilterState, node_labels: Mapping[str, str]) -> str | None:
    """The reason the node fails, None when it passes."""
    if state.affinity:
        pods_exist = True
        for term in state.affinity:
            value = node_labels.get(term.topology_key)
            if value is None:
                return REASON_AFFINITY  # every topology label must be on the node, self-affinity too
            if state.affinity_counts[(term.topology_key, value)] <= 0:
                pods_exist = False
        if not pods_exist and not (not state.affinity_counts and state.matches_itself):
            return REASON_AFFINITY
    for term in state.anti_affinity:
        value = node_labels.get(term.topology_key)
        if value is not None and state.anti_affinity_counts[(term.topology_key, value)] > 0:
            return REASON_ANTI_AFFINITY
    if state.existing_anti_affinity_counts:
        for key, value in node_labels.items():
            if state.existing_anti_affinity_counts[(key, value)] > 0:
                return REASON_EXISTING_ANTI_AFFINITY
    return None


HOSTNAME_LABEL = "kubernetes.io/hostname"


def conflicts_on_one_node(namespace: str, labels: Mapping[str, str], anti_affinity: Iterable[PodAffinityTerm],
                          others: Iterable[PlacedPod]) -> bool:
    """Whether, on one node, the pod's hostname-scoped anti-affinity selects one of `others`, or one
    of theirs selects the pod: what a node's reservation entry can check at commit, so two shards
    placing at once cannot both put such a pair on one node."""
    anti_affinity = [t for t in anti_affinity if t.topology_key == HOSTNAME_LABEL]
    for other in others:
        if any(term_selects(t, namespace, other.namespace, other.labels) for t in anti_affinity):
            return True
        if any(t.topology_key == HOSTNAME_LABEL and term_selects(t, other.namespace, namespace, labels)
               for t in other.anti_affinity):
            return True
    return False

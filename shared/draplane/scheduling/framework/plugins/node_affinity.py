"""NodeAffinity: the pod's `spec.nodeSelector` and its required node affinity hold on the node.

Its PreFilter narrows the nodes when every required term names them (matchFields metadata.name
In; the runtime merges that with NodeName's), and terms that name no node in common refuse the pod
on every node."""

from __future__ import annotations

from draplane.api.core import Pod
from draplane.component_helpers.node_affinity import matches_node_affinity
from draplane.scheduling.framework.interface import NodeInfo, PreFilterRejected, Rejection

NAME = "NodeAffinity"
REASON = "node(s) didn't match Pod's node affinity/selector"
REASON_CONFLICT = "pod affinity terms conflict"


def node_names_required(pod: Pod) -> frozenset[str] | None:
    """NodeAffinity's PreFilter: the nodes the pod's required node affinity can only mean, when
    every term names them (matchFields metadata.name In; within a term the names intersect,
    across terms they add up); None when some term does not, so every node is looked at. An
    empty set: the terms conflict and no node can be."""
    affinity = pod.spec.affinity.node_affinity if pod.spec.affinity else None
    required = affinity.required_during_scheduling_ignored_during_execution if affinity else None
    if required is None or not required.node_selector_terms:
        return None
    names: set[str] = set()
    for term in required.node_selector_terms:
        in_term: set[str] | None = None
        for field in term.match_fields or ():
            if field.key == "metadata.name" and field.operator == "In":
                values = set(field.values or ())
                in_term = values if in_term is None else in_term & values
        if in_term is None:
            return None
        names |= in_term
    return frozenset(names)


def pre_filter(pod: Pod) -> frozenset[str] | None:
    """The nodes the pod can only go to (None: every node is looked at); raises PreFilterRejected
    when its terms name no node in common."""
    named = node_names_required(pod)
    if named is not None and not named:
        raise PreFilterRejected(NAME, REASON_CONFLICT)
    return named


def filter_node(pod: Pod, node: NodeInfo) -> Rejection | None:
    if matches_node_affinity(pod, node.node):
        return None
    return Rejection(NAME, (REASON,))

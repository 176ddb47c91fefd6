"""Does a node selector match a node (component-helpers' nodeaffinity): a term's requirements
are ANDed, the terms of a selector ORed; a pod's `spec.nodeSelector` and its required node
affinity must both hold. A malformed requirement raises SpecError naming the field, where
Kubernetes' validation would have refused it."""

from __future__ import annotations

from typing import Mapping

from draplane.api.core import Node, Pod
from draplane.api.meta import NodeSelectorRequirement, NodeSelectorTerm
from draplane.component_helpers.errors import SpecError


def _requirement_matches(req: NodeSelectorRequirement, labels: Mapping[str, str], where: str) -> bool:
    op = req.operator
    values = req.values or []
    present = req.key in labels
    if op in ("In", "NotIn"):
        if not values:
            raise SpecError(f"{where}: operator {op} needs at least one value")
        if op == "In":
            return present and labels[req.key] in values
        return not present or labels[req.key] not in values
    if op in ("Exists", "DoesNotExist"):
        if values:
            raise SpecError(f"{where}: operator {op} takes no values")
        return present if op == "Exists" else not present
    if op in ("Gt", "Lt"):
        if len(values) != 1:
            raise SpecError(f"{where}: operator {op} needs exactly one value")
        try:
            bound = int(values[0])
        except ValueError:
            raise SpecError(f"{where}: operator {op} needs an integer value, got {values[0]!r}") from None
        if not present:
            return False
        try:
            actual = int(labels[req.key])
        except ValueError:
            return False  # a label that is not a number matches neither Gt nor Lt
        return actual > bound if op == "Gt" else actual < bound
    raise SpecError(f"{where}: unknown operator {op!r} (In, NotIn, Exists, DoesNotExist, Gt, Lt)")


def _field_matches(req: NodeSelectorRequirement, node_name: str, where: str) -> bool:
    if req.key != "metadata.name":
        raise SpecError(f"{where}: only metadata.name is supported in matchFields, got {req.key!r}")
    if req.operator not in ("In", "NotIn"):
        raise SpecError(f"{where}: matchFields supports In and NotIn, got {req.operator!r}")
    # The apiserver allows a single value here; more would make the term ambiguous.
    if len(req.values or []) != 1:
        raise SpecError(f"{where}: matchFields metadata.name needs exactly one value")
    return _requirement_matches(req, {"metadata.name": node_name}, where)


def term_matches(term: NodeSelectorTerm, labels: Mapping[str, str], node_name: str, where: str = "term") -> bool:
    """All requirements of the term hold. A term with none matches no node, as in Kubernetes."""
    expressions = term.match_expressions or []
    fields = term.match_fields or []
    if not expressions and not fields:
        return False
    for i, req in enumerate(expressions):
        if not _requirement_matches(req, labels, f"{where}.matchExpressions[{i}]"):
            return False
    for i, req in enumerate(fields):
        if not _field_matches(req, node_name, f"{where}.matchFields[{i}]"):
            return False
    return True


def matches_node_affinity(pod: Pod, node: Node) -> bool:
    """spec.nodeSelector and requiredDuringSchedulingIgnoredDuringExecution both hold."""
    labels = node.metadata.labels or {}
    for key, value in (pod.spec.node_selector or {}).items():
        if labels.get(key) != value:
            return False
    affinity = pod.spec.affinity.node_affinity if pod.spec.affinity else None
    required = affinity.required_during_scheduling_ignored_during_execution if affinity else None
    if required is None:
        return True
    name = pod.metadata.name or "<unnamed>"
    base = f"pod {name}: spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    node_name = node.metadata.name or ""
    return any(
        term_matches(term, labels, node_name, f"{base}.nodeSelectorTerms[{i}]")
        for i, term in enumerate(required.node_selector_terms)
    )

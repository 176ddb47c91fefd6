"""Node fit: can this pod run on this node at all, before any device is looked at?

The checks kube-scheduler's filter plugins make, in the same order and with the same reason
strings, so that a user reading "why is my pod pending" sees what they would see with kube-scheduler:

- NodeUnschedulable: `spec.unschedulable` unless the pod tolerates `node.kubernetes.io/unschedulable`;
- TaintToleration: every NoSchedule/NoExecute taint must be tolerated;
- NodeAffinity: `spec.nodeSelector` and required node affinity (terms ORed, requirements ANDed);
- NodePorts: no host port the pod asks for is held on the node already;
- NodeResourcesFit: pod slots, CPU, memory, ephemeral storage and every other scalar resource the
  pod requests, against allocatable minus what the pods already bound to the node request.

Pure: no I/O. Requests are integers in the units the scheduler compares (CPU in millicores,
everything else in base units, rounded up), computed once per pod so that a simulator can keep
running totals per node instead of re-reading every bound pod.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import msgspec

from draplane.api.core import Container, Node, Pod, PodSpec, Taint, Toleration
from draplane.api.meta import NodeSelectorRequirement, NodeSelectorTerm
from draplane.api.quantity import QuantityError, parse_quantity
from draplane.allocation.tolerations import tolerates

CPU = "cpu"
MEMORY = "memory"
EPHEMERAL_STORAGE = "ephemeral-storage"
PODS = "pods"

UNSCHEDULABLE_TAINT_KEY = "node.kubernetes.io/unschedulable"

REASON_UNSCHEDULABLE = "node(s) were unschedulable"
REASON_AFFINITY = "node(s) didn't match Pod's node affinity/selector"
REASON_TOO_MANY_PODS = "Too many pods"
REASON_TAINT_PREFIX = "node(s) had untolerated taint "
# What kube-scheduler 1.37 counts for a node with an untolerated taint: it no longer names the
# taint (our own detail still does).
REASON_TAINTS = "node(s) had untolerated taint(s)"
REASON_NODE_PORTS = "node(s) didn't have free ports for the requested pod ports"
# NodeAffinity's PreFilter: every required term names its nodes (matchFields metadata.name In), and
# no node is left; a node outside the names is not filtered at all, only counted under this
REASON_AFFINITY_CONFLICT = "pod affinity terms conflict"
REASON_NOT_NAMED_BY_AFFINITY = "node(s) didn't satisfy plugin(s) [NodeAffinity]"

ALL_HOST_IPS = "0.0.0.0"


class HostPort(msgspec.Struct, frozen=True, array_like=True):
    """A host port a pod holds on its node, with kube-scheduler's defaults filled in."""

    protocol: str
    ip: str
    port: int


def pod_host_ports(spec: PodSpec) -> tuple[HostPort, ...]:
    """The host ports the pod holds, as kube-scheduler's GetHostPorts reads them: every container's,
    and those of init containers that run as long as the pod (restartPolicy Always)."""
    containers = [c for c in spec.init_containers or () if c.restart_policy == "Always"] + list(spec.containers)
    return tuple(HostPort(p.protocol or "TCP", p.host_ip or ALL_HOST_IPS, p.host_port)
                 for c in containers for p in c.ports or () if (p.host_port or 0) > 0)


def ports_conflict(wanted: Iterable[HostPort], in_use: Iterable[HostPort]) -> bool:
    """kube-scheduler's HostPortInfo.CheckConflict for each wanted port: the same protocol and
    port, held on the same IP, or on 0.0.0.0 by either side."""
    in_use = list(in_use)
    for w in wanted:
        for u in in_use:
            if u.port == w.port and u.protocol == w.protocol and (
                    w.ip == ALL_HOST_IPS or u.ip == ALL_HOST_IPS or u.ip == w.ip):
                return True
    return False


class NodeFitError(ValueError):
    """A pod or node whose fields cannot be read (a bad quantity, a malformed selector)."""


@dataclass(frozen=True, slots=True)
class NodeFit:
    """The outcome for one node: fits when there is no reason against it."""

    node: str
    reasons: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return not self.reasons

    @property
    def scheduler_reasons(self) -> tuple[str, ...]:
        """The reasons kube-scheduler would report for this node: its filters run in the order
        NodeUnschedulable, TaintToleration, NodeAffinity, NodePorts, NodeResourcesFit, and it
        stops at the first that rejects the node, so only that one's reasons are counted."""
        if REASON_UNSCHEDULABLE in self.reasons:
            return (REASON_UNSCHEDULABLE,)
        if any(r.startswith(REASON_TAINT_PREFIX) for r in self.reasons):
            return (REASON_TAINTS,)
        for reason in (REASON_AFFINITY, REASON_NODE_PORTS):
            if reason in self.reasons:
                return (reason,)
        return self.reasons

    def __str__(self) -> str:
        return f"{self.node}: fits" if self.fits else f"{self.node}: {', '.join(self.reasons)}"


# --- quantities ----------------------------------------------------------------------------------


def _units(resource: str, text: str, where: str) -> int:
    """The integer the scheduler compares: millicores for CPU, rounded-up base units otherwise."""
    try:
        return _parsed_units(resource, text)
    except QuantityError as exc:
        raise NodeFitError(f"{where}[{resource!r}]: {exc}") from None


# Every shard reads the requests of every pod bound anywhere, and pods of one workload say the
# same few quantities: parsing them was 3 % of a follower shard's CPU. An invalid one raises and
# is not kept; the bound keeps odd inputs from growing it.
@functools.lru_cache(maxsize=4096)
def _parsed_units(resource: str, text: str) -> int:
    value = parse_quantity(text).value
    if resource == CPU:
        value *= 1000
    return -((-value.numerator) // value.denominator)


def _container_requests(container: Container, where: str) -> dict[str, int]:
    resources = container.resources
    if resources is None:
        return {}
    # The apiserver defaults a missing request to the limit; pods read from files have not been
    # through it, so do the same here.
    merged = dict(resources.limits or {})
    merged.update(resources.requests or {})
    return {name: _units(name, text, f"{where}.resources.requests") for name, text in merged.items()}


def pod_requests(pod: Pod) -> dict[str, int]:
    """What the pod asks of its node: max(sum of containers, largest init container) + overhead."""
    name = pod.metadata.name or "<unnamed>"
    total: dict[str, int] = {}
    for i, container in enumerate(pod.spec.containers):
        for resource, amount in _container_requests(container, f"pod {name}: spec.containers[{i}]").items():
            total[resource] = total.get(resource, 0) + amount
    # Init containers run one after another before the app containers, so only the largest counts.
    for i, container in enumerate(pod.spec.init_containers or ()):
        for resource, amount in _container_requests(container, f"pod {name}: spec.initContainers[{i}]").items():
            if amount > total.get(resource, 0):
                total[resource] = amount
    for resource, text in (pod.spec.overhead or {}).items():
        total[resource] = total.get(resource, 0) + _units(resource, text, f"pod {name}: spec.overhead")
    return total


def node_allocatable(node: Node) -> dict[str, int]:
    name = node.metadata.name or "<unnamed>"
    allocatable = (node.status.allocatable if node.status else None) or {}
    return {r: _units(r, text, f"node {name}: status.allocatable") for r, text in allocatable.items()}


def sum_requests(pods: Iterable[Pod]) -> tuple[dict[str, int], int]:
    """Total requests of the pods bound to a node, and how many there are."""
    total: dict[str, int] = {}
    count = 0
    for pod in pods:
        count += 1
        for resource, amount in pod_requests(pod).items():
            total[resource] = total.get(resource, 0) + amount
    return total, count


# --- NodeResourcesFit ----------------------------------------------------------------------------


def insufficient_resources(
    requests: Mapping[str, int],
    allocatable: Mapping[str, int],
    in_use: Mapping[str, int],
    bound_pod_count: int,
) -> list[str]:
    """Reasons the node lacks room, in kube-scheduler's order and words; empty when it fits."""
    reasons: list[str] = []
    # kube-scheduler treats a node without `pods` in allocatable as holding none; every kubelet
    # reports it, so a missing entry here means a hand-written node, which we do not limit.
    if PODS in allocatable and bound_pod_count + 1 > allocatable[PODS]:
        reasons.append(REASON_TOO_MANY_PODS)
    for resource in (CPU, MEMORY, EPHEMERAL_STORAGE):
        wanted = requests.get(resource, 0)
        if wanted > 0 and wanted > allocatable.get(resource, 0) - in_use.get(resource, 0):
            reasons.append(f"Insufficient {resource}")
    for resource in sorted(requests):
        if resource in (CPU, MEMORY, EPHEMERAL_STORAGE, PODS):
            continue
        wanted = requests[resource]
        # A request of zero is satisfied by any node, even one that never heard of the resource.
        if wanted > 0 and wanted > allocatable.get(resource, 0) - in_use.get(resource, 0):
            reasons.append(f"Insufficient {resource}")
    return reasons


# --- NodeAffinity --------------------------------------------------------------------------------


def _requirement_matches(req: NodeSelectorRequirement, labels: Mapping[str, str], where: str) -> bool:
    op = req.operator
    values = req.values or []
    present = req.key in labels
    if op in ("In", "NotIn"):
        if not values:
            raise NodeFitError(f"{where}: operator {op} needs at least one value")
        if op == "In":
            return present and labels[req.key] in values
        return not present or labels[req.key] not in values
    if op in ("Exists", "DoesNotExist"):
        if values:
            raise NodeFitError(f"{where}: operator {op} takes no values")
        return present if op == "Exists" else not present
    if op in ("Gt", "Lt"):
        if len(values) != 1:
            raise NodeFitError(f"{where}: operator {op} needs exactly one value")
        try:
            bound = int(values[0])
        except ValueError:
            raise NodeFitError(f"{where}: operator {op} needs an integer value, got {values[0]!r}") from None
        if not present:
            return False
        try:
            actual = int(labels[req.key])
        except ValueError:
            return False  # a label that is not a number matches neither Gt nor Lt
        return actual > bound if op == "Gt" else actual < bound
    raise NodeFitError(f"{where}: unknown operator {op!r} (In, NotIn, Exists, DoesNotExist, Gt, Lt)")


def _field_matches(req: NodeSelectorRequirement, node_name: str, where: str) -> bool:
    if req.key != "metadata.name":
        raise NodeFitError(f"{where}: only metadata.name is supported in matchFields, got {req.key!r}")
    if req.operator not in ("In", "NotIn"):
        raise NodeFitError(f"{where}: matchFields supports In and NotIn, got {req.operator!r}")
    # The apiserver allows a single value here; more would make the term ambiguous.
    if len(req.values or []) != 1:
        raise NodeFitError(f"{where}: matchFields metadata.name needs exactly one value")
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


# --- TaintToleration and NodeUnschedulable -------------------------------------------------------


def untolerated_taint(tolerations: Sequence[Toleration], taints: Sequence[Taint]) -> Taint | None:
    """The first NoSchedule/NoExecute taint no toleration covers (PreferNoSchedule never blocks)."""
    for taint in taints:
        if taint.effect not in ("NoSchedule", "NoExecute"):
            continue
        if not any(tolerates(t, taint) for t in tolerations):
            return taint
    return None


def _taint_reason(taint: Taint) -> str:
    inner = f"{taint.key}: {taint.value}" if taint.value else taint.key
    return f"{REASON_TAINT_PREFIX}{{{inner}}}"


# --- the whole filter ----------------------------------------------------------------------------


def node_fit(
    pod: Pod,
    node: Node,
    bound_pods: Iterable[Pod] = (),
    *,
    requests: Mapping[str, int] | None = None,
    in_use: tuple[Mapping[str, int], int] | None = None,
    ports_in_use: Iterable[HostPort] | None = None,
) -> NodeFit:
    """Every reason the pod cannot go to the node (none: it fits, devices aside).

    `requests` (from pod_requests) and `in_use` (from sum_requests over the bound pods) may be
    passed in by callers that keep them per node, to avoid recomputing them for every pod; so may
    `ports_in_use`, the host ports the pods there hold (from the bound pods without it).
    """
    node_name = node.metadata.name or "<unnamed>"
    bound_pods = tuple(bound_pods)  # read twice: for their ports and their requests
    tolerations = pod.spec.tolerations or []
    reasons: list[str] = []
    spec = node.spec
    if spec is not None and spec.unschedulable:
        cordon = Taint(key=UNSCHEDULABLE_TAINT_KEY, effect="NoSchedule")
        if not any(tolerates(t, cordon) for t in tolerations):
            reasons.append(REASON_UNSCHEDULABLE)
    if not matches_node_affinity(pod, node):
        reasons.append(REASON_AFFINITY)
    taint = untolerated_taint(tolerations, (spec.taints or []) if spec else [])
    if taint is not None:
        reasons.append(_taint_reason(taint))
    wanted_ports = pod_host_ports(pod.spec)
    if wanted_ports:
        held = ports_in_use if ports_in_use is not None else (
            port for other in bound_pods for port in pod_host_ports(other.spec))
        if ports_conflict(wanted_ports, held):
            reasons.append(REASON_NODE_PORTS)
    if requests is None:
        requests = pod_requests(pod)
    used, count = in_use if in_use is not None else sum_requests(bound_pods)
    reasons.extend(insufficient_resources(requests, node_allocatable(node), used, count))
    return NodeFit(node=node_name, reasons=tuple(reasons))

"""One pod's scheduling cycle through kube-scheduler's default profile.

kube-scheduler runs a pod's PreFilters once, then its Filters node by node in the profile's order,
and the first plugin to refuse a node names it in `0/N nodes are available: …`. The same here:

- `DEFAULT_FILTERS`: the default profile's Filter plugins, in its order (the oracle test holds it
  to kube-scheduler's own list);
- `node_fit`: the Filters that read only the node and the pods on it (NodeName through
  NodeResourcesFit, and NodeDeclaredFeatures). It runs all of them, so that our detail lists every
  reason and preemption can tell which plugins no eviction cures; kube-scheduler's count takes the
  first;
- `volume_filters`: VolumeRestrictions, NodeVolumeLimits, VolumeBinding and VolumeZone over what
  the binder's PreFilter found of the pod's volumes (`volume_binding.PodVolumes`);
  `volume_plan` is VolumeBinding's PreBind after them;
- `Cycle`: the pod's PreFilter results, and `filter_node`, every Filter in order for one node.

Score, Reserve and PreBind run where their state lives: scores in `placing` (the device score and
`pod_scores`), Reserve in the shard's reservation (`draplane.scheduling.reservations`), PreBind in
the binder's placement writer, each with its undo beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Mapping

from draplane.api.core import Node, Pod
from draplane.component_helpers.errors import SpecError
from draplane.component_helpers.resource import pod_requests, sum_requests
from draplane.scheduling.framework.interface import HostPort, NodeInfo, PreFilterRejected, Rejection
from draplane.scheduling.framework.plugins import (
    dynamic_resources,
    inter_pod_affinity,
    node_affinity,
    node_declared_features,
    node_name,
    node_ports,
    node_resources_fit,
    node_unschedulable,
    node_volume_limits,
    pod_topology_spread,
    taint_toleration,
    volume_binding,
    volume_restrictions,
    volume_zone,
)

# kube-scheduler 1.37's default profile, Filter extension point, in order.
DEFAULT_FILTERS = (
    node_name.NAME,
    node_unschedulable.NAME,
    taint_toleration.NAME,
    node_affinity.NAME,
    node_ports.NAME,
    node_resources_fit.NAME,
    volume_restrictions.NAME,
    node_volume_limits.NAME,
    volume_binding.NAME,
    volume_zone.NAME,
    pod_topology_spread.NAME,
    inter_pod_affinity.NAME,
    dynamic_resources.NAME,
    node_declared_features.NAME,
)

# Refusals that no eviction on the node cures (UnschedulableAndUnresolvable in kube-scheduler),
# read with every pod gone. NodePorts is curable (its holder can be evicted) but callers that do
# not rerun it with victims gone count it here too.
NODE_LOCAL_UNRESOLVABLE = frozenset({node_unschedulable.NAME, node_name.NAME, taint_toleration.NAME,
                                     node_affinity.NAME, node_declared_features.NAME})


@dataclass(frozen=True, slots=True)
class NodeFit:
    """The node-local Filters' verdict on one node: it fits when none refuses it."""

    node: str
    rejections: tuple[Rejection, ...] = ()

    @property
    def fits(self) -> bool:
        return not self.rejections

    @property
    def reasons(self) -> tuple[str, ...]:
        """Every reason, in our own words, in the order the plugins run."""
        return tuple(d for r in self.rejections for d in r.details)

    @property
    def scheduler_reasons(self) -> tuple[str, ...]:
        """What kube-scheduler counts for the node: the first refusing plugin's reasons."""
        return self.rejections[0].reasons if self.rejections else ()

    @property
    def plugins(self) -> tuple[str, ...]:
        return tuple(r.plugin for r in self.rejections)

    def __str__(self) -> str:
        return f"{self.node}: fits" if self.fits else f"{self.node}: {', '.join(self.reasons)}"


def node_fit(
    pod: Pod,
    node: Node,
    bound_pods: Iterable[Pod] = (),
    *,
    requests: Mapping[str, int] | None = None,
    in_use: tuple[Mapping[str, int], int] | None = None,
    ports_in_use: Iterable[HostPort] | None = None,
) -> NodeFit:
    """NodeName, NodeUnschedulable, TaintToleration, NodeAffinity, NodePorts, NodeResourcesFit and
    NodeDeclaredFeatures on the node, against the pods bound there. Raises SpecError for a field that cannot be read.

    `requests` (from pod_requests) and `in_use` (from sum_requests over the bound pods) may be
    passed in by callers that keep them per node, to avoid recomputing them for every pod; so may
    `ports_in_use`, the host ports the pods there hold (from the bound pods without it)."""
    bound_pods = tuple(bound_pods)  # read twice: for their ports and their requests
    if requests is None:
        requests = pod_requests(pod)
    used, count = in_use if in_use is not None else sum_requests(bound_pods)
    held = ports_in_use if ports_in_use is not None else (
        port for other in bound_pods for port in node_ports.pod_host_ports(other.spec))
    info = NodeInfo(node=node, requested=used, pod_count=count, ports=held)
    found = [
        node_name.filter_node(pod, info),
        node_unschedulable.filter_node(pod, info),
        taint_toleration.filter_node(pod, info),
        node_affinity.filter_node(pod, info),
        node_ports.filter_node(node_ports.pre_filter(pod), info),
        node_resources_fit.filter_node(requests, info),
        node_declared_features.filter_node(node_declared_features.pre_filter(pod), info),
    ]
    return NodeFit(node=info.name or "<unnamed>", rejections=tuple(r for r in found if r is not None))


def volume_filters(volumes: volume_binding.PodVolumes | None, node: str,
                   labels: Mapping[str, str]) -> Rejection | None:
    """VolumeRestrictions, NodeVolumeLimits, VolumeBinding, then VolumeZone: the first to refuse."""
    if volumes is None:
        return None
    reason = volume_restrictions.filter_node(volumes.in_use_elsewhere)
    if reason is not None:
        return Rejection(volume_restrictions.NAME, (reason,))
    reason = node_volume_limits.filter_over_limit(volumes.over_limit, node)
    if reason is not None:
        return Rejection(node_volume_limits.NAME, (reason,))
    found, _ = volume_binding.filter_node(volumes, node, labels)
    if found:
        return Rejection(volume_binding.NAME, tuple(found))
    reason = volume_zone.filter_node((b.zones for b in volumes.bound), labels)
    if reason is not None:
        return Rejection(volume_zone.NAME, (reason,))
    return None


def volume_reasons(volumes: volume_binding.PodVolumes | None, node: str, labels: Mapping[str, str]) -> list[str]:
    """volume_filters' reasons for the node (none: its volumes let the pod run there)."""
    rejection = volume_filters(volumes, node, labels)
    return list(rejection.reasons) if rejection is not None else []


def volume_plan(volumes: volume_binding.PodVolumes | None, node: str,
                labels: Mapping[str, str]) -> volume_binding.VolumePlan | list[str]:
    """VolumeBinding's PreBind on the chosen node: what to bind and provision there, or the
    reasons the node no longer will do (the volumes changed since the shard looked)."""
    found = volume_reasons(volumes, node, labels)
    if found:
        return found
    return volume_binding.plan_for_node(volumes, node, labels)


@dataclass(frozen=True, slots=True)
class NamedNodes:
    """What the PreFilters that name nodes (NodeAffinity, NodeName) leave: the nodes all of them
    allow, and how kube-scheduler counts every other node."""

    nodes: frozenset[str]
    plugins: tuple[str, ...]

    @property
    def left_out(self) -> Rejection:
        reason = f"node(s) didn't satisfy plugin(s) [{' '.join(self.plugins)}]"
        return Rejection(self.plugins[0] if len(self.plugins) == 1 else "", (reason,))


def named_nodes(pod: Pod) -> NamedNodes | None:
    """NodeAffinity's and NodeName's PreFilters, merged as kube-scheduler merges PreFilter results:
    None when neither narrows the nodes. Raises PreFilterRejected when NodeAffinity's terms
    conflict, or when the two name no node in common."""
    merged: frozenset[str] | None = None
    plugins: list[str] = []
    for plugin, names in ((node_affinity.NAME, node_affinity.pre_filter(pod)), (node_name.NAME, node_name.pre_filter(pod))):
        if names is None:
            continue
        plugins.append(plugin)
        merged = names if merged is None else merged & names
        if not merged:
            listed = sorted(plugins)
            reason = (f"node(s) didn't satisfy plugin {listed[0]}" if len(listed) == 1
                      else f"node(s) didn't satisfy plugin(s) [{' '.join(listed)}] simultaneously")
            raise PreFilterRejected("", reason)
    return NamedNodes(merged, tuple(sorted(plugins))) if merged is not None else None


@dataclass
class Cycle:
    """One pod's PreFilter results and its Filters, node by node, in the default profile's order
    (DynamicResources' device search is run by the caller on the nodes this passes; where the
    devices do not fit a node that only NodeDeclaredFeatures refuses, `placing` names the devices).

    `node_local` is node_fit for the pod on a node; the caller may answer it from a cache."""

    pod: Pod
    node_local: Callable[[Node], NodeFit]
    named: NamedNodes | None = None
    volumes: volume_binding.PodVolumes | None = None
    spreading: pod_topology_spread.PreFilterState | None = None
    affinity: inter_pod_affinity.PreFilterState | None = None
    pinned: Collection[str] = ()
    rejections: dict[str, Rejection] = field(default_factory=dict)

    def filter_node(self, node: Node) -> Rejection | None:
        """The first Filter that refuses the node (recorded in `rejections`), or None."""
        rejection = self._first_refusal(node)
        if rejection is not None:
            self.rejections[node.metadata.name or ""] = rejection
        return rejection

    def _first_refusal(self, node: Node) -> Rejection | None:
        name = node.metadata.name or ""
        if self.named is not None and name not in self.named.nodes:
            return self.named.left_out  # left out by a PreFilter: no Filter runs there
        try:
            fit = self.node_local(node)
        except SpecError as exc:
            return Rejection("", (str(exc),))
        # NodeDeclaredFeatures is node-local, but the profile's last Filter: any other refusal
        # names the node before it does
        last: Rejection | None = None
        if not fit.fits:
            first = fit.rejections[0]
            if first.plugin != node_declared_features.NAME:
                return Rejection(first.plugin, first.reasons, fit.reasons)
            last = first
        labels = node.metadata.labels or {}
        rejection = volume_filters(self.volumes, name, labels)
        if rejection is not None:
            return rejection
        if self.spreading is not None:
            reason = pod_topology_spread.filter_node(self.spreading, labels)
            if reason is not None:
                return Rejection(pod_topology_spread.NAME, (reason,))
        if self.affinity is not None:
            reason = inter_pod_affinity.filter_node(self.affinity, labels)
            if reason is not None:
                return Rejection(inter_pod_affinity.NAME, (reason,))
        if self.pinned and name not in self.pinned:
            return Rejection(dynamic_resources.NAME, (dynamic_resources.REASON_CLAIM_ELSEWHERE,),
                             (dynamic_resources.DETAIL_CLAIM_ELSEWHERE,))
        return last

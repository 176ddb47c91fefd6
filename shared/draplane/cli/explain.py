"""`draplane explain CLAIM|POD`: why a claim is pending, or where it went and why, per node class.

Kubernetes says "cannot allocate all claims". This reads the cluster (ResourceSlices, DeviceClasses,
Nodes, every claim and pod), re-runs the shards' placement for the pod or claim against it, and
prints, per failure class, which nodes failed and the first concrete reason, next to what the
binder last wrote on the pod. Reading and placing are separate: `gather` does the I/O, `explain_*`
are pure functions of a `Snapshot`, and the tests call them directly.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys

import msgspec

from draplane.api.core import Node, Pod
from draplane.api.meta import ObjectMeta
from draplane.api.policy import PodDisruptionBudget
from draplane.api.resource import DeviceClass, DeviceTaintRule, ResourceClaim, ResourceSlice
from draplane.api.scheduling import PodGroup
from draplane.api.storage import (
    CSIDriver, CSINode, PersistentVolume, PersistentVolumeClaim, StorageClass, VolumeAttachment,
)
from draplane.scheduling import preemption
from draplane.scheduling.gangs import GangSpecError, gang_spec, pod_group_key
from draplane.scheduling.framework.plugins.dynamic_resources import allocation_node
from draplane.scheduling.placing import SchedulingState, NotPlaced, Placed
from draplane.scheduling.unschedulable import FailureReason
from draplane.scheduling import extended_resources
from draplane.scheduling.framework.plugins import node_volume_limits, scheduling_gates, volume_binding

# How many node names to list per failure class before "and N more".
NODES_SHOWN = 5


@dataclasses.dataclass(slots=True)
class Snapshot:
    slices: list[ResourceSlice]
    classes: list[DeviceClass]
    nodes: list[Node]
    claims: list[ResourceClaim]
    pods: list[Pod]
    taint_rules: list[DeviceTaintRule] = dataclasses.field(default_factory=list)
    budgets: list[PodDisruptionBudget] = dataclasses.field(default_factory=list)
    # The `Preempted` Events the binder wrote on victims: (victim "namespace/name", message), the
    # message naming the preemptor by UID and the node, as kube-scheduler's does.
    preempted: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    pod_groups: list[PodGroup] = dataclasses.field(default_factory=list)
    volume_claims: list[PersistentVolumeClaim] = dataclasses.field(default_factory=list)
    volumes: list[PersistentVolume] = dataclasses.field(default_factory=list)
    storage_classes: list[StorageClass] = dataclasses.field(default_factory=list)
    csinodes: list[CSINode] = dataclasses.field(default_factory=list)
    csidrivers: list[CSIDriver] = dataclasses.field(default_factory=list)
    volume_attachments: list[VolumeAttachment] = dataclasses.field(default_factory=list)

    def pod_volumes(self, pod: Pod) -> volume_binding.PodVolumes | None:
        """The binder's volume PreFilters over this snapshot (NodeVolumeLimits' Filter too, as the
        binder evaluates it); raises VolumeUnschedulable."""
        # (files given to `draplane allocate` may leave the namespace out: "default", as kubectl)
        def claims(namespace: str) -> dict[str, PersistentVolumeClaim]:
            return {c.metadata.name: c for c in self.volume_claims if (c.metadata.namespace or "default") == namespace}

        namespace = pod.metadata.namespace or "default"
        pods_on: dict[str, list[Pod]] = {}
        for other in self.pods:
            if other.spec.node_name and not (other.status and other.status.phase in ("Succeeded", "Failed")):
                pods_on.setdefault(other.spec.node_name, []).append(other)

        def used_by_other_pod(claim: str) -> bool:
            # VolumeRestrictions: a ReadWriteOncePod claim a scheduled pod (not this one) uses
            return any((other.metadata.namespace or "default") == namespace and other.metadata.uid != pod.metadata.uid
                       and claim in dict(volume_binding.pod_claim_names(other))
                       for pods in pods_on.values() for other in pods)

        volumes = {v.metadata.name: v for v in self.volumes}
        classes = {c.metadata.name: c for c in self.storage_classes}
        found = volume_binding.pre_filter(pod, claims(namespace), volumes, classes, used_by_other_pod)
        if found is None:
            return None
        attachments_on: dict[str, list[tuple[str, str]]] = {}
        for attachment in self.volume_attachments:
            attachments_on.setdefault(attachment.spec.node_name, []).append(
                (attachment.spec.attacher, attachment.spec.source.persistent_volume_name or ""))
        objects = node_volume_limits.VolumeObjects(
            claims=claims, volumes=volumes, classes=classes,
            csinodes={c.metadata.name: c for c in self.csinodes}, drivers=self.csidrivers,
            pods_on=lambda node: pods_on.get(node, ()), attachments_on=lambda node: attachments_on.get(node, ()))
        over_limit = node_volume_limits.nodes_over_limit(pod, [n.metadata.name or "" for n in self.nodes], objects)
        return msgspec.structs.replace(found, over_limit=over_limit) if over_limit else found

    def state(self, *, without: set[str] = frozenset()) -> SchedulingState:
        """The shards' view, minus the claims being explained (so they are placed afresh)."""
        state = SchedulingState()
        state.set_taint_rules(self.taint_rules)
        for c in self.classes:
            state.set_class(c)
        for n in self.nodes:
            state.set_node(n)
        by_node: dict[str, list[ResourceSlice]] = {}
        for s in self.slices:
            by_node.setdefault(s.spec.node_name or f"pool:{s.spec.driver}/{s.spec.pool.name}", []).append(s)
        for key, slices in by_node.items():
            state.set_feed_entry(key, slices)
        for claim in self.claims:
            if claim.metadata.uid not in without:
                state.set_claim(claim)
        for pod in self.pods:
            state.set_pod(pod)
        for budget in self.budgets:
            state.set_budget(budget)
        return state


def _claim_name(claim: ResourceClaim) -> str:
    return f"{claim.metadata.namespace}/{claim.metadata.name}"


def _describe_allocation(claim: ResourceClaim) -> list[str]:
    allocation = claim.status.allocation
    lines = [f"ResourceClaim {_claim_name(claim)} is allocated"
             + (f" on node {allocation_node(allocation)}" if allocation_node(allocation) else " (not tied to a node)")
             + ":"]
    for r in (allocation.devices.results if allocation.devices else None) or ():
        extra = []
        if r.admin_access:
            extra.append("admin access")
        if r.share_id:
            extra.append(f"share {r.share_id}")
        if r.consumed_capacity:
            extra.append("consumes " + ", ".join(f"{k}={v}" for k, v in sorted(r.consumed_capacity.items())))
        lines.append(f"  request {r.request}: {r.driver} pool {r.pool} device {r.device}"
                     + (f" ({'; '.join(extra)})" if extra else ""))
    consumers = claim.status.reserved_for or []
    if consumers:
        lines.append("  reserved for: " + ", ".join(f"{c.resource}/{c.name}" for c in consumers))
    else:
        lines.append("  reserved for nobody: it will be deallocated")
    return lines


def _describe_failures(outcome: NotPlaced, said: list[str]) -> list[str]:
    """The outcome of placing the pod now, then its per-node-class table. A message the pod's
    condition already says (printed just before) is not printed again."""
    if outcome.claim_error:
        return [] if any(outcome.claim_error in line for line in said) else [f"No node can help: {outcome.claim_error}"]
    lines = [] if any(line.endswith(f": {outcome.message}") for line in said) else [f"Placing it now: {outcome.message}"]
    lines.append("Per node class:")
    groups: dict[str, list] = {}
    for f in outcome.failures:
        groups.setdefault(f.reason, []).append(f)
    for reason, failures in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        try:
            words = FailureReason(reason).words
        except ValueError:
            words = reason
        names = [f.node for f in failures]
        shown = ", ".join(names[:NODES_SHOWN]) + (f" and {len(names) - NODES_SHOWN} more" if len(names) > NODES_SHOWN else "")
        lines.append(f"  {words}: {len(names)} node{'s' if len(names) != 1 else ''} ({shown})")
        detail = next((f.detail for f in failures if f.detail), "")
        if detail:
            lines.append(f"    e.g. {failures[0].node}: {detail}")
    return lines


def _pod_claims(snapshot: Snapshot, pod: Pod) -> tuple[list[ResourceClaim], list[str]]:
    namespace = pod.metadata.namespace
    by_name = {c.metadata.name: c for c in snapshot.claims if c.metadata.namespace == namespace}
    recorded = {s.name: s.resource_claim_name for s in (pod.status.resource_claim_statuses if pod.status else None) or ()}
    claims, missing = [], []
    for pc in pod.spec.resource_claims or ():
        name = pc.resource_claim_name or recorded.get(pc.name)
        if name and name in by_name:
            claims.append(by_name[name])
        elif pc.resource_claim_template_name and not name:
            missing.append(f"pod claim {pc.name}: no claim created yet from template {pc.resource_claim_template_name}")
        else:
            missing.append(f"pod claim {pc.name}: resourceclaim {name!r} not found")
    special = extended_resources.find_special_claim(pod, by_name.values())
    if special is not None:
        claims.append(special)
    return claims, missing


def _dra_extended_resources(snapshot: Snapshot, pod: Pod) -> list[str]:
    """The pod's extended resources that DRA serves (KEP-5004), as the binder decides it."""
    offered = {r for n in snapshot.nodes for r, amount in ((n.status.allocatable or {}) if n.status else {}).items()
               if amount not in ("0", "")}
    try:
        return sorted(extended_resources.dra_backed_resources(
            pod, extended_resources.ClassResolver(snapshot.classes), lambda resource: resource in offered))
    except extended_resources.ExtendedResourceError:
        return []  # node fit says what is wrong with the request


def _pod_status_lines(pod: Pod) -> list[str]:
    lines = []
    for c in (pod.status.conditions if pod.status else None) or ():
        if c.type == "PodScheduled" and c.status == "False":
            lines.append(f"The scheduler said ({c.reason}): {c.message}")
    return lines


def explain_claim(snapshot: Snapshot, claim: ResourceClaim) -> list[str]:
    if claim.status and claim.status.allocation:
        return _describe_allocation(claim)
    lines = [f"ResourceClaim {_claim_name(claim)} is pending (not allocated)."]
    users = [p for p in snapshot.pods if p.metadata.namespace == claim.metadata.namespace
             and claim in _pod_claims(snapshot, p)[0]]
    pod = users[0] if users else Pod(metadata=ObjectMeta(name="(no pod)", namespace=claim.metadata.namespace, uid="-"))
    said: list[str] = []
    if users:
        lines.append(f"Used by pod {pod.metadata.name}.")
        said = _pod_status_lines(pod)
        lines.extend(said)
    else:
        lines.append("No pod uses it yet, so nothing asks for it to be allocated; what would happen if one did:")
    outcome = snapshot.state(without={claim.metadata.uid}).place_pod(pod, [claim])
    if isinstance(outcome, Placed):
        lines.append(f"It fits now: node {outcome.node} can take it; the next scheduling attempt should place it.")
    else:
        lines.extend(_describe_failures(outcome, said))
    return lines


def explain_pod(snapshot: Snapshot, pod: Pod) -> list[str]:
    name = f"{pod.metadata.namespace}/{pod.metadata.name}"
    claims, missing = _pod_claims(snapshot, pod)
    if pod.spec.node_name:
        lines = [f"Pod {name} is bound to node {pod.spec.node_name}."]
        for claim in claims:
            lines.extend(_describe_allocation(claim) if claim.status and claim.status.allocation
                         else [f"ResourceClaim {_claim_name(claim)} is NOT allocated although the pod is bound"])
        lines.extend(_preempted_for(snapshot, pod))
        return lines
    lines = [f"Pod {name} is pending (scheduler {pod.spec.scheduler_name or 'default-scheduler'})."]
    said = _pod_status_lines(pod)
    lines.extend(said)
    if missing:
        lines.extend(f"Cannot be scheduled yet: {m}" for m in missing)
        return lines
    gates = scheduling_gates.gates(pod)
    if gates:
        lines.append(f"Held by scheduling gates {', '.join(gates)}: no scheduler tries it until every gate is "
                     "removed (by whoever added it: Kueue, a quota controller).")
    try:
        volumes = snapshot.pod_volumes(pod)
    except volume_binding.VolumeUnschedulable as exc:
        lines.append(f"Cannot be scheduled yet: {exc.message} (its PersistentVolumeClaims; no node is tried "
                     "until they change).")
        return lines
    gang_wait = _gang_wait(snapshot, pod)
    if gang_wait:
        lines.append(gang_wait)
    outcome = snapshot.state(without={c.metadata.uid for c in claims if not (c.status and c.status.allocation)}) \
        .place_pod(pod, claims, volumes=volumes, dra_extended_resources=_dra_extended_resources(snapshot, pod))
    if isinstance(outcome, Placed) and gates:
        lines.append(f"Once the gates are removed it fits now: node {outcome.node}.")
    elif isinstance(outcome, Placed) and gang_wait:
        lines.append(f"On its own it fits now: node {outcome.node}; it is placed only together with its gang.")
    elif isinstance(outcome, Placed):
        lines.append(f"It fits now: node {outcome.node}; the next scheduling attempt should bind it.")
    else:
        lines.extend(_describe_failures(outcome, said))
        lines.extend(_preemption_now(snapshot, pod, claims, volumes))
    lines.extend(_preempted_for(snapshot, pod))
    return lines


def _gang_wait(snapshot: Snapshot, pod: Pod) -> str:
    """Why the pod's gang keeps it back, as the shards see it; "" when nothing does. A member
    counts once it is bound, or pending and not gated (a gated member is never sent to a shard)."""
    namespace = pod.metadata.namespace or ""
    key = pod_group_key(namespace, pod.spec)
    if key is None:
        return ""
    group = next((g for g in snapshot.pod_groups
                  if f"{g.metadata.namespace or ''}/{g.metadata.name or ''}" == key), None)
    if group is None:
        return (f"Waiting for PodGroup {key}: not found. The pod names it in spec.schedulingGroup.podGroupName, "
                "and no member is placed until it exists.")
    try:
        spec = gang_spec(group)
    except GangSpecError as exc:
        return f"Its gang cannot be placed: {exc}."
    if spec is None:
        return ""  # a `basic` group: each pod is placed on its own
    members = [p for p in snapshot.pods if p.metadata.namespace == namespace
               and pod_group_key(namespace, p.spec) == key
               and not (p.status and p.status.phase in ("Succeeded", "Failed"))
               and (p.spec.node_name or (p.metadata.deletion_timestamp is None and not p.spec.scheduling_gates))]
    if len(members) >= spec.min_count:
        return ""
    missing = spec.min_count - len(members)
    return (f"Waiting for the gang's minimum count: {len(members)} of {spec.min_count} pods of PodGroup {key} exist; "
            f"no member is placed until {missing} more {'exists' if missing == 1 else 'exist'}.")


def _preempted_for(snapshot: Snapshot, pod: Pod) -> list[str]:
    """Who was evicted to make room for this pod, from the victims' Preempted Events."""
    marker = f"Preempted by pod {pod.metadata.uid} on node "
    victims: dict[str, list[str]] = {}
    for victim, message in snapshot.preempted:
        if message.startswith(marker):
            victims.setdefault(message[len(marker):], []).append(victim)
    return [f"It preempted {len(names)} pod(s) on node {node} (lower priority, evicted to free what it needs): "
            + ", ".join(sorted(names)) for node, names in sorted(victims.items())]


def _preemption_now(snapshot: Snapshot, pod: Pod, claims: list[ResourceClaim],
                    volumes: volume_binding.PodVolumes | None = None) -> list[str]:
    state = snapshot.state(without={c.metadata.uid for c in claims if not (c.status and c.status.allocation)})
    plan = state.preemption_for(pod, claims, volumes=volumes)
    if isinstance(plan, preemption.PreemptionPlan):
        return [f"Preemption: {plan.explain()}."]
    if isinstance(plan, preemption.AwaitingVictims):
        return [f"Preemption: {plan.explain()}."]
    if isinstance(plan, preemption.NoPreemption):
        return [f"Preemption cannot help: {plan.reason.removeprefix('preemption: ')}"]
    return []


# --- I/O -----------------------------------------------------------------------------------------


async def gather(kubeconfig) -> Snapshot:
    from draplane.kube import KubeClient

    from draplane.kube import KubeApiError

    async def if_served(kube, model) -> tuple[list, None]:
        """All objects of a kind a feature gate may leave unserved (DeviceTaintRules without
        DRADeviceTaintRules, PodGroups without GenericWorkload): none where it is."""
        try:
            return await kube.list(model)
        except KubeApiError as exc:
            if exc.is_not_found:
                return [], None
            raise

    async def preempted(kube) -> tuple[list[tuple[str, str]], None]:
        data = await kube.request("GET", "/api/v1/events", query={"fieldSelector": "reason=Preempted"})
        events = msgspec.json.decode(data).get("items") or []
        return [(f"{e['involvedObject'].get('namespace')}/{e['involvedObject'].get('name')}", e.get("message") or "")
                for e in events if isinstance(e, dict) and isinstance(e.get("involvedObject"), dict)], None

    async with await KubeClient.from_environment(kubeconfig) as kube:
        results = await asyncio.gather(
            kube.list(ResourceSlice), kube.list(DeviceClass), kube.list(Node), kube.list(ResourceClaim), kube.list(Pod),
            if_served(kube, DeviceTaintRule), kube.list(PodDisruptionBudget), preempted(kube), if_served(kube, PodGroup),
            kube.list(PersistentVolumeClaim), kube.list(PersistentVolume), kube.list(StorageClass),
            kube.list(CSINode), kube.list(CSIDriver), kube.list(VolumeAttachment),
        )
    return Snapshot(*(items for items, _ in results))


def find_targets(snapshot: Snapshot, target: str, namespace: str) -> list[ResourceClaim | Pod]:
    """What `target` names: a pod, a claim, or both when a bare NAME is both (the pod first)."""
    kind, _, name = target.rpartition("/")
    kind = kind.lower()
    found: list[ResourceClaim | Pod] = []
    if kind in ("", "pod", "pods"):
        found += [p for p in snapshot.pods if p.metadata.namespace == namespace and p.metadata.name == name]
    if kind in ("", "claim", "resourceclaim", "resourceclaims"):
        found += [c for c in snapshot.claims if c.metadata.namespace == namespace and c.metadata.name == name]
    return found


def find_target(snapshot: Snapshot, target: str, namespace: str) -> ResourceClaim | Pod | None:
    found = find_targets(snapshot, target, namespace)
    return found[0] if found else None


def chosen_line(found: list[ResourceClaim | Pod], target: str) -> str:
    """Said first when a bare NAME is both a pod and a claim: which one is explained, and how to ask
    for the other ("" when the name was not ambiguous)."""
    if len(found) < 2:
        return ""
    name = target.rpartition("/")[2]
    return (f"Both pod/{name} and resourceclaim/{name} exist in namespace {found[0].metadata.namespace}: "
            f"explaining pod/{name} (draplane explain claim/{name} for the claim).")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain", help="why a ResourceClaim or pod is pending, or where it went, per node class",
        description="Explain a ResourceClaim or Pod: pending (why, per node class) or allocated (where).",
    )
    parser.add_argument("target", metavar="CLAIM|POD", help="a name, or claim/NAME or pod/NAME")
    parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument("--kubeconfig", default=None)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from draplane.kube import KubeApiError

    try:
        snapshot = asyncio.run(gather(args.kubeconfig))
    except (KubeApiError, OSError) as exc:
        print(f"draplane explain: cannot read the cluster: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a missing kubeconfig raises the client's own types
        print(f"draplane explain: cannot connect: {exc}", file=sys.stderr)
        return 2
    found = find_targets(snapshot, args.target, args.namespace)
    if not found:
        print(f"draplane explain: no ResourceClaim or Pod {args.target!r} in namespace {args.namespace}", file=sys.stderr)
        return 1
    obj = found[0]
    lines = explain_claim(snapshot, obj) if isinstance(obj, ResourceClaim) else explain_pod(snapshot, obj)
    chosen = chosen_line(found, args.target)
    print("\n".join([chosen] + lines if chosen else lines))
    return 0

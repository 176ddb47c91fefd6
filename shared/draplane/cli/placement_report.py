"""Why a bound pod's claims got their node and devices, per node class. Pure: no I/O.

The shards record their result (the claim's allocation), not their reasoning. To show a user *why*,
the allocator core is asked again, node by node, on the cluster as it is now less the pod's own
claims, with the policy the shards use: each node either fits (with its score) or says why not.
With nothing else scheduling in between, that is the decision the shard made; when the replay's best
node differs from the real one, the report says so instead of pretending.
"""

from __future__ import annotations

import dataclasses
import textwrap
from fractions import Fraction
from typing import Iterable, Sequence

import msgspec

from draplane.allocation import AllocationError, DeviceAllocator, NodeFailure, NodePlacement, Unallocatable
from draplane.api.core import Node, Pod
from draplane.api.resource import DeviceClass, ResourceClaim, ResourceSlice

PROFILE_LABELS = ("draplane.dev/profile", "node.kubernetes.io/instance-type")


class ReportError(ValueError):
    """The objects do not describe a bound pod with allocated claims; the text names what is missing."""


@dataclasses.dataclass(frozen=True, slots=True)
class AllocatedDevice:
    claim: str  # namespace/name
    request: str
    driver: str
    pool: str
    device: str
    product: str  # productName attribute, "" when the driver publishes none
    memory: Fraction | None  # bytes, the device's `memory` capacity


@dataclasses.dataclass(frozen=True, slots=True)
class NodeOutcome:
    node: str
    node_class: str  # the profile / instance-type label, else the node name
    largest_memory: Fraction | None  # the largest `memory` capacity of any device on the node
    class_matches: int  # devices on the node that pass the selectors of the claims' device classes
    devices: int
    score: float | None  # set when the claims fit here
    reason: str  # "Fits", or the core's failure reason (NoDeviceMatchesClass, ...)
    message: str


@dataclasses.dataclass(slots=True)
class PlacementReport:
    pod: str  # namespace/name
    node: str
    devices: list[AllocatedDevice]
    classes: dict[str, list[str]]  # device class name -> its CEL selector expressions
    policy: str
    outcomes: list[NodeOutcome]  # one per node, in name order
    replay_node: str | None  # the core's best node today; None when nothing fits any more
    policy_summary: str = ""  # the first line of the policy's own description

    @property
    def chosen(self) -> NodeOutcome | None:
        return next((o for o in self.outcomes if o.node == self.node), None)


def _memory(record) -> Fraction | None:
    found = None
    for key, entry in record.capacity.items():
        if key == "memory" or key.endswith("/memory"):
            found = entry.value.value if found is None else max(found, entry.value.value)
    return found


def _product(record) -> str:
    value = record.attributes.get("productName")
    return value[1] if isinstance(value, tuple) and isinstance(value[1], str) else ""


def _node_class(node: Node) -> str:
    labels = node.metadata.labels or {}
    for label in PROFILE_LABELS:
        if labels.get(label):
            return labels[label]
    return node.metadata.name or ""


def _claim_key(claim: ResourceClaim) -> str:
    return f"{claim.metadata.namespace}/{claim.metadata.name}"


def report_placement(
    pod: Pod,
    pod_claims: Sequence[ResourceClaim],
    *,
    slices: Iterable[ResourceSlice],
    classes: Iterable[DeviceClass],
    nodes: Iterable[Node],
    all_claims: Iterable[ResourceClaim],
    policy: str | None = None,
) -> PlacementReport:
    """`pod` is bound and `pod_claims` are its allocated claims; `all_claims` is every claim in the
    cluster (the pod's own among them or not): the others' allocations are what was in use."""
    pod_name = f"{pod.metadata.namespace}/{pod.metadata.name}"
    if not pod.spec.node_name:
        raise ReportError(f"Pod {pod_name}: spec.nodeName is empty: the pod is not bound")
    if not pod_claims:
        raise ReportError(f"Pod {pod_name}: spec.resourceClaims: the pod has no claims to explain")
    for claim in pod_claims:
        if claim.status is None or claim.status.allocation is None:
            raise ReportError(f"ResourceClaim {_claim_key(claim)}: status.allocation is empty: the claim is not allocated")

    cluster = DeviceAllocator(slices=slices, classes=classes, nodes=nodes, policy=policy)
    cluster.ensure_nodes_from_slices()
    own = {c.metadata.uid for c in pod_claims}
    for claim in all_claims:
        if claim.metadata.uid not in own and claim.status is not None and claim.status.allocation is not None:
            cluster.add_allocated_claim(claim)
    pending = [msgspec.structs.replace(c, status=None) for c in pod_claims]

    records = {}
    for name in cluster.nodes:
        for pool in cluster.inventory.pools_for_node(cluster.node(name)):
            for record in pool.reachable:
                records[record.id] = record

    devices = []
    for claim in pod_claims:
        results = claim.status.allocation.devices.results if claim.status.allocation.devices else None
        for result in results or ():
            record = records.get((result.driver, result.pool, result.device))
            devices.append(AllocatedDevice(
                claim=_claim_key(claim), request=result.request, driver=result.driver, pool=result.pool,
                device=result.device, product=_product(record) if record else "",
                memory=_memory(record) if record else None,
            ))

    try:
        plans = [cluster.allocator.plan(c) for c in pending]
    except AllocationError as exc:
        raise ReportError(f"the claims cannot be evaluated any more: {exc.message}") from None
    class_selectors: dict[str, list[str]] = {}
    for plan in plans:
        for subs in plan.requests:
            for request in subs:
                class_selectors.setdefault(request.device_class.metadata.name or "", list(request.class_selectors))

    matcher = cluster.allocator.matcher

    def matches_a_class(record) -> bool:
        return any(all(matcher.evaluate(e, record) is True for e in selectors) for selectors in class_selectors.values())

    outcomes = []
    for name in sorted(cluster.nodes):
        node = cluster.node(name)
        node_records = [r for pool in cluster.inventory.pools_for_node(node) for r in pool.reachable]
        memories = [m for m in map(_memory, node_records) if m is not None]
        try:
            outcome = cluster.allocate_on_node(pending, name)
        except AllocationError as exc:
            outcome = NodeFailure(name, exc.reason, exc.message)
        common = dict(
            node=name, node_class=_node_class(node), largest_memory=max(memories) if memories else None,
            class_matches=sum(map(matches_a_class, node_records)), devices=len(node_records),
        )
        if isinstance(outcome, NodePlacement):
            outcomes.append(NodeOutcome(**common, score=outcome.score, reason="Fits", message="the claims fit"))
        else:
            outcomes.append(NodeOutcome(**common, score=None, reason=outcome.reason.value, message=outcome.message))

    try:
        best = cluster.allocate(pending)
    except AllocationError:
        best = None
    replay_node = best.node if isinstance(best, NodePlacement) else None
    if isinstance(best, Unallocatable):
        replay_node = None
    return PlacementReport(
        pod=pod_name, node=pod.spec.node_name, devices=devices, classes=class_selectors,
        policy=cluster.policy.name, outcomes=outcomes, replay_node=replay_node,
        policy_summary=((type(cluster.policy).__doc__ or "").strip().splitlines() or [""])[0],
    )


# --- text -----------------------------------------------------------------------------------------


def format_memory(value: Fraction | None) -> str:
    if value is None:
        return "-"
    gib = value / 2**30
    text = f"{float(gib):.1f}".removesuffix(".0")
    return f"{text}Gi"


def format_score(score: float) -> str:
    return f"{score:.3f}"


@dataclasses.dataclass(frozen=True, slots=True)
class OutcomeGroup:
    """Nodes of one class that fared the same, shown as one row."""

    node_class: str
    nodes: list[str]
    outcome: NodeOutcome  # the first node's; the others differ only in their name


def group_outcomes(report: PlacementReport) -> list[OutcomeGroup]:
    """Rows per node class: the chosen node alone first, then nodes that fit (best score first), then
    the others; nodes of one class with the same outcome share a row."""
    groups: dict[tuple, OutcomeGroup] = {}
    for o in report.outcomes:
        chosen = o.node == report.node
        key = (chosen, o.node_class, o.reason, o.message, o.largest_memory, o.class_matches, o.devices,
               None if o.score is None else round(o.score, 6), o.node if chosen else None)
        group = groups.get(key)
        if group is None:
            groups[key] = OutcomeGroup(o.node_class, [o.node], o)
        else:
            group.nodes.append(o.node)

    def order(group: OutcomeGroup) -> tuple:
        o = group.outcome
        return (o.node != report.node, o.score is None, o.score or 0.0, group.node_class, group.nodes[0])

    return sorted(groups.values(), key=order)


def _nodes_text(nodes: list[str]) -> str:
    if len(nodes) <= 2:
        return ", ".join(nodes)
    return f"{len(nodes)} nodes ({nodes[0]} .. {nodes[-1]})"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)] + [row[-1]]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def format_report(report: PlacementReport, timings: Sequence[tuple[str, float]] = ()) -> str:
    """The placement, the reasons per node class and the timings, as a user reads them."""
    chosen = report.chosen
    lines = [f"Pod {report.pod}"]
    summary: list[list[str]] = [["node", f"{report.node}" + (f"  (class {chosen.node_class})" if chosen and chosen.node_class != report.node else "")]]
    for d in report.devices:
        what = ", ".join(x for x in (d.product, f"memory {format_memory(d.memory)}" if d.memory is not None else "") if x)
        summary.append(["device", f"{d.driver}/{d.pool}/{d.device}" + (f"  ({what})" if what else "")
                        + f"  for request {d.request} of claim {d.claim}"])
    for name, selectors in report.classes.items():
        matched = sum(o.class_matches for o in report.outcomes)
        total = sum(o.devices for o in report.outcomes)
        summary.append(["class", f"{name} matched the device ({matched} of {total} devices in the cluster match it)"])
        for expression in selectors:
            summary.append(["", f"selector: {expression}"])
    if chosen is not None and chosen.score is not None:
        others = sorted((o.score, o.node) for o in report.outcomes if o.score is not None and o.node != report.node)
        beaten = f"; next best {format_score(others[0][0])} on {others[0][1]}" if others else "; the only node that fits"
        summary.append(["score", f"{format_score(chosen.score)}, lowest wins{beaten}"])
        summary.append(["", f"policy {report.policy}" + (f": {report.policy_summary}" if report.policy_summary else "")])
    for label, seconds in timings:
        summary.append([label, f"{seconds:.2f}s"])
    lines += _table(summary)

    lines.append("")
    lines.append(f"Why this node: the allocator core asked again on every node (policy {report.policy}):")
    rows = [["NODE CLASS", "NODES", "LARGEST GPU", "CLASS MATCHES", "OUTCOME"]]
    for group in group_outcomes(report):
        o = group.outcome
        if o.score is not None:
            outcome = f"fits, score {format_score(o.score)}" + ("   <- chosen" if o.node == report.node else "")
        else:
            outcome = o.reason
        rows.append([group.node_class, _nodes_text(group.nodes), format_memory(o.largest_memory),
                     f"{o.class_matches}/{o.devices}", outcome])
    table = _table(rows)
    lines.append(table[0])
    # A failure's message goes on its own line under its row: the core's messages are long.
    for line, group in zip(table[1:], group_outcomes(report)):
        lines.append(line)
        if group.outcome.score is None:
            lines.extend(f"      {part}" for part in textwrap.wrap(group.outcome.message, 96, break_on_hyphens=False))
    if report.replay_node != report.node:
        where = report.replay_node or "no node"
        lines.append(f"  note: asked today, the core would pick {where}: the cluster changed after the pod was bound")
    return "\n".join(lines) + "\n"

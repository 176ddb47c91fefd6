"""From a node's devices to its ResourceSlices, and from the slices that exist to the writes that
make them right. Pure: no I/O.

The rules are the ones a kubelet DRA plugin follows, so that the scheduler and draplane's allocator
read our pools exactly as they read a real driver's:

* one pool per (driver, node), named after the node, with ``spec.nodeName`` set;
* at most 128 devices per slice, 64 when any device of the pool has taints or consumes counters;
* counter sets (``sharedCounters``) in slices of their own, at most 8 per slice, placed first;
* every slice of the pool carries the pool's ``generation`` and ``resourceSliceCount``; any change
  bumps the generation and rewrites every slice of the pool, so a consumer never mixes old and new;
* nothing is written when nothing changed; slices of the pool that are no longer wanted are deleted;
* each slice is owned by its Node, so deleting the Node garbage-collects its slices.

Slice names are deterministic (``<node>-<driver>-<index>``): after a restart the service finds its
own slices by name, and a create that races with an earlier one fails with AlreadyExists instead
of leaving a duplicate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Iterable

import msgspec

from draplane.api.meta import ObjectMeta, OwnerReference
from draplane.api.resource import (
    Device,
    DeviceTaint,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)
from draplane.messages.inventory import DriverDevices, MessageError, NodeSnapshot

MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 64
MAX_COUNTER_SETS = 8
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "draplane-inventory"  # the label value; one per inventory instance sharing a cluster
STALE_TAINT_KEY = "draplane.io/node-agent-unreachable"
_NAME_MAX = 253


@dataclasses.dataclass(frozen=True, slots=True)
class NodeRef:
    name: str
    uid: str


@dataclasses.dataclass(slots=True)
class PoolPlan:
    """The writes that bring one pool from what exists to what is wanted."""

    driver: str
    pool: str
    generation: int
    creates: list[ResourceSlice] = dataclasses.field(default_factory=list)
    updates: list[ResourceSlice] = dataclasses.field(default_factory=list)
    deletes: list[str] = dataclasses.field(default_factory=list)

    @property
    def writes(self) -> int:
        return len(self.creates) + len(self.updates) + len(self.deletes)

    @property
    def empty(self) -> bool:
        return self.writes == 0


def slice_name_base(node: str, driver: str) -> str:
    base = f"{node}-{re.sub(r'[^a-z0-9-]', '-', driver.lower())}"
    if len(base) > _NAME_MAX - 8:
        # Keep it unique and still recognisable when a long node name meets a long driver name.
        digest = hashlib.sha256(base.encode()).hexdigest()[:10]
        base = f"{base[:_NAME_MAX - 20]}-{digest}"
    return base


def stale_taint(time_added: str) -> DeviceTaint:
    return DeviceTaint(key=STALE_TAINT_KEY, value="true", effect="NoSchedule", time_added=time_added)


def _with_taint(device: Device, taint: DeviceTaint) -> Device:
    taints = [t for t in (device.taints or []) if t.key != taint.key] + [taint]
    return msgspec.structs.replace(device, taints=taints)


def _chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def desired_specs(node: str, entry: DriverDevices, taint: DeviceTaint | None = None) -> list[ResourceSliceSpec]:
    """The pool's slices, generation 0 and count filled in; empty when the driver has nothing."""
    devices = list(entry.devices)
    if taint is not None:
        devices = [_with_taint(d, taint) for d in devices]
    limited = any(d.taints or d.consumes_counters for d in devices)
    per_slice = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS if limited else MAX_DEVICES
    specs: list[ResourceSliceSpec] = []
    for counter_sets in _chunks(list(entry.counter_sets), MAX_COUNTER_SETS):
        specs.append(
            ResourceSliceSpec(
                driver=entry.driver,
                pool=ResourcePool(name=node, generation=0, resource_slice_count=0),
                node_name=node,
                shared_counters=counter_sets,
            )
        )
    for chunk in _chunks(devices, per_slice):
        specs.append(
            ResourceSliceSpec(
                driver=entry.driver,
                pool=ResourcePool(name=node, generation=0, resource_slice_count=0),
                node_name=node,
                devices=chunk,
            )
        )
    for spec in specs:
        spec.pool.resource_slice_count = len(specs)
    return specs


def _comparable(spec: ResourceSliceSpec) -> dict:
    raw = msgspec.to_builtins(spec)
    raw["pool"].pop("generation", None)
    return raw


def _owner(node: NodeRef) -> OwnerReference:
    return OwnerReference(api_version="v1", kind="Node", name=node.name, uid=node.uid, controller=True)


def _metadata(name: str, node: NodeRef, managed_by: str) -> ObjectMeta:
    return ObjectMeta(name=name, labels={MANAGED_BY_LABEL: managed_by}, owner_references=[_owner(node)])


def _owned_by(slice_: ResourceSlice, node: NodeRef) -> bool:
    return any(ref.kind == "Node" and ref.uid == node.uid for ref in slice_.metadata.owner_references or [])


def plan_pool(
    node: NodeRef,
    entry: DriverDevices,
    existing: list[ResourceSlice],
    *,
    taint: DeviceTaint | None = None,
    last_generation: int = 0,
    managed_by: str = MANAGED_BY,
) -> PoolPlan:
    """Writes for the pool (entry.driver, node) given its slices now in the apiserver.

    `existing` are the slices of this pool that the inventory service manages. `last_generation`
    is the highest generation the service remembers writing, so a pool that was deleted and comes
    back never reuses a generation a consumer may have cached.
    """
    specs = desired_specs(node.name, entry, taint)
    base = slice_name_base(node.name, entry.driver)
    wanted = {f"{base}-{i}": spec for i, spec in enumerate(specs)}
    by_name = {s.metadata.name: s for s in existing}
    current_generation = max([s.spec.pool.generation for s in existing] + [last_generation, 0])

    generations = {s.spec.pool.generation for s in existing}
    matching = (
        set(by_name) <= set(wanted)
        and len(generations) <= 1
        and all(
            _owned_by(by_name[name], node) and _comparable(by_name[name].spec) == _comparable(wanted[name])
            for name in by_name
        )
    )
    if matching and existing:
        # Every slice present is right and only some are missing (a write was interrupted): add the
        # missing ones at the same generation, which completes the pool without rewriting it.
        generation = current_generation if generations == {current_generation} else None
        if generation is not None:
            plan = PoolPlan(driver=entry.driver, pool=node.name, generation=generation)
            for name, spec in wanted.items():
                if name not in by_name:
                    spec.pool.generation = generation
                    plan.creates.append(ResourceSlice(metadata=_metadata(name, node, managed_by), spec=spec))
            return plan

    generation = current_generation + 1
    plan = PoolPlan(driver=entry.driver, pool=node.name, generation=generation)
    for name, spec in wanted.items():
        spec.pool.generation = generation
        metadata = _metadata(name, node, managed_by)
        old = by_name.get(name)
        if old is None:
            plan.creates.append(ResourceSlice(metadata=metadata, spec=spec))
        else:
            metadata.resource_version = old.metadata.resource_version
            plan.updates.append(ResourceSlice(metadata=metadata, spec=spec))
    plan.deletes = sorted(name for name in by_name if name not in wanted)
    return plan


def plan_node(
    node: NodeRef,
    drivers: list[DriverDevices],
    existing: list[ResourceSlice],
    *,
    taint: DeviceTaint | None = None,
    last_generations: dict[str, int] | None = None,
    managed_by: str = MANAGED_BY,
) -> list[PoolPlan]:
    """Plans for every pool of the node: the snapshot's drivers, and any managed pool it dropped."""
    last_generations = last_generations or {}
    by_driver: dict[str, list[ResourceSlice]] = {}
    for s in existing:
        by_driver.setdefault(s.spec.driver, []).append(s)
    plans = []
    seen = set()
    for entry in drivers:
        if entry.driver in seen:
            raise ValueError(f"node {node.name}: driver {entry.driver} appears twice in the snapshot")
        seen.add(entry.driver)
        plans.append(
            plan_pool(node, entry, by_driver.get(entry.driver, []), taint=taint,
                      last_generation=last_generations.get(entry.driver, 0), managed_by=managed_by)
        )
    for driver, slices in sorted(by_driver.items()):
        if driver not in seen:
            plans.append(
                PoolPlan(driver=driver, pool=node.name, generation=max(s.spec.pool.generation for s in slices),
                         deletes=sorted(s.metadata.name for s in slices))
            )
    return plans


def is_managed(slice_: ResourceSlice, managed_by: str = MANAGED_BY) -> bool:
    """Written by this inventory service (the label's value names the instance)."""
    return (slice_.metadata.labels or {}).get(MANAGED_BY_LABEL) == managed_by


def drivers_of_other_publishers(on_node: Iterable[ResourceSlice], managed_by: str) -> dict[str, str]:
    """driver -> who else publishes it on this node: the name of one of its slices and, where it has
    one, its managed-by label (another draplane inventory, NVIDIA's kubelet plugin, ...)."""
    others: dict[str, str] = {}
    for s in on_node:
        if is_managed(s, managed_by) or s.spec.driver in others:
            continue
        manager = (s.metadata.labels or {}).get(MANAGED_BY_LABEL)
        others[s.spec.driver] = f"ResourceSlice {s.metadata.name}" + (f" (managed-by {manager})" if manager else "")
    return others


def refused_drivers(wanted: Iterable[str], ours: Iterable[ResourceSlice], others: dict[str, str]) -> dict[str, str]:
    """The drivers of `wanted` this inventory must not publish on the node: another publisher
    already uses the name there, and we hold no slice of it. Two publishers of one driver on one
    node would write one pool (the node's name) twice, and the scheduler would see neither whole.
    Where ours came first, ours stay and the other publisher is the one to fix."""
    held = {s.spec.driver for s in ours}
    return {driver: others[driver] for driver in wanted if driver in others and driver not in held}


def check_snapshot(snapshot: NodeSnapshot) -> None:
    """Raise MessageError("invalid") for a snapshot whose slices the apiserver would refuse (a
    device name that is not a DNS label, an attribute string over 64 bytes, one driver twice).

    Such a snapshot decodes, but writing its slices fails every time: taken, it was retried every
    half second for ever and never acknowledged. Refused here, the node keeps the slices of its last
    good snapshot and the agent's bug is said once, by name."""
    from draplane.validation import validate_typed

    try:
        plans = plan_node(NodeRef(snapshot.node, "uid"), snapshot.drivers, [], taint=stale_taint("2006-01-02T15:04:05Z"))
    except ValueError as exc:
        raise MessageError("invalid", f"snapshot from node {snapshot.node!r}: {exc}") from None
    for plan in plans:
        for slice_ in plan.creates:
            problems = validate_typed(slice_)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise MessageError("invalid", f"snapshot from node {snapshot.node!r}, driver {plan.driver}: the slice "
                                   f"would be refused: {problems[0]}{more}")

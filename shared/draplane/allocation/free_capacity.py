"""Free capacity per DeviceClass and node: what a new claim could still get. Pure.

`free_capacity` answers with the allocator itself, never with its own idea of the rules. Which
devices belong to a class is the class's selectors as the allocator evaluates them; how many
devices are free *whole* is how many one-device claims of the class the allocator places on the
node one after the other, each seeing the ones before it (counters, taints, shares and devices in
use are all its checks); how many MIG placements of a profile are still possible is the same count
for claims that select that profile. So a GPU with one MIG slice in use is not free whole, and the
7 x 1g.5gb placements of an empty A100 drop to 6 when one is taken, exactly as scheduling would
find them.

Only pools local to one node are counted (a network-attached pool visible to many nodes would
count once per node). Nodes alike in devices and in what is allocated on them share one count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

from draplane.allocation.allocator import NodePlacement, taint_blocks
from draplane.allocation.device_allocator import DeviceAllocator
from draplane.allocation.errors import AllocationError
from draplane.allocation.inventory import DeviceRecord, Pool
from draplane.allocation.scoring import FIRST_FIT
from draplane.api.meta import ObjectMeta
from draplane.api.quantity import Quantity, QuantityFormat
from draplane.api.resource import (
    AllocationResult,
    CELDeviceSelector,
    DeviceClaim,
    DeviceClass,
    DeviceRequest,
    DeviceSelector,
    DeviceTaintRule,
    ExactDeviceRequest,
    ResourceClaim,
    ResourceClaimSpec,
    ResourceClaimStatus,
    ResourceSlice,
)

# A device's state, as the metrics subscriber counts devices.
FREE, ALLOCATED, SHARED, TAINTED, BLOCKED = "free", "allocated", "shared", "tainted", "blocked"
DEVICE_STATES = (FREE, ALLOCATED, SHARED, TAINTED, BLOCKED)

# The attribute the NVIDIA DRA driver (and draplane's node agent) names a MIG profile with.
PROFILE_ATTRIBUTE = "profile"


@dataclass(slots=True)
class SharedCapacity:
    """A capacity of devices that allow multiple allocations, summed over those devices."""

    capacity: str
    devices: int
    total: Fraction
    left: Fraction

    def text(self, value: Fraction) -> str:
        return str(Quantity(value, QuantityFormat.BINARY_SI if self.capacity == "memory" else QuantityFormat.DECIMAL_SI))


@dataclass(slots=True)
class ClassOnNode:
    node: str
    device_class: str
    devices: int  # devices of the class here
    states: dict[str, int]  # DEVICE_STATES -> devices
    whole_free: int  # one-device claims of the class that still fit here at once
    shared: list[SharedCapacity] = field(default_factory=list)
    # profile -> placements of that profile that still fit here at once
    partitions: dict[str, int] = field(default_factory=dict)
    error: str = ""  # the allocator refused to evaluate the class here (a CEL error, say)


@dataclass(slots=True)
class ClassTotals:
    device_class: str
    nodes: int  # nodes with devices of the class
    devices: int
    states: dict[str, int]
    whole_free: int
    shared: list[SharedCapacity]
    partitions: dict[str, int]


@dataclass(slots=True)
class FreeCapacity:
    classes: list[ClassTotals]
    nodes: list[ClassOnNode]


def free_capacity(
    slices: Iterable[ResourceSlice],
    classes: Iterable[DeviceClass],
    allocations: Mapping[str, AllocationResult],
    taint_rules: Iterable[DeviceTaintRule] = (),
) -> FreeCapacity:
    """`allocations`: claim UID (or any unique key) -> what it holds: every device in use.
    `taint_rules`: the DeviceTaintRules in force, whose taints count as the devices' own."""
    cluster = DeviceAllocator(slices=slices, classes=classes, taint_rules=taint_rules, policy=FIRST_FIT)
    cluster.ensure_nodes_from_slices()
    for key, allocation in allocations.items():
        cluster.add_allocated_claim(_holder(key, allocation))
    counter = _Counter(cluster)
    rows = []
    for node_name in sorted(cluster.nodes):
        for class_name in sorted(cluster.classes):
            row = counter.class_on_node(class_name, node_name)
            if row is not None:
                rows.append(row)
    return FreeCapacity(classes=[class_totals(name, [r for r in rows if r.device_class == name])
                                 for name in sorted(cluster.classes) if any(r.device_class == name for r in rows)],
                        nodes=rows)


def device_state(cluster: DeviceAllocator, record: DeviceRecord, pool: Pool | None) -> str:
    """One device's state (DEVICE_STATES) in `cluster`, as `draplane free`, the metrics and the
    device map count it. `pool` None: its counters are not looked at (it cannot be BLOCKED)."""
    state = cluster.state
    if state.in_use(record.id):
        return ALLOCATED
    if state.shared_capacity(record.id) is not None:
        return SHARED
    if taint_blocks(record, None):
        return TAINTED
    if record.consumes and pool is not None and not cluster.allocator.counters_left(record, pool):
        return BLOCKED  # its counters are used by other partitions of the same GPU
    return FREE


def _holder(key: str, allocation: AllocationResult) -> ResourceClaim:
    return ResourceClaim(metadata=ObjectMeta(namespace="held", name=key, uid=key),
                         status=ResourceClaimStatus(allocation=allocation))


def _probe(class_name: str, index: int, selector: str | None) -> ResourceClaim:
    return ResourceClaim(
        metadata=ObjectMeta(namespace="draplane-free", name=f"probe-{index}", uid=f"draplane-free-probe-{index}"),
        spec=ResourceClaimSpec(devices=DeviceClaim(requests=[DeviceRequest(
            name="probe",
            exactly=ExactDeviceRequest(
                device_class_name=class_name, count=1,
                selectors=[DeviceSelector(cel=CELDeviceSelector(expression=selector))] if selector else None),
        )])),
    )


def profile_selector(driver: str, profile: str) -> str:
    return f'device.attributes["{driver}"].{PROFILE_ATTRIBUTE} == "{profile}"'


def _profile(record: DeviceRecord) -> str | None:
    """The partition profile of a device that consumes counters (a MIG placement), if it says one."""
    if not record.consumes:
        return None
    value = record.attribute(f"{record.driver}/{PROFILE_ATTRIBUTE}")
    return value[1] if value is not None and value[0] == "string" else None


class _Counter:
    def __init__(self, cluster: DeviceAllocator):
        self.devices = cluster
        self.allocator = cluster.allocator
        self.state = cluster.state
        # (what the node's pools hold and have in use, class, selector) -> placements that fit
        self._fits: dict[tuple, int] = {}

    def _local_pools(self, node_name: str) -> list[Pool]:
        inventory = self.devices.inventory
        return [p for p in inventory.pools_for_node(self.devices.node(node_name))
                if p.usable and inventory.pool_is_node_local(p.id)]

    def class_on_node(self, class_name: str, node_name: str) -> ClassOnNode | None:
        pools = self._local_pools(node_name)
        if not pools:
            return None
        try:
            plan = self.allocator.plan(_probe(class_name, 0, None))
        except AllocationError:
            return None  # a class the allocator cannot use (a selector that does not compile)
        request = plan.requests[0][0]
        node = self.devices.node(node_name)
        candidates = [c for c in self.allocator.candidates(node, pools, request) if c.error is None]
        reachable = {id(r) for p in pools for r in p.reachable}
        records = [(c.record, c.pool) for c in candidates if id(c.record) in reachable]
        if not records:
            return None
        row = ClassOnNode(node=node_name, device_class=class_name, devices=len(records),
                          states={s: 0 for s in DEVICE_STATES}, whole_free=0)
        for record, pool in records:
            row.states[self.device_state(record, pool)] += 1
        row.shared = self._shared(records)
        signature = self._signature(pools, {id(r) for r, _ in records})
        try:
            row.whole_free = self._fit_count(signature, node_name, class_name, None, len(records))
            profiles = sorted({(r.driver, p) for r, _ in records if (p := _profile(r)) is not None})
            for driver, profile in profiles:
                limit = sum(1 for r, _ in records if _profile(r) == profile)
                row.partitions[profile] = self._fit_count(signature, node_name, class_name,
                                                          profile_selector(driver, profile), limit)
        except AllocationError as exc:
            row.error = exc.message
        return row

    def device_state(self, record: DeviceRecord, pool: Pool) -> str:
        return device_state(self.devices, record, pool)

    def _shared(self, records: list[tuple[DeviceRecord, Pool]]) -> list[SharedCapacity]:
        by_name: dict[str, SharedCapacity] = {}
        for record, _ in records:
            if not record.allow_multiple or self.state.in_use(record.id):
                continue
            used = self.state.shared_capacity(record.id) or {}
            for name, capacity in record.capacity.items():
                entry = by_name.setdefault(name, SharedCapacity(name, 0, Fraction(0), Fraction(0)))
                entry.devices += 1
                entry.total += capacity.value.value
                entry.left += max(Fraction(0), capacity.value.value - used.get(name, Fraction(0)))
        return [by_name[n] for n in sorted(by_name)]

    def _signature(self, pools: list[Pool], in_class: set[int]) -> tuple:
        """Two nodes with this equal give the same counts: the same devices in the class, with the
        same profiles, counters, taints, capacity and use. (Attributes matter only through the
        class and profile, and differ between alike nodes: a GPU's uuid, say.)"""
        state = self.state
        parts = []
        for pool in pools:
            counters = tuple(sorted((n, tuple(sorted(c.items()))) for n, c in pool.counter_sets.items()))
            devices = tuple(
                (r.name, r.physical, id(r) in in_class, _profile(r), state.in_use(r.id),
                 tuple(sorted((state.shared_capacity(r.id) or {}).items())), state.is_allocated(r.id))
                for r in pool.devices
            )
            # Counters are shared by the pool: devices used elsewhere use them up too.
            used_elsewhere = tuple(sorted(n for n in pool.counter_consumers if state.is_allocated((*pool.id, n))))
            parts.append((pool.id[0], counters, devices, used_elsewhere))
        return tuple(parts)

    def _fit_count(self, signature: tuple, node_name: str, class_name: str, selector: str | None, limit: int) -> int:
        key = (signature, class_name, selector)
        known = self._fits.get(key)
        if known is not None:
            return known
        placed: list[ResourceClaim] = []
        node = self.devices.node(node_name)
        try:
            for index in range(limit):
                probe = _probe(class_name, index, selector)
                # No diagnosis: that it stops fitting is all the count needs to know.
                outcome = self.allocator.allocate([probe], node, FIRST_FIT, diagnose=False)
                if not isinstance(outcome, NodePlacement):
                    break
                self.devices.commit([probe], outcome)
                placed.append(probe)
        finally:
            for probe in placed:
                self.devices.release_claim(probe)
        self._fits[key] = len(placed)
        return len(placed)


def class_totals(class_name: str, rows: list[ClassOnNode]) -> ClassTotals:
    """One class summed over its rows (nodes)."""
    states = {s: sum(r.states[s] for r in rows) for s in DEVICE_STATES}
    shared: dict[str, SharedCapacity] = {}
    partitions: dict[str, int] = {}
    for r in rows:
        for s in r.shared:
            total = shared.setdefault(s.capacity, SharedCapacity(s.capacity, 0, Fraction(0), Fraction(0)))
            total.devices += s.devices
            total.total += s.total
            total.left += s.left
        for profile, count in r.partitions.items():
            partitions[profile] = partitions.get(profile, 0) + count
    return ClassTotals(
        device_class=class_name, nodes=len(rows), devices=sum(r.devices for r in rows), states=states,
        whole_free=sum(r.whole_free for r in rows), shared=[shared[n] for n in sorted(shared)],
        partitions=dict(sorted(partitions.items())),
    )

"""The device inventory the allocator searches: ResourceSlices turned into pools of device records.

Slices are decoded once into `DeviceRecord`s (attributes fully qualified, quantities parsed), so the
search never touches strings it has to parse again. The inventory is updated one slice or one pool at
a time and keeps a version per node, so that a cache of per-node results stays valid until something
on that node changes.

Pools are gathered per node as Kubernetes does it (`GatherPools`): slices relevant to the node, the
highest generation wins, a pool missing slices is incomplete, a pool with duplicate device names or
unknown counter sets is invalid.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable

import msgspec

from draplane.api.core import Node
from draplane.api.meta import NodeSelector
from draplane.api.quantity import Quantity, parse_quantity
from draplane.allocation.taintrules import taint_slice
from draplane.api.resource import Device, DeviceCapacity, DeviceTaintRule, ResourceSlice
from draplane.shared_instances import SharedInstances

DeviceID = tuple[str, str, str]  # (driver, pool, device)
PoolID = tuple[str, str]  # (driver, pool)

_encode = msgspec.json.Encoder().encode


def _content_id(device) -> bytes:
    """A device's content, as a 128-bit digest of its encoding: two devices with equal content are
    interchangeable for allocation wherever they sit, which lets whole nodes be compared cheaply
    (see DeviceAllocator._likeness). The digest, not the encoding itself (about 330 bytes a GPU), is kept:
    at 40,000 devices that was 26 MB of a shard's memory."""
    return hashlib.blake2b(_encode(device), digest_size=16).digest()


# What alike devices hold alike (an attribute's value, a capacity, the content of the same GPU
# model), one object for all of them: a shard holds every device of the cluster, and at 5,000
# dgx-h100 nodes a copy per device came to 2 KB each.
SHARED_VALUES = SharedInstances(limit=16_384)
_shared = SHARED_VALUES.get

PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA_NODE = "resource.kubernetes.io/numaNode"


def device_id_text(device_id: DeviceID) -> str:
    return "/".join(device_id)


def _attribute_value(raw) -> tuple[str, object] | None:
    # (kind, value): kinds compare too, so an int 1 never equals a string "1" (as in Kubernetes).
    if raw.string_value is not None:
        return _shared(("string", raw.string_value))
    if raw.int_value is not None:
        return _shared(("int", raw.int_value))
    if raw.bool_value is not None:
        return _shared(("bool", raw.bool_value))
    if raw.version_value is not None:
        return _shared(("version", raw.version_value))
    return None


def _share_alike_attributes(device: Device) -> None:
    """Let the device's attributes be the instances alike devices already hold (equal in every
    field, so nothing reads differently; its capacities likewise, in DeviceRecord). Nothing
    changes these structs once decoded; the slice keeps them, so they would otherwise be a copy
    per device."""
    attributes = device.attributes
    for key, raw in (attributes or {}).items():
        shared = _shared(("attribute", raw.int_value, raw.bool_value, raw.string_value, raw.version_value),
                         lambda _, raw=raw: raw)
        if shared is not raw:
            attributes[key] = shared


@dataclass(slots=True, frozen=True)
class CapacityEntry:
    value: Quantity
    default: Quantity | None = None
    valid_values: tuple[Quantity, ...] | None = None
    range_min: Quantity | None = None
    range_max: Quantity | None = None
    range_step: Quantity | None = None
    has_policy: bool = False


def _capacity_entry(key: tuple[str, bytes]) -> CapacityEntry:
    """A DeviceCapacity (as encoded) parsed. Devices of equal capacity share it, keyed by its text,
    not its value: "80Gi" and "85899345920" are equal but are written out differently."""
    cap = msgspec.json.decode(key[1], type=DeviceCapacity)
    policy = cap.request_policy
    if policy is None:
        return CapacityEntry(value=parse_quantity(cap.value))
    valid_range = policy.valid_range
    return CapacityEntry(
        value=parse_quantity(cap.value),
        default=parse_quantity(policy.default) if policy.default is not None else None,
        valid_values=tuple(parse_quantity(v) for v in policy.valid_values) if policy.valid_values is not None else None,
        range_min=parse_quantity(valid_range.min) if valid_range is not None else None,
        range_max=parse_quantity(valid_range.max) if valid_range is not None and valid_range.max is not None else None,
        range_step=parse_quantity(valid_range.step) if valid_range is not None and valid_range.step is not None else None,
        has_policy=True,
    )


class DeviceRecord:
    """One device of one slice, pre-digested for the search. Identity-compared and hashable."""

    __slots__ = (
        "id", "driver", "pool", "name", "device", "slice_name", "slice_node_name", "slice_node_selector",
        "per_device_node_selection", "attributes", "capacity", "consumes", "taints", "binding_conditions",
        "binding_failure_conditions", "binds_to_node", "allow_multiple", "pcie_root", "numa_node",
        "match_cache", "_cel_device", "content", "physical",
    )

    def __init__(self, slice_: ResourceSlice, device: Device):
        _share_alike_attributes(device)
        spec = slice_.spec
        self.driver = spec.driver
        self.pool = spec.pool.name
        self.name = device.name
        self.id: DeviceID = (spec.driver, spec.pool.name, device.name)
        self.device = device
        self.slice_name = slice_.metadata.name or ""
        self.per_device_node_selection = bool(spec.per_device_node_selection)
        self.slice_node_name = spec.node_name
        self.slice_node_selector = spec.node_selector
        # Fully-qualified attribute names. Unqualified names belong to the driver's domain; a
        # qualified spelling of the same name wins, as Kubernetes looks it up first.
        attributes: dict[str, tuple[str, object]] = {}
        qualified: dict[str, tuple[str, object]] = {}
        for key, raw in (device.attributes or {}).items():
            value = _attribute_value(raw)
            if value is None:
                continue
            if "/" in key:
                qualified[key] = value
            else:
                attributes[sys.intern(f"{spec.driver}/{key}")] = value
                attributes[key] = value
        attributes.update(qualified)
        self.attributes = attributes
        self.capacity: dict[str, CapacityEntry] = {}
        for key, cap in (device.capacity or {}).items():
            encoded = _encode(cap)
            shared = _shared(("capacity", encoded), lambda _, cap=cap: cap)
            if shared is not cap:
                device.capacity[key] = shared
            self.capacity[key] = _shared(("parsed capacity", encoded), _capacity_entry)
        self.consumes: list[tuple[str, dict[str, Fraction]]] = [
            (c.counter_set, {name: parse_quantity(counter.value).value for name, counter in c.counters.items()})
            for c in (device.consumes_counters or [])
        ]
        self.taints = device.taints or None
        self.binding_conditions = device.binding_conditions or None
        self.binding_failure_conditions = device.binding_failure_conditions or None
        self.binds_to_node = bool(device.binds_to_node)
        self.allow_multiple = bool(device.allow_multiple_allocations)
        pcie = attributes.get(PCIE_ROOT)
        numa = attributes.get(NUMA_NODE)
        self.pcie_root = pcie[1] if pcie else None
        self.numa_node = numa[1] if numa else None
        self.match_cache: dict[str, object] = {}
        self._cel_device = None
        self.content = _content_id(device)
        # Everything allocation looks at besides attributes (which matter only through selectors
        # and constraints) and the name (which results carry, but which never decides a fit).
        self.physical = _shared(("physical", _content_id(msgspec.structs.replace(device, name="", attributes=None))),
                                lambda key: key[1])

    def attribute(self, name: str) -> tuple[str, object] | None:
        """Kubernetes' lookupAttribute for a fully-qualified name."""
        return self.attributes.get(name)

    def __repr__(self) -> str:
        return f"DeviceRecord({device_id_text(self.id)})"


@dataclass(slots=True)
class SliceEntry:
    slice: ResourceSlice
    name: str
    generation: int
    slice_count: int
    node_name: str | None
    all_nodes: bool
    node_selector: NodeSelector | None
    per_device: bool
    has_counters: bool
    devices: list[DeviceRecord]
    counter_sets: dict[str, dict[str, Fraction]]


def _slice_entry(slice_: ResourceSlice) -> SliceEntry:
    spec = slice_.spec
    devices = [DeviceRecord(slice_, d) for d in (spec.devices or [])]
    counter_sets = {
        cs.name: {name: parse_quantity(c.value).value for name, c in cs.counters.items()}
        for cs in (spec.shared_counters or [])
    }
    return SliceEntry(
        slice=slice_,
        name=slice_.metadata.name or "",
        generation=spec.pool.generation,
        slice_count=spec.pool.resource_slice_count,
        node_name=spec.node_name or None,
        all_nodes=bool(spec.all_nodes),
        node_selector=spec.node_selector,
        per_device=bool(spec.per_device_node_selection),
        has_counters=bool(spec.shared_counters),
        devices=devices,
        counter_sets=counter_sets,
    )


@dataclass(slots=True)
class Pool:
    """A pool as seen from one node."""

    id: PoolID
    generation: int = 0
    incomplete: bool = False
    invalid_reason: str | None = None
    # Devices from slices that target the node, in slice order (slices sorted by name): as in
    # Kubernetes, a perDeviceNodeSelection slice brings all its devices when one reaches the node,
    # because selectors run before the per-device node check (a CEL error on a device the node
    # cannot use still fails the attempt) and its binding conditions order the pool.
    devices: list[DeviceRecord] = field(default_factory=list)
    # The devices this node can be given (the same list where no slice selects per device).
    reachable: list[DeviceRecord] = field(default_factory=list)
    counter_sets: dict[str, dict[str, Fraction]] = field(default_factory=dict)
    # Every device of the pool's current generation that consumes counters, on this node or not:
    # counters are shared across the pool, so devices allocated elsewhere use them up too.
    counter_consumers: dict[str, list[tuple[str, dict[str, Fraction]]]] = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        return not self.incomplete and self.invalid_reason is None

    def describe(self) -> str:
        return f"{self.id[0]}/{self.id[1]}"


def node_selector_matches(selector: NodeSelector, node: Node) -> bool:
    from draplane.component_helpers.node_affinity import term_matches

    labels = (node.metadata.labels or {}) if node is not None else {}
    name = (node.metadata.name or "") if node is not None else ""
    return any(
        term_matches(term, labels, name, where=f"nodeSelectorTerms[{i}]")
        for i, term in enumerate(selector.node_selector_terms or [])
    )


def node_matches(node: Node | None, node_name: str | None, all_nodes: bool, selector: NodeSelector | None) -> bool:
    """Kubernetes' NodeMatches: nodeName, then allNodes, then a node selector."""
    if node_name:
        return node is not None and node.metadata.name == node_name
    if all_nodes:
        return True
    if selector is not None:
        return node is not None and node_selector_matches(selector, node)
    return False


def _slice_targets_node(entry: SliceEntry, node: Node | None) -> bool:
    # A slice of counter sets is selected by its own node selection too, as in Kubernetes'
    # GatherPools: where a device of the node needs one from a slice that does not target the
    # node, the pool looks incomplete among the node's slices, and _gather_pool then reads every
    # slice of the generation, counter sets included.
    if entry.node_name or entry.all_nodes or entry.node_selector is not None:
        return node_matches(node, entry.node_name, entry.all_nodes, entry.node_selector)
    if entry.per_device:
        return any(
            node_matches(node, d.device.node_name, bool(d.device.all_nodes), d.device.node_selector)
            for d in entry.devices
        )
    return False  # some future way of selecting nodes: not ours to guess


class Inventory:
    """All ResourceSlices, indexed by pool and by node, with per-node versions for caching."""

    def __init__(self, slices: Iterable[ResourceSlice] = ()):
        self._slices: dict[str, SliceEntry] = {}
        self._pools: dict[PoolID, dict[str, SliceEntry]] = {}
        self._pools_by_node: dict[str, set[PoolID]] = {}
        # Pools with at least one slice not bound to one node by nodeName: visible to many nodes.
        self._shared_pools: dict[PoolID, int] = {}
        self.version = 0  # bumped when something visible to more than one node changes
        self.changes = 0  # bumped on every change of any slice
        self._node_versions: dict[str, int] = {}
        self._pool_cache: dict[str, tuple[tuple, Node, list[Pool]]] = {}
        # The slices as published, by name, and the DeviceTaintRules applied to them: what is
        # indexed is each slice with the rules' taints added (the same object where none applies).
        self._published: dict[str, ResourceSlice] = {}
        self._taint_rules: dict[str, DeviceTaintRule] = {}
        for s in slices:
            self.apply_slice(s)

    # --- updates --------------------------------------------------------------------------------

    def apply_slice(self, slice_: ResourceSlice) -> None:
        """Add or replace one slice (by name)."""
        name = slice_.metadata.name
        if not name:
            raise ValueError("ResourceSlice without metadata.name cannot be indexed")
        if name in self._slices:
            self._remove(name)
        self._published[name] = slice_
        slice_ = taint_slice(slice_, self._taint_rules.values())
        entry = _slice_entry(slice_)
        self._slices[name] = entry
        pool_id = (slice_.spec.driver, slice_.spec.pool.name)
        self._pools.setdefault(pool_id, {})[name] = entry
        self._index_add(pool_id, entry)
        self._touch(pool_id, entry)

    def remove_slice(self, name: str) -> None:
        if name in self._slices:
            self._remove(name)

    def replace_pool(self, driver: str, pool: str, slices: Iterable[ResourceSlice]) -> None:
        """Replace every slice of one pool (what a driver publishes for a node) in one step."""
        for name in list(self._pools.get((driver, pool), {})):
            self._remove(name)
        for s in slices:
            self.apply_slice(s)

    def set_taint_rules(self, rules: Iterable[DeviceTaintRule]) -> bool:
        """Replace the DeviceTaintRules; re-index the slices whose devices' taints change. True
        when anything changed."""
        rules = {r.metadata.name or "": r for r in rules}
        if rules == self._taint_rules:
            return False
        self._taint_rules = rules
        changed = False
        for name, published in list(self._published.items()):
            tainted = taint_slice(published, rules.values())
            if tainted is not self._slices[name].slice and tainted != self._slices[name].slice:
                self.apply_slice(published)
                changed = True
        return changed

    @property
    def taint_rules(self) -> list[DeviceTaintRule]:
        return list(self._taint_rules.values())

    def _remove(self, name: str) -> None:
        self._published.pop(name, None)
        entry = self._slices.pop(name)
        pool_id = (entry.slice.spec.driver, entry.slice.spec.pool.name)
        pool_slices = self._pools[pool_id]
        del pool_slices[name]
        if not pool_slices:
            del self._pools[pool_id]
        self._touch(pool_id, entry)
        self._reindex(pool_id)

    def _index_add(self, pool_id: PoolID, entry: SliceEntry) -> None:
        # A counter-set slice is relevant to every node in Kubernetes, but one bound to a node by
        # nodeName only matters where that pool's devices are: keeping it node-local lets a commit
        # on a partitioned GPU invalidate one node rather than every node.
        if entry.node_name:
            self._pools_by_node.setdefault(entry.node_name, set()).add(pool_id)
        else:
            self._shared_pools[pool_id] = self._shared_pools.get(pool_id, 0) + 1

    def _reindex(self, pool_id: PoolID) -> None:
        self._shared_pools.pop(pool_id, None)
        for pools in self._pools_by_node.values():
            pools.discard(pool_id)
        for entry in self._pools.get(pool_id, {}).values():
            self._index_add(pool_id, entry)

    def _touch(self, pool_id: PoolID, entry: SliceEntry) -> None:
        self.changes += 1
        if entry.node_name and pool_id not in self._shared_pools:
            self._node_versions[entry.node_name] = self._node_versions.get(entry.node_name, 0) + 1
        else:
            self.version += 1

    # --- queries --------------------------------------------------------------------------------

    def has_slice(self, name: str) -> bool:
        return name in self._slices

    def slice_node(self, name: str) -> str | None:
        entry = self._slices.get(name)
        return entry.node_name if entry else None

    def pool_slice_names(self, driver: str, pool: str) -> list[str]:
        return list(self._pools.get((driver, pool), {}))

    def slice_entries(self) -> dict[str, SliceEntry]:
        """Every slice as indexed, by name. Read-only: an entry is replaced, never changed."""
        return self._slices

    def slices(self) -> list[ResourceSlice]:
        return [e.slice for e in self._slices.values()]

    def node_names(self) -> set[str]:
        return {n for n, pools in self._pools_by_node.items() if pools}

    def node_version(self, node_name: str) -> tuple[int, int]:
        """Changes whenever the pools visible to this node may have changed."""
        return (self.version, self._node_versions.get(node_name, 0))

    def nodes_of_pool(self, pool_id: PoolID) -> set[str]:
        return {e.node_name for e in self._pools.get(pool_id, {}).values() if e.node_name}

    def pool_is_node_local(self, pool_id: PoolID) -> bool:
        return pool_id not in self._shared_pools

    def has_shared_pools(self) -> bool:
        """Some pool is visible to more than one node (allNodes, node selectors, counter slices)."""
        return bool(self._shared_pools)

    def pools_for_node(self, node: Node) -> list[Pool]:
        """The pools usable from `node`, sorted by (driver, pool) so the search order is stable."""
        name = node.metadata.name or ""
        key = self.node_version(name)
        cached = self._pool_cache.get(name)
        if cached is not None and cached[0] == key and cached[1] is node:
            return cached[2]
        candidates = set(self._pools_by_node.get(name, ())) | set(self._shared_pools)
        pools = []
        for pool_id in sorted(candidates):
            pool = self._gather_pool(pool_id, node)
            if pool is not None:
                pools.append(pool)
        self._pool_cache[name] = (key, node, pools)
        return pools

    def _gather_pool(self, pool_id: PoolID, node: Node) -> Pool | None:
        all_entries = sorted(self._pools.get(pool_id, {}).values(), key=lambda e: e.name)
        relevant = [e for e in all_entries if _slice_targets_node(e, node)]
        if not relevant:
            return None
        generation = max(e.generation for e in relevant)
        current = [e for e in relevant if e.generation == generation]
        expected = current[0].slice_count
        complete = len(current) == expected
        every = current
        if not complete:
            # Slices filtered out for this node may belong to a newer generation (then this one is
            # obsolete and ignored) or complete the pool.
            if any(e.generation > generation for e in all_entries):
                return None
            every = [e for e in all_entries if e.generation == generation]
            complete = len(every) == expected
        pool = Pool(id=pool_id, generation=generation)
        if not complete:
            pool.incomplete = True
            return pool
        device_entries = [e for e in current if not e.has_counters]
        seen: set[str] = set()
        for e in device_entries:
            for d in e.devices:
                if d.name in seen:
                    pool.invalid_reason = f"duplicate device name {d.name}"
                    return pool
                seen.add(d.name)
        for e in every:
            if e.has_counters:
                for set_name, counters in e.counter_sets.items():
                    if set_name in pool.counter_sets:
                        pool.invalid_reason = f"duplicate counter set name {set_name}"
                        return pool
                    pool.counter_sets[set_name] = counters
        for e in every:
            for d in e.devices:
                for set_name, counters in d.consumes:
                    known = pool.counter_sets.get(set_name)
                    if known is None:
                        pool.invalid_reason = f"counter set {set_name} not found"
                        return pool
                    for counter in counters:
                        if counter not in known:
                            pool.invalid_reason = f"counter {counter} not found in counter set {set_name}"
                            return pool
                if d.consumes:
                    pool.counter_consumers[d.name] = d.consumes
        per_device = False
        for e in device_entries:
            pool.devices.extend(e.devices)
            per_device = per_device or e.per_device
        if not per_device:
            pool.reachable = pool.devices
        else:
            for e in device_entries:
                if e.per_device:
                    pool.reachable.extend(
                        d for d in e.devices
                        if node_matches(node, d.device.node_name, bool(d.device.all_nodes), d.device.node_selector)
                    )
                else:
                    pool.reachable.extend(e.devices)
        return pool

"""Allocation across nodes: the inventory, the allocated state, and the best node for a set of claims.

`DeviceAllocator` is what the allocator service, the simulator and `draplane allocate` hold. It answers
"where do these claims go?" with the scoring policy, and remembers the answer per node for claims of
the same shape: the per-node result stays valid until that node's version changes (a slice on it or
an allocation from one of its pools), so after one commit only that node is recomputed. Nodes alike
in devices and use share one search, and the node picked takes that search's devices at the same
positions (`NodeAllocator.place_like`) rather than searching again. A simulator scheduling thousands
of pods of a few shapes over a thousand nodes then costs less than one node search per pod.
"""

from __future__ import annotations

import dataclasses
import heapq
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from draplane.api.codec import encode_json
from draplane.api.core import Node
from draplane.api.meta import ObjectMeta
from draplane.api.resource import DeviceClass, DeviceTaintRule, ResourceClaim, ResourceSlice
from draplane.allocation.allocator import NodeAllocator, NodePlacement, SelectorMatcher, ShareIDFactory, random_share_id
from draplane.allocation.errors import AllocationError, NodeFailure, Reason
from draplane.allocation.inventory import Inventory, PoolID
from draplane.allocation.scarcity import DeviceScarcity
from draplane.allocation.scoring import ScoringPolicy, get_policy
from draplane.allocation.state import AllocatedState, claim_key

NodeFilter = Callable[[Node], bool]


def placement_device_milli(placement: NodePlacement) -> float:
    """What a placement takes of its node's devices, in milli-devices: 1000 per device taken whole,
    the consumed fraction (its largest capacity) of a shared one."""
    total = 0.0
    for chosen in placement.chosen:
        for c in chosen:
            if not c.consumed:
                total += 1000.0
                continue
            fraction = 0.0
            for cap_name, amount in c.consumed.items():
                cap = c.record.capacity.get(cap_name)
                if cap is not None and cap.value.value > 0:
                    fraction = max(fraction, float(amount.value / cap.value.value))
            total += 1000.0 * fraction
    return total


def _device_positions(placement: NodePlacement, pools) -> tuple[tuple[int, ...], ...]:
    """Where each chosen device is among the devices of the node's pools, in order, per claim."""
    position = {id(r): i for i, r in enumerate(r for pool in pools for r in pool.devices)}
    return tuple(tuple(position[id(c.record)] for c in chosen) for chosen in placement.chosen)


@dataclass(slots=True)
class Unallocatable:
    """No node can take the claims. `failures` has one entry per node examined (when explained)."""

    message: str
    failures: list[NodeFailure] = field(default_factory=list)

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True, slots=True)
class NodeResources:
    """The pod's CPU (milli) and memory (bytes) requests, and each node's free CPU and memory
    (allocatable minus the requests of the pods bound there), for policies whose node score reads
    them (`ScoringPolicy.reads_node_resources`)."""

    cpu: int
    memory: int
    free: Callable[[str], tuple[int, int]]


@dataclass(slots=True)
class _NodeEntry:
    stamp: tuple
    frees: int  # the node's count of capacity-freeing changes when the outcome was computed
    outcome: object  # NodePlacement | NodeFailure | AllocationError
    # For a placement found on another, alike node: where its devices are among that node's
    # (see `NodeAllocator.place_like`); None for an outcome computed on this node.
    positions: tuple | None = None


@dataclass(slots=True, eq=False)
class _NodeLooks:
    """What one node's devices look like (see `DeviceAllocator._likeness`), for one list of its pools: a
    new list (a slice changed) starts afresh. One object per node, not one per cached part: the
    garbage collector walks every object a busy cluster keeps."""

    pools: list
    columns: dict[tuple, tuple] = field(default_factory=dict)  # (kind, selector | attribute | policy name) -> column
    contents: dict[tuple, int] = field(default_factory=dict)  # likeness key -> content number
    used_versions: tuple | None = None  # the pools' state versions `used` was computed at
    used: tuple = ()


class _ScoredNodes:
    """One claim shape's feasible nodes as arrays (device score, free and taken milli-devices,
    free CPU and memory, node order), for `ScoringPolicy.node_resources_scores` over all of them
    at once (see `DeviceAllocator._best_with_resources`). A node that stops being feasible leaves a hole."""

    def __init__(self, resource_epoch: int, capacity: int):
        self.resource_epoch = resource_epoch
        self.seen_changes = 0  # positions in the cluster's change logs
        self.seen_resource_changes = 0
        self.slot: dict[str, int] = {}
        self.names: list[str] = []
        self.size = 0
        capacity = max(16, capacity)
        self.score = np.zeros(capacity)
        self.device_free = np.zeros(capacity)
        self.taken = np.zeros(capacity)
        self.cpu_free = np.zeros(capacity, dtype=np.int64)
        self.memory_free = np.zeros(capacity, dtype=np.int64)
        self.order = np.zeros(capacity, dtype=np.int64)
        self.valid = np.zeros(capacity, dtype=bool)

    def put(self, name: str, order: int, free: tuple[int, int], score: float, device_free: float, taken: float) -> None:
        i = self.slot.get(name)
        if i is None:
            if self.size == len(self.valid):
                self._grow()
            i = self.slot[name] = self.size
            self.names.append(name)
            self.size += 1
        self.order[i], self.score[i], self.device_free[i], self.taken[i] = order, score, device_free, taken
        self.cpu_free[i], self.memory_free[i] = _int64(free[0]), _int64(free[1])
        self.valid[i] = True

    def drop(self, name: str) -> None:
        i = self.slot.get(name)
        if i is not None:
            self.valid[i] = False

    def _grow(self) -> None:
        for attribute in ("score", "device_free", "taken", "cpu_free", "memory_free", "order", "valid"):
            array = getattr(self, attribute)
            setattr(self, attribute, np.concatenate([array, np.zeros_like(array)]))


# Amounts beyond any machine's (2^62 bytes is 4 EiB) are held at this, so that numpy's int64
# neither overflows nor wraps on a pathological request or allocatable.
_INT64_BOUND = 1 << 62


def _int64(value: int) -> int:
    return max(-_INT64_BOUND, min(_INT64_BOUND, value))


def _ranked(total: np.ndarray, order: np.ndarray, valid: np.ndarray) -> Iterable[int]:
    """Valid positions by (total, order): the best first without sorting (the node filter nearly
    always takes it), the rest sorted only when it did not."""
    if not valid.any():
        return
    best_total = total[valid].min()
    ties = np.flatnonzero(valid & (total == best_total))
    first = int(ties[np.argmin(order[ties])])
    yield first
    for i in np.lexsort((order, total)):
        if valid[i] and i != first:
            yield int(i)


class _ShapeIndex:
    """Per claim shape: each node's last outcome, and a heap of feasible nodes by score."""

    def __init__(self, epoch: int, policy: ScoringPolicy, plans):
        self.epoch = epoch
        self.seen = 0  # position in the cluster's change log
        self.entries: dict[str, _NodeEntry] = {}
        self.heap: list[tuple[float, int, str, tuple]] = []
        self.errors: dict[str, AllocationError] = {}
        # Nodes where evaluating the claims raised an error that holds there only (an incomplete
        # pool for `All`, a constraint an `All` request's device breaks): kube-scheduler's
        # DynamicResources Filter returns it as an error, which ends the pod's attempt.
        self.node_errors: dict[str, NodeFailure] = {}
        # Nodes alike in devices and use (see DeviceAllocator._likeness) share one search:
        # likeness -> (outcome, the positions of a placement's devices on the node searched).
        self.by_likeness: dict[tuple, tuple[object, tuple | None]] = {}
        self.policy = policy
        self.policy_version = policy.version  # scores go stale when the policy learns (see ScoringPolicy.version)
        self.expressions: tuple[str, ...] = ()
        self.likeness_key: tuple = ()
        self.attributes: tuple[str, ...] = ()
        self.scored: _ScoredNodes | None = None  # for policies that read node resources


class DeviceAllocator:
    def __init__(
        self,
        *,
        slices: Iterable[ResourceSlice] = (),
        classes: Iterable[DeviceClass] = (),
        taint_rules: Iterable[DeviceTaintRule] = (),
        nodes: Iterable[Node] = (),
        policy: str | ScoringPolicy | None = None,
        share_ids: ShareIDFactory = random_share_id,
        matcher: SelectorMatcher | None = None,
        tie_break: int = 0,
    ):
        """`tie_break` orders nodes that score the same: 0 by name; another number by a hash of
        it and the name, so that shards given different numbers pick different nodes among equals
        (kube-scheduler picks at random among them) rather than all race for the first."""
        self.inventory = Inventory()
        self.inventory.set_taint_rules(taint_rules)
        for s in slices:
            self.inventory.apply_slice(s)
        self.state = AllocatedState()
        self.classes: dict[str, DeviceClass] = {c.metadata.name: c for c in classes}
        self.policy = policy if isinstance(policy, ScoringPolicy) else get_policy(policy)
        self.allocator = NodeAllocator(self.inventory, self.state, self.classes, matcher=matcher, share_ids=share_ids)
        self.scarcity = DeviceScarcity(self.inventory, self.allocator.matcher)
        self.scarcity.set_classes(self.classes.values())
        self.allocator.scarcity = self.scarcity
        self._scarcity_version = -1  # the scarcity.version the caches were built under
        self.nodes: dict[str, Node] = {}
        self._node_order: dict[str, int] = {}
        self._order_stale = False  # nodes came or went since _node_order was computed
        self._tie_break = tie_break
        self._epoch = 0  # bumped when every node may be affected
        self._node_stamps: dict[str, int] = {}
        self._node_frees: dict[str, int] = {}
        self._changes: list[str] = []
        self._shapes: dict[tuple, _ShapeIndex] = {}
        self._looks: dict[str, _NodeLooks] = {}  # node -> what its devices look like (see `_likeness`)
        # What devices look like -> a number for it, so that a likeness hashes and compares cheaply.
        # Numbers are never reused (a cleared table only hands out new ones).
        self._content_numbers: dict[tuple, int] = {}
        self._next_content_number = 0
        self._device_free: dict[str, tuple[tuple, float]] = {}  # node -> (stamp, free milli-devices)
        self._resource_changes: list[str] = []  # nodes whose CPU or memory in use changed (see node_resources_changed)
        self._resource_epoch = 0  # bumped when that log is cleared
        self._taken_milli: dict[int, tuple[NodePlacement, float]] = {}  # id(outcome) -> (outcome, milli-devices)
        for n in nodes:
            self.set_node(n)

    # --- inputs ---------------------------------------------------------------------------------

    def set_node(self, node: Node) -> None:
        name = node.metadata.name or ""
        if name not in self.nodes:
            self._reorder()
        self.nodes[name] = node
        self._node_changed(name)

    def remove_node(self, name: str) -> None:
        self.nodes.pop(name, None)
        self._looks.pop(name, None)
        self._reorder()
        self._node_changed(name)

    def _reorder(self) -> None:
        # Computed when next asked (_ensure_order), not per node: a shard's start adds thousands.
        self._order_stale = True
        self._epoch += 1

    def _ensure_order(self) -> None:
        if not self._order_stale:
            return
        if self._tie_break:
            salt = f"{self._tie_break}/".encode()
            names = sorted(self.nodes, key=lambda n: (zlib.crc32(salt + n.encode()), n))
        else:
            names = sorted(self.nodes)
        self._node_order = {n: i for i, n in enumerate(names)}
        self._order_stale = False

    def node(self, name: str) -> Node:
        """The Node object, or a bare one when only slices name it."""
        node = self.nodes.get(name)
        if node is None:
            node = Node(metadata=ObjectMeta(name=name))
            self.nodes[name] = node
            self._reorder()
        return node

    def ensure_nodes_from_slices(self) -> None:
        """Nodes named by slices but not given as Node objects take part with no labels."""
        for name in self.inventory.node_names():
            if name not in self.nodes:
                self.nodes[name] = Node(metadata=ObjectMeta(name=name))
        self._reorder()

    def set_classes(self, classes: Iterable[DeviceClass]) -> None:
        self.classes = {c.metadata.name: c for c in classes}
        self.allocator.set_classes(self.classes)
        self.scarcity.set_classes(self.classes.values())
        self._epoch += 1

    def _check_scarcity(self, policy: ScoringPolicy) -> None:
        """Scores that read scarcity go stale when the classes' shares of the cluster move."""
        if not policy.reads_scarcity:
            return
        self.scarcity.refresh()
        if self.scarcity.version != self._scarcity_version:
            self._scarcity_version = self.scarcity.version
            self._epoch += 1

    def set_taint_rules(self, rules: Iterable[DeviceTaintRule]) -> None:
        """The cluster's DeviceTaintRules: their taints count as the devices' own."""
        if self.inventory.set_taint_rules(rules):
            self._epoch += 1

    def apply_slice(self, slice_: ResourceSlice) -> None:
        before = self.inventory.version
        self.inventory.apply_slice(slice_)
        self._after_inventory_change(before, slice_.spec.node_name)

    def remove_slice(self, name: str) -> None:
        before = self.inventory.version
        node = self.inventory.slice_node(name)
        self.inventory.remove_slice(name)
        self._after_inventory_change(before, node)

    def replace_pool(self, driver: str, pool: str, slices: Sequence[ResourceSlice]) -> None:
        """Everything one driver publishes for one pool (typically one node), in one step."""
        before = self.inventory.version
        nodes = {self.inventory.slice_node(n) for n in self.inventory.pool_slice_names(driver, pool)}
        nodes |= {s.spec.node_name for s in slices}
        self.inventory.replace_pool(driver, pool, slices)
        if self.inventory.version != before or None in nodes:
            self._epoch += 1
        else:
            for n in nodes:
                self._node_changed(n)

    def _after_inventory_change(self, version_before: int, node_name: str | None) -> None:
        if self.inventory.version != version_before or not node_name:
            self._epoch += 1
        else:
            self._node_changed(node_name)

    def add_allocated_claim(self, claim: ResourceClaim) -> None:
        """A claim with status.allocation (ours or anyone's): its devices are in use."""
        allocation = claim.status.allocation if claim.status else None
        key = claim_key(claim)
        frees = self.state.holds(key)  # a re-allocation releases what the claim held before
        self._pools_changed(self.state.add_claim(key, allocation), frees=frees)

    def release_claim(self, claim: ResourceClaim | str) -> None:
        key = claim if isinstance(claim, str) else claim_key(claim)
        self._pools_changed(self.state.remove_claim(key), frees=True)

    def commit(self, claims: Sequence[ResourceClaim], placement: NodePlacement) -> None:
        for claim, allocation in zip(claims, placement.allocations):
            key = claim_key(claim)
            frees = self.state.holds(key)
            self._pools_changed(self.state.add_claim(key, allocation), frees=frees)

    def _pools_changed(self, pools: list[PoolID], *, frees: bool) -> None:
        for pool in set(pools):
            if not self.inventory.pool_is_node_local(pool):
                self._epoch += 1
                return
        nodes = set()
        for pool in set(pools):
            nodes.update(self._nodes_of_pool(pool))
        for n in nodes:
            self._node_changed(n, frees=frees)

    def _nodes_of_pool(self, pool: PoolID) -> set[str]:
        return self.inventory.nodes_of_pool(pool)

    def _node_changed(self, name: str, *, frees: bool = True) -> None:
        """Something on the node changed. `frees=False` when it only took devices or capacity: then
        claims that did not fit still do not fit (allocation is monotonic), and need no new search."""
        self._node_stamps[name] = self._node_stamps.get(name, 0) + 1
        if frees:
            self._node_frees[name] = self._node_frees.get(name, 0) + 1
        self._changes.append(name)
        if len(self._changes) > 200_000:
            self._changes.clear()
            self._epoch += 1

    def _stamp(self, name: str) -> tuple:
        return (self._epoch, self._node_stamps.get(name, 0))

    # --- allocation -----------------------------------------------------------------------------

    def allocate_on_node(self, claims: Sequence[ResourceClaim], node_name: str,
                         policy: ScoringPolicy | None = None) -> NodePlacement | NodeFailure:
        """All claims on one node. Raises AllocationError for bad input or evaluation errors."""
        policy = policy or self.policy
        self._check_scarcity(policy)
        return self.allocator.allocate(claims, self.node(node_name), policy)

    def allocate(
        self,
        claims: Sequence[ResourceClaim],
        *,
        node_filter: NodeFilter | None = None,
        policy: ScoringPolicy | None = None,
        explain: bool = False,
        node_resources: NodeResources | None = None,
        node_bonus: Mapping[str, float] | None = None,
    ) -> NodePlacement | Unallocatable:
        """The best node for all claims together, per the policy. Raises AllocationError (fatal input
        errors, or an evaluation error on any node, as kube-scheduler fails the whole attempt).

        With `node_resources`, a policy that reads them adds a term per node for its CPU and memory
        (see `_best_with_resources`); which nodes are feasible does not change. `node_bonus` is taken
        off the named nodes' scores (a pod's own preferences, draplane.scheduling.pod_scores)."""
        policy = policy or self.policy
        self._ensure_order()
        self._check_scarcity(policy)
        plans = [self.allocator.plan(c) for c in claims]  # fatal validation errors surface here
        shape = (policy.name, tuple(encode_json(c.spec) for c in claims))
        index = self._refresh(shape, claims, policy, plans)
        if index.errors:
            raise next(iter(index.errors.values()))
        for name in sorted(index.node_errors):
            # Only where the other filters let the pod be: kube-scheduler runs this one there alone.
            if name in self.nodes and (node_filter is None or node_filter(self.nodes[name])):
                failure = index.node_errors[name]
                raise AllocationError(failure.reason, failure.message, node=name)
        with_resources = node_resources is not None and policy.reads_node_resources
        while True:
            if with_resources:
                name = self._best_with_resources(index, node_filter, policy, node_resources, node_bonus)
            elif node_bonus:
                name = self._best_with_bonus(index, node_filter, node_bonus)
            else:
                name = self._best(index, node_filter)
            if name is None:
                return self._unallocatable(index, node_filter, claims, plans, explain)
            entry = index.entries[name]
            template = entry.outcome
            if template.node == name:
                return self._for_claims(template, claims, plans, policy)
            # Computed on a node just like this one: the search here gives the same answer, with
            # this node's pool and device names and node selector. Share IDs must be fresh, so a
            # placement with them is searched for again.
            node = self.nodes[name]
            if entry.positions is not None and not any(c.share_id for chosen in template.chosen for c in chosen):
                placement = self.allocator.place_like(template, entry.positions, node, self.inventory.pools_for_node(node))
                entry.outcome, entry.positions = placement, None
                return placement
            placement = self.allocator.allocate(claims, node, policy, plans=plans, diagnose=False)
            if isinstance(placement, NodePlacement):
                index.entries[name].outcome = placement
                return placement
            index.entries[name].outcome = placement  # should not happen; never trust it again
            index.entries[name].positions = None
            index.by_likeness.clear()

    def _refresh(self, shape, claims, policy, plans) -> _ShapeIndex:
        index = self._shapes.get(shape)
        if index is None or index.epoch != self._epoch or index.policy_version != policy.version:
            if len(self._shapes) > 1024:
                self._shapes.clear()
            index = _ShapeIndex(self._epoch, policy, plans)
            index.policy_version = policy.version
            index.expressions = tuple(dict.fromkeys(
                e for plan in plans for subs in plan.requests for r in subs for e in r.class_selectors + r.request_selectors))
            index.attributes = tuple(dict.fromkeys(c.attribute for plan in plans for c in plan.constraints))
            index.likeness_key = (index.expressions, index.attributes, policy.name,
                                  self.scarcity.version if policy.reads_scarcity else None)
            self._shapes[shape] = index
            dirty = list(self.nodes)
        else:
            dirty = set(self._changes[index.seen:])
        index.seen = len(self._changes)
        for name in dirty:
            if name not in self.nodes:
                index.entries.pop(name, None)
                index.errors.pop(name, None)
                index.node_errors.pop(name, None)
                continue
            stamp = self._stamp(name)
            entry = index.entries.get(name)
            if entry is not None and entry.stamp == stamp:
                continue
            frees = self._node_frees.get(name, 0)
            if (entry is not None and entry.stamp[0] == stamp[0] and entry.frees == frees
                    and isinstance(entry.outcome, NodeFailure) and entry.outcome.reason is not Reason.SEARCH_LIMIT):
                entry.stamp = stamp  # only more devices taken since: still does not fit
                continue
            index.errors.pop(name, None)
            likeness = self._likeness(name, index)
            shared = index.by_likeness.get(likeness) if likeness is not None else None
            if shared is None:
                try:
                    outcome = self.allocator.allocate(claims, self.nodes[name], policy, plans=plans, diagnose=False)
                except AllocationError as exc:
                    outcome = NodeFailure(name, exc.reason, exc.message, from_error=True) if not exc.fatal else exc
                positions = None
                if likeness is not None:
                    if isinstance(outcome, NodePlacement):
                        positions = _device_positions(outcome, self.inventory.pools_for_node(self.nodes[name]))
                    if len(index.by_likeness) > 100_000:
                        index.by_likeness.clear()
                    index.by_likeness[likeness] = (outcome, positions)
                positions = None  # computed here: the outcome is this node's own
            else:
                outcome, positions = shared
            if isinstance(outcome, AllocationError):
                index.errors[name] = outcome
            if isinstance(outcome, NodeFailure) and outcome.from_error:
                index.node_errors[name] = outcome
            else:
                index.node_errors.pop(name, None)
            if entry is None:
                index.entries[name] = _NodeEntry(stamp, frees, outcome, positions)
            else:  # updated in place: a busy cluster otherwise makes one object per node change
                entry.stamp, entry.frees, entry.outcome, entry.positions = stamp, frees, outcome, positions
            if isinstance(outcome, NodePlacement):
                heapq.heappush(index.heap, (outcome.score, self._node_order.get(name, 0), name, stamp))
        return index

    def _likeness(self, name: str, index: _ShapeIndex) -> tuple | None:
        """Equal for two nodes on which these claims must fare the same: pools of the same devices
        in the same order (as far as the claims' selectors and constraints and the policy can tell),
        used the same way. None when pools shared between nodes are visible (their labels and state
        would matter too)."""
        if self.inventory.has_shared_pools():
            return None
        node = self.nodes[name]
        pools = self.inventory.pools_for_node(node)
        looks = self._looks.get(name)
        if looks is None or looks.pools is not pools:
            looks = self._looks[name] = _NodeLooks(pools)
        number = looks.contents.get(index.likeness_key)
        if number is None:
            # Column by column (the pools and devices, the policy's view, each selector's answers,
            # each constrained attribute), each column cached per node: claim shapes share
            # most columns (one class's selector, say), so a new shape computes only its own.
            content = (
                self._column(looks, "devices", None),
                self._column(looks, "policy", index.policy),
                tuple(self._column(looks, "selector", e) for e in index.expressions),
                tuple(self._column(looks, "attribute", a) for a in index.attributes),
                self._column(looks, "scarcity", self.scarcity) if index.policy.reads_scarcity else (),
            )
            number = self._content_numbers.get(content)
            if number is None:
                if len(self._content_numbers) > 100_000:
                    self._content_numbers.clear()
                number = self._content_numbers[content] = self._next_content_number
                self._next_content_number += 1
            if len(looks.contents) > 128:
                looks.contents.clear()  # a bound, not an LRU, as for columns
            looks.contents[index.likeness_key] = number
        return (number, self._used(looks), index.policy.node_likeness(node))

    def _column(self, looks: _NodeLooks, kind: str, what) -> tuple:
        """One part of what a node's devices look like, in device order (see `_likeness`)."""
        key = (kind, what.name if kind == "policy" else what.version if kind == "scarcity" else what)
        column = looks.columns.get(key)
        if column is not None:
            return column
        pools = looks.pools
        records = [r for pool in pools for r in pool.devices]
        if kind == "devices":
            column = (tuple((pool.id[0], pool.incomplete, pool.invalid_reason, len(pool.devices),
                             tuple(sorted((n, tuple(sorted(c.items()))) for n, c in pool.counter_sets.items())))
                            for pool in pools),
                      tuple(r.physical for r in records))
        elif kind == "policy":
            column = tuple(what.likeness(r) for r in records)
        elif kind == "scarcity":
            column = tuple(what.of(r) for r in records)
        elif kind == "selector":
            evaluate = self.allocator.matcher.evaluate
            column = tuple(result if isinstance(result, bool) else "error"
                           for result in (evaluate(what, r) for r in records))
        else:
            column = tuple(r.attribute(what) for r in records)
        if len(looks.columns) > 128:
            looks.columns.clear()  # a bound, not an LRU: columns are cheap to recompute
        looks.columns[key] = column
        return column

    def _used(self, looks: _NodeLooks) -> tuple:
        """Which of the node's devices are taken, and how much of the shared ones: the same for
        every claim shape, so computed once per change of the node's pools' state."""
        state = self.state
        versions = tuple([state.pool_version(pool.id) for pool in looks.pools])
        if looks.used_versions == versions:
            return looks.used
        used = []
        position = 0
        for pool in looks.pools:
            for r in pool.devices:
                if state.is_allocated(r.id):
                    shared = state.shared_capacity(r.id)
                    used.append((position, None if shared is None else tuple(sorted(shared.items()))))
                position += 1
        looks.used, looks.used_versions = tuple(used), versions
        return looks.used

    def _best(self, index: _ShapeIndex, node_filter: NodeFilter | None) -> str | None:
        heap = index.heap
        skipped = []
        found = None
        while heap:
            score, order, name, stamp = heap[0]
            entry = index.entries.get(name)
            if entry is None or entry.stamp != stamp or stamp != self._stamp(name) or not isinstance(entry.outcome, NodePlacement):
                heapq.heappop(heap)  # stale
                continue
            if node_filter is not None and not node_filter(self.nodes[name]):
                skipped.append(heapq.heappop(heap))
                continue
            found = name
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def node_resources_changed(self, name: str) -> None:
        """The CPU or memory in use on the node changed (a pod came or went there): its term in
        `allocate(node_resources=...)` is computed again. Device outcomes stay as they are."""
        self._resource_changes.append(name)
        if len(self._resource_changes) > 200_000:
            self._resource_changes.clear()
            self._resource_epoch += 1

    def _best_with_bonus(self, index: _ShapeIndex, node_filter: NodeFilter | None,
                         bonus: Mapping[str, float]) -> str | None:
        """`_best` with `bonus` taken off the named nodes' scores: every feasible node sorted, as
        only the few pods with preferences come here."""
        ranked = []
        for name, entry in index.entries.items():
            if isinstance(entry.outcome, NodePlacement) and entry.stamp == self._stamp(name):
                ranked.append((entry.outcome.score - bonus.get(name, 0.0), self._node_order.get(name, 0), name))
        for _, _, name in sorted(ranked):
            if node_filter is None or node_filter(self.nodes[name]):
                return name
        return None

    def _best_with_resources(self, index: _ShapeIndex, node_filter: NodeFilter | None, policy: ScoringPolicy,
                             resources: NodeResources, bonus: Mapping[str, float] | None = None) -> str | None:
        """The feasible node with the lowest device score plus the policy's CPU/memory term, ties
        by node order; the node filter (node fit) is asked in that order, as `_best` does.

        The term reads the node's free CPU and memory, and what the policy learned from every pod
        so far (so it changes for every node with every pod): it is computed for all feasible nodes
        at once, over arrays the shape keeps current from the nodes changed since (`_ScoredNodes`).
        Scoring node by node in Python took 22 of a placement's 23 ms at 5,000 nodes."""
        observed = False
        for name, entry in index.entries.items():
            if isinstance(entry.outcome, NodePlacement) and entry.stamp == self._stamp(name):
                # Same claims, same devices asked on every node: learn the pod's shape once.
                policy.observe_requests(resources.cpu, resources.memory, self._taken(entry.outcome))
                observed = True
                break
        if not observed:
            return None
        scored = self._scored_nodes(index, resources)
        requests = (_int64(resources.cpu), _int64(resources.memory))
        reread = False
        while True:
            size = scored.size
            total = scored.score[:size] + policy.node_resources_scores(
                scored.device_free[:size], scored.taken[:size], scored.cpu_free[:size], scored.memory_free[:size], requests)
            for name, amount in (bonus or {}).items():
                slot = scored.slot.get(name)
                if slot is not None and slot < size:
                    total[slot] -= amount
            total[~scored.valid[:size] | np.isnan(total)] = np.inf  # a policy's NaN ranks last
            stale = False
            for i in _ranked(total, scored.order[:size], scored.valid[:size]):
                name = scored.names[i]
                entry = index.entries.get(name)
                if entry is None or not isinstance(entry.outcome, NodePlacement):
                    scored.drop(name)  # allocate replaced its outcome in place: no change log says so
                    continue
                free = resources.free(name)
                if not reread and (_int64(free[0]) != scored.cpu_free[i] or _int64(free[1]) != scored.memory_free[i]):
                    stale = True  # changed and nobody said (see node_resources_changed)
                    break
                if node_filter is None or node_filter(self.nodes[name]):
                    return name
            if not stale:
                return None
            # Unreported changes: read every node's CPU and memory again, once, and score again.
            for name, i in scored.slot.items():
                if scored.valid[i]:
                    free = resources.free(name)
                    scored.cpu_free[i], scored.memory_free[i] = _int64(free[0]), _int64(free[1])
            reread = True

    def _scored_nodes(self, index: _ShapeIndex, resources: NodeResources) -> "_ScoredNodes":
        """The shape's feasible nodes as arrays, updated for the nodes changed since last asked."""
        scored = index.scored
        # A node added or removed makes a new index (an epoch), so the slots never outgrow the nodes.
        if scored is None or scored.resource_epoch != self._resource_epoch:
            scored = index.scored = _ScoredNodes(self._resource_epoch, len(index.entries))
            dirty: Iterable[str] = list(index.entries)
        else:
            dirty = set(self._changes[scored.seen_changes:])
            dirty.update(self._resource_changes[scored.seen_resource_changes:])
        scored.seen_changes, scored.seen_resource_changes = len(self._changes), len(self._resource_changes)
        for name in dirty:
            entry = index.entries.get(name)
            if entry is None or not isinstance(entry.outcome, NodePlacement) or entry.stamp != self._stamp(name):
                scored.drop(name)
                continue
            scored.put(name, self._node_order.get(name, 0), resources.free(name), entry.outcome.score,
                       self.device_free_milli(name), self._taken(entry.outcome))
        return scored

    def _taken(self, outcome: NodePlacement) -> float:
        cached = self._taken_milli.get(id(outcome))
        if cached is not None and cached[0] is outcome:
            return cached[1]
        if len(self._taken_milli) > 4 * len(self.nodes) + 1024:
            self._taken_milli.clear()  # a bound: outcomes of nodes that changed since are never asked again
        taken = placement_device_milli(outcome)
        self._taken_milli[id(outcome)] = (outcome, taken)
        return taken

    def rank_without_claims(self, names: Sequence[str], resources: NodeResources,
                            policy: ScoringPolicy | None = None, *,
                            node_bonus: Mapping[str, float] | None = None) -> list[str]:
        """Nodes for a pod that claims no devices, best first: by the policy's CPU/memory term alone
        (what the pod would strand of the node's free devices) less `node_bonus`, then node order;
        as given (less the bonus) when the policy reads no node resources."""
        policy = policy or self.policy
        bonus = node_bonus or {}
        if not policy.reads_node_resources:
            if not bonus:
                return list(names)
            position = {name: i for i, name in enumerate(names)}
            return sorted(names, key=lambda name: (-bonus.get(name, 0.0), position[name]))
        self._ensure_order()
        requests = (resources.cpu, resources.memory)
        return sorted(names, key=lambda name: (
            policy.node_resources_score(self.device_free_milli(name), 0.0, resources.free(name), requests)
            - bonus.get(name, 0.0),
            self._node_order.get(name, 0)))

    def device_free_milli(self, name: str) -> float:
        """The node's free devices in milli-devices: 1000 per free device, the unused fraction of a
        shared one (its most used capacity), 0 for one in exclusive use. Remembered until the
        node's stamp changes (an allocation from its pools, a slice on it)."""
        stamp = self._stamp(name)
        cached = self._device_free.get(name)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        state = self.state
        total = 0.0
        for pool in self.inventory.pools_for_node(self.node(name)):
            if not pool.usable:
                continue
            for r in pool.reachable:
                if not state.is_allocated(r.id):
                    total += 1000.0
                    continue
                shared = state.shared_capacity(r.id)
                if shared is None:
                    continue
                used = 0.0
                for cap_name, amount in shared.items():
                    cap = r.capacity.get(cap_name)
                    if cap is not None and cap.value.value > 0:
                        used = max(used, float(amount / cap.value.value))
                total += 1000.0 * max(0.0, 1.0 - used)
        self._device_free[name] = (stamp, total)
        return total

    def _for_claims(self, placement: NodePlacement, claims, plans, policy) -> NodePlacement:
        # The cached placement may have been computed for other claims of the same shape; results do
        # not name claims, but share IDs must be fresh for each allocation.
        if any(c.share_id for chosen in placement.chosen for c in chosen):
            fresh = self.allocator.allocate(claims, self.nodes[placement.node], policy, plans=plans)
            return fresh if isinstance(fresh, NodePlacement) else placement
        return placement

    def _diagnose(self, claims, plans, name: str) -> NodeFailure:
        node = self.nodes[name]
        return self.allocator.diagnose(plans, node, self.inventory.pools_for_node(node))

    def _unallocatable(self, index, node_filter, claims, plans, explain) -> Unallocatable:
        if not self.nodes:
            return Unallocatable("no nodes: no Node objects and no ResourceSlice names a node")
        failures: list[NodeFailure] = []
        diagnosed: dict[tuple, NodeFailure] = {}
        filtered = 0
        for name in sorted(self.nodes):
            entry = index.entries.get(name)
            if entry is None:
                continue
            outcome = entry.outcome
            if isinstance(outcome, NodePlacement):
                filtered += 1
                failures.append(NodeFailure(name, Reason.NODE_FILTERED, "devices fit, but the node filter rejected the node"))
            elif isinstance(outcome, NodeFailure):
                if outcome.reason is Reason.NOT_DIAGNOSED and explain:
                    # Alike nodes fail alike: diagnose one of each kind (messages name no node).
                    likeness = self._likeness(name, index)
                    known = diagnosed.get(likeness) if likeness is not None else None
                    if known is None:
                        known = self._diagnose(claims, plans, name)
                        if likeness is not None and known.reason not in (Reason.POOL_INCOMPLETE, Reason.POOL_INVALID):
                            diagnosed[likeness] = known  # those two name the node's own pool
                    outcome = dataclasses.replace(known, node=name)
                elif outcome.node != name:
                    outcome = dataclasses.replace(outcome, node=name)
                failures.append(outcome)
        counts: dict[str, int] = {}
        for f in failures:
            counts[f.reason.value] = counts.get(f.reason.value, 0) + 1
        summary = ", ".join(f"{n} {r}" for r, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        message = f"0/{len(self.nodes)} nodes can allocate the claims: {summary}"
        return Unallocatable(message, failures if explain or len(failures) <= 10 else [])

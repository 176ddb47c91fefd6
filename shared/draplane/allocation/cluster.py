"""Allocation across nodes: the inventory, the allocated state, and the best node for a set of claims.

`Cluster` is what the allocator service, the simulator and `draplane allocate` hold. It answers
"where do these claims go?" with the scoring policy, and remembers the answer per node for claims of
the same shape: the per-node result stays valid until that node's version changes (a slice on it or
an allocation from one of its pools), so after one commit only that node is recomputed. A simulator
scheduling thousands of pods of a few shapes over a thousand nodes then costs about one node search
per pod.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from draplane.api.codec import encode_json
from draplane.api.core import Node
from draplane.api.meta import ObjectMeta
from draplane.api.resource import AllocationResult, DeviceClass, ResourceClaim, ResourceSlice
from draplane.allocation.allocator import NodeAllocator, NodePlacement, SelectorMatcher, ShareIDFactory, random_share_id
from draplane.allocation.errors import AllocationError, NodeFailure, Reason
from draplane.allocation.inventory import Inventory, PoolID
from draplane.allocation.scoring import ScoringPolicy, get_policy
from draplane.allocation.state import AllocatedState, claim_key

NodeFilter = Callable[[Node], bool]


@dataclass(slots=True)
class Unallocatable:
    """No node can take the claims. `failures` has one entry per node examined (when explained)."""

    message: str
    failures: list[NodeFailure] = field(default_factory=list)

    def __str__(self) -> str:
        return self.message


@dataclass(slots=True)
class _NodeEntry:
    stamp: tuple
    outcome: object  # NodePlacement | NodeFailure | AllocationError


class _ShapeIndex:
    """Per claim shape: each node's last outcome, and a heap of feasible nodes by score."""

    def __init__(self, epoch: int):
        self.epoch = epoch
        self.seen = 0  # position in the cluster's change log
        self.entries: dict[str, _NodeEntry] = {}
        self.heap: list[tuple[float, int, str, tuple]] = []
        self.errors: dict[str, AllocationError] = {}


class Cluster:
    def __init__(
        self,
        *,
        slices: Iterable[ResourceSlice] = (),
        classes: Iterable[DeviceClass] = (),
        nodes: Iterable[Node] = (),
        policy: str | ScoringPolicy | None = None,
        share_ids: ShareIDFactory = random_share_id,
        matcher: SelectorMatcher | None = None,
    ):
        self.inventory = Inventory(slices)
        self.state = AllocatedState()
        self.classes: dict[str, DeviceClass] = {c.metadata.name: c for c in classes}
        self.policy = policy if isinstance(policy, ScoringPolicy) else get_policy(policy)
        self.allocator = NodeAllocator(self.inventory, self.state, self.classes, matcher=matcher, share_ids=share_ids)
        self.nodes: dict[str, Node] = {}
        self._node_order: dict[str, int] = {}
        self._epoch = 0  # bumped when every node may be affected
        self._node_stamps: dict[str, int] = {}
        self._changes: list[str] = []
        self._shapes: dict[tuple, _ShapeIndex] = {}
        for n in nodes:
            self.set_node(n)

    # --- inputs ---------------------------------------------------------------------------------

    def set_node(self, node: Node) -> None:
        name = node.metadata.name or ""
        self.nodes[name] = node
        self._reorder()
        self._node_changed(name)

    def remove_node(self, name: str) -> None:
        self.nodes.pop(name, None)
        self._reorder()
        self._node_changed(name)

    def _reorder(self) -> None:
        self._node_order = {n: i for i, n in enumerate(sorted(self.nodes))}
        self._epoch += 1

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
        self._pools_changed(self.state.add_claim(claim_key(claim), allocation), allocation)

    def release_claim(self, claim: ResourceClaim | str) -> None:
        key = claim if isinstance(claim, str) else claim_key(claim)
        self._pools_changed(self.state.remove_claim(key), None)

    def commit(self, claims: Sequence[ResourceClaim], placement: NodePlacement) -> None:
        for claim, allocation in zip(claims, placement.allocations):
            self._pools_changed(self.state.add_claim(claim_key(claim), allocation), allocation)

    def _pools_changed(self, pools: list[PoolID], allocation: AllocationResult | None) -> None:
        for pool in set(pools):
            if not self.inventory.pool_is_node_local(pool):
                self._epoch += 1
                return
        nodes = set()
        for pool in set(pools):
            nodes.update(self._nodes_of_pool(pool))
        for n in nodes:
            self._node_changed(n)

    def _nodes_of_pool(self, pool: PoolID) -> set[str]:
        return self.inventory.nodes_of_pool(pool)

    def _node_changed(self, name: str) -> None:
        self._node_stamps[name] = self._node_stamps.get(name, 0) + 1
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
        return self.allocator.allocate(claims, self.node(node_name), policy or self.policy)

    def allocate(
        self,
        claims: Sequence[ResourceClaim],
        *,
        node_filter: NodeFilter | None = None,
        policy: ScoringPolicy | None = None,
        explain: bool = False,
    ) -> NodePlacement | Unallocatable:
        """The best node for all claims together, per the policy. Raises AllocationError (fatal input
        errors, or an evaluation error on any node, as kube-scheduler fails the whole attempt)."""
        policy = policy or self.policy
        plans = [self.allocator.plan(c) for c in claims]  # fatal validation errors surface here
        shape = (policy.name, tuple(encode_json(c.spec) for c in claims))
        index = self._refresh(shape, claims, policy, plans)
        if index.errors:
            raise next(iter(index.errors.values()))
        placement = self._best(index, node_filter)
        if placement is not None:
            if placement.allocations and claims:
                return self._for_claims(placement, claims, plans, policy)
            return placement
        return self._unallocatable(index, node_filter, claims, plans, explain)

    def _refresh(self, shape, claims, policy, plans) -> _ShapeIndex:
        index = self._shapes.get(shape)
        if index is None or index.epoch != self._epoch:
            if len(self._shapes) > 1024:
                self._shapes.clear()
            index = _ShapeIndex(self._epoch)
            self._shapes[shape] = index
            dirty = list(self.nodes)
        else:
            dirty = set(self._changes[index.seen:])
        index.seen = len(self._changes)
        for name in dirty:
            if name not in self.nodes:
                index.entries.pop(name, None)
                index.errors.pop(name, None)
                continue
            stamp = self._stamp(name)
            entry = index.entries.get(name)
            if entry is not None and entry.stamp == stamp:
                continue
            index.errors.pop(name, None)
            try:
                outcome = self.allocator.allocate(claims, self.nodes[name], policy, plans=plans, diagnose=False)
            except AllocationError as exc:
                if exc.fatal:
                    index.errors[name] = exc
                outcome = NodeFailure(name, exc.reason, exc.message) if not exc.fatal else exc
            index.entries[name] = _NodeEntry(stamp, outcome)
            if isinstance(outcome, NodePlacement):
                heapq.heappush(index.heap, (outcome.score, self._node_order.get(name, 0), name, stamp))
        return index

    def _best(self, index: _ShapeIndex, node_filter: NodeFilter | None) -> NodePlacement | None:
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
            found = entry.outcome
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

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
                    outcome = self._diagnose(claims, plans, name)
                failures.append(outcome)
        counts: dict[str, int] = {}
        for f in failures:
            counts[f.reason.value] = counts.get(f.reason.value, 0) + 1
        summary = ", ".join(f"{n} {r}" for r, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        message = f"0/{len(self.nodes)} nodes can allocate the claims: {summary}"
        return Unallocatable(message, failures if explain or len(failures) <= 10 else [])

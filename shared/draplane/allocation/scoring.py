"""Scoring policies: which of the valid placements to take.

A policy does two things, neither of which can change whether claims fit:
- `order_candidates` returns a permutation of one request's candidate devices on a node. The search is
  exhaustive over combinations, so any order finds a solution when one exists; the order decides
  which one is found first.
- `score_placement` scores a complete, valid placement on a node; across nodes the lowest wins
  (ties: node name order).

`first-fit` is Kubernetes: candidates in pool/slice/device order, every node scores the same.
`draplane` (the default) prefers tight topology and low fragmentation; see `DraplanePolicy`.
New policies (`draplane` itself is `fragmentation.FragmentationAwareDraplane`) subclass `ScoringPolicy` and call
`register_policy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draplane.allocation.scarcity import unit_of

if TYPE_CHECKING:
    from draplane.allocation.allocator import Candidate, NodePlacement, NodeView, RequestPlan


class ScoringPolicy:
    name = "base"

    def likeness(self, record) -> object:
        """What of a device, beyond what allocation itself looks at, this policy reads. Two nodes
        whose devices agree on it (and on everything allocation reads) get the same answer, so the
        cluster searches only one of them. The default, the whole device, is always safe."""
        return record.content

    def node_likeness(self, node) -> object:
        """Likewise for the Node object (labels, allocatable CPU and memory) when scores read it.
        The default, the node's name, makes no two nodes alike: safe, and slower."""
        return node.metadata.name

    # Changes when what the policy learned makes scores computed before stale; `DeviceAllocator` then
    # searches every node again for the next claims.
    version = 0

    def order_candidates(self, request: "RequestPlan", candidates: list["Candidate"], view: "NodeView") -> list["Candidate"]:
        return candidates

    def score_placement(self, placement: "NodePlacement", view: "NodeView") -> float:
        return 0.0

    # Whether `node_resources_score` reads anything: when it does, and the caller passes the pod's
    # CPU and memory and the nodes' free amounts (`DeviceAllocator.allocate(node_resources=...)`), the
    # cluster adds it to each feasible node's score. Never consulted for feasibility.
    reads_node_resources = False

    # Whether scores read `view.scarcity` (see draplane.allocation.scarcity): the cluster then
    # builds its caches again when the classes' shares of the cluster move.
    reads_scarcity = False

    def observe_requests(self, cpu: int, memory: int, device_milli: float) -> None:
        """A pod about to be placed: its CPU (milli), memory (bytes) and devices (milli-devices)."""

    def node_resources_score(self, device_free: float, device_taken: float, free: tuple[int, int],
                             requests: tuple[int, int]) -> float:
        """Added to a node's score (lower is better) from its free devices (milli-devices), what the
        placement takes of them, its free CPU and memory, and the pod's CPU and memory requests."""
        return 0.0

    def node_resources_scores(self, device_free: "np.ndarray", device_taken: "np.ndarray", cpu_free: "np.ndarray",
                              memory_free: "np.ndarray", requests: tuple[int, int]) -> "np.ndarray":
        """`node_resources_score` for many nodes at once, one array item per node. This default
        asks the scalar one per node; a policy scoring thousands of nodes per pod overrides it."""
        import numpy as np

        return np.array([self.node_resources_score(float(d), float(t), (int(c), int(m)), requests)
                         for d, t, c, m in zip(device_free, device_taken, cpu_free, memory_free)], dtype=float)


class FirstFitPolicy(ScoringPolicy):
    """Kubernetes' choice: the first valid placement in device order, on the first node that fits."""

    name = "first-fit"

    def likeness(self, record) -> object:
        return None  # the order of devices is all first-fit reads

    def node_likeness(self, node) -> object:
        return None


def _group_rank(free: int, needed: int) -> tuple[int, int]:
    # Groups that can hold the whole request come first, the tightest of them first (best fit keeps
    # larger groups whole for larger requests); then the largest partial groups.
    return (0, free) if free >= needed else (1, -free)


class DraplanePolicy(ScoringPolicy):
    """Topology first, then fragmentation.

    Device order on a node:
    1. a multi-allocatable device that already has shares before one that has none, and a partition
       of a GPU that is already partitioned before one of an untouched GPU (shared GPUs fill before
       new ones are split);
    2. devices of the PCIe root that fits the request most tightly (all of one claim's devices under
       one root when possible), then of the tightest NUMA node; for a one-device request the least
       scarce device comes before the tightest root (see draplane.allocation.scarcity), for more
       devices it orders the devices of one root;
    3. Kubernetes' order.

    Node score (lower is better): 10 per extra PCIe root a claim spans, 5 per extra NUMA node, 1 per
    newly split shared/partitioned device, plus the fraction of the node's devices left whole and free
    (prefer filling busy nodes, so that whole nodes stay free for large requests), plus
    SCARCITY_WEIGHT times the scarcity of each physical device the placement newly takes: a generic
    request leaves the H100s that only `high-memory-gpu` can use, and the GPUs that `mig.nvidia.com`
    can partition, to the requests that need them.
    """

    name = "draplane"

    def likeness(self, record) -> object:
        return (record.pcie_root, record.numa_node)

    def node_likeness(self, node) -> object:
        return None  # scores read devices and their use only

    TOPOLOGY_WEIGHT = 10.0
    NUMA_WEIGHT = 5.0
    SPLIT_WEIGHT = 1.0
    # Scarcity is 0..1 per device, so an 8-device claim's scarcity stays below one extra NUMA node:
    # topology decides first. Above the packing and fragmentation tie-breakers of the shipped
    # policy: an 8-GPU generic claim goes to an empty A100 node (scarcity 0.53 per GPU in the
    # default `up` cluster) before the empty DGX H100 (0.75), although taking whole A100s blocks
    # their MIG placements (PLACEMENT_LOSS_WEIGHT, 0.25 for the eight).
    SCARCITY_WEIGHT = 0.5
    reads_scarcity = True

    def order_candidates(self, request, candidates, view):
        if len(candidates) <= 1:
            return candidates
        in_use = view.state.in_use
        free = []
        busy = []
        for c in candidates:
            # Devices in use stay out of the way at the end: the search skips them anyway.
            (busy if not c.record.allow_multiple and in_use(c.record.id) else free).append(c)
        if len(free) <= 1:
            return free + busy
        needed = max(request.count, 1)
        root_free: dict[object, int] = {}
        numa_free: dict[object, int] = {}
        splittable = False
        for c in free:
            r = c.record
            root_free[r.pcie_root] = root_free.get(r.pcie_root, 0) + 1
            numa_free[r.numa_node] = numa_free.get(r.numa_node, 0) + 1
            splittable = splittable or r.allow_multiple or bool(r.consumes)
        root_rank = {g: (_group_rank(n, needed) if g is not None else (2, 0)) + (str(g),) for g, n in root_free.items()}
        numa_rank = {g: (_group_rank(n, needed) if g is not None else (2, 0)) + (str(g),) for g, n in numa_free.items()}
        scarcity = view.scarcity
        if splittable:
            shared_capacity = view.state.shared_capacity
            touched_sets = self._touched_counter_sets(view)
            # Where scarcity is known it decides between whole devices and the whole GPUs that
            # could be partitioned (what MIG requests need is one of the classes it counts);
            # without it, a plain device comes before a GPU that a later MIG request could split.
            plain = 1 if scarcity is not None else 0

            def newly_taken(r) -> int:
                if r.allow_multiple:
                    return 1 if shared_capacity(r.id) is None else 0
                if r.consumes:
                    return 0 if any((r.driver, r.pool, s) in touched_sets for s, _ in r.consumes) else 1
                return plain
        else:
            def newly_taken(r) -> int:
                return 0

        if scarcity is None:
            def scarce(r, newly: int) -> float:
                return 0.0
        else:
            def scarce(r, newly: int) -> float:
                # Only a device this request is first to take costs its scarcity: a share of a
                # shared device or a partition of a partitioned GPU takes no new one.
                return scarcity.of(r) if newly or not (r.allow_multiple or r.consumes) else 0.0
        keyed = []
        for i, c in enumerate(free):
            r = c.record
            newly = newly_taken(r)
            if needed == 1:
                keyed.append((newly, scarce(r, newly), root_rank[r.pcie_root], numa_rank[r.numa_node], i, c))
            else:
                keyed.append((newly, root_rank[r.pcie_root], numa_rank[r.numa_node], scarce(r, newly), i, c))
        keyed.sort(key=lambda k: k[:5])
        return [k[5] for k in keyed] + busy

    @staticmethod
    def _touched_counter_sets(view) -> set[tuple[str, str, str]]:
        touched = set()
        for pool in view.pools:
            if not pool.counter_consumers:
                continue
            for device_name, consumes in pool.counter_consumers.items():
                if view.state.is_allocated((pool.id[0], pool.id[1], device_name)):
                    for set_name, _ in consumes:
                        touched.add((pool.id[0], pool.id[1], set_name))
        return touched

    # The packing terms (newly split devices, whole devices left free) count this much against
    # topology; a policy with a finer fragmentation measure makes them its tie-breakers.
    PACKING_WEIGHT = 1.0

    def score_placement(self, placement, view):
        return (self.topology_penalty(placement) + self.PACKING_WEIGHT * self.packing_penalty(placement, view)
                + self.SCARCITY_WEIGHT * self.scarcity_taken(placement, view))

    def scarcity_taken(self, placement, view) -> float:
        """The scarcity of the physical devices this placement is the first to take: a free device,
        a shared device without shares, a GPU none of whose partitions is allocated."""
        scarcity = view.scarcity
        if scarcity is None:
            return 0.0
        state = view.state
        touched_sets = None
        units: dict = {}
        for chosen in placement.chosen:
            for c in chosen:
                r = c.record
                if c.plan.admin_access:
                    continue  # adminAccess takes nothing from anyone
                if r.consumes:
                    if touched_sets is None:
                        touched_sets = self._touched_counter_sets(view)
                    if any((r.driver, r.pool, s) in touched_sets for s, _ in r.consumes):
                        continue
                elif r.allow_multiple and state.shared_capacity(r.id) is not None:
                    continue
                unit = unit_of(r)
                if unit not in units:
                    units[unit] = scarcity.of(r)
        return sum(units.values())

    def topology_penalty(self, placement) -> float:
        penalty = 0.0
        for chosen in placement.chosen:
            roots = {c.record.pcie_root for c in chosen if c.record.pcie_root is not None}
            numas = {c.record.numa_node for c in chosen if c.record.numa_node is not None}
            penalty += self.TOPOLOGY_WEIGHT * max(len(roots) - 1, 0) + self.NUMA_WEIGHT * max(len(numas) - 1, 0)
        return penalty

    def packing_penalty(self, placement, view) -> float:
        """SPLIT_WEIGHT per newly split device, plus the fraction of the node's devices left whole
        and free (busy nodes fill first, so that whole nodes stay free for large requests)."""
        state = view.state
        split = 0
        chosen_ids = set()
        touched_sets = None
        newly_touched: set = set()  # the counter sets (GPUs) this placement partitions first
        for chosen in placement.chosen:
            for c in chosen:
                r = c.record
                chosen_ids.add(r.id)
                if r.allow_multiple and state.shared_capacity(r.id) is None:
                    split += 1
                if r.consumes:
                    if touched_sets is None:
                        touched_sets = self._touched_counter_sets(view)
                    sets = {(r.driver, r.pool, s) for s, _ in r.consumes}
                    if not sets & touched_sets:
                        # one GPU split for two of its partitions, not two: two 3g.20gb slices
                        # on one GPU keep another GPU whole, on two GPUs they split both
                        if not sets & newly_touched:
                            split += 1
                        newly_touched |= sets
        total = 0
        whole_free = 0
        for pool in view.pools:
            if not pool.usable:
                continue
            for r in pool.reachable:
                total += 1
                if r.id in chosen_ids or state.is_allocated(r.id):
                    continue
                whole_free += 1
        return self.SPLIT_WEIGHT * split + (whole_free / total if total else 0.0)


FIRST_FIT = FirstFitPolicy()
DRAPLANE = DraplanePolicy()
DEFAULT_POLICY = "draplane"

_POLICIES: dict[str, ScoringPolicy] = {FIRST_FIT.name: FIRST_FIT, DRAPLANE.name: DRAPLANE}


def register_policy(policy: ScoringPolicy) -> None:
    _POLICIES[policy.name] = policy


def get_policy(name: str | None = None) -> ScoringPolicy:
    name = name or DEFAULT_POLICY
    try:
        return _POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown scoring policy {name!r} (known: {', '.join(sorted(_POLICIES))})") from None


def policy_names() -> list[str]:
    return sorted(_POLICIES)

"""Fragmentation-aware placement scores: best-fit, FGD, and draplane's own.

A GPU is fragmented when it is free but the pods that will come cannot use it: a sliver too small for
the shares they ask, a node whose CPU or memory is gone, a node with free GPUs but too few whole ones
for a multi-GPU pod. Which GPUs count as fragmented therefore depends on the workload, and the
policies here measure it against the workload's own distribution of request shapes.

- `best-fit`: the node left with the least free CPU and GPU, as in the FGD paper's baseline
  (Σ 0.5·(free − request)/max-spec over CPU and GPU, scaled to an integer 0..100).
- `fgd`: Fragmentation Gradient Descent (Weng et al., USENIX ATC 2023). A node's fragmentation is the
  expected GPU milli that a pod drawn from the typical shapes (the most frequent shapes covering 95%
  of pods, memory ignored) could not use. A pod goes to the node and GPU that most reduce it; the
  score is sigmoid(Δ/1000)·100 truncated to an integer, as in the paper's simulator, so ties are
  common and go to the node order.
- `draplane`: the allocator core's policy (topology first) with fragmentation measured exactly
  against what it has learned of the workload online: slivers no common share size can fill, and
  devices stranded without CPU or memory (see `OnlineWorkload`, `FragmentationAwareDraplane`). It is
  the policy the shards run and the one `draplane simulate` measures.

The scores are pure arithmetic on `NodeState` (a node's free CPU, memory and per-GPU free milli) and
`PodShape`, so the allocator service and the simulator run the very same code. The baselines'
results are a function of (state, shape) and callers may cache them; draplane's depend also on what
it has learned (`OnlineWorkload.version`, its CPU and memory ratios).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from draplane.allocation.scoring import DraplanePolicy, register_policy

MILLI = 1000
# The FGD paper's normalisation constants for best-fit (its largest node: 128 CPUs, 8 GPUs).
MAX_SPEC_CPU_MILLI = 128_000
MAX_SPEC_GPU_MILLI = 8_000
TYPICAL_COVERAGE = 0.95


@dataclass(frozen=True, slots=True)
class PodShape:
    """What a pod asks of a node, in the units scores compare."""

    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int  # per GPU; below 1000 only for a one-GPU share
    models: tuple[str, ...] = ()  # allowed GPU models, empty for any

    @property
    def gpu_demand(self) -> int:
        return self.num_gpu * self.gpu_milli

    @property
    def shares_gpu(self) -> bool:
        return self.num_gpu == 1 and self.gpu_milli < MILLI


@dataclass(frozen=True, slots=True)
class NodeState:
    """A node as scores see it: free CPU (milli), free memory (MiB), free milli of each GPU."""

    model: str
    cpu_free: int
    memory_free: int
    gpus: tuple[int, ...]

    @property
    def gpu_free_total(self) -> int:
        return sum(self.gpus)


@dataclass(frozen=True, slots=True)
class Placement:
    """A policy's choice on one node: its score (higher is better) and the GPUs it would use."""

    score: float
    gpus: tuple[int, ...]  # indexes into NodeState.gpus; empty for CPU-only pods


@dataclass(frozen=True, slots=True)
class WorkloadProfile:
    """The typical request shapes of a workload and how often each occurs (weights sum to 1)."""

    shapes: tuple[PodShape, ...]
    weights: tuple[float, ...]


def typical_shapes(shapes: Iterable[PodShape], *, coverage: float = TYPICAL_COVERAGE, with_memory: bool = False) -> WorkloadProfile:
    """The most frequent shapes that together cover `coverage` of the pods, weights renormalised.

    FGD leaves memory out of a shape (`with_memory=False` sets it to 0): its fragmentation only
    looks at CPU and GPUs.
    """
    counts: Counter[PodShape] = Counter()
    total = 0
    for shape in shapes:
        if not with_memory:
            shape = PodShape(shape.cpu_milli, 0, shape.num_gpu, shape.gpu_milli, shape.models)
        counts[shape] += 1
        total += 1
    if total == 0:
        return WorkloadProfile((), ())
    # Most frequent first; equal counts in a fixed order so that runs repeat exactly.
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0].cpu_milli, kv[0].gpu_milli, kv[0].num_gpu, kv[0].models, kv[0].memory_mib))
    chosen: list[tuple[PodShape, int]] = []
    covered = 0
    for shape, count in ranked:
        if covered >= coverage * total:
            break
        chosen.append((shape, count))
        covered += count
    return WorkloadProfile(tuple(s for s, _ in chosen), tuple(c / covered for _, c in chosen))


# --- the fragmentation measure -------------------------------------------------------------------


def unusable_gpu_milli(state: NodeState, shape: PodShape, *, with_memory: bool = False) -> int:
    """GPU milli on the node that a pod of this shape could not use (FGD's per-shape fragment)."""
    total = sum(state.gpus)
    if shape.num_gpu == 0 or shape.gpu_milli == 0:
        # FGD counts every free GPU as fragment for a CPU-only pod: it cannot use any of them.
        return total
    if shape.models and state.model not in shape.models:
        return total
    if state.cpu_free < shape.cpu_milli or (with_memory and state.memory_free < shape.memory_mib):
        return total
    fitting = 0
    stranded = 0
    for free in state.gpus:
        if free >= shape.gpu_milli:
            fitting += 1
        else:
            stranded += free
    return stranded if fitting >= shape.num_gpu else total


def expected_fragmentation(state: NodeState, profile: WorkloadProfile, *, with_memory: bool = False) -> float:
    return sum(w * unusable_gpu_milli(state, s, with_memory=with_memory) for s, w in zip(profile.shapes, profile.weights))


# --- placements on one node ----------------------------------------------------------------------


def fits(state: NodeState, shape: PodShape) -> bool:
    """The node has room for the pod: CPU, memory, model and GPUs (the simulator's own pre-check)."""
    if state.cpu_free < shape.cpu_milli or state.memory_free < shape.memory_mib:
        return False
    if shape.num_gpu == 0:
        return True
    if shape.models and state.model not in shape.models:
        return False
    return sum(1 for free in state.gpus if free >= shape.gpu_milli) >= shape.num_gpu


def after(state: NodeState, shape: PodShape, gpus: Sequence[int]) -> NodeState:
    freed = list(state.gpus)
    for i in gpus:
        freed[i] -= shape.gpu_milli
    return NodeState(state.model, state.cpu_free - shape.cpu_milli, state.memory_free - shape.memory_mib, tuple(freed))


def candidate_gpus(state: NodeState, shape: PodShape) -> list[tuple[int, ...]]:
    """The distinct GPU choices worth scoring: for a share, one GPU per distinct free amount (the
    lowest index of each, since equal GPUs are interchangeable); for whole GPUs, the first free ones."""
    if shape.num_gpu == 0:
        return [()]
    if shape.shares_gpu:
        seen: dict[int, int] = {}
        for i, free in enumerate(state.gpus):
            if free >= shape.gpu_milli and free not in seen:
                seen[free] = i
        return [(i,) for i in seen.values()]
    whole = [i for i, free in enumerate(state.gpus) if free >= shape.gpu_milli]
    if len(whole) < shape.num_gpu:
        return []
    return [tuple(whole[: shape.num_gpu])]


def _fuller(state: NodeState, gpus: Sequence[int], than: Sequence[int]) -> bool:
    return sum(state.gpus[i] for i in gpus) < sum(state.gpus[i] for i in than)


def _sigmoid(x: float) -> float:
    if x < -700:
        return 0.0
    return 1.0 / (1.0 + math.exp(-x))


def kube_scheduler_scores(cpu_free: np.ndarray, cpu_allocatable: np.ndarray, memory_free: np.ndarray,
                          memory_allocatable: np.ndarray, shape: PodShape) -> np.ndarray:
    """kube-scheduler's default node scores for a pod: NodeResourcesFit (LeastAllocated over CPU and
    memory) plus NodeResourcesBalancedAllocation, each 0..100 in integer arithmetic. DRA devices
    add nothing: the DynamicResources plugin does not score. The other default plugins score every
    node of this cluster the same (no affinity, no topology spread, no images)."""
    # The scheduler counts a request of zero as 100m CPU / 200Mi so that empty pods still spread.
    cpu_request = shape.cpu_milli or 100
    memory_request = shape.memory_mib or 200
    cpu_used = cpu_allocatable - cpu_free + cpu_request
    memory_used = memory_allocatable - memory_free + memory_request
    cpu_alloc = np.maximum(cpu_allocatable, 1)
    memory_alloc = np.maximum(memory_allocatable, 1)
    least_cpu = np.maximum(cpu_allocatable - cpu_used, 0) * 100 // cpu_alloc
    least_memory = np.maximum(memory_allocatable - memory_used, 0) * 100 // memory_alloc
    least_allocated = (least_cpu + least_memory) // 2
    cpu_fraction = np.minimum(cpu_used / cpu_alloc, 1.0)
    memory_fraction = np.minimum(memory_used / memory_alloc, 1.0)
    balanced = np.trunc((1.0 - np.abs(cpu_fraction - memory_fraction) / 2) * 100).astype(np.int64)
    return least_allocated + balanced


class FirstFit:
    """Kubernetes as it is: kube-scheduler's default node scores, then DRA's first-fit devices.

    The DRA allocator takes the first devices that fit on the node kube-scheduler picked; the node
    is picked by the default scoring plugins, which know CPU and memory but not devices
    (`kube_scheduler_scores`). `FirstNode` is the other reading: the first node in order.
    """

    name = "first-fit"

    def place(self, state: NodeState, shape: PodShape) -> Placement | None:
        choices = candidate_gpus(state, shape) if fits(state, shape) else None
        if not choices:
            return None
        if shape.shares_gpu:
            # First device in slice order with room, as the DRA allocator walks them.
            return Placement(0.0, (min(c[0] for c in choices),))
        return Placement(0.0, choices[0])


def best_fit_scores(cpu_free: np.ndarray, gpu_free_total: np.ndarray, shape: PodShape) -> np.ndarray:
    """Best-fit scores of many nodes at once: 100 for a node the pod fills exactly."""
    left = (cpu_free - shape.cpu_milli) / MAX_SPEC_CPU_MILLI * 0.5 + (gpu_free_total - shape.gpu_demand) / MAX_SPEC_GPU_MILLI * 0.5
    return np.trunc((1.0 - left) * 100).astype(np.int64)


class FirstNode(FirstFit):
    """The first node (in the fixed node order) that fits, the first devices on it: pure packing."""

    name = "first-node"


class BestFit:
    """The FGD paper's best-fit baseline; for a share, the fullest GPU that still fits."""

    name = "best-fit"

    def place(self, state: NodeState, shape: PodShape) -> Placement | None:
        choices = candidate_gpus(state, shape) if fits(state, shape) else None
        if not choices:
            return None
        score = float(best_fit_scores(np.array([state.cpu_free]), np.array([state.gpu_free_total]), shape)[0])
        if shape.shares_gpu:
            best = min(choices, key=lambda c: (state.gpus[c[0]], c[0]))
            return Placement(score, best)
        return Placement(score, choices[0])


class FragmentationGradientDescent:
    """FGD as published: integer sigmoid scores of the drop in expected fragmentation."""

    name = "fgd"

    def __init__(self, profile: WorkloadProfile):
        self.profile = profile
        self._cpu_steps = sorted({s.cpu_milli for s in profile.shapes})
        self._memo: dict[tuple, float] = {}

    def fragmentation(self, state: NodeState) -> float:
        """expected_fragmentation, remembered: it depends on the free CPU only through which typical
        shapes it covers, so states that differ below that resolution share one value."""
        key = (state.model, bisect.bisect_right(self._cpu_steps, state.cpu_free), tuple(sorted(state.gpus)))
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = expected_fragmentation(state, self.profile)
        return found

    def place(self, state: NodeState, shape: PodShape) -> Placement | None:
        choices = candidate_gpus(state, shape) if fits(state, shape) else None
        if not choices:
            return None
        before = self.fragmentation(state)
        best: Placement | None = None
        for gpus in choices:
            drop = before - self.fragmentation(after(state, shape, gpus))
            score = float(int(_sigmoid(drop / MILLI) * 100))
            # Equal scores: the fuller GPU (the paper's code takes the lowest index; by value, the
            # choice depends on the node's state alone, which is what lets the simulator share it).
            if best is None or score > best.score or (score == best.score and _fuller(state, gpus, best.gpus)):
                best = Placement(score, gpus)
        return best


FILLER_MIN_SUPPLY = 0.25


def filler_sizes(frequency: Mapping[int, float], min_frequency: float) -> list[int]:
    """The share sizes (milli, with their frequencies) counted on to fill what is left on GPUs.

    A size rarer than `min_frequency` is not. Nor is a small one (≤ 500) whose supply is short of
    the slivers it would fill: each share above 500 takes a GPU of its own and leaves 1000 − L that
    only smaller shares can use, so a small size counts only if it is at least FILLER_MIN_SUPPLY
    times as frequent as the large shares that leave room for it. Counting a scarce size (160s
    against ten times as many 810s) makes most remainders look fillable, and the policy then packs
    as if they were: on gpushare100, 210- and 190-milli remainders and CPU-starved nodes. Measured
    on seeds 42 and 1: gpushare100 12.73 -> 11.41, default and multigpu20 unchanged; 0.2 to 0.3
    give the same, 0.1 keeps 220s (12.09), 0.35 drops 370s (11.63).
    """
    large = {z: f for z, f in frequency.items() if MILLI // 2 < z < MILLI}
    kept = []
    for size, f in frequency.items():
        if f < min_frequency or not 0 < size <= MILLI:
            continue
        if size <= MILLI // 2:
            leaving_room = sum(fl for zl, fl in large.items() if zl <= MILLI - size)
            if leaving_room and f < FILLER_MIN_SUPPLY * leaving_room:
                continue
        kept.append(size)
    return sorted(kept)


def packing_waste_table(sizes: Iterable[int]) -> list[int]:
    """waste[f]: the milli of a GPU with f free that no combination of these share sizes can fill.

    An unbounded knapsack over 0..1000: a GPU left with 60 milli when the smallest common share is
    110 is lost for good, while one left with 220 can still take two 110s."""
    usable = sorted({z for z in sizes if 0 < z <= MILLI})
    best = [0] * (MILLI + 1)
    for f in range(1, MILLI + 1):
        b = best[f - 1]
        for z in usable:
            if z > f:
                break
            v = z + best[f - z]
            if v > b:
                b = v
        best[f] = b
    return [f - best[f] for f in range(MILLI + 1)]


class OnlineWorkload:
    """What draplane knows of the workload: only the pods it has been asked to place so far.

    Two kinds of device go to waste in a cluster that fills up, and both are measured against it:

    1. Slivers: free milli on a device that no combination of the common share sizes seen so far
       can fill (`packing_waste_table` over `filler_sizes`). FGD looks one pod ahead and counts a
       220-milli remainder as lost to every pod above 220; packing it with two 110s is what
       happens over the next hour.
    2. Stranded devices: free milli-devices beyond what the node's free CPU and memory can feed, at
       the ratio of CPU and memory to devices of the device-using pods seen so far. CPU-only pods
       would dilute the ratios (they ask CPU with no device) and make every node look short of CPU.

    Share sizes are fractions of one device in milli, learned from one-device pods (a whole one
    counts as 1000, so that the frequencies are those of all one-device pods). The waste table is
    rebuilt every REFRESH_EVERY such pods and at each size not seen before (at most 1,001 sizes);
    `version` changes only when the sizes
    counted on to fill slivers change, so callers may keep scores computed under one version.
    """

    REFRESH_EVERY = 64
    SHARE_MIN_FREQUENCY = 0.01  # shares rarer than this are not counted on to fill slivers

    def __init__(self) -> None:
        self.sizes: Counter[int] = Counter()
        self.fillers: list[int] = []
        self.waste = packing_waste_table([])
        self.version = 0
        self._since_refresh = 0
        # Running sums over the device-using pods seen: milli-devices, CPU milli, memory bytes.
        self.device_milli = 0
        self.cpu = 0
        self.memory = 0

    def observe(self, cpu: int, memory: int, device_milli: float) -> None:
        """A pod about to be placed: CPU (milli), memory (bytes), devices (milli-devices)."""
        # Whole milli: the float residue of capacity fractions must not make two equal pods differ.
        milli = round(device_milli)
        if milli <= 0:
            return
        self.device_milli += milli
        self.cpu += cpu
        self.memory += memory
        if milli <= MILLI:
            new_size = milli not in self.sizes
            self.sizes[milli] += 1
            self._since_refresh += 1
            if new_size or self._since_refresh >= self.REFRESH_EVERY:
                self._refresh()

    def _refresh(self) -> None:
        self._since_refresh = 0
        total = sum(self.sizes.values())
        fillers = filler_sizes({z: n / total for z, n in self.sizes.items()}, self.SHARE_MIN_FREQUENCY)
        if fillers != self.fillers:
            self.fillers = fillers
            self.waste = packing_waste_table(fillers)
            self.version += 1

    def sliver_cost(self, free: int, take: int) -> int:
        """What taking `take` milli of a device with `free` milli free adds to its unfillable part."""
        return self.waste[free - take] - self.waste[free]

    def stranded(self, device_free: float, cpu_free: float, memory_free: float) -> float:
        """Milli-devices beyond what the free CPU and memory feed at the observed ratios; a resource
        no pod has asked for yet feeds without limit. Floats throughout, in one order, so that
        `stranded_many` gives the very same numbers."""
        feedable = math.inf
        if self.cpu > 0:
            feedable = min(feedable, float(cpu_free) * float(self.device_milli) / float(self.cpu))
        if self.memory > 0:
            feedable = min(feedable, float(memory_free) * float(self.device_milli) / float(self.memory))
        return max(0.0, float(device_free) - feedable)

    def stranded_many(self, device_free: np.ndarray, cpu_free: np.ndarray, memory_free: np.ndarray) -> np.ndarray:
        """`stranded` for many nodes at once."""
        feedable = np.full(len(device_free), math.inf)
        if self.cpu > 0:
            feedable = np.minimum(feedable, cpu_free.astype(float) * float(self.device_milli) / float(self.cpu))
        if self.memory > 0:
            feedable = np.minimum(feedable, memory_free.astype(float) * float(self.device_milli) / float(self.memory))
        return np.maximum(0.0, device_free.astype(float) - feedable)


MIB = 1 << 20


class FragmentationAwareDraplane(DraplanePolicy):
    """The `draplane` policy: what the allocator shards run and what `draplane simulate` measures.

    It is the core's topology-first `DraplanePolicy` (one PCIe root, then one NUMA node; shared
    devices fill before new ones are split; busy nodes first) plus the two fragmentation terms of
    `OnlineWorkload`, learned online from the pods placed so far and never from later ones:

    - device order: among devices that the base policy ranks equal on splitting, a share goes to the
      device whose unfillable part (by the common share sizes) grows least, then to the one whose
      remainder stays the most fillable, then in the base order;
    - node score (lower is better): the base score plus the chosen devices' sliver cost, and, when
      the caller passes the pod's CPU and memory and the nodes' free amounts
      (`DeviceAllocator.allocate(node_resources=...)`, as the shard's `SchedulingState.place_pod` does), the
      devices the placement newly strands, both in devices.

    Ordering never changes whether a claim fits. `place` is the same policy on the simulator's
    `NodeState` (a node of identical shareable GPUs, no topology), so the simulator's fast engine
    replays it without the device search; `tests/shared/simulation/test_shipped_policy.py` checks
    that the engine and the shard's core make the same choices pod by pod.
    """

    name = "draplane"
    reads_node_resources = True
    # Splitting and whole free devices only break ties: measured on seed 42 with them at full weight
    # (as in the base policy) default 4.33, gpushare100 12.83, multigpu20 3.84; as tie-breakers 3.65,
    # 11.5, 3.27 unallocated GPU %.
    PACKING_WEIGHT = 1e-6

    def __init__(self) -> None:
        self.workload = OnlineWorkload()

    @property
    def version(self) -> int:
        """Changes when scores computed before may no longer hold (the DeviceAllocator recomputes them)."""
        return self.workload.version

    # --- learning --------------------------------------------------------------------------------

    def observe_requests(self, cpu: int, memory: int, device_milli: float) -> None:
        self.workload.observe(cpu, memory, device_milli)

    # --- the allocator core's hooks ----------------------------------------------------------------

    def node_resources_score(self, device_free, device_taken, free, requests):
        cpu_free, memory_free = free
        cpu, memory = requests
        # Whole milli-devices, as the simulator counts them: float residue must not decide a tie.
        device_free = round(device_free)
        device_taken = round(device_taken)
        before = self.workload.stranded(device_free, cpu_free, memory_free)
        after = self.workload.stranded(device_free - device_taken, cpu_free - cpu, memory_free - memory)
        # Lower is better: devices newly stranded cost, devices given back their CPU/memory gain.
        return (after - before) / MILLI

    def node_resources_scores(self, device_free, device_taken, cpu_free, memory_free, requests):
        # The same arithmetic as node_resources_score, in the same order, so that ties fall alike.
        cpu, memory = requests
        device_free = np.round(device_free)
        device_taken = np.round(device_taken)
        before = self.workload.stranded_many(device_free, cpu_free, memory_free)
        after = self.workload.stranded_many(device_free - device_taken, cpu_free - cpu, memory_free - memory)
        return (after - before) / MILLI

    @staticmethod
    def _share(candidate, consumed, view) -> tuple[int, int] | None:
        """(free milli, milli taken) of a share of a multi-allocatable device: by the capacity that
        is most used, as `DeviceAllocator.device_free_milli` counts it."""
        record = candidate.record
        if not record.allow_multiple or not consumed:
            return None
        used = view.state.shared_capacity(record.id) or {}
        used_fraction = take_fraction = 0.0
        for name, amount in consumed.items():
            cap = record.capacity.get(name)
            if cap is None or cap.value.value <= 0:
                continue
            value = amount.value if hasattr(amount, "value") else amount
            take_fraction = max(take_fraction, float(value / cap.value.value))
        for name, amount in used.items():
            cap = record.capacity.get(name)
            if cap is not None and cap.value.value > 0:
                used_fraction = max(used_fraction, float(amount / cap.value.value))
        free = round(MILLI * max(0.0, 1.0 - used_fraction))
        return free, min(free, round(MILLI * take_fraction))

    def _order_partitions(self, ordered, view, count: int = 1):
        """Stable: partitions of GPUs already partitioned stay first (the base order), then the least
        scarce new GPU or device, then the partition that takes the least of what its GPU could
        still hold. For a request of `count` > 1
        partitions, those of one GPU stay together (GPUs in the order of their best partition), so
        that the search fills one GPU before it splits the next: two 3g.20gb slices share an empty
        A100 rather than take the start-4 slot of two."""
        touched = self._touched_counter_sets(view)
        cache: dict = {}

        scarcity = view.scarcity

        def key(c):
            # A GPU no partition of which is taken yet, and a plain device, are new units: the
            # least scarce of them first (see draplane.allocation.scarcity), then what they block.
            r = c.record
            if not r.consumes:
                return (1, scarcity.of(r) if scarcity is not None else 0.0, 0.0)
            untouched = not any((r.driver, r.pool, s) in touched for s, _ in r.consumes)
            scarce = scarcity.of(r) if untouched and scarcity is not None else 0.0
            return (int(untouched), scarce, self.placement_loss(r, c.pool, view, cache))

        keyed = sorted(((key(c), i, c) for i, c in enumerate(ordered)), key=lambda k: (k[0], k[1]))
        if count <= 1:
            return [c for _, _, c in keyed]
        group_rank: dict = {}  # a GPU (its counter sets) -> the rank of its first partition
        for rank, (_, _, c) in enumerate(keyed):
            group = (c.record.driver, c.record.pool, tuple(sorted(s for s, _ in c.record.consumes or ())))
            group_rank.setdefault(group, rank)
        return [c for _, _, c in sorted(
            keyed, key=lambda k: (k[0][0], group_rank[(k[2].record.driver, k[2].record.pool,
                                                       tuple(sorted(s for s, _ in k[2].record.consumes or ())))],
                                  k[0], k[1]))]

    def score_placement(self, placement, view):
        score = super().score_placement(placement, view)
        sliver = 0
        loss = 0.0
        cache: dict = {}
        for chosen in placement.chosen:
            for c in chosen:
                share = self._share(c, c.consumed, view)
                if share is not None:
                    sliver += self.workload.sliver_cost(*share)
                if c.record.consumes:
                    loss += self.placement_loss(c.record, c.pool, view, cache)
        return score + sliver / MILLI + self.PLACEMENT_LOSS_WEIGHT * loss

    # --- partitionable devices (MIG): keep the placements the GPU can still take -------------------

    # A lost placement counts this much in the node score: below topology (10), above the packing
    # tie-breakers.
    PLACEMENT_LOSS_WEIGHT = 1e-3

    @staticmethod
    def _counters_left(pool, view, cache: dict) -> dict[str, dict]:
        """Each counter set's counters left after the pool's allocated devices, per pool."""
        left = cache.get(pool.id)
        if left is None:
            left = {name: dict(counters) for name, counters in pool.counter_sets.items()}
            for device_name, consumes in pool.counter_consumers.items():
                if view.state.is_allocated((pool.id[0], pool.id[1], device_name)):
                    for set_name, counters in consumes:
                        target = left.get(set_name)
                        if target is not None:
                            for counter, value in counters.items():
                                if counter in target:
                                    target[counter] -= value
            cache[pool.id] = left
        return left

    def placement_loss(self, record, pool, view, cache: dict) -> float:
        """How much taking this partition takes from what its GPU could still hold: every device
        drawing on the same counter set that fits now and would not fit after (the partition
        itself included), each weighted by its memory slices (the counters named memory-slice-*;
        1 for a device without such counters). The MIG rules are in the counters: a 1g at slice 0
        blocks the only 4g placement and both 3g positions' neighbour, a 1g at slice 6 blocks less."""
        if not record.consumes or not pool.counter_consumers:
            return 0.0
        left = self._counters_left(pool, view, cache)
        loss = 0.0
        for set_name, need in record.consumes:
            available = left.get(set_name)
            if available is None:
                continue
            after = {c: v - need.get(c, 0) for c, v in available.items()}
            for consumes in pool.counter_consumers.values():
                for other_set, other_need in consumes:
                    if other_set != set_name:
                        continue
                    if all(available.get(c, 0) >= v for c, v in other_need.items()) and not all(
                            after.get(c, 0) >= v for c, v in other_need.items()):
                        loss += sum(1 for c in other_need if c.startswith("memory-slice-")) or 1
        return loss

    def order_candidates(self, request, candidates, view):
        ordered = super().order_candidates(request, candidates, view)
        if len(ordered) > 1 and any(c.record.consumes for c in ordered):
            return self._order_partitions(ordered, view, max(request.count, 1))
        if len(ordered) <= 1 or not request.capacity or request.count != 1:
            return ordered
        wanted = {name: amount for name, amount in request.capacity.items()}
        workload = self.workload
        shared_capacity = view.state.shared_capacity

        def sliver(candidate) -> tuple[int, int]:
            share = self._share(candidate, wanted, view)
            if share is None or share[1] > share[0]:
                return MILLI, MILLI
            free, take = share
            return workload.sliver_cost(free, take), workload.waste[free - take]

        # Stable: devices the base policy put first (already shared, tightest topology) stay first
        # among equals; then the device whose unfillable part grows least, and of those the one
        # whose remainder stays the most fillable.
        split_rank = {id(c): (c.record.allow_multiple and shared_capacity(c.record.id) is None) for c in ordered}
        return sorted(ordered, key=lambda c: (split_rank[id(c)], sliver(c)))

    # --- the same policy on the simulator's node states ------------------------------------------

    def device_choice(self, gpus: Sequence[int], shape: PodShape) -> tuple[float, tuple[int, ...]] | None:
        """The GPUs the core would take on a node whose GPUs have `gpus` milli free (sorted or not),
        and the part of the node score that depends on them: newly split GPUs, the fraction of GPUs
        left whole and free (`DraplanePolicy.score_placement`), and the sliver cost. None when the
        GPUs cannot hold the pod. Topology is absent: the simulator's nodes have none."""
        if shape.num_gpu == 0:
            return 0.0, ()
        if shape.shares_gpu:
            best = None
            for i, free in enumerate(gpus):
                if free < shape.gpu_milli:
                    continue
                left = free - shape.gpu_milli
                key = (free == MILLI, self.workload.sliver_cost(free, shape.gpu_milli), self.workload.waste[left], i)
                if best is None or key < best:
                    best = key
            if best is None:
                return None
            chosen: tuple[int, ...] = (best[-1],)
        else:
            whole = [i for i, free in enumerate(gpus) if free >= shape.gpu_milli]
            if len(whole) < shape.num_gpu:
                return None
            chosen = tuple(whole[: shape.num_gpu])
        split = sum(1 for i in chosen if gpus[i] == MILLI)
        whole_left = sum(1 for free in gpus if free == MILLI) - split
        sliver = sum(self.workload.sliver_cost(gpus[i], shape.gpu_milli) for i in chosen)
        # The very arithmetic of score_placement (no topology: 0.0), so that floats agree exactly.
        packing = self.SPLIT_WEIGHT * split + whole_left / len(gpus)
        return 0.0 + self.PACKING_WEIGHT * packing + sliver / MILLI, chosen

    def place(self, state: NodeState, shape: PodShape) -> Placement | None:
        """The policy on one node, without learning from the pod (the caller observes it once);
        Placement scores are higher-is-better, so the node cost is negated."""
        if not fits(state, shape):
            return None
        found = self.device_choice(state.gpus, shape)
        if found is None:
            return None
        device_score, chosen = found
        resources = self.node_resources_score(state.gpu_free_total, shape.gpu_demand,
                                              (state.cpu_free, state.memory_free * MIB),
                                              (shape.cpu_milli, shape.memory_mib * MIB))
        return Placement(-(device_score + resources), chosen)


register_policy(FragmentationAwareDraplane())

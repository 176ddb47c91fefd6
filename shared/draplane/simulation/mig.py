"""A MIG workload: requests for MIG profiles arriving and leaving on partitionable A100s or H100s.

NVIDIA's DRA driver and kube-scheduler place a MIG request first-fit: the first placement of the
profile, in the slice's device order, that the GPU's counters still allow (NVIDIA dra-driver issue
932 reports the fragmented GPUs this leaves). Here a seeded stream of 1g/2g/3g/4g/7g requests, each
living a random while, goes through the allocator core (`DeviceAllocator`) on nodes made from a node agent
profile with MIG (`a100-mig`, A100 40GB; `h100-mig`, H100 80GB), exactly as the agent and the
inventory service publish them: one counter set per GPU (engines and one counter per memory slice),
each MIG placement a device consuming from it. The placement rules come from the profile too.

What is counted:
- refused requests: no node had a placement left for the profile when it arrived (it is dropped);
- stranded memory slices: at each refusal, the free memory slices of the cluster, and whether some
  GPU had as many free slices as the profile needs but in no position it may take (a refusal that
  only fragmentation caused).

`placement_bound` is the offline bound: an integer program over the same arrivals (HiGHS, through
scipy's `milp`) on how many requests any policy, even one that knows the future, could place.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import Counter
from functools import lru_cache
from typing import Sequence

import msgspec
import numpy as np

from draplane.allocation.device_allocator import DeviceAllocator
from draplane.allocation.allocator import NodePlacement
from draplane.api.meta import ObjectMeta
from draplane.api.resource import (
    CELDeviceSelector,
    DeviceClass,
    DeviceClaim,
    DeviceRequest,
    DeviceSelector,
    ExactDeviceRequest,
    ResourceClaim,
    ResourceClaimSpec,
)

PROFILE = "a100-mig"
NODE_PROFILES = ("a100-mig", "h100-mig")
DEVICE_CLASS = "mig.nvidia.com"
DRIVER = "gpu.nvidia.com"
# The mix of requests (profile, weight): small slices are the most common, as in shared inference.
DEFAULT_MIX = (("1g.5gb", 0.35), ("2g.10gb", 0.25), ("3g.20gb", 0.2), ("4g.20gb", 0.1), ("7g.40gb", 0.1))
# The H100's mix asks for the same compute sizes as often (1g 35 %, 2g 25 %, ...), so the two GPUs'
# figures compare; its 1g requests split between 1g.10gb and the two-slice 1g.20gb.
MIXES = {
    "a100-mig": DEFAULT_MIX,
    "h100-mig": (("1g.10gb", 0.25), ("1g.20gb", 0.1), ("2g.20gb", 0.25), ("3g.40gb", 0.2), ("4g.40gb", 0.1),
                 ("7g.80gb", 0.1)),
}


@dataclasses.dataclass(frozen=True, slots=True)
class MigRequest:
    index: int
    profile: str
    arrival: float
    departure: float


@dataclasses.dataclass(frozen=True, slots=True)
class MigProfileShape:
    """What the placement rules of one profile are: its memory slices and where it may start."""

    name: str
    slices: int
    starts: tuple[int, ...]
    engines: tuple[int, ...]  # multiprocessors, copy engines, decoders, encoders, jpeg, ofa; memory bytes


@dataclasses.dataclass(frozen=True, slots=True)
class MigGpuShape:
    node_profile: str
    gpus_per_node: int
    memory_slices: int
    engines: tuple[int, ...]  # the GPU's totals, in MigProfileShape.engines' order
    profiles: tuple[MigProfileShape, ...]

    def profile(self, name: str) -> MigProfileShape:
        for p in self.profiles:
            if p.name == name:
                return p
        raise KeyError(f"MIG profile {name!r} is not in the {self.node_profile} profile "
                       f"({', '.join(p.name for p in self.profiles)})")


@lru_cache(maxsize=None)
def gpu_shape(node_profile: str = PROFILE) -> MigGpuShape:
    """One GPU's MIG rules as the node agent's profile states them (its GPUs are all alike)."""
    from draplane.nodes.profile import load_profile, profile_hardware

    gpus = profile_hardware(load_profile(node_profile), "shape").gpus
    gpu = gpus[0]
    mig = gpu.mig
    if mig is None or any(g.mig != mig for g in gpus):
        raise ValueError(f"node profile {node_profile!r}: the MIG workload needs GPUs that are all alike and all partitionable")
    profiles = tuple(
        MigProfileShape(
            p.name, p.placements[0][1], tuple(start for start, _ in p.placements),
            (p.multiprocessors, p.copy_engines, p.decoders, p.encoders, p.jpeg_engines, p.ofa_engines, p.memory),
        )
        for p in mig.profiles
    )
    engines = (mig.multiprocessors, mig.copy_engines, mig.decoders, mig.encoders, mig.jpeg_engines, mig.ofa_engines, gpu.memory)
    return MigGpuShape(node_profile, len(gpus), mig.memory_slices, engines, profiles)


def node_slices(nodes: int, node_profile: str = PROFILE):
    """(Node objects, ResourceSlices) of `nodes` nodes of a MIG node profile, as the agent and
    inventory make them."""
    from draplane.api.core import Node, NodeSpec, NodeStatus
    from draplane.nodes.slices import NodeRef, plan_node
    from draplane.nodes.hardware import driver_devices
    from draplane.nodes.profile import load_profile, profile_hardware

    profile = load_profile(node_profile)
    k8s_nodes, slices = [], []
    for i in range(nodes):
        name = f"{node_profile}-{i:04d}"
        drivers = [d for d in driver_devices(profile_hardware(profile, name)) if d.driver == DRIVER]
        slices.extend(s for plan in plan_node(NodeRef(name, f"uid-{name}"), drivers, []) for s in plan.creates)
        k8s_nodes.append(Node(metadata=ObjectMeta(name=name), spec=NodeSpec(), status=NodeStatus()))
    return k8s_nodes, slices


def mig_device_class() -> DeviceClass:
    from draplane.localenv.environment import standard_device_classes

    return next(msgspec.convert(c, DeviceClass) for c in standard_device_classes() if c["metadata"]["name"] == DEVICE_CLASS)


def mig_claim(name: str, profile: str) -> ResourceClaim:
    selector = f"device.attributes['{DRIVER}'].profile == '{profile}'"
    return ResourceClaim(
        metadata=ObjectMeta(name=name, namespace="mig", uid=name),
        spec=ResourceClaimSpec(devices=DeviceClaim(requests=[DeviceRequest(
            name="mig", exactly=ExactDeviceRequest(device_class_name=DEVICE_CLASS,
                                                   selectors=[DeviceSelector(cel=CELDeviceSelector(expression=selector))]))])),
    )


def mig_requests(seed: int, count: int, gpus: int, load: float, mix: Sequence[tuple[str, float]] | None = None,
                 node_profile: str = PROFILE) -> list[MigRequest]:
    """`count` requests arriving one per time unit on average (Poisson), each staying an
    exponential while whose mean makes the offered memory slices `load` x the cluster's. The mix
    defaults to the node profile's (`MIXES`)."""
    shape = gpu_shape(node_profile)
    mix = MIXES[node_profile] if mix is None else mix
    rng = random.Random(f"mig-{seed}")
    names = [name for name, _ in mix]
    weights = [w for _, w in mix]
    mean_slices = sum(w * shape.profile(n).slices for n, w in mix) / sum(weights)
    mean_life = load * gpus * shape.memory_slices / mean_slices
    now = 0.0
    requests = []
    for i in range(count):
        now += rng.expovariate(1.0)
        profile = rng.choices(names, weights)[0]
        requests.append(MigRequest(i, profile, now, now + rng.expovariate(1.0 / mean_life)))
    return requests


@dataclasses.dataclass(frozen=True, slots=True)
class MigResult:
    policy: str
    seed: int
    requests: int
    refused: int
    refused_by_profile: tuple[tuple[str, int], ...]
    fragmentation_refusals: int  # refused while some GPU had enough free slices, in no allowed position
    stranded_slices: float  # mean free memory slices of the cluster at a refusal
    seconds: float

    @property
    def refused_pct(self) -> float:
        return 100.0 * self.refused / self.requests if self.requests else 0.0


def _placed_slices(placement: NodePlacement, shape: MigGpuShape) -> tuple[str, int, int, int]:
    """(node, GPU index, first slice, slices) of a placed MIG device, from its name
    (gpu-<i>-mig-<profile>-<start>, as the node agent names them)."""
    result = placement.allocations[0].devices.results[0]
    gpu_part, _, rest = result.device.partition("-mig-")
    profile_part, _, start = rest.rpartition("-")
    profile = next(p for p in shape.profiles if p.name.replace(".", "-").lower() == profile_part)
    return placement.node, int(gpu_part.split("-")[1]), int(start), profile.slices


def replay(requests: Sequence[MigRequest], nodes: int, policy, seed: int = 0, node_profile: str = PROFILE) -> MigResult:
    """Every request through the allocator core with `policy` (a name or a ScoringPolicy), on
    `nodes` nodes of `node_profile`."""
    import time

    shape = gpu_shape(node_profile)
    k8s_nodes, slices = node_slices(nodes, node_profile)
    cluster = DeviceAllocator(slices=slices, classes=[mig_device_class()], nodes=k8s_nodes, policy=policy)
    free = {(n.metadata.name, g): [True] * shape.memory_slices for n in k8s_nodes for g in range(shape.gpus_per_node)}
    holding: dict[str, tuple[str, int, int, int]] = {}
    leaving: list[tuple[float, str]] = []
    refused: Counter[str] = Counter()
    fragmentation = 0
    stranded_total = 0
    started = time.process_time()
    for request in requests:
        while leaving and leaving[0][0] <= request.arrival:
            _, key = heapq.heappop(leaving)
            node, gpu, start, size = holding.pop(key)
            cluster.release_claim(key)
            free[(node, gpu)][start:start + size] = [True] * size
        claim = mig_claim(f"r{request.index}", request.profile)
        placement = cluster.allocate([claim])
        if isinstance(placement, NodePlacement):
            cluster.commit([claim], placement)
            node, gpu, start, size = _placed_slices(placement, shape)
            key = f"mig/r{request.index}"
            holding[key] = (node, gpu, start, size)
            free[(node, gpu)][start:start + size] = [False] * size
            heapq.heappush(leaving, (request.departure, key))
            continue
        refused[request.profile] += 1
        need = shape.profile(request.profile).slices
        stranded_total += sum(sum(slots) for slots in free.values())
        if any(sum(slots) >= need for slots in free.values()):
            fragmentation += 1
    total = sum(refused.values())
    name = policy if isinstance(policy, str) else policy.name
    return MigResult(name, seed, len(requests), total, tuple(sorted(refused.items())), fragmentation,
                     stranded_total / total if total else 0.0, time.process_time() - started)


# --- the offline bound ---------------------------------------------------------------------------


def gpu_configurations(shape: MigGpuShape) -> list[tuple[int, ...]]:
    """The maximal multisets of profiles (counts in `shape.profiles` order) that one GPU holds at
    once: placements in allowed positions on disjoint memory slices, engines within the GPU's."""
    placements = [(k, start, p.slices, p.engines) for k, p in enumerate(shape.profiles) for start in p.starts]
    found: set[tuple[int, ...]] = set()

    def extend(i: int, used: int, engines: tuple[int, ...], counts: list[int]) -> None:
        if i == len(placements):
            found.add(tuple(counts))
            return
        extend(i + 1, used, engines, counts)
        k, start, size, need = placements[i]
        mask = ((1 << size) - 1) << start
        after = tuple(e - n for e, n in zip(engines, need))
        if used & mask == 0 and min(after) >= 0:
            counts[k] += 1
            extend(i + 1, used | mask, after, counts)
            counts[k] -= 1

    extend(0, 0, shape.engines, [0] * len(shape.profiles))
    return sorted(c for c in found if not any(o != c and all(a >= b for a, b in zip(o, c)) for o in found))


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementBound:
    requests: int
    most_placed: int  # no policy places more
    proven_optimal: bool

    @property
    def fewest_refused(self) -> int:
        return self.requests - self.most_placed


def placement_bound(requests: Sequence[MigRequest], gpus: int, *, time_limit: float = 60.0,
                    node_profile: str = PROFILE) -> PlacementBound:
    """An upper bound on the requests any policy could place, arrivals and departures as given.

    Variables: a_r ∈ {0, 1}, request r placed; y_tc ≥ 0 integer, GPUs in configuration c at the
    arrival instant t. At every arrival instant the placed requests still present must fit the GPUs:
    Σ_c y_tc ≤ gpus, and per profile k, Σ_{r present, profile k} a_r ≤ Σ_c mult(k, c)·y_tc. Every
    real run satisfies them (each GPU's instances at t fit one maximal configuration), so the
    optimum bounds every policy. It is loose where a real run is not free: an instance never moves
    between GPUs, and the bound lets each instant choose its own configurations. Solved by HiGHS
    (scipy's `milp`); when the time limit stops it, the solver's dual bound is used, still a bound.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    shape = gpu_shape(node_profile)
    configs = gpu_configurations(shape)
    names = [p.name for p in shape.profiles]
    n, c = len(requests), len(configs)
    times = [r.arrival for r in requests]
    rows, cols, vals = [], [], []
    lower, upper = [], []
    row = 0
    order = sorted(range(n), key=lambda i: requests[i].arrival)
    for t_index, t in enumerate(times):
        y0 = n + t_index * c
        for j in range(c):  # Σ_c y_tc ≤ gpus
            rows.append(row); cols.append(y0 + j); vals.append(1.0)
        lower.append(-np.inf); upper.append(gpus); row += 1
        present = [i for i in order if requests[i].arrival <= t < requests[i].departure]
        for kk, name in enumerate(names):
            members = [i for i in present if requests[i].profile == name]
            if not members:
                continue
            for i in members:
                rows.append(row); cols.append(i); vals.append(1.0)
            for j, config in enumerate(configs):
                if config[kk]:
                    rows.append(row); cols.append(y0 + j); vals.append(-float(config[kk]))
            lower.append(-np.inf); upper.append(0.0); row += 1
    size = n + len(times) * c
    matrix = coo_matrix((vals, (rows, cols)), shape=(row, size)).tocsr()
    objective = np.zeros(size)
    objective[:n] = -1.0
    result = milp(
        objective, constraints=LinearConstraint(matrix, lower, upper), integrality=np.ones(size),
        bounds=Bounds(np.zeros(size), np.concatenate([np.ones(n), np.full(len(times) * c, gpus)])),
        options={"time_limit": time_limit, "disp": False},
    )
    dual = getattr(result, "mip_dual_bound", None)
    if result.status == 0:
        return PlacementBound(n, int(round(-result.fun)), True)
    if dual is None or not math.isfinite(dual):
        raise RuntimeError(f"the MIG placement bound did not solve: {result.message}")
    return PlacementBound(n, int(math.floor(-dual + 1e-6)), False)


__all__ = [
    "DEFAULT_MIX", "MIXES", "NODE_PROFILES", "MigRequest", "MigResult", "PlacementBound", "gpu_configurations", "gpu_shape", "mig_claim",
    "mig_requests", "node_slices", "placement_bound", "replay",
]

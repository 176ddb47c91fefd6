"""Policies side by side on the same seeds: the runs behind `draplane simulate`.

One run = one (policy, seed): build the arrival sequence, replay it pod by pod, record the curve.
Runs are independent, so they spread over worker processes.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

from draplane.allocation.fragmentation import (
    BestFit,
    FirstFit,
    FirstNode,
    FragmentationAwareDraplane,
    FragmentationGradientDescent,
    PodShape,
    typical_shapes,
)
from draplane.simulation.binding import CoreBinder, CoreInventory
from draplane.simulation.engine import Replay, build_arrays
from draplane.simulation.trace import TraceNode, TracePod
from draplane.simulation.workload import AllocationCurve, arrival_sequence

POLICIES = ("first-fit", "best-fit", "fgd", "draplane")
EXTRA_POLICIES = ("first-node",)


@dataclass(frozen=True, slots=True)
class RunResult:
    policy: str
    seed: int
    points: tuple[tuple[int, float], ...]  # (arrived %, allocated %)
    pods: int
    failed: int
    failed_gpu_pods: int

    @property
    def unallocated_pct(self) -> float:
        return 100.0 - (self.points[-1][1] if self.points else 0.0)


def shape_of(pod: TracePod) -> PodShape:
    return PodShape(pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, pod.gpu_spec)


def tie_order(nodes: Sequence[TraceNode], seed: int) -> list[int]:
    """The seed's fixed random node order that breaks score ties."""
    import random

    order = list(range(len(nodes)))
    random.Random(f"tie-order-{seed}").shuffle(order)
    return order


def make_policy(name: str, shapes: Sequence[PodShape]):
    """The policy and the CPU/memory thresholds its scores compare against (for the score cache)."""
    if name == "first-fit":
        return FirstFit(), (), ()
    if name == "first-node":
        return FirstNode(), (), ()
    if name == "best-fit":
        return BestFit(), (), ()
    if name == "fgd":
        profile = typical_shapes(shapes)
        return FragmentationGradientDescent(profile), [s.cpu_milli for s in profile.shapes], ()
    if name == "draplane":
        # The shipped policy, fresh: it learns from the pods as they arrive, as a shard does.
        return FragmentationAwareDraplane(), (), ()
    raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES + EXTRA_POLICIES)})")


_CORE: dict[tuple[str, ...], CoreInventory] = {}


def core_inventory(nodes: Sequence[TraceNode]) -> CoreInventory:
    """The allocator core's inventory of these nodes, built once per process."""
    key = tuple(n.name for n in nodes)
    found = _CORE.get(key)
    if found is None:
        _CORE.clear()
        found = _CORE[key] = CoreInventory(nodes)
    return found


def run_one(nodes: Sequence[TraceNode], pods: Sequence[TracePod], policy_name: str, seed: int, inflate: float,
            through_core: bool = True) -> RunResult:
    """One (policy, seed) run. Every placement is confirmed and recorded by the allocator core
    (`CoreBinder`) unless `through_core` is off, which only tests use to compare the two."""
    capacity = sum(n.gpus for n in nodes) * 1000
    arrivals = arrival_sequence(pods, capacity, seed, inflate)
    shapes = [shape_of(p) for p in arrivals]
    policy, cpu_thr, mem_thr = make_policy(policy_name, shapes)
    order = tie_order(nodes, seed)
    ordered = [nodes[i] for i in order]
    arrays = build_arrays(
        [n.name for n in ordered], [n.model for n in ordered], [n.cpu_milli for n in ordered],
        [n.memory_mib for n in ordered], [n.gpus for n in ordered],
    )
    binder = CoreBinder(core_inventory(nodes), order) if through_core else None
    replay = Replay(arrays, policy, cpu_thresholds=cpu_thr, memory_thresholds=mem_thr,
                    confirm=binder.confirm if binder else None)
    curve = AllocationCurve.empty(capacity)
    arrived = allocated = failed = failed_gpu = 0
    for shape in shapes:
        arrived += shape.gpu_demand
        outcome = replay.offer(shape)
        if outcome.node is None:
            failed += 1
            failed_gpu += shape.num_gpu > 0
        else:
            allocated += shape.gpu_demand
        curve.record(arrived, allocated)
    return RunResult(policy_name, seed, tuple(curve.points()), len(shapes), failed, failed_gpu)


def _run_job(job: tuple) -> RunResult:
    return run_one(*job)


def run_many(
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    policies: Iterable[str],
    seeds: Iterable[int],
    inflate: float,
    *,
    processes: int | None = None,
) -> list[RunResult]:
    jobs = [(nodes, pods, policy, seed, inflate) for seed in seeds for policy in policies]
    workers = processes if processes is not None else min(len(jobs), os.cpu_count() or 1)
    if workers <= 1 or len(jobs) <= 1:
        return [_run_job(j) for j in jobs]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(_run_job, jobs, chunksize=1)

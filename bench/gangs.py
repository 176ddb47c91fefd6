"""Gangs through the allocator core: draplane's joint all-or-nothing placement against per-pod first-fit.

A seeded synthetic trace of jobs arriving and finishing on a cluster of 8-GPU nodes: gangs of 2-16
pods of 1, 2, 4 or 8 GPUs each, and singletons. The same trace runs twice:

- `gang`: every job is placed whole by `draplane.allocation.gang.place_gang` or waits whole; jobs
  wait in arrival order, and a job that does not fit lets later ones try (`order=backfill`), or
  holds up every later one (`order=fifo`: big gangs are not overtaken, GPUs idle meanwhile);
- `per-pod`: each pod on its own, as kube-scheduler without gangs: the first node that fits
  (`first-fit`), in arrival order. A job runs only once all its pods are placed; until then its
  placed pods hold their GPUs for nothing (GPU-hours held by partial gangs). Two half-placed gangs
  can hold what both need and wait for ever.

Reported over the window from the first to the last arrival: useful GPU utilisation (GPUs of jobs
whose pods are all placed) and held utilisation (any GPU allocated), per tenth of the window and
on average; gang wait p50/p99 (hours, of the gangs that started; `unstarted` counts those that
never did by the end of the run); GPU-hours held by partial gangs, which must be 0 for `gang`.

    .venv/bin/python bench/gangs.py [--nodes 32] [--jobs 400] [--seed 7] [--load 1.1]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))

from draplane.allocation import DeviceAllocator, NodePlacement  # noqa: E402
from draplane.allocation.gang import (  # noqa: E402
    Gang, GangMember, GangPlacement, SearchBudget, commit_gang, place_gang, release_gang,
)
from draplane.api.meta import ObjectMeta  # noqa: E402
from draplane.api.resource import (  # noqa: E402
    CELDeviceSelector,
    Device,
    DeviceClaim,
    DeviceClass,
    DeviceClassSpec,
    DeviceRequest,
    DeviceSelector,
    ExactDeviceRequest,
    ResourceClaim,
    ResourceClaimSpec,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)

DRIVER = "gpu.nvidia.com"
CLASS = "gpu.nvidia.com"
GPUS_PER_NODE = 8
GPU_SIZES = (1, 2, 4, 8)
HOUR = 3600.0
BUDGET = SearchBudget(node_attempts=5_000, seconds=3600.0)


@dataclass(frozen=True, slots=True)
class Job:
    name: str
    arrival: float  # seconds
    duration: float
    pods: int
    gpus_per_pod: int

    @property
    def gpus(self) -> int:
        return self.pods * self.gpus_per_pod

    @property
    def is_gang(self) -> bool:
        return self.pods > 1


def synthetic_trace(seed: int, jobs: int, capacity_gpus: int, load: float, gang_share: float = 0.35) -> list[Job]:
    """Poisson arrivals at a rate that asks `load` times the cluster's GPUs on average."""
    rng = random.Random(seed)
    drafts = []
    for i in range(jobs):
        if rng.random() < gang_share:
            pods, gpus, mean_h = rng.randint(2, 16), rng.choice(GPU_SIZES), 3.0
        else:
            pods, gpus, mean_h = 1, rng.choice(GPU_SIZES), 1.5
        duration = min(max(rng.expovariate(1.0 / mean_h), 0.1), 6 * mean_h) * HOUR
        drafts.append((pods, gpus, duration))
    gpu_seconds = sum(p * g * d for p, g, d in drafts) / jobs
    rate = load * capacity_gpus / gpu_seconds  # arrivals per second
    t = 0.0
    out = []
    for i, (pods, gpus, duration) in enumerate(drafts):
        t += rng.expovariate(rate)
        out.append(Job(f"job-{i:04d}", t, duration, pods, gpus))
    return out


def make_cluster(nodes: int, policy: str) -> DeviceAllocator:
    slices = [
        ResourceSlice(
            metadata=ObjectMeta(name=f"node-{n:03d}-gpus"),
            spec=ResourceSliceSpec(driver=DRIVER, pool=ResourcePool(name=f"node-{n:03d}", generation=1, resource_slice_count=1),
                                   node_name=f"node-{n:03d}", devices=[Device(name=f"gpu-{i}") for i in range(GPUS_PER_NODE)]),
        )
        for n in range(nodes)
    ]
    gpu_class = DeviceClass(metadata=ObjectMeta(name=CLASS), spec=DeviceClassSpec(
        selectors=[DeviceSelector(cel=CELDeviceSelector(expression=f'device.driver == "{DRIVER}"'))]))
    cluster = DeviceAllocator(slices=slices, classes=[gpu_class], policy=policy)
    cluster.ensure_nodes_from_slices()
    return cluster


def pod_claim(job: Job, index: int) -> ResourceClaim:
    return ResourceClaim(
        metadata=ObjectMeta(name=f"{job.name}-{index}-gpus", namespace="bench"),
        spec=ResourceClaimSpec(devices=DeviceClaim(requests=[
            DeviceRequest(name="gpus", exactly=ExactDeviceRequest(device_class_name=CLASS, count=job.gpus_per_pod))])),
    )


def job_gang(job: Job) -> Gang:
    return Gang(f"bench/{job.name}", tuple(GangMember(f"bench/{job.name}-{i}", (pod_claim(job, i),)) for i in range(job.pods)))


@dataclass(slots=True)
class Timeline:
    """GPUs in use over time, integrated piecewise: useful (whole jobs) and held (any allocation)."""

    window_end: float
    buckets: int = 10
    last: float = 0.0
    useful: int = 0
    held: int = 0
    useful_seconds: list[float] = field(default_factory=list)
    held_seconds: list[float] = field(default_factory=list)
    partial_gpu_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.useful_seconds = [0.0] * self.buckets
        self.held_seconds = [0.0] * self.buckets

    def advance(self, now: float) -> None:
        t = self.last
        width = self.window_end / self.buckets
        self.partial_gpu_seconds += (self.held - self.useful) * (now - t)
        stop = min(now, self.window_end)
        bucket = min(int(t / width), self.buckets - 1)
        while t < stop:
            # By index, not by t / width alone: a t on a boundary can round into the bucket
            # before, whose end is then t itself.
            end = stop if bucket == self.buckets - 1 else min(stop, (bucket + 1) * width)
            self.useful_seconds[bucket] += self.useful * (end - t)
            self.held_seconds[bucket] += self.held * (end - t)
            t = end
            if t >= (bucket + 1) * width:
                bucket = min(bucket + 1, self.buckets - 1)
        self.last = max(self.last, now)


@dataclass(slots=True)
class Outcome:
    mode: str
    timeline: Timeline
    waits: list[float]  # gangs that started: start - arrival
    unstarted: int
    unstarted_gangs: int
    seconds: float
    attempts: int = 0


def run_gang(jobs: list[Job], nodes: int, policy: str, window_end: float, backfill: bool = True) -> Outcome:
    cluster = make_cluster(nodes, policy)
    capacity = nodes * GPUS_PER_NODE
    timeline = Timeline(window_end)
    events: list[tuple[float, int, str, int]] = [(j.arrival, 1, "arrive", i) for i, j in enumerate(jobs)]
    heapq.heapify(events)
    pending: list[int] = []
    running: dict[int, GangPlacement] = {}
    waits: list[float] = []
    free = capacity
    attempts = 0
    started = time.process_time()
    while events:
        now = events[0][0]
        timeline.advance(now)
        while events and events[0][0] == now:
            _, _, kind, i = heapq.heappop(events)
            if kind == "arrive":
                pending.append(i)
            else:
                release_gang(cluster, running.pop(i))
                free += jobs[i].gpus
                timeline.useful -= jobs[i].gpus
                timeline.held -= jobs[i].gpus
        failed_shapes: set[tuple[int, int]] = set()  # the state only shrinks during one pass
        for i in list(pending):
            job = jobs[i]
            shape = (job.pods, job.gpus_per_pod)
            if job.gpus > free or shape in failed_shapes or not _slots_suffice(cluster, job):
                failed_shapes.add(shape)
                if backfill:
                    continue
                break
            # The budget in node allocations only, so that a run is the same on a loaded machine.
            outcome = place_gang(cluster, job_gang(job), budget=BUDGET)
            attempts += 1
            if not isinstance(outcome, GangPlacement):
                failed_shapes.add(shape)
                if backfill:
                    continue
                break
            commit_gang(cluster, outcome)
            running[i] = outcome
            pending.remove(i)
            free -= job.gpus
            timeline.useful += job.gpus
            timeline.held += job.gpus
            if job.is_gang:
                waits.append(now - job.arrival)
            heapq.heappush(events, (now + job.duration, 0, "finish", i))
    seconds = time.process_time() - started
    unstarted = [jobs[i] for i in pending]
    mode = "gang order=backfill" if backfill else "gang order=fifo"
    return Outcome(mode, timeline, waits, len(unstarted), sum(j.is_gang for j in unstarted), seconds, attempts)


def _slots_suffice(cluster: DeviceAllocator, job: Job) -> bool:
    """A necessary condition, in arithmetic: enough nodes with room for a pod each, counted."""
    slots = 0
    for name in cluster.nodes:
        slots += int(cluster.device_free_milli(name) // 1000) // job.gpus_per_pod
        if slots >= job.pods:
            return True
    return False


def run_per_pod(jobs: list[Job], nodes: int, window_end: float, give_up_after: float) -> Outcome:
    cluster = make_cluster(nodes, "first-fit")
    timeline = Timeline(window_end)
    events: list[tuple[float, int, str, int]] = [(j.arrival, 1, "arrive", i) for i, j in enumerate(jobs)]
    heapq.heapify(events)
    pending_pods: list[tuple[int, int]] = []  # (job, pod) in arrival order
    placed: dict[int, list[ResourceClaim]] = {}
    waits: list[float] = []
    started_jobs: set[int] = set()
    started = time.process_time()
    while events:
        now = events[0][0]
        if now > give_up_after:
            break  # deadlocked: nothing finishes, nothing can start
        timeline.advance(now)
        while events and events[0][0] == now:
            _, _, kind, i = heapq.heappop(events)
            if kind == "arrive":
                pending_pods.extend((i, p) for p in range(jobs[i].pods))
            else:
                for claim in placed.pop(i):
                    cluster.release_claim(claim)
                timeline.useful -= jobs[i].gpus
                timeline.held -= jobs[i].gpus
        refused: set[int] = set()  # gpus per pod that found no node in this pass
        for i, p in list(pending_pods):
            job = jobs[i]
            if job.gpus_per_pod in refused:
                continue
            claim = pod_claim(job, p)
            outcome = cluster.allocate([claim])
            if not isinstance(outcome, NodePlacement):
                refused.add(job.gpus_per_pod)
                continue
            cluster.commit([claim], outcome)
            pending_pods.remove((i, p))
            placed.setdefault(i, []).append(claim)
            timeline.held += job.gpus_per_pod
            if len(placed[i]) == job.pods:
                started_jobs.add(i)
                timeline.useful += job.gpus
                if job.is_gang:
                    waits.append(now - job.arrival)
                heapq.heappush(events, (now + job.duration, 0, "finish", i))
    timeline.advance(max(timeline.last, min(give_up_after, window_end)))
    seconds = time.process_time() - started
    unstarted = [j for i, j in enumerate(jobs) if i not in started_jobs]
    return Outcome("per-pod", timeline, waits, len(unstarted), sum(j.is_gang for j in unstarted), seconds)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def report(outcome: Outcome, capacity: int, window_end: float, jobs: list[Job]) -> None:
    t = outcome.timeline
    width = window_end / t.buckets
    for b in range(t.buckets):
        print(f"BENCH name=gangs_util mode={outcome.mode} bucket={b} t_h={(b + 1) * width / HOUR:.2f} "
              f"useful_util={t.useful_seconds[b] / (capacity * width):.3f} held_util={t.held_seconds[b] / (capacity * width):.3f}")
    gangs = sum(j.is_gang for j in jobs)
    print(f"BENCH name=gangs mode={outcome.mode} jobs={len(jobs)} gangs={gangs} gpus={capacity} "
          f"window_h={window_end / HOUR:.1f} useful_util={sum(t.useful_seconds) / (capacity * window_end):.3f} "
          f"held_util={sum(t.held_seconds) / (capacity * window_end):.3f} "
          f"gang_wait_p50_h={percentile(outcome.waits, 50) / HOUR:.2f} gang_wait_p99_h={percentile(outcome.waits, 99) / HOUR:.2f} "
          f"gangs_started={len(outcome.waits)} unstarted_jobs={outcome.unstarted} unstarted_gangs={outcome.unstarted_gangs} "
          f"partial_gang_gpu_hours={t.partial_gpu_seconds / HOUR:.1f} gang_searches={outcome.attempts} "
          f"seconds={outcome.seconds:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--load", type=float, default=1.1, help="GPU demand as a multiple of the cluster's GPUs")
    parser.add_argument("--policy", default="draplane", help="scoring policy of the gang run")
    args = parser.parse_args()
    capacity = args.nodes * GPUS_PER_NODE
    jobs = synthetic_trace(args.seed, args.jobs, capacity, args.load)
    window_end = jobs[-1].arrival
    print(f"# {len(jobs)} jobs ({sum(j.is_gang for j in jobs)} gangs) over {window_end / HOUR:.1f} h on "
          f"{args.nodes} nodes x {GPUS_PER_NODE} GPUs, seed {args.seed}, load {args.load}", flush=True)
    for backfill in (True, False):
        report(run_gang(jobs, args.nodes, args.policy, window_end, backfill), capacity, window_end, jobs)
    # The per-pod run stops once nothing has finished for a day past the last arrival: deadlocked.
    per_pod = run_per_pod(jobs, args.nodes, window_end, give_up_after=window_end + 24 * HOUR * 30)
    report(per_pod, capacity, window_end, jobs)


if __name__ == "__main__":
    main()

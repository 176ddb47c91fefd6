"""Backpressure: a backlog of pending pods far beyond what fits, on real etcd, kube-apiserver,
kube-controller-manager and NATS, with the binder and a shard as their own processes.

1,000 nodes x 8 GPUs (hand-made Node objects and their inventory feed entries, as bench/e2e.py
makes them: no node agents), and 20,000 pods, each with its own one-GPU ResourceClaim. Only 8,000
fit. Three phases:

- `queued`: the binder runs and no shard does. The pods are created (64 creates in flight) and
  then left `--queue-seconds` (longer than the binder's 60 s in-flight backstop): every pending pod
  goes to the shard's work queue in JetStream and waits there;
- `drain`: the shard starts, places 8,000 pods and answers the other 12,000 unschedulable, which
  the binder writes to their PodScheduled condition and a FailedScheduling Event; until every pod
  is bound or marked;
- `backlog`: `--backlog-seconds` more with the 12,000 unschedulable pods retried with backoff.

Sampled every second: the binder's and the shard's RSS (VmRSS) and peak RSS (VmHWM, from
/proc/<pid>/status), nats-server's and kube-apiserver's RSS, the messages waiting in the pending
and results streams, and the requests the binder and the shard sent to the apiserver (their
`draplane_apiserver_requests_total` and `..._throttled_requests_total`, scraped from /metrics).

    flock /tmp/draplane-bench.lock .venv/bin/python bench/backpressure.py
    .venv/bin/python bench/backpressure.py --nodes 100 --pods 2000 --queue-seconds 70 --backlog-seconds 20

Prints, per phase, `BENCH name=backpressure_<pods>x<nodes>x<gpus> phase=P seconds=... binder_rss_mb=...
binder_hwm_mb=... shard_rss_mb=... shard_hwm_mb=... nats_rss_mb=... apiserver_rss_mb=...
pending_stream_max=... results_stream_max=... binder_req_per_s=... binder_req_per_s_max=...
shard_req_per_s=... shard_req_per_s_max=... binder_throttled=... bound=... unschedulable=...`, and
`BENCH name=backpressure_<...>_setup create_s=... creates_per_s=...` for the creation of the
objects. A pod count the apiserver cannot hold in `--create-timeout` is said, with how many it took.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import nats
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import setup_nodes  # noqa: E402 - bench/ is not a package

from draplane.api.core import Pod  # noqa: E402
from draplane.kube import KubeClient, watch_objects  # noqa: E402
from draplane.localenv.controllermanager import controller_manager  # noqa: E402
from draplane.localenv.controlplane import ControlPlane  # noqa: E402
from draplane.localenv.processes import free_port  # noqa: E402
from draplane.simulation import scenario  # noqa: E402
from draplane.scheduling.messages import Subjects  # noqa: E402

PREFIX = "draplane."
MB = 1024 * 1024
log = logging.getLogger("backpressure")


def proc_status_kib(pid: int, field: str) -> int:
    """A field of /proc/<pid>/status in KiB (VmRSS, VmHWM); 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _insecure_dev_flag(module: str) -> list[str]:
    """`--insecure-dev` where the service has it (a NATS without credentials must be said so)."""
    help_text = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True).stdout
    return ["--insecure-dev"] if "--insecure-dev" in help_text else []


@dataclasses.dataclass
class Service:
    name: str
    process: subprocess.Popen
    port: int


def start_service(name: str, module: str, plane: ControlPlane, logdir: Path, extra: list[str]) -> Service:
    port = free_port()
    # shards talk to NATS only: the kubeconfig is the binder's
    kube = ["--kubeconfig", str(plane.kubeconfig)] if module != "draplane_allocator" else []
    argv = [sys.executable, "-m", module, "--nats", plane.nats_url, *kube,
            "--prefix", PREFIX, "--shards", "1", "--port", str(port), *_insecure_dev_flag(module), *extra]
    out = open(logdir / f"{name}.log", "ab")
    return Service(name, subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT), port)


def stop_service(service: Service) -> None:
    if service.process.poll() is None:
        service.process.send_signal(signal.SIGTERM)
        try:
            service.process.wait(15)
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait()


async def scrape(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    """Sums of the counters this bench follows, from a service's /metrics ({} when unreachable)."""
    try:
        async with session.get(f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("draplane_apiserver_requests_total", "draplane_apiserver_throttled_requests_total",
                               "draplane_binder_pending_published_total", "draplane_allocator_unschedulable_total",
                               "draplane_allocator_placements_total"):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


class PodCounts:
    """Bound pods, and pending ones with PodScheduled=False written, from a watch of the namespace."""

    def __init__(self, kube: KubeClient, namespace: str):
        self.bound: set[str] = set()
        self.unschedulable: set[str] = set()
        self.task = asyncio.create_task(self._run(kube, namespace))

    async def _run(self, kube: KubeClient, namespace: str) -> None:
        async for event in watch_objects(kube, Pod, namespace):
            pod = event.object
            if pod is None:
                continue
            name = pod.metadata.name or ""
            if event.type == "DELETED":
                self.bound.discard(name)
                self.unschedulable.discard(name)
            elif pod.spec.node_name:
                self.bound.add(name)
                self.unschedulable.discard(name)
            elif any(c.type == "PodScheduled" and c.status == "False" for c in (pod.status.conditions if pod.status else None) or ()):
                self.unschedulable.add(name)


@dataclasses.dataclass
class Sample:
    at: float
    rss: dict[str, int]  # component -> KiB
    hwm: dict[str, int]
    pending_stream: int
    results_stream: int
    metrics: dict[str, dict[str, float]]  # service -> counter sums
    bound: int
    unschedulable: int


class Sampler:
    def __init__(self, pids: dict[str, int], services: dict[str, Service], js, subjects: Subjects, counts: PodCounts):
        self.pids = pids
        self.services = services
        self.js = js
        self.subjects = subjects
        self.counts = counts
        self.samples: list[Sample] = []
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run())

    async def _stream_messages(self, stream: str) -> int:
        try:
            return (await self.js.stream_info(stream)).state.messages
        except Exception:  # noqa: BLE001 - not made yet
            return 0

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                started = time.monotonic()
                metrics = dict(zip(self.services, await asyncio.gather(
                    *(scrape(session, s.port) for s in self.services.values()))))
                self.samples.append(Sample(
                    at=time.monotonic(),
                    rss={n: proc_status_kib(p, "VmRSS") for n, p in self.pids.items()},
                    hwm={n: proc_status_kib(p, "VmHWM") for n, p in self.pids.items()},
                    pending_stream=await self._stream_messages(self.subjects.pending_stream),
                    results_stream=await self._stream_messages(self.subjects.results_stream),
                    metrics=metrics, bound=len(self.counts.bound), unschedulable=len(self.counts.unschedulable),
                ))
                await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))

    def add_service(self, service: Service) -> None:
        self.services[service.name] = service
        self.pids[service.name] = service.process.pid

    def stop(self) -> None:
        if self.task:
            self.task.cancel()


def rates(samples: list[Sample], service: str, counter: str) -> tuple[float, float]:
    """Mean and highest per-second rate of a counter over the samples (the highest over 5 s windows)."""
    points = [(s.at, s.metrics.get(service, {}).get(counter)) for s in samples]
    points = [(t, v) for t, v in points if v is not None]
    if len(points) < 2:
        return 0.0, 0.0
    mean = (points[-1][1] - points[0][1]) / max(1e-9, points[-1][0] - points[0][0])
    highest = 0.0
    for i in range(len(points)):
        for j in range(i + 1, len(points)):
            if points[j][0] - points[i][0] >= 5.0:
                highest = max(highest, (points[j][1] - points[i][1]) / (points[j][0] - points[i][0]))
                break
    return mean, highest


def report(name: str, phase: str, samples: list[Sample]) -> str:
    if not samples:
        return f"BENCH name={name} phase={phase} samples=0"
    fields: dict[str, object] = {"seconds": round(samples[-1].at - samples[0].at, 1)}
    for component in ("binder", "shard"):
        if any(component in s.rss for s in samples):
            fields[f"{component}_rss_mb"] = round(max(s.rss.get(component, 0) for s in samples) / 1024, 1)
            fields[f"{component}_hwm_mb"] = round(max(s.hwm.get(component, 0) for s in samples) / 1024, 1)
    for component in ("nats", "apiserver", "etcd"):
        fields[f"{component}_rss_mb"] = round(max(s.rss.get(component, 0) for s in samples) / 1024, 1)
    fields["pending_stream_max"] = max(s.pending_stream for s in samples)
    fields["pending_stream_end"] = samples[-1].pending_stream
    fields["results_stream_max"] = max(s.results_stream for s in samples)
    for service in ("binder", "shard"):
        mean, highest = rates(samples, service, "draplane_apiserver_requests_total")
        if any(service in s.metrics for s in samples):
            fields[f"{service}_req_per_s"] = round(mean, 1)
            fields[f"{service}_req_per_s_max"] = round(highest, 1)
            last = next((s.metrics[service] for s in reversed(samples) if s.metrics.get(service)), {})
            fields[f"{service}_throttled_total"] = int(last.get("draplane_apiserver_throttled_requests_total", 0))
    published, _ = rates(samples, "binder", "draplane_binder_pending_published_total")
    fields["pending_published_per_s"] = round(published, 1)
    fields["bound"] = samples[-1].bound
    fields["unschedulable"] = samples[-1].unschedulable
    return f"BENCH name={name} phase={phase} " + " ".join(f"{k}={v}" for k, v in fields.items())


async def create_objects(kube: KubeClient, namespace: str, pods: int, class_name: str, timeout: float,
                         in_flight: int = 64) -> int:
    """A claim and a pod per index, `in_flight` creates at once; how many pods exist at the end."""
    slots = asyncio.Semaphore(in_flight)
    created = 0
    deadline = time.monotonic() + timeout

    async def one(i: int) -> None:
        nonlocal created
        async with slots:
            if time.monotonic() > deadline:
                return
            name = f"p-{i:05d}"
            await kube.create(scenario.claim(namespace, name, class_name))
            await kube.create(scenario.pod(namespace, name, claim_name=name))
            created += 1
            if created % 2000 == 0:
                log.info("%d pods created", created)

    await asyncio.gather(*(one(i) for i in range(pods)))
    return created


async def run(args) -> int:
    name = f"backpressure_{args.pods}x{args.nodes}x{args.gpus}"
    workdir = Path(tempfile.mkdtemp(prefix="draplane-backpressure-"))
    plane = ControlPlane.start(workdir / "plane")
    manager = controller_manager(plane, workdir / "kube-controller-manager.log", controllers="*,-node-lifecycle-controller")
    manager.start()
    services: dict[str, Service] = {}
    counts = sampler = None
    try:
        kube = await KubeClient.from_kubeconfig(plane.kubeconfig)
        nc = await nats.connect(plane.nats_url)
        js = nc.jetstream()
        tag = uuid.uuid4().hex[:4]
        namespace = f"bp-{tag}"
        await kube.create_namespace(namespace)
        class_name = f"gpu-{tag}"
        await kube.create(scenario.device_class(class_name, 'device.attributes["gpu.nvidia.com"].type == "gpu"'))
        started = time.monotonic()
        await setup_nodes(kube, nc, args.nodes, args.gpus, tag)
        print(f"BENCH name={name}_setup nodes={args.nodes} nodes_s={time.monotonic() - started:.1f}", flush=True)

        binder_args = ["--no-manage-claims"]
        if args.binder_qps is not None:
            binder_args += ["--kube-api-qps", str(args.binder_qps), "--kube-api-burst", str(args.binder_burst)]
        services["binder"] = start_service("binder", "draplane_binder", plane, workdir, binder_args)
        pids = {"apiserver": plane.process("kube-apiserver").pid, "etcd": plane.process("etcd").pid,
                "nats": plane.process("nats-server").pid, "binder": services["binder"].process.pid}
        counts = PodCounts(kube, namespace)
        sampler = Sampler(pids, dict(services), js, Subjects(prefix=PREFIX), counts)
        sampler.start()

        # queued: the pods are created and wait in the shard's work queue
        phase_start = len(sampler.samples)
        started = time.monotonic()
        created = await create_objects(kube, namespace, args.pods, class_name, args.create_timeout)
        create_s = time.monotonic() - started
        print(f"BENCH name={name}_setup pods_created={created} create_s={create_s:.1f} "
              f"creates_per_s={2 * created / create_s:.1f}", flush=True)
        if created < args.pods:
            print(f"the apiserver took {created} of {args.pods} pods (and their claims) in {args.create_timeout:.0f} s; "
                  f"measuring at {created}", flush=True)
        await asyncio.sleep(args.queue_seconds)
        print(report(name, "queued", sampler.samples[phase_start:]), flush=True)

        # drain: a shard places what fits and answers the rest
        phase_start = len(sampler.samples)
        services["shard"] = start_service("shard", "draplane_allocator", plane, workdir, ["--shard-index", "0"])
        sampler.add_service(services["shard"])
        capacity = min(created, args.nodes * args.gpus)
        deadline = time.monotonic() + args.drain_timeout
        progress, progress_at = (0, 0), time.monotonic()
        while len(counts.bound) + len(counts.unschedulable) < created or len(counts.bound) < capacity:
            if (len(counts.bound), len(counts.unschedulable)) != progress:
                progress, progress_at = (len(counts.bound), len(counts.unschedulable)), time.monotonic()
            if time.monotonic() > deadline or time.monotonic() - progress_at > 180:
                print(f"drain: {len(counts.bound)} bound and {len(counts.unschedulable)} marked unschedulable of "
                      f"{created} after {time.monotonic() - deadline + args.drain_timeout:.0f} s "
                      f"(no change for {time.monotonic() - progress_at:.0f} s)", flush=True)
                break
            for service in services.values():
                if service.process.poll() is not None:
                    raise RuntimeError(f"{service.name} exited with {service.process.returncode}; see {workdir}")
            await asyncio.sleep(1.0)
        drained_s = time.monotonic() - (sampler.samples[phase_start].at if len(sampler.samples) > phase_start else time.monotonic())
        print(report(name, "drain", sampler.samples[phase_start:]) + f" pods_per_s={len(counts.bound) / max(1e-9, drained_s):.1f}",
              flush=True)

        # backlog: the unschedulable pods are retried with backoff
        phase_start = len(sampler.samples)
        await asyncio.sleep(args.backlog_seconds)
        print(report(name, "backlog", sampler.samples[phase_start:]), flush=True)
        print(report(name, "all", sampler.samples), flush=True)
        print(f"logs: {workdir}", flush=True)
        await nc.close()
        await kube.close()
        return 0
    finally:
        if sampler:
            sampler.stop()
        if counts:
            counts.task.cancel()
        for service in services.values():
            stop_service(service)
        manager.stop()
        plane.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--pods", type=int, default=20000)
    parser.add_argument("--queue-seconds", type=float, default=75.0,
                        help="how long the backlog waits with no shard (more than the binder's 60 s in-flight backstop)")
    parser.add_argument("--backlog-seconds", type=float, default=60.0)
    parser.add_argument("--create-timeout", type=float, default=1800.0)
    parser.add_argument("--drain-timeout", type=float, default=1800.0)
    parser.add_argument("--binder-qps", type=float, default=None, help="the binder's --kube-api-qps (default: its own)")
    parser.add_argument("--binder-burst", type=int, default=None)
    args = parser.parse_args(argv)
    if args.binder_qps is not None and args.binder_burst is None:
        args.binder_burst = max(1, int(2 * args.binder_qps))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

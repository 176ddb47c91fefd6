"""End to end: pods with template claims to bound pods, through NATS and the real kube-apiserver.

The shape of kube-scheduler's DRA benchmark `SchedulingWithResourceClaimTemplate/5000pods_500nodes`:
500 nodes x 10 devices, 5,000 pods each with a one-device claim template; the first 2,500 pods are
warm-up, the next 2,500 are measured (pods/s from the first measured create to the last measured
bind; create-to-bound latency p50/p99). Every shard count runs on a fresh local control plane with
the binder and each shard as its own process, all on this machine. Then a steady 10 pods/s run
measures latency alone. Then a topology mix: 1-, 2-, 4- and 8-GPU template claims (the 2-GPU one
under one PCIe root, by matchAttribute) on 8-GPU nodes, at 60 % of the GPUs.

    .venv/bin/python bench/e2e.py                       # the full shape (long on 2 cores)
    .venv/bin/python bench/e2e.py --nodes 100 --pods 1000 --warmup 500 --shards 1 2 4
    .venv/bin/python bench/e2e.py --only-topology --mix-nodes 100 --mix-pods 200

Prints `BENCH name=e2e_5000x500 shards=N pods_per_s=... p50_ms=... p99_ms=...` per shard count
(the name carries the shape actually run), `BENCH name=e2e_steady_10pps p50_ms=... p99_ms=...` and
`BENCH name=e2e_topology_mix_<pods>x<nodes> shards=N pods_per_s=... p50_ms=... p99_ms=... gpus=...`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import contextlib
import logging
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nats
from nats.js.api import KeyValueConfig

from draplane.api.core import Node, Pod
from draplane.api.resource import DeviceConstraint
from draplane.kube import KubeClient, watch_objects
from draplane.localenv.controlplane import ControlPlane
from draplane.messages.inventory import SCHEMA_VERSION, FeedEntry, InventoryNames, encode
from draplane.scheduling import scenario

PREFIX = "draplane."
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
# (template, GPUs, share of pods in %): gpu_slice puts two GPUs under each PCIe root
TOPOLOGY_MIX = (("one-gpu", 1, 50), ("two-gpus-one-root", 2, 25), ("four-gpus", 4, 15), ("eight-gpus", 8, 10))


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


async def make_ready(kube: KubeClient, name: str) -> None:
    # no kubelet or node lifecycle controller runs locally: lift the apiserver's not-ready taint
    await kube.patch(Node, name, {"spec": {"taints": None}})


async def setup_nodes(kube: KubeClient, nc, nodes: int, gpus: int, tag: str) -> None:
    js = nc.jetstream()
    names = InventoryNames(prefix=PREFIX)
    try:
        kv = await js.key_value(names.feed_bucket)
    except Exception:  # noqa: BLE001 - not there yet: create it as the inventory service would
        kv = await js.create_key_value(KeyValueConfig(bucket=names.feed_bucket, history=1))

    async def one(i: int) -> None:
        name = f"{tag}-node-{i:04d}"
        await kube.create(scenario.gpu_node(name))
        await make_ready(kube, name)
        key = InventoryNames.node_key(name)
        await kv.put(key, encode(FeedEntry(schema_version=SCHEMA_VERSION, key=key, node=name,
                                           slices=[scenario.gpu_slice(name, gpus, "80Gi")])))

    for start in range(0, nodes, 25):
        await asyncio.gather(*(one(i) for i in range(start, min(nodes, start + 25))))


def start_services(plane: ControlPlane, shards: int, logdir: Path) -> list[subprocess.Popen]:
    common = ["--nats", plane.nats_url, "--kubeconfig", str(plane.kubeconfig), "--prefix", PREFIX,
              "--shards", str(shards), "--port", "0"]
    procs = []
    for i in range(shards):
        log = open(logdir / f"shard-{i}.log", "ab")
        procs.append(subprocess.Popen([sys.executable, "-m", "draplane_allocator", *common, "--shard-index", str(i)],
                                      stdout=log, stderr=subprocess.STDOUT))
    log = open(logdir / "binder.log", "ab")
    procs.append(subprocess.Popen([sys.executable, "-m", "draplane_binder", *common, "--concurrency", "64"],
                                  stdout=log, stderr=subprocess.STDOUT))
    return procs


def stop_services(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class BindRecorder:
    """Watches the namespace's pods and records when each was first seen bound."""

    def __init__(self, kube: KubeClient, namespace: str):
        self.kube = kube
        self.namespace = namespace
        self.bound_at: dict[str, float] = {}
        self.task = asyncio.create_task(self._run())
        self.changed = asyncio.Event()

    async def _run(self) -> None:
        async for event in watch_objects(self.kube, Pod, self.namespace):
            pod = event.object
            if pod is not None and pod.spec.node_name and pod.metadata.name not in self.bound_at:
                self.bound_at[pod.metadata.name] = time.time()
                self.changed.set()

    async def wait_bound(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(n in self.bound_at for n in names):
            if time.monotonic() > deadline:
                missing = [n for n in names if n not in self.bound_at]
                raise TimeoutError(f"{len(missing)} pods not bound after {timeout}s, e.g. {missing[:3]}")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    def stop(self) -> None:
        self.task.cancel()


async def create_pods(kube: KubeClient, namespace: str, names: list[str], created_at: dict[str, float],
                      *, rate: float | None = None, batch: int = 64, templates: dict[str, str] | None = None) -> None:
    async def one(name: str) -> None:
        t = time.time()
        template = (templates or {}).get(name, "one-gpu")
        await kube.create(scenario.pod(namespace, name, template_name=template))
        created_at[name] = t

    if rate is None:
        # `batch` creates in flight at any time, as scheduler_perf's client keeps many: creating in
        # lock-step batches made the benchmark measure its own creation rate, not the scheduler
        slots = asyncio.Semaphore(batch)

        async def limited(name: str) -> None:
            async with slots:
                await one(name)

        await asyncio.gather(*(limited(n) for n in names))
        return
    start = time.monotonic()
    tasks = []
    for i, name in enumerate(names):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(name)))
    await asyncio.gather(*tasks)


def topology_templates(namespace: str, class_name: str) -> list:
    templates = []
    for name, gpus, _ in TOPOLOGY_MIX[1:]:
        template = scenario.claim_template(namespace, name, class_name, count=gpus)
        if name == "two-gpus-one-root":
            template.spec.spec.devices.constraints = [DeviceConstraint(requests=["gpu"], match_attribute=PCIE_ROOT)]
        templates.append(template)
    return templates


async def prepare(plane: ControlPlane, nodes: int, gpus: int):
    kube = await KubeClient.from_kubeconfig(plane.kubeconfig)
    nc = await nats.connect(plane.nats_url)
    tag = uuid.uuid4().hex[:4]
    await setup_nodes(kube, nc, nodes, gpus, tag)
    namespace = f"bench-{tag}"
    await kube.create_namespace(namespace)
    class_name = f"gpu-{tag}"
    await kube.create(scenario.device_class(class_name, 'device.attributes["gpu.nvidia.com"].type == "gpu"'))
    await kube.create(scenario.claim_template(namespace, "one-gpu", class_name))
    for template in topology_templates(namespace, class_name):
        await kube.create(template)
    return kube, nc, namespace


@contextlib.asynccontextmanager
async def running_services(args, shards: int, prefix: str, *, nodes: int | None = None, gpus: int | None = None):
    """A fresh control plane, its nodes and the services, up once a probe pod binds; torn down after.
    Yields the client, the namespace, the bind recorder and the creation times to fill."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    plane = ControlPlane.start(workdir / "plane")
    procs: list[subprocess.Popen] = []
    try:
        kube, nc, namespace = await prepare(plane, nodes or args.nodes, gpus or args.gpus)
        procs = start_services(plane, shards, workdir)
        recorder = BindRecorder(kube, namespace)
        created_at: dict[str, float] = {}
        await create_pods(kube, namespace, ["probe"], created_at)
        await recorder.wait_bound(["probe"], timeout=120)
        try:
            yield kube, namespace, recorder, created_at
        finally:
            recorder.stop()
            await nc.close()
            await kube.close()
    finally:
        stop_services(procs)
        plane.stop()


async def throughput_case(args, shards: int) -> dict:
    async with running_services(args, shards, "draplane-e2e-") as (kube, namespace, recorder, created_at):
        names = [f"p-{i:05d}" for i in range(args.pods - 1)]
        warm, measured = names[: args.warmup - 1], names[args.warmup - 1 :]
        await create_pods(kube, namespace, warm, created_at)
        await recorder.wait_bound(warm, timeout=args.timeout)
        await create_pods(kube, namespace, measured, created_at)
        await recorder.wait_bound(measured, timeout=args.timeout)
        first = min(created_at[n] for n in measured)
        last = max(recorder.bound_at[n] for n in measured)
        latencies = [(recorder.bound_at[n] - created_at[n]) * 1000 for n in measured]
    return {"pods_per_s": len(measured) / (last - first), "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99)}


async def steady_case(args, shards: int) -> dict:
    async with running_services(args, shards, "draplane-e2e-steady-") as (kube, namespace, recorder, created_at):
        names = [f"s-{i:05d}" for i in range(int(args.steady_seconds * 10))]
        await create_pods(kube, namespace, names, created_at, rate=10.0)
        await recorder.wait_bound(names, timeout=args.timeout)
        latencies = [(recorder.bound_at[n] - created_at[n]) * 1000 for n in names]
    return {"p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99)}


async def topology_case(args, shards: int) -> dict:
    """Mixed 1/2/4/8-GPU claims arriving in a random (seeded) order on 8-GPU nodes."""
    rng = random.Random(args.seed)
    names = [f"t-{i:05d}" for i in range(args.mix_pods)]
    weights = [share for _, _, share in TOPOLOGY_MIX]
    templates = {n: rng.choices([t for t, _, _ in TOPOLOGY_MIX], weights)[0] for n in names}
    gpus_of = {t: g for t, g, _ in TOPOLOGY_MIX}
    async with running_services(args, shards, "draplane-e2e-topology-", nodes=args.mix_nodes, gpus=8) as (
        kube, namespace, recorder, created_at,
    ):
        await create_pods(kube, namespace, names, created_at, templates=templates)
        await recorder.wait_bound(names, timeout=args.timeout)
        first = min(created_at[n] for n in names)
        last = max(recorder.bound_at[n] for n in names)
        latencies = [(recorder.bound_at[n] - created_at[n]) * 1000 for n in names]
    return {"pods_per_s": len(names) / (last - first), "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99), "gpus": sum(gpus_of[t] for t in templates.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--gpus", type=int, default=10, help="devices per node")
    parser.add_argument("--pods", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=2500)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steady-seconds", type=float, default=30.0)
    parser.add_argument("--steady-shards", type=int, default=None, help="default: the best throughput shard count")
    parser.add_argument("--skip-steady", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--mix-nodes", type=int, default=200, help="8-GPU nodes of the topology mix")
    parser.add_argument("--mix-pods", type=int, default=400, help="pods of the topology mix (about 60%% of the GPUs)")
    parser.add_argument("--mix-shards", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--skip-topology", action="store_true")
    parser.add_argument("--only-topology", action="store_true")
    args = parser.parse_args(argv)
    if not 0 < args.warmup < args.pods:
        parser.error("--warmup must be between 0 and --pods")
    logging.basicConfig(level=logging.WARNING)
    import uvloop

    uvloop.install()
    name = f"e2e_{args.pods}x{args.nodes}"
    results = {}
    if args.only_topology:
        args.shards, args.skip_steady = [], True
    for shards in args.shards:
        results[shards] = asyncio.run(throughput_case(args, shards))
        r = results[shards]
        print(f"BENCH name={name} shards={shards} pods_per_s={r['pods_per_s']:.1f} "
              f"p50_ms={r['p50_ms']:.0f} p99_ms={r['p99_ms']:.0f}", flush=True)
    if not args.skip_steady:
        best = args.steady_shards or max(results, key=lambda s: results[s]["pods_per_s"])
        r = asyncio.run(steady_case(args, best))
        print(f"BENCH name=e2e_steady_10pps shards={best} p50_ms={r['p50_ms']:.0f} p99_ms={r['p99_ms']:.0f}", flush=True)
    if not args.skip_topology:
        r = asyncio.run(topology_case(args, args.mix_shards))
        print(f"BENCH name=e2e_topology_mix_{args.mix_pods}x{args.mix_nodes} shards={args.mix_shards} "
              f"pods_per_s={r['pods_per_s']:.1f} p50_ms={r['p50_ms']:.0f} p99_ms={r['p99_ms']:.0f} gpus={r['gpus']}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End to end: pods with template claims to bound pods, through NATS and the real kube-apiserver.

The shape of kube-scheduler's DRA benchmark `SchedulingWithResourceClaimTemplate/5000pods_500nodes`:
500 nodes x 10 devices, 5,000 pods each with a one-device claim template; the first 2,500 pods are
warm-up, the next 2,500 are measured (pods/s from the first measured create to the last measured
bind; create-to-bound latency p50/p99). Every shard count runs on a fresh local control plane with
the binder and each shard as its own process, all on this machine. Then steady 10 pods/s runs
measure latency alone (at each `--steady-shards`): one-GPU claims, then the topology mix's claims
on its 8-GPU nodes (`--skip-steady-mix` leaves that out). Then a topology mix: 1-, 2-, 4- and 8-GPU template claims (the 2-GPU one
under one PCIe root, by matchAttribute) on 8-GPU nodes, at 60 % of the GPUs. Those three run in the
`previous` setup. Then the setups, side by side (small by default, a few minutes on 2 cores):

- `previous`: hand-made Node objects (their not-ready taint lifted by us), no
  kube-controller-manager, the binder creates the claims from the templates (manage_claims on);
- `kcm+kwok`: as `draplane up` runs it: kube-controller-manager (its resourceclaim controller
  creates the claims and records them in the pods' status) and KWOK playing the nodes' kubelets
  (Ready, heartbeats, leases, bound pods Running); the binder runs with `--no-manage-claims`.

Each setup runs `--setup-rounds` times on a fresh control plane, the order alternating from round
to round (the machine is shared and noisy). Over the measured pods' window (from the first
measured create to the last measured pod bound, and Running where KWOK runs, and then no pod or
claim write for a second: kube-controller-manager, held to its client's rate, still writes after
that) it reads each component's CPU from /proc/<pid>/stat (utime+stime; every component is its
own process, the bench's own client, which creates the pods and watches them, from
time.process_time()) and the apiserver's writes from the deltas of kube-apiserver's `apiserver_request_total` (create, update, patch, server-side apply
and delete requests, by resource/subresource, whatever their answer); `pod_writes_per_pod` leaves
out the node and lease writes (KWOK's heartbeats), which follow the clock, not the pods. Before
the measured window, `--setup-idle-seconds` with no pod moving gives each component's idle CPU
and writes per second, the part of the per-pod figures that only the window's length makes
(`net_cpu_ms_per_pod`: the CPU per pod less the idle CPU over the window).

    .venv/bin/python bench/e2e.py                       # the full shape (long on 2 cores)
    .venv/bin/python bench/e2e.py --nodes 100 --pods 1000 --warmup 500 --shards 1 2 4
    .venv/bin/python bench/e2e.py --only-topology --mix-nodes 100 --mix-pods 200
    .venv/bin/python bench/e2e.py --shards 1 --nodes 50 --pods 300 --warmup 100 --steady-shards 1 4 --skip-topology --skip-setups
    .venv/bin/python bench/e2e.py --only-setups         # the setups alone
    .venv/bin/python bench/e2e.py --only-setups --setup-nodes 100 --setup-pods 1500 --setup-warmup 500 --setup-rounds 3

Prints `BENCH name=e2e_5000x500 shards=N pods_per_s=... p50_ms=... p99_ms=...` per shard count
(the name carries the shape actually run), `BENCH name=e2e_steady_10pps shards=N p50_ms=... p99_ms=...`,
`BENCH name=e2e_steady_mix_10pps shards=N p50_ms=... p99_ms=...` and
`BENCH name=e2e_topology_mix_<pods>x<nodes> shards=N pods_per_s=... p50_ms=... p99_ms=... gpus=...`.
The setups print, per round and then as the median over the rounds (`round=median`):
`BENCH name=e2e_setups_<pods>x<nodes> setup=S round=R shards=N pods_per_s=... p50_ms=... p99_ms=...
window_s=... cpu_ms_per_pod=... net_cpu_ms_per_pod=... writes_per_pod=... pod_writes_per_pod=...
conflicts_per_pod=...`,
`BENCH name=e2e_setups_<pods>x<nodes>_cpu setup=S round=R <component>=<CPU ms per measured pod> ...`,
`BENCH name=e2e_setups_<pods>x<nodes>_writes setup=S round=R <verb>.<resource>=<writes per measured pod> ...`
and `BENCH name=e2e_setups_<pods>x<nodes>_idle setup=S round=R writes_per_s=... cpu_ms_per_s.<component>=...`,
then a side-by-side table of the medians. kube-controller-manager runs with the client limits
`draplane up` gives it (`--kube-api-qps` 100, burst 150) unless `--kcm-api-qps` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import re
import shutil
import signal
import statistics
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
from draplane.localenv import binaries
from draplane.localenv.controllermanager import controller_manager
from draplane.localenv.controlplane import ControlPlane
from draplane.localenv.kwok import KWOK_ANNOTATION, kwok_arguments
from draplane.localenv.processes import ServerProcess
from draplane.messages.inventory import SCHEMA_VERSION, FeedEntry, InventoryNames, encode
from draplane.simulation import scenario

PREFIX = "draplane."
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
# (template, GPUs, share of pods in %): gpu_slice puts two GPUs under each PCIe root
TOPOLOGY_MIX = (("one-gpu", 1, 50), ("two-gpus-one-root", 2, 25), ("four-gpus", 4, 15), ("eight-gpus", 8, 10))
PREVIOUS, KCM_KWOK = "previous", "kcm+kwok"
SETUPS = (PREVIOUS, KCM_KWOK)
# apiserver_request_total's verb label (the HTTP method; APPLY a server-side apply patch) -> the API verb
WRITE_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "APPLY": "apply", "DELETE": "delete",
               "DELETECOLLECTION": "deletecollection"}


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


async def make_ready(kube: KubeClient, name: str) -> None:
    # no kubelet or node lifecycle controller runs locally: lift the apiserver's not-ready taint
    await kube.patch(Node, name, {"spec": {"taints": None}})


async def register_kwok_node(kube: KubeClient, name: str) -> None:
    """As `draplane up` registers a node (environment._register_node): annotated for KWOK, which
    keeps it Ready from then on, its Ready status written once as a kubelet's first report, and the
    not-ready taint of its admission lifted."""
    node = scenario.gpu_node(name)
    node.metadata.annotations = {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"}
    await kube.create(node)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    await kube.patch(Node, name, {"status": {"conditions": [{
        "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated by bench/e2e.py",
        "lastHeartbeatTime": now, "lastTransitionTime": now}]}}, subresource="status")
    await make_ready(kube, name)


async def setup_nodes(kube: KubeClient, nc, nodes: int, gpus: int, tag: str, *, kwok: bool = False) -> None:
    js = nc.jetstream()
    names = InventoryNames(prefix=PREFIX)
    try:
        kv = await js.key_value(names.feed_bucket)
    except Exception:  # noqa: BLE001 - not there yet: create it as the inventory service would
        kv = await js.create_key_value(KeyValueConfig(bucket=names.feed_bucket, history=1))

    async def one(i: int) -> None:
        name = f"{tag}-node-{i:04d}"
        if kwok:
            await register_kwok_node(kube, name)
        else:
            await kube.create(scenario.gpu_node(name))
            await make_ready(kube, name)
        key = InventoryNames.node_key(name)
        await kv.put(key, encode(FeedEntry(schema_version=SCHEMA_VERSION, key=key, node=name,
                                           slices=[scenario.gpu_slice(name, gpus, "80Gi")])))

    for start in range(0, nodes, 25):
        await asyncio.gather(*(one(i) for i in range(start, min(nodes, start + 25))))


def start_services(plane: ControlPlane, shards: int, logdir: Path, *, manage_claims: bool = True,
                   follower: bool = False, binder_args: tuple[str, ...] = ()) -> dict[str, subprocess.Popen]:
    """The shards and the binder, by component name. With `follower`, one more shard process
    (component `follower`) that keeps the whole state as every shard does but is handed no pod:
    the binder deals pods over `shards` partitions and it takes partition `shards`. Its CPU is what
    following the others' work costs one shard."""
    # The benchmark's own NATS takes any client (no auth config): said explicitly.
    connect = ["--nats", plane.nats_url, "--insecure-dev", "--prefix", PREFIX, "--port", "0"]
    common = [*connect, "--shards", str(shards)]
    procs = {}
    for i in range(shards):
        log = open(logdir / f"shard-{i}.log", "ab")
        procs[f"shard-{i}"] = subprocess.Popen([sys.executable, "-m", "draplane_allocator", *common, "--shard-index", str(i)],
                                               stdout=log, stderr=subprocess.STDOUT)
    if follower:
        log = open(logdir / "follower.log", "ab")
        procs["follower"] = subprocess.Popen([sys.executable, "-m", "draplane_allocator", *connect, "--shards", str(shards + 1),
                                              "--shard-index", str(shards)], stdout=log, stderr=subprocess.STDOUT)
    log = open(logdir / "binder.log", "ab")
    # said either way: the binder's default has changed before
    procs["binder"] = subprocess.Popen([sys.executable, "-m", "draplane_binder", *common, "--kubeconfig",
                                        str(plane.kubeconfig), "--concurrency", "64",
                                        "--manage-claims" if manage_claims else "--no-manage-claims", *binder_args],
                                       stdout=log, stderr=subprocess.STDOUT)
    return procs


def start_kcm_and_kwok(plane: ControlPlane, logdir: Path, kcm_api_qps: float | None) -> list[ServerProcess]:
    """KWOK and kube-controller-manager as `draplane up` starts them (environment.start)."""
    kwok = ServerProcess("kwok", [str(binaries.require(binaries.KWOK)), *kwok_arguments(plane.kubeconfig, logdir / "kwok.yaml")],
                         logdir / "kwok.log")
    manager = controller_manager(plane, logdir / "kube-controller-manager.log")
    if kcm_api_qps:
        manager.argv += [f"--kube-api-qps={kcm_api_qps:g}", f"--kube-api-burst={int(kcm_api_qps * 1.5)}"]
    started = []
    try:
        for process in (kwok, manager):
            process.start()
            started.append(process)
    except BaseException:
        for process in started:
            process.stop()
        raise
    return started


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
    """Watches the namespace's pods and records when each was first seen bound, and Running (which
    only KWOK, playing the kubelet, makes them)."""

    def __init__(self, kube: KubeClient, namespace: str):
        self.kube = kube
        self.namespace = namespace
        self.bound_at: dict[str, float] = {}
        self.running_at: dict[str, float] = {}
        self.task = asyncio.create_task(self._run())
        self.changed = asyncio.Event()

    async def _run(self) -> None:
        async for event in watch_objects(self.kube, Pod, self.namespace):
            pod = event.object
            if pod is None:
                continue
            name = pod.metadata.name
            if pod.spec.node_name and name not in self.bound_at:
                self.bound_at[name] = time.time()
                self.changed.set()
            if pod.status is not None and pod.status.phase == "Running" and name not in self.running_at:
                self.running_at[name] = time.time()
                self.changed.set()

    async def wait_bound(self, names: list[str], timeout: float, *, running: bool = False) -> None:
        """Until every pod is bound (and Running, with `running`)."""
        seen = self.running_at if running else self.bound_at
        what = "Running" if running else "bound"
        deadline = time.monotonic() + timeout
        while not all(n in seen for n in names):
            if time.monotonic() > deadline:
                missing = [n for n in names if n not in seen]
                raise TimeoutError(f"{len(missing)} pods not {what} after {timeout}s, e.g. {missing[:3]}")
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


async def prepare(plane: ControlPlane, nodes: int, gpus: int, *, kwok: bool = False):
    kube = await KubeClient.from_kubeconfig(plane.kubeconfig)
    nc = await nats.connect(plane.nats_url)
    tag = uuid.uuid4().hex[:4]
    await setup_nodes(kube, nc, nodes, gpus, tag, kwok=kwok)
    namespace = f"bench-{tag}"
    await kube.create_namespace(namespace)
    class_name = f"gpu-{tag}"
    await kube.create(scenario.device_class(class_name, 'device.attributes["gpu.nvidia.com"].type == "gpu"'))
    await kube.create(scenario.claim_template(namespace, "one-gpu", class_name))
    for template in topology_templates(namespace, class_name):
        await kube.create(template)
    return kube, nc, namespace


# --- what the components cost -------------------------------------------------------------------

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def apiserver_writes(metrics: str) -> tuple[dict[str, float], float]:
    """(writes by `verb.resource[/subresource]`, writes answered 409) from kube-apiserver's
    `apiserver_request_total` counters."""
    writes: dict[str, float] = {}
    conflicts = 0.0
    for line in metrics.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels_text, _, value = line[len("apiserver_request_total{"):].rpartition("} ")
        labels = dict(_LABEL_RE.findall(labels_text))
        if labels.get("verb") not in WRITE_VERBS:
            continue
        resource = labels.get("resource", "")
        if labels.get("subresource"):
            resource += "/" + labels["subresource"]
        key = f"{WRITE_VERBS[labels['verb']]}.{resource}"
        writes[key] = writes.get(key, 0.0) + float(value)
        if labels.get("code") == "409":
            conflicts += float(value)
    return writes, conflicts


@dataclasses.dataclass
class Sample:
    cpu: dict[str, float]  # component -> CPU seconds so far
    writes: dict[str, float]
    conflicts: float
    at: float


async def sample(kube: KubeClient, components: dict[str, int]) -> Sample:
    at = time.time()
    cpu = {name: process_cpu_seconds(pid) for name, pid in components.items()}
    cpu["bench"] = time.process_time()  # this process: the pods' creation and the watch
    metrics = (await kube.request("GET", "/metrics", headers={"Accept": "text/plain"})).decode()
    writes, conflicts = apiserver_writes(metrics)
    return Sample(cpu, writes, conflicts, at)


async def settle(kube: KubeClient, *, quiet: float = 1.0, limit: float = 30.0) -> None:
    """Until no pod or claim write reaches the apiserver for `quiet` seconds (at most `limit`): a
    controller behind its client's rate limit (kube-controller-manager's) still writes for pods
    that are bound and Running already."""
    deadline = time.monotonic() + limit
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        metrics = (await kube.request("GET", "/metrics", headers={"Accept": "text/plain"})).decode()
        writes, _ = apiserver_writes(metrics)
        total = sum(v for k, v in writes.items() if not node_write(k))
        if total != last:
            last, since = total, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        await asyncio.sleep(0.5)  # each scrape costs the apiserver CPU, counted in the window


def per_second(before: Sample, after: Sample) -> dict:
    """CPU ms and apiserver writes per second between two samples."""
    seconds = after.at - before.at
    return {"cpu_ms": {name: (after.cpu[name] - before.cpu[name]) * 1000 / seconds for name in after.cpu},
            "writes": {key: (after.writes[key] - before.writes.get(key, 0.0)) / seconds
                       for key in sorted(after.writes) if after.writes[key] > before.writes.get(key, 0.0)}}


def node_write(key: str) -> bool:
    """Writes that follow the nodes and the clock (KWOK's node heartbeats and leases), not the pods."""
    resource = key.split(".", 1)[1]
    return resource.startswith("nodes") or resource == "leases"


def per_pod(before: Sample, after: Sample, pods: int) -> dict:
    """CPU ms and apiserver writes per pod between two samples."""
    cpu = {name: (after.cpu[name] - before.cpu[name]) * 1000 / pods for name in after.cpu}
    writes = {key: (after.writes[key] - before.writes.get(key, 0.0)) / pods for key in after.writes}
    writes = {key: value for key, value in sorted(writes.items()) if value > 0}
    return {"cpu_ms": cpu, "writes": writes, "conflicts": (after.conflicts - before.conflicts) / pods,
            "window_s": after.at - before.at}


# --- the cases -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    """One fresh control plane with its nodes and services, as a case sees it."""

    kube: KubeClient
    namespace: str
    recorder: BindRecorder
    created_at: dict[str, float]
    setup: str
    components: dict[str, int]  # component -> pid, for its CPU

    @property
    def kwok(self) -> bool:
        return self.setup == KCM_KWOK


@contextlib.asynccontextmanager
async def running_services(args, shards: int, prefix: str, *, nodes: int | None = None, gpus: int | None = None,
                           setup: str = PREVIOUS):
    """A fresh control plane, its nodes and the services, up once a probe pod binds (and runs,
    where KWOK runs); torn down after. Yields a Run, with the creation times to fill."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    plane = ControlPlane.start(workdir / "plane")
    procs: dict[str, subprocess.Popen] = {}
    servers: list[ServerProcess] = []
    failed = True
    try:
        kwok = setup == KCM_KWOK
        if kwok:
            servers = start_kcm_and_kwok(plane, workdir, getattr(args, "kcm_api_qps", None))
        kube, nc, namespace = await prepare(plane, nodes or args.nodes, gpus or args.gpus, kwok=kwok)
        procs = start_services(plane, shards, workdir, manage_claims=not kwok, follower=getattr(args, "follower", False),
                               binder_args=tuple(getattr(args, "binder_args", ())))
        components = {"etcd": plane.process("etcd").pid, "kube-apiserver": plane.process("kube-apiserver").pid,
                      "nats": plane.process("nats-server").pid}
        components.update({server.name: server.pid for server in servers})
        components.update({name: p.pid for name, p in procs.items()})
        recorder = BindRecorder(kube, namespace)
        created_at: dict[str, float] = {}
        await create_pods(kube, namespace, ["probe"], created_at)
        await recorder.wait_bound(["probe"], timeout=120, running=kwok)
        try:
            yield Run(kube, namespace, recorder, created_at, setup, components)
        finally:
            recorder.stop()
            await nc.close()
            await kube.close()
        failed = False
    finally:
        stop_services(list(procs.values()))
        for server in servers:
            server.terminate()
        for server in servers:
            server.stop()
        plane.stop()
        if failed:
            print(f"# the run failed; its servers' and services' logs are in {workdir}", file=sys.stderr, flush=True)
        elif getattr(args, "keep", False):
            print(f"# logs kept in {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)  # etcd's data alone is 80-100 MB a run


async def measured_throughput(run: Run, pods: int, warmup: int, timeout: float, *, idle_seconds: float = 0.0,
                              settled: bool = False) -> dict:
    """Warm-up pods bound (and Running, where KWOK runs), then the measured ones: pods/s from the
    first measured create to the last measured bind, create-to-bound latencies, and what the
    components spent over the measured window (to the last measured pod bound, or Running, and
    with `settled` the pods' writes settled, before and after). With `idle_seconds`, first what
    they spend per second with no pod to handle."""
    names = [f"p-{i:05d}" for i in range(pods - 1)]  # the probe pod was the first
    warm, measured = names[: warmup - 1], names[warmup - 1 :]
    await create_pods(run.kube, run.namespace, warm, run.created_at)
    await run.recorder.wait_bound(warm, timeout=timeout, running=run.kwok)
    if settled:
        await settle(run.kube)
    idle = None
    if idle_seconds > 0:
        start = await sample(run.kube, run.components)
        await asyncio.sleep(idle_seconds)
        idle = per_second(start, await sample(run.kube, run.components))
    before = await sample(run.kube, run.components)
    await create_pods(run.kube, run.namespace, measured, run.created_at)
    await run.recorder.wait_bound(measured, timeout=timeout)
    if run.kwok:
        await run.recorder.wait_bound(measured, timeout=timeout, running=True)
    if settled:
        await settle(run.kube)
    after = await sample(run.kube, run.components)
    first = min(run.created_at[n] for n in measured)
    last = max(run.recorder.bound_at[n] for n in measured)
    latencies = [(run.recorder.bound_at[n] - run.created_at[n]) * 1000 for n in measured]
    return {"pods_per_s": len(measured) / (last - first), "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99), "measured": len(measured), "idle": idle,
            **per_pod(before, after, len(measured))}


async def throughput_case(args, shards: int) -> dict:
    async with running_services(args, shards, "draplane-e2e-") as run:
        return await measured_throughput(run, args.pods, args.warmup, args.timeout)


async def setup_case(args, setup: str) -> dict:
    async with running_services(args, args.setup_shards, "draplane-e2e-setup-", nodes=args.setup_nodes,
                                gpus=args.gpus, setup=setup) as run:
        return await measured_throughput(run, args.setup_pods, args.setup_warmup, args.timeout,
                                         idle_seconds=args.setup_idle_seconds, settled=True)


def mix_templates(names: list[str], seed: int) -> dict[str, str]:
    """Each pod's claim template, drawn from TOPOLOGY_MIX by its shares in a seeded random order."""
    rng = random.Random(seed)
    weights = [share for _, _, share in TOPOLOGY_MIX]
    return {n: rng.choices([t for t, _, _ in TOPOLOGY_MIX], weights)[0] for n in names}


async def steady_case(args, shards: int, *, mix: bool = False) -> dict:
    """Pods created at 10 pods/s, each bound long before the next comes: the latency a pod sees on
    a quiet cluster. With `mix`, the topology mix's claims (1-8 GPUs, in a seeded random order)
    on its 8-GPU nodes instead of one GPU each."""
    names = [f"s-{i:05d}" for i in range(int(args.steady_seconds * 10))]
    templates, shape = None, {}
    if mix:
        templates, shape = mix_templates(names, args.seed), {"nodes": args.mix_nodes, "gpus": 8}
    async with running_services(args, shards, "draplane-e2e-steady-", **shape) as run:
        await create_pods(run.kube, run.namespace, names, run.created_at, rate=10.0, templates=templates)
        await run.recorder.wait_bound(names, timeout=args.timeout)
        latencies = [(run.recorder.bound_at[n] - run.created_at[n]) * 1000 for n in names]
    return {"p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99)}


async def topology_case(args, shards: int) -> dict:
    """Mixed 1/2/4/8-GPU claims arriving in a random (seeded) order on 8-GPU nodes."""
    names = [f"t-{i:05d}" for i in range(args.mix_pods)]
    templates = mix_templates(names, args.seed)
    gpus_of = {t: g for t, g, _ in TOPOLOGY_MIX}
    async with running_services(args, shards, "draplane-e2e-topology-", nodes=args.mix_nodes, gpus=8) as run:
        await create_pods(run.kube, run.namespace, names, run.created_at, templates=templates)
        await run.recorder.wait_bound(names, timeout=args.timeout)
        first = min(run.created_at[n] for n in names)
        last = max(run.recorder.bound_at[n] for n in names)
        latencies = [(run.recorder.bound_at[n] - run.created_at[n]) * 1000 for n in names]
    return {"pods_per_s": len(names) / (last - first), "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99), "gpus": sum(gpus_of[t] for t in templates.values())}


def system_cpu(cpu: dict[str, float]) -> float:
    """The components' CPU summed, the `--follower` shard left out: it only looks on."""
    return sum(v for k, v in cpu.items() if k != "follower")


def net_cpu_ms_per_pod(r: dict) -> float | None:
    """CPU per pod less what the components spend idle over the same window (None: no idle figure)."""
    if not r.get("idle"):
        return None
    return system_cpu(r["cpu_ms"]) - system_cpu(r["idle"]["cpu_ms"]) * r["window_s"] / r["measured"]


def setup_lines(name: str, setup: str, round_: str, shards: int, r: dict) -> list[str]:
    cpu, writes = r["cpu_ms"], r["writes"]
    pod_writes = sum(v for k, v in writes.items() if not node_write(k))
    net = net_cpu_ms_per_pod(r)
    tag = f"setup={setup} round={round_}"
    lines = [
        f"BENCH name={name} {tag} shards={shards} pods_per_s={r['pods_per_s']:.1f} p50_ms={r['p50_ms']:.0f} "
        f"p99_ms={r['p99_ms']:.0f} window_s={r['window_s']:.1f} cpu_ms_per_pod={system_cpu(cpu):.2f} "
        + (f"net_cpu_ms_per_pod={net:.2f} " if net is not None else "")
        + f"writes_per_pod={sum(writes.values()):.2f} pod_writes_per_pod={pod_writes:.2f} "
        f"conflicts_per_pod={r['conflicts']:.3f}",
        f"BENCH name={name}_cpu {tag} " + " ".join(f"{k}={v:.2f}" for k, v in cpu.items()),
        f"BENCH name={name}_writes {tag} " + " ".join(f"{k}={v:.3f}" for k, v in writes.items()),
    ]
    if r.get("idle"):
        idle = r["idle"]
        lines.append(f"BENCH name={name}_idle {tag} writes_per_s={sum(idle['writes'].values()):.2f} "
                     + " ".join(f"cpu_ms_per_s.{k}={v:.1f}" for k, v in idle["cpu_ms"].items()))
    return lines


def median_result(results: list[dict]) -> dict:
    """Each figure's median over the rounds (a key missing from a round counts as 0 there)."""
    def med(get) -> float:
        return statistics.median(get(r) for r in results)

    scalar = {k: med(lambda r, k=k: r[k]) for k in ("pods_per_s", "p50_ms", "p99_ms", "window_s", "conflicts", "measured")}

    def med_dict(get) -> dict[str, float]:
        keys = list(dict.fromkeys(k for r in results for k in get(r)))
        return {k: med(lambda r, k=k: get(r).get(k, 0.0)) for k in keys}

    result = {**scalar, "cpu_ms": med_dict(lambda r: r["cpu_ms"]),
              "writes": dict(sorted(med_dict(lambda r: r["writes"]).items())), "idle": None}
    if all(r.get("idle") for r in results):
        result["idle"] = {"cpu_ms": med_dict(lambda r: r["idle"]["cpu_ms"]),
                          "writes": dict(sorted(med_dict(lambda r: r["idle"]["writes"]).items()))}
    return result


def side_by_side(medians: dict[str, dict]) -> str:
    setups = list(medians)
    rows = [("pods/s", "pods_per_s", "{:.1f}"), ("create-to-bound p50 ms", "p50_ms", "{:.0f}"),
            ("create-to-bound p99 ms", "p99_ms", "{:.0f}")]
    lines = [f"{'':34}" + "".join(f"{s:>14}" for s in setups)]
    for label, key, fmt in rows:
        lines.append(f"{label:34}" + "".join(f"{fmt.format(medians[s][key]):>14}" for s in setups))

    def block(title: str, tables: dict[str, dict[str, float]], fmt: str) -> None:
        keys = list(dict.fromkeys(k for table in tables.values() for k in table))
        lines.append(title)
        for k in keys:
            lines.append(f"  {k:32}" + "".join(
                f"{fmt.format(tables[s][k]) if k in tables[s] else '-':>14}" for s in setups))
        lines.append(f"  {'total':32}" + "".join(f"{fmt.format(sum(tables[s].values())):>14}" for s in setups))

    block("CPU ms per measured pod", {s: medians[s]["cpu_ms"] for s in setups}, "{:.2f}")
    if all(medians[s]["idle"] for s in setups):
        lines.append(f"  {'total less idle over the window':32}"
                     + "".join(f"{net_cpu_ms_per_pod(medians[s]):>14.2f}" for s in setups))
    block("apiserver writes per measured pod", {s: medians[s]["writes"] for s in setups}, "{:.3f}")
    if all(medians[s]["idle"] for s in setups):
        block("idle (no pod moving): CPU ms per second", {s: medians[s]["idle"]["cpu_ms"] for s in setups}, "{:.1f}")
        block("idle: apiserver writes per second", {s: medians[s]["idle"]["writes"] for s in setups}, "{:.2f}")
    return "\n".join(lines)


def run_setups(args) -> None:
    name = f"e2e_setups_{args.setup_pods}x{args.setup_nodes}"
    results: dict[str, list[dict]] = {s: [] for s in args.setups}
    for round_ in range(args.setup_rounds):
        # alternate the order, so that neither setup always runs on the machine's quieter side
        order = args.setups if round_ % 2 == 0 else list(reversed(args.setups))
        for setup in order:
            r = asyncio.run(setup_case(args, setup))
            results[setup].append(r)
            for line in setup_lines(name, setup, str(round_ + 1), args.setup_shards, r):
                print(line, flush=True)
    medians = {setup: median_result(rs) for setup, rs in results.items()}
    for setup, r in medians.items():
        for line in setup_lines(name, setup, "median", args.setup_shards, r):
            print(line, flush=True)
    print(f"\n{name}: medians over {args.setup_rounds} round(s), {args.setup_shards} shard(s)\n"
          + side_by_side(medians), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--gpus", type=int, default=10, help="devices per node")
    parser.add_argument("--pods", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=2500)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steady-seconds", type=float, default=30.0)
    parser.add_argument("--steady-shards", type=int, nargs="+", default=None,
                        help="shard counts of the steady runs, each its own run (default: the best throughput shard count)")
    parser.add_argument("--skip-steady", action="store_true")
    parser.add_argument("--skip-steady-mix", action="store_true",
                        help="no steady run of the topology mix's claims (on --mix-nodes 8-GPU nodes)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--mix-nodes", type=int, default=200, help="8-GPU nodes of the topology mix")
    parser.add_argument("--mix-pods", type=int, default=400, help="pods of the topology mix (about 60%% of the GPUs)")
    parser.add_argument("--mix-shards", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--skip-topology", action="store_true")
    parser.add_argument("--only-topology", action="store_true")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS),
                        help="the setups compared side by side (default: both)")
    parser.add_argument("--setup-nodes", type=int, default=60, help="nodes of the setup comparison")
    parser.add_argument("--setup-pods", type=int, default=600, help="pods of the setup comparison, warm-up included")
    parser.add_argument("--setup-warmup", type=int, default=200)
    parser.add_argument("--setup-shards", type=int, default=1)
    parser.add_argument("--setup-rounds", type=int, default=2, help="runs of each setup, alternating their order")
    parser.add_argument("--setup-idle-seconds", type=float, default=5.0,
                        help="after the warm-up, measure each component's CPU with no pod moving this long (0: skip)")
    parser.add_argument("--kcm-api-qps", type=float, default=None,
                        help="kube-controller-manager's --kube-api-qps (burst 1.5x) in kcm+kwok; default: "
                             "100, burst 150, as draplane up runs it")
    parser.add_argument("--skip-setups", action="store_true")
    parser.add_argument("--follower", action="store_true",
                        help="one more shard process, handed no pod: its CPU (component `follower`) is what following costs a shard")
    parser.add_argument("--keep", action="store_true", help="keep each run's servers' and services' logs (a failed run's are kept anyway)")
    parser.add_argument("--only-setups", action="store_true")
    args = parser.parse_args(argv)
    if not 0 < args.warmup < args.pods:
        parser.error("--warmup must be between 0 and --pods")
    if not 0 < args.setup_warmup < args.setup_pods:
        parser.error("--setup-warmup must be between 0 and --setup-pods")
    # every pod takes one device and waits for it: more pods than devices would never finish
    if args.pods > args.nodes * args.gpus:
        parser.error("--pods must be at most --nodes x --gpus")
    if args.setup_pods > args.setup_nodes * args.gpus:
        parser.error("--setup-pods must be at most --setup-nodes x --gpus")
    if args.only_setups and args.only_topology:
        parser.error("--only-setups and --only-topology exclude each other")
    logging.basicConfig(level=logging.WARNING)
    import uvloop

    uvloop.install()
    name = f"e2e_{args.pods}x{args.nodes}"
    results = {}
    if args.only_topology:
        args.shards, args.skip_steady, args.skip_setups = [], True, True
    if args.only_setups:
        args.shards, args.skip_steady, args.skip_topology = [], True, True
    for shards in args.shards:
        results[shards] = asyncio.run(throughput_case(args, shards))
        r = results[shards]
        print(f"BENCH name={name} shards={shards} pods_per_s={r['pods_per_s']:.1f} "
              f"p50_ms={r['p50_ms']:.0f} p99_ms={r['p99_ms']:.0f}", flush=True)
    if not args.skip_steady:
        steady_shards = args.steady_shards or [max(results, key=lambda s: results[s]["pods_per_s"])]
        for mix in (False, True) if not args.skip_steady_mix else (False,):
            for shards in steady_shards:
                r = asyncio.run(steady_case(args, shards, mix=mix))
                print(f"BENCH name=e2e_steady_{'mix_' if mix else ''}10pps shards={shards} p50_ms={r['p50_ms']:.0f} "
                      f"p99_ms={r['p99_ms']:.0f}", flush=True)
    if not args.skip_topology:
        r = asyncio.run(topology_case(args, args.mix_shards))
        print(f"BENCH name=e2e_topology_mix_{args.mix_pods}x{args.mix_nodes} shards={args.mix_shards} "
              f"pods_per_s={r['pods_per_s']:.1f} p50_ms={r['p50_ms']:.0f} p99_ms={r['p99_ms']:.0f} gpus={r['gpus']}",
              flush=True)
    if not args.skip_setups:
        run_setups(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

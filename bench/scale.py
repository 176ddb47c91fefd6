"""Scale: 5,000 nodes x 8 GPUs and 50,000 pending pods, the allocator shard tier on NATS alone.

Everything is a real process on this machine: etcd, kube-apiserver and nats-server
(draplane.localenv.controlplane), the inventory service, one node-agent process simulating every
node, the binder and the allocator shards. Phases, in order:

1. Inventory (`scale_inventory`): the Node objects are registered as `draplane up` registers
   them, then the inventory service and the node-agent fleet (`--profile`, a copy of the shipped
   dgx-h100 profile with `--gpus-per-node` GPUs and no NICs) start; `load_s` runs from the
   fleet's start until the inventory has written every node's ResourceSlice and feed entry (then
   checked by listing the slices: `devices` is what the apiserver holds). Both stop after it: the
   slices stay in the apiserver and the feed in NATS, and the inventory stops first so that no
   node is tainted for going silent.
2. Pods (`scale_apiserver`): `--pods` pods, each with its own ResourceClaim, created with
   `--create-concurrency` pods in flight (claim, then pod). The claims' mix: `--mix` (GPUs:share)
   for as many pods as ask at most `--fill` of the GPUs; each pod beyond those is a monitoring pod
   whose one-GPU claim has adminAccess, which Kubernetes' allocator (and draplane's) gives a
   device without taking it. 50,000 pods of one GPU or more cannot fit 40,000 GPUs, and a pod
   that fits nowhere costs a shard a search of every node and a 1.2 MB Unschedulable (measured
   offline on a full 5,000-node state: 123 ms each), which would measure that, not placing. At
   the defaults: 20,000 GPU pods asking 36,000 GPUs (70/15/10/5 % of 1/2/4/8 GPUs), 30,000
   monitoring pods. Creation stops early when its rate falls below `--min-create-rate` over 30 s,
   when etcd + kube-apiserver pass `--apiserver-rss-limit-gb`, or when the machine's available
   memory falls below 6 GB; `stopped_because` says which, and the shard tier runs on what was made.
3. Binder (`scale_binder`): the real binder process with `--shards 1` publishes the cluster
   bucket (classes, nodes, every claim) and a PendingPod per pod, and is stopped once the pending
   stream holds them all; the bucket stays on NATS. The bench reads the PendingPods back. Then
   kube-apiserver and etcd are stopped: the shard tier runs on NATS alone.
4. Shard tier (`scale_shards`), for each `--shards` S on the same NATS: the pending and results
   streams and the reservation bucket are deleted and made again, the PendingPods published again
   to `pending.<shard_for(partition_key, S)>` (what a binder with `--shards S` does), then S shard
   processes start (`draplane_allocator --shards S --shard-index i`, lease `--lease-seconds`:
   no binder confirms anything here, and a lapsed lease would give the devices out again).
   `cold_start_s` is process start to /readyz OK (the state rebuilt from the inventory feed, the
   cluster bucket and the reservation bucket), the slowest shard's; `ready_rss_mb` the largest
   VmRSS then. The bench drains the results stream itself (a durable pull consumer acking every
   Placement and Unschedulable), standing in for the binder so that the shards' back-pressure (they
   wait while 128 results are unread) does not measure the binder. `placements_per_s` is
   Placements over the time from the first result to the last, `conflicts_per_placement` the
   shards' `draplane_allocator_reservation_conflicts_total` (both kinds) over the Placements,
   `peak_rss_mb` the largest VmHWM of a shard process, `shard_cpu_ms_per_placement` the shards'
   utime+stime from ready to the end over the Placements, and `double_allocated` the devices
   (adminAccess results aside) that two Placements were given (must be 0). With `--tier-seconds`
   a tier stops that long after its first answer (`stopped=time_limit`, `unanswered` pods left).

The machine's available memory is watched throughout: below 4 GB the run is stopped.

    flock /tmp/draplane-bench.lock .venv/bin/python bench/scale.py
    flock /tmp/draplane-bench.lock .venv/bin/python bench/scale.py --tier-seconds 300
    flock /tmp/draplane-bench.lock .venv/bin/python bench/scale.py --nodes 200 --pods 2000 --shards 1 2

Prints `BENCH name=scale_inventory nodes=... devices=... feed_nodes=... nodes_s=... load_s=...`,
`BENCH name=scale_apiserver pods_created=... gpu_pods=... monitor_pods=... gpus_asked=... create_s=...
pods_per_s=... apiserver_rss_mb=... etcd_rss_mb=... stopped_because=...`,
`BENCH name=scale_binder published=... publish_s=... peak_rss_mb=...` and per shard count
`BENCH name=scale_shards shards=S pods=... placements=... placements_per_s=... unschedulable=...
unanswered=... repeated=... conflicts_per_placement=... peak_rss_mb=... ready_rss_mb=... cold_start_s=...
window_s=... shard_cpu_ms_per_placement=... double_allocated=... stopped=...`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import yaml

PREFIX = "scale."
SCHEDULER_NAME = "draplane-scale"
NODE_PREFIX = "scale"
NAMESPACE = "scale"
GPU_CLASS = "gpu.nvidia.com"
DEFAULT_MIX = "1:70,2:15,4:10,8:5"
ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"
CONFLICTS_METRIC = "draplane_allocator_reservation_conflicts"
# A size of 0 in a claim plan: a monitoring pod, one GPU with adminAccess (takes no device).
MONITOR = 0
# Below this the run is stopped; below STOP_CREATING_GB no more pods are created.
MIN_AVAILABLE_GB = 4.0
STOP_CREATING_GB = 6.0
RATE_WINDOW_SECONDS = 30.0


# --- the pure part: the claim mix, and what the processes report -------------------------------------

def parse_mix(text: str) -> tuple[tuple[int, float], ...]:
    """`1:70,2:15` -> ((1, 70.0), (2, 15.0)): GPUs per claim and their share of the GPU pods."""
    mix = []
    for part in text.split(","):
        size, sep, share = part.partition(":")
        try:
            if not sep:
                raise ValueError
            item = (int(size), float(share))
        except ValueError:
            raise ValueError(f"--mix: {part!r} is not GPUS:SHARE (e.g. 1:70)") from None
        if item[0] < 1 or item[1] <= 0:
            raise ValueError(f"--mix: {part!r}: GPUs must be at least 1 and the share above 0")
        mix.append(item)
    if len({size for size, _ in mix}) != len(mix):
        raise ValueError(f"--mix: {text!r} names a size twice")
    return tuple(mix)


def deal(count: int, mix: tuple[tuple[int, float], ...]) -> dict[int, int]:
    """`count` pods shared out by the mix's shares, largest remainder first: size -> pods."""
    total = sum(share for _, share in mix)
    exact = [(size, count * share / total) for size, share in mix]
    dealt = {size: int(x) for size, x in exact}
    left = count - sum(dealt.values())
    for size, x in sorted(exact, key=lambda e: (int(e[1]) - e[1], e[0]))[:left]:
        dealt[size] += 1
    return dealt


def gpus_asked(dealt: dict[int, int]) -> int:
    return sum(size * pods for size, pods in dealt.items())


def claim_plan(pods: int, gpus: int, mix: tuple[tuple[int, float], ...], fill: float, seed: int) -> list[int]:
    """GPUs of each pod's claim, in creation order: as many pods of the mix as ask at most
    `fill` of the `gpus`, the rest MONITOR; shuffled with `seed`, so every size arrives throughout."""
    budget = int(gpus * fill)
    average = sum(size * share for size, share in mix) / sum(share for _, share in mix)
    consuming = min(pods, int(budget / average))
    while consuming > 0 and gpus_asked(deal(consuming, mix)) > budget:
        consuming -= 1
    while consuming < pods and gpus_asked(deal(consuming + 1, mix)) <= budget:
        consuming += 1
    plan = [size for size, n in sorted(deal(consuming, mix).items()) for _ in range(n)]
    plan += [MONITOR] * (pods - consuming)
    random.Random(seed).shuffle(plan)
    return plan


def metric_total(text: str, name: str) -> float:
    """The sum of every sample of counter `name` (its `_total` samples) in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == f"{name}_total")


def status_kib(status: str, field: str) -> int:
    """A `/proc/<pid>/status` field in KiB (VmHWM: the peak resident set, VmRSS: now); 0 if absent."""
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key == field:
            return int(value.split()[0])
    return 0


class Answers:
    """What the shard tier answered, as the bench drains it: Placements and Unschedulables by pod,
    when the first and last came, and every whole device a Placement was given, so that a device
    given to two pods shows."""

    def __init__(self) -> None:
        self.placed: dict[str, str] = {}  # pod uid -> node
        self.unschedulable: set[str] = set()
        self.repeated = 0  # answers for a pod answered before (redeliveries)
        self.device_owner: dict[tuple[str, str, str], str] = {}  # (driver, pool, device) -> claim uid
        self.double_allocated: set[tuple[str, str, str]] = set()
        self.first: float | None = None
        self.last: float | None = None

    @property
    def answered(self) -> int:
        return len(self.placed.keys() | self.unschedulable)

    def take(self, message, at: float) -> None:
        from draplane.scheduling.messages import Placement, Unschedulable
        from draplane.scheduling.reservations import devices_of

        self.first = at if self.first is None else self.first
        self.last = at
        uid = message.pod.uid
        if uid in self.placed or uid in self.unschedulable:
            self.repeated += 1
        if isinstance(message, Unschedulable):
            if uid not in self.placed:
                self.unschedulable.add(uid)
            return
        if not isinstance(message, Placement):
            raise ValueError(f"{type(message).__name__} on the results stream")
        self.unschedulable.discard(uid)
        self.placed[uid] = message.node
        for claim in message.claims:
            for device in devices_of(claim.allocation):
                if not device.admin_access and device.share_id is None:
                    key = (device.driver, device.pool, device.device)
                    owner = self.device_owner.setdefault(key, claim.claim.uid)
                    if owner != claim.claim.uid:
                        self.double_allocated.add(key)

    @property
    def window_s(self) -> float:
        return (self.last - self.first) if self.first is not None and self.last is not None else 0.0


def bench_line(name: str, **fields) -> str:
    def text(value) -> str:
        return f"{value:.3f}" if isinstance(value, float) and abs(value) < 10 else \
            f"{value:.1f}" if isinstance(value, float) else str(value)

    return f"BENCH name={name} " + " ".join(f"{k}={text(v)}" for k, v in fields.items())


# --- the shell: processes, the apiserver, NATS --------------------------------------------------------

def memory_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read()
    except OSError:
        return ""


def rss_mb(pid: int | None, field: str = "VmRSS") -> float:
    return status_kib(proc_status(pid), field) / 1024 if pid else 0.0


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def ok(url: str) -> bool:
    try:
        return http_get(url, timeout=2.0)[0] == 200
    except OSError:
        return False


class MemoryLow(RuntimeError):
    pass


async def guard_memory(main: asyncio.Task, reasons: list[str]) -> None:
    """Cancel the run when the machine's available memory falls below MIN_AVAILABLE_GB: it must never swap."""
    while True:
        available = memory_available_gb()
        if available < MIN_AVAILABLE_GB:
            reasons.append(f"available memory {available:.1f} GB < {MIN_AVAILABLE_GB:g} GB")
            main.cancel()
            return
        await asyncio.sleep(1.0)


@dataclasses.dataclass
class Run:
    args: argparse.Namespace
    workdir: Path
    plane: object  # ControlPlane
    processes: list = dataclasses.field(default_factory=list)  # ServerProcess, stopped at the end

    def service(self, name: str, module: str, *argv: str, kube: bool = False):
        """A draplane service as its own process, on the bench's open NATS (said with --insecure-dev)."""
        from draplane.localenv.processes import ServerProcess

        common = ["--nats", self.plane.nats_url, "--insecure-dev", "--prefix", PREFIX]
        if kube:
            common += ["--kubeconfig", str(self.plane.kubeconfig)]
        process = ServerProcess(name, [sys.executable, "-m", module, *common, *argv], self.workdir / "logs" / f"{name}.log",
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        process.start()
        self.processes.append(process)
        return process

    def stop(self, process) -> None:
        process.stop(timeout=20.0)
        if process in self.processes:
            self.processes.remove(process)


def scale_profile(path: Path, gpus: int) -> Path:
    """The shipped dgx-h100 profile with `gpus` GPUs and no NICs: `gpus` devices a node."""
    from draplane.nodes.profile import load_profile

    profile = load_profile("dgx-h100")
    roots = min(profile.pcie_roots, gpus)
    profile = msgspec.structs.replace(
        profile, name=f"scale-h100x{gpus}", description=f"dgx-h100 with {gpus} GPUs and no NICs (bench/scale.py)",
        pcie_roots=roots, numa_nodes=min(profile.numa_nodes, roots),
        gpus=[msgspec.structs.replace(profile.gpus[0], count=gpus)], nics=[])
    path.write_text(yaml.safe_dump(msgspec.to_builtins(profile), sort_keys=False))
    load_profile(path)  # the agent would refuse it otherwise: refuse it here first
    return path


async def bounded(limit: int, items, work) -> None:
    slots = asyncio.Semaphore(limit)

    async def one(item) -> None:
        async with slots:
            await work(item)

    await asyncio.gather(*(one(item) for item in items))


async def feed_nodes(js) -> int:
    """Nodes with an entry in the inventory feed bucket (what the shards will read)."""
    import nats.js.errors

    from draplane.messages.inventory import InventoryNames

    try:
        kv = await js.key_value(InventoryNames(prefix=PREFIX).feed_bucket)
        return sum(1 for key in await kv.keys() if key.startswith("node."))
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.NoKeysError):
        return 0


async def load_inventory(run: Run, kube, js) -> dict:
    from draplane.api.resource import ResourceSlice
    from draplane.localenv import environment
    from draplane.localenv.processes import free_port
    from draplane_node_agent.__main__ import simulated_node_names

    args = run.args
    names = simulated_node_names(NODE_PREFIX, args.nodes)
    started = time.monotonic()
    # as `draplane up` registers a kubelet's node (capacity, Ready, the not-ready taint lifted)
    await bounded(32, names, lambda name: environment._register_node(kube, name, NODE_PREFIX))
    nodes_s = time.monotonic() - started
    print(f"# {len(names)} Node objects registered in {nodes_s:.1f} s", flush=True)

    port = free_port()
    inventory = run.service("inventory", "draplane_inventory", f"--listen=127.0.0.1:{port}",
                            "--taint-after=3600", "--remove-after=7200", kube=True)
    await asyncio.to_thread(inventory.wait_ready, lambda: ok(f"http://127.0.0.1:{port}/readyz"), 120)
    profile = scale_profile(run.workdir / "scale-profile.yaml", args.gpus_per_node)
    started = time.monotonic()
    agents = run.service("node-agents", "draplane_node_agent", f"--profile={profile}", f"--nodes={args.nodes}",
                         f"--node-prefix={NODE_PREFIX}")
    deadline = started + args.load_timeout
    while True:
        if not agents.alive() or not inventory.alive():
            raise RuntimeError(f"inventory or node agents exited while loading:\n{inventory.log_tail()}\n{agents.log_tail()}")
        _, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/metrics")
        # the counters first (cheap); then what is there, read back: a node may be written twice
        if metric_total(text, "draplane_inventory_slice_writes") >= args.nodes and \
                metric_total(text, "draplane_inventory_feed_updates") >= args.nodes:
            in_feed = await feed_nodes(js)
            if in_feed >= args.nodes:
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"inventory: {await feed_nodes(js)} of {args.nodes} nodes in the feed after "
                               f"{args.load_timeout:.0f} s")
        await asyncio.sleep(0.5)
    load_s = time.monotonic() - started
    # the inventory first, so that nobody taints the nodes whose agents then go silent
    run.stop(inventory)
    run.stop(agents)
    listed, _ = await kube.list(ResourceSlice)
    devices = sum(len(s.spec.devices or ()) for s in listed if (s.spec.node_name or "").startswith(NODE_PREFIX))
    return {"nodes": args.nodes, "devices": devices, "feed_nodes": await feed_nodes(js), "nodes_s": nodes_s,
            "load_s": load_s}


async def create_pods(run: Run, kube) -> dict:
    from draplane.api.core import Pod
    from draplane.api.resource import DeviceClass
    from draplane.localenv import environment
    from draplane.simulation import scenario

    args = run.args
    gpus = args.nodes * args.gpus_per_node
    plan = claim_plan(args.pods, gpus, args.mix, args.fill, args.seed)
    for raw in environment.standard_device_classes():
        if raw["metadata"]["name"] == GPU_CLASS:
            await kube.create(msgspec.convert(raw, DeviceClass))
    # adminAccess claims are only admitted in a namespace labeled for them
    await kube.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": NAMESPACE, "labels": {ADMIN_ACCESS_LABEL: "true"}}})

    created = 0
    stop: list[str] = []
    samples: list[tuple[float, int]] = []  # (monotonic, pods created) every second
    apiserver, etcd = run.plane.process("kube-apiserver").pid, run.plane.process("etcd").pid
    peak = {"apiserver": 0.0, "etcd": 0.0}

    async def one(i: int) -> None:
        nonlocal created
        if stop:
            return
        size = plan[i]
        claim = scenario.claim(NAMESPACE, f"c-{i:05d}", GPU_CLASS, count=max(1, size))
        if size == MONITOR:
            claim.spec.devices.requests[0].exactly.admin_access = True
        await kube.create(claim)
        await kube.create(scenario.pod(NAMESPACE, f"p-{i:05d}", claim_name=f"c-{i:05d}", scheduler_name=SCHEDULER_NAME))
        created += 1

    async def watch() -> None:
        started = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            samples.append((now, created))
            peak["apiserver"] = max(peak["apiserver"], rss_mb(apiserver))
            peak["etcd"] = max(peak["etcd"], rss_mb(etcd))
            if not stop and peak["apiserver"] + peak["etcd"] > args.apiserver_rss_limit_gb * 1024:
                stop.append(f"apiserver+etcd_rss_{(peak['apiserver'] + peak['etcd']) / 1024:.1f}GB")
            if not stop and memory_available_gb() < STOP_CREATING_GB:
                stop.append(f"available_memory_{memory_available_gb():.1f}GB")
            window = [(t, n) for t, n in samples if t >= now - RATE_WINDOW_SECONDS]
            if not stop and now - started > RATE_WINDOW_SECONDS and len(window) > 1:
                rate = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
                if rate < args.min_create_rate:
                    stop.append(f"create_rate_{rate:.0f}_per_s_below_{args.min_create_rate:g}")
            if len(samples) % 30 == 0:
                print(f"# {created} pods created, apiserver {rss_mb(apiserver):.0f} MB, etcd {rss_mb(etcd):.0f} MB, "
                      f"{memory_available_gb():.1f} GB available", flush=True)

    started = time.monotonic()
    watcher = asyncio.create_task(watch())
    try:
        await bounded(args.create_concurrency, range(args.pods), one)
    finally:
        watcher.cancel()
    create_s = time.monotonic() - started
    # which pods exist is read back (creation is concurrent, and may have stopped midway)
    pods, _ = await kube.list(Pod, NAMESPACE)
    existing = sorted(int(p.metadata.name.split("-")[1]) for p in pods)
    sizes = [plan[i] for i in existing]
    return {"pods_created": len(existing), "gpu_pods": sum(1 for s in sizes if s != MONITOR),
            "monitor_pods": sum(1 for s in sizes if s == MONITOR), "gpus_asked": sum(sizes),
            "gpus": gpus, "create_s": create_s, "pods_per_s": len(existing) / create_s if create_s else 0.0,
            "apiserver_rss_mb": peak["apiserver"], "etcd_rss_mb": peak["etcd"],
            "stopped_because": stop[0] if stop else "none"}


async def publish_with_binder(run: Run, js, expected: int) -> tuple[dict, list[bytes]]:
    """The binder publishes the cluster bucket and a PendingPod per pod, then stops; returns the
    PendingPods as published."""
    from draplane.localenv.processes import free_port
    from draplane.scheduling import cluster_feed
    from draplane.scheduling.messages import Subjects
    from draplane.jetstream import streams

    subjects = Subjects(prefix=PREFIX)
    port = free_port()
    started = time.monotonic()
    binder = run.service("binder", "draplane_binder", "--shards=1", f"--scheduler-name={SCHEDULER_NAME}",
                         # every claim in the bucket before the binder stops, as a binder that keeps
                         # running writes them once their hold ends: the shards are timed holding them
                         "--no-manage-claims", "--feed-new-claim-hold-seconds=0", f"--port={port}", kube=True)
    peak = 0.0
    deadline = started + run.args.publish_timeout
    while True:
        if not binder.alive():
            raise RuntimeError(f"the binder exited:\n{binder.log_tail()}")
        peak = max(peak, rss_mb(binder.pid, "VmHWM"))
        try:
            held = (await js.stream_info(subjects.pending_stream)).state.messages
        except Exception:  # noqa: BLE001 - not made yet
            held = 0
        if held >= expected:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the binder published {held} of {expected} PendingPods in {run.args.publish_timeout:.0f} s")
        await asyncio.sleep(0.5)
    publish_s = time.monotonic() - started
    kv = await streams.cluster_bucket(js, subjects)
    for _ in range(100):
        with contextlib.suppress(Exception):
            if (await kv.get(cluster_feed.SYNCED_KEY)).value:
                break
        await asyncio.sleep(0.2)
    else:
        raise RuntimeError("the binder never marked the cluster bucket synced")
    peak = max(peak, rss_mb(binder.pid, "VmHWM"))
    run.stop(binder)

    consumer = streams.work_consumer("scale-capture")
    sub = await js.pull_subscribe(subjects.pending_all, durable="scale-capture", stream=subjects.pending_stream,
                                  config=consumer)
    captured: list[bytes] = []
    while len(captured) < expected:
        messages = await sub.fetch(512, timeout=5.0)
        captured.extend(m.data for m in messages)
        await asyncio.gather(*(m.ack() for m in messages))
    await sub.unsubscribe()
    return {"published": len(captured), "publish_s": publish_s, "peak_rss_mb": peak}, captured


async def reset_tier(js, captured: list[bytes], shards: int) -> None:
    """Fresh pending and results streams and reservation bucket; the PendingPods published again,
    partitioned for `shards` as the binder partitions them."""
    import nats.js.errors

    from draplane.jetstream import streams
    from draplane.scheduling.messages import Subjects, decode_message, partition_key, shard_for

    subjects = Subjects(prefix=PREFIX)
    for stream in (subjects.pending_stream, subjects.results_stream):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_stream(stream)
    with contextlib.suppress(nats.js.errors.NotFoundError, nats.js.errors.BucketNotFoundError):
        await js.delete_key_value(subjects.reservations_bucket)
    await streams.ensure_streams(js, subjects)
    for start in range(0, len(captured), 1000):
        chunk = captured[start:start + 1000]
        await asyncio.gather(*(js.publish(subjects.pending(shard_for(partition_key(decode_message(data)), shards)), data)
                               for data in chunk))


async def run_tier(run: Run, js, captured: list[bytes], shards: int) -> dict:
    import nats.errors

    from draplane.localenv.processes import free_port
    from draplane.jetstream import streams
    from draplane.scheduling.messages import Subjects, decode_message

    args = run.args
    subjects = Subjects(prefix=PREFIX)
    await reset_tier(js, captured, shards)
    sub = await js.pull_subscribe(subjects.results, durable="scale-bench", stream=subjects.results_stream,
                                  config=streams.work_consumer("scale-bench"))
    answers = Answers()
    ports = [free_port() for _ in range(shards)]
    started = time.monotonic()
    tier = [run.service(f"shard-{shards}-{i}", "draplane_allocator", f"--shards={shards}", f"--shard-index={i}",
                        f"--port={ports[i]}", f"--lease-seconds={args.lease_seconds:g}") for i in range(shards)]

    cpu_at_ready: dict[int, float] = {}
    rss_at_ready: dict[int, float] = {}

    async def ready(process, port) -> float:
        await asyncio.to_thread(process.wait_ready, lambda: ok(f"http://127.0.0.1:{port}/readyz"), 300)
        cpu_at_ready[process.pid] = process_cpu_seconds(process.pid)
        rss_at_ready[process.pid] = rss_mb(process.pid)  # the state rebuilt, nothing placed yet
        return time.monotonic() - started

    cold = asyncio.gather(*(ready(p, port) for p, port in zip(tier, ports)))
    last_progress = report_at = time.monotonic()
    first_at: float | None = None
    stopped = "all_answered"
    while answers.answered < len(captured):
        dead = [p for p in tier if not p.alive()]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited:\n{dead[0].log_tail()}")
        now = time.monotonic()
        if args.tier_seconds and first_at is not None and now - first_at >= args.tier_seconds:
            stopped = "time_limit"
            break
        if now - report_at >= 30:
            report_at = now
            print(f"# {shards} shard(s): {answers.answered} of {len(captured)} answered "
                  f"({len(answers.placed) / answers.window_s if answers.window_s else 0:.1f} placements/s), "
                  f"{memory_available_gb():.1f} GB available", flush=True)
        try:
            messages = await sub.fetch(256, timeout=1.0)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):  # nothing answered this second
            if time.monotonic() - last_progress > args.stall_seconds:
                stopped = "stalled"
                break
            continue
        first_at = first_at or time.monotonic()
        at = time.time()
        for m in messages:
            answers.take(decode_message(m.data), at)
        await asyncio.gather(*(m.ack() for m in messages))
        last_progress = time.monotonic()
    cold_starts = await cold
    conflicts = cpu = peak = 0.0
    for process, port in zip(tier, ports):
        _, text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/metrics")
        conflicts += metric_total(text, CONFLICTS_METRIC)
        peak = max(peak, rss_mb(process.pid, "VmHWM"))
        cpu += process_cpu_seconds(process.pid) - cpu_at_ready[process.pid]
    for process in tier:
        process.terminate()
    for process in tier:
        run.stop(process)
    await sub.unsubscribe()
    placements = len(answers.placed)
    return {"shards": shards, "pods": len(captured), "placements": placements,
            "placements_per_s": placements / answers.window_s if answers.window_s else 0.0,
            "unschedulable": len(answers.unschedulable), "unanswered": len(captured) - answers.answered,
            "repeated": answers.repeated,
            "conflicts_per_placement": conflicts / placements if placements else 0.0,
            "peak_rss_mb": peak, "ready_rss_mb": max(rss_at_ready.values()), "cold_start_s": max(cold_starts),
            "window_s": answers.window_s,
            "shard_cpu_ms_per_placement": cpu * 1000 / placements if placements else 0.0,
            "double_allocated": len(answers.double_allocated), "stopped": stopped}


async def scale(args: argparse.Namespace, workdir: Path) -> int:
    import nats

    from draplane.kube import KubeClient
    from draplane.localenv.controlplane import ControlPlane

    plane = await asyncio.to_thread(ControlPlane.start, workdir / "controlplane", logs=workdir / "logs")
    run = Run(args, workdir, plane)
    low_memory: list[str] = []
    guard = asyncio.create_task(guard_memory(asyncio.current_task(), low_memory))
    nc = None
    try:
        nc = await nats.connect(plane.nats_url)
        js = nc.jetstream()
        async with await KubeClient.from_kubeconfig(plane.kubeconfig) as kube:
            inventory = await load_inventory(run, kube, js)
            print(bench_line("scale_inventory", **inventory), flush=True)
            made = await create_pods(run, kube)
            print(bench_line("scale_apiserver", **{k: v for k, v in made.items() if k != "gpus"}), flush=True)
        published, captured = await publish_with_binder(run, js, made["pods_created"])
        print(bench_line("scale_binder", **published), flush=True)
        # The shard tier runs on NATS alone: with the apiserver and etcd gone, that is shown, not
        # assumed, and their memory is the shards'.
        plane.process("kube-apiserver").stop()
        plane.process("etcd").stop()
        for shards in args.shards:
            r = await run_tier(run, js, captured, shards)
            print(bench_line("scale_shards", **r), flush=True)
    except asyncio.CancelledError:
        if low_memory:
            print(f"# stopped: {low_memory[0]}", flush=True)
            return 1
        raise
    finally:
        guard.cancel()
        if nc is not None:
            await nc.close()
        for process in reversed(run.processes):
            process.terminate()
        for process in reversed(run.processes):
            process.stop()
        await asyncio.to_thread(plane.stop)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--pods", type=int, default=50_000)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--mix", default=DEFAULT_MIX, help="GPUS:SHARE,... of the GPU pods (default %(default)s)")
    parser.add_argument("--fill", type=float, default=0.9, help="share of the GPUs the GPU pods ask (default %(default)s)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--create-concurrency", type=int, default=64, help="pods being created at once")
    parser.add_argument("--min-create-rate", type=float, default=50.0,
                        help="stop creating below this many pods/s over 30 s (default %(default)s)")
    parser.add_argument("--apiserver-rss-limit-gb", type=float, default=12.0,
                        help="stop creating when etcd + kube-apiserver hold more (default %(default)s)")
    parser.add_argument("--lease-seconds", type=float, default=86400.0,
                        help="the shards' reservation lease: no binder confirms here (default %(default)s)")
    parser.add_argument("--load-timeout", type=float, default=900.0)
    parser.add_argument("--publish-timeout", type=float, default=1200.0)
    parser.add_argument("--tier-seconds", type=float, default=0.0,
                        help="stop each shard tier this long after its first answer (default 0: when every pod "
                             "is answered)")
    parser.add_argument("--stall-seconds", type=float, default=120.0,
                        help="a shard tier answering nothing this long is stopped (default %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, etcd, JetStream)")
    args = parser.parse_args(argv)
    try:
        args.mix = parse_mix(args.mix)
    except ValueError as exc:
        parser.error(str(exc))
    if args.nodes < 1 or args.gpus_per_node < 1 or args.pods < 1 or min(args.shards) < 1:
        parser.error("--nodes, --gpus-per-node, --pods and --shards must be at least 1")
    if not 0 < args.fill <= 1:
        parser.error("--fill must be in (0, 1]")
    import uvloop

    workdir = Path(tempfile.mkdtemp(prefix="draplane-scale-"))
    print(f"# {args.nodes} nodes x {args.gpus_per_node} GPUs, {args.pods} pods, shards "
          f"{' '.join(map(str, args.shards))}; work folder {workdir}", flush=True)
    try:
        return uvloop.run(scale(args, workdir))
    finally:
        if args.keep:
            print(f"# kept {workdir}", flush=True)
        else:
            # the logs are the evidence; the stores are large and rebuilt by every run
            for store in ("controlplane/etcd", "controlplane/jetstream"):
                shutil.rmtree(workdir / store, ignore_errors=True)
            print(f"# logs in {workdir / 'logs'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

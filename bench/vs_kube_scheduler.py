"""draplane and kube-scheduler side by side: the same workload on the same local cluster setup.

Every run starts a fresh control plane: etcd, kube-apiserver with every DRA feature gate,
kube-controller-manager (its resourceclaim controller makes the claims from the templates, for
both schedulers; all its controllers but node lifecycle, as no kubelet renews the hand-made nodes'
leases) and the same hand-made nodes, each with one ResourceSlice of GPUs in the apiserver (the
inventory feed entry that draplane's inventory service would publish for it is written to NATS
too, in both runs). Then one scheduler:

- `kube-scheduler`: the real kube-scheduler v1.37.2 (`binaries.KUBE_SCHEDULER`), its default
  profile, its client at `--kube-scheduler-qps` (default 5000, burst the same, as scheduler_perf
  runs it; kube-scheduler's own default is 50/100); the pods have no schedulerName;
- `draplane`: the allocator shards and the binder (`--no-manage-claims`, as beside kcm in every
  cluster), each its own process; the pods have `schedulerName: draplane`.

Each case runs `--rounds` times per scheduler, the order alternating from round to round (the
machine is shared and noisy). The cases:

- `template`: kube-scheduler's DRA benchmark `SchedulingWithResourceClaimTemplate/5000pods_500nodes`:
  `--nodes` x `--gpus` devices, `--pods` pods each with a one-device claim template, the first
  `--warmup` as warm-up, the rest measured (pods/s from the first measured create to the last
  measured bind); at most 64 creates in flight, as scheduler_perf's client keeps many;
- `steady`: `--steady-seconds` of pods created at 10 pods/s on `--steady-nodes`, all measured;
- `topology`: `--mix-pods` pods of 1-, 2-, 4- and 8-GPU template claims (50/25/15/10 %; the
  2-GPU one under one PCIe root by matchAttribute) in a seeded random order on `--mix-nodes`
  8-GPU nodes, about 60 % of the GPUs, all created at once and all measured.

Per run: pods/s, create-to-bound p50/p99, apiserver requests per measured pod (the delta of
kube-apiserver's `apiserver_request_total`, every verb, over the measured window, whose writes
also alone) and CPU-seconds per measured pod of each component (utime+stime from /proc/<pid>/stat
over the window: from before the first measured create to the last measured bind and then a second
with no pod or claim write). `cpu_s_per_pod` sums etcd, kube-apiserver, kube-controller-manager
and the scheduler: kube-scheduler, or draplane's shards, binder and NATS server (which only
draplane uses; in kube-scheduler's runs it idles and is not counted). The benchmark's own client
(the pods' creation and its watch) is the same in both runs and is given apart. A pod that is
still not bound after `--stall-seconds` without any pod binding counts as `unbound` and the
figures are of the bound ones.

    .venv/bin/python bench/vs_kube_scheduler.py                              # the full shape
    .venv/bin/python bench/vs_kube_scheduler.py --nodes 200 --pods 2000 --warmup 1000 --rounds 3
    .venv/bin/python bench/vs_kube_scheduler.py --cases template --nodes 5 --pods 40 --warmup 10 --rounds 1

Prints, per run and then as the medians over the rounds (`round=median`):
`BENCH name=vs_kube_scheduler case=C scheduler=kube-scheduler|draplane round=R pods_per_s=...
p50_ms=... p99_ms=... requests_per_pod=... writes_per_pod=... cpu_s_per_pod=... bench_cpu_s_per_pod=...
measured=... unbound=...` and `BENCH name=vs_kube_scheduler_cpu case=C scheduler=S round=R
<component>=<CPU-seconds per pod> ...`; per case `BENCH name=vs_kube_scheduler_ratio case=C
pods_per_s=... p50_ms=... p99_ms=... requests_per_pod=... cpu_s_per_pod=...` (draplane's median over
kube-scheduler's); then the issue's targets, met or not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nats
from nats.js.api import KeyValueConfig

import e2e  # bench/e2e.py, beside this file: its recorder, pod templates and process CPU reading
from draplane.kube import KubeClient
from draplane.localenv.controllermanager import controller_manager
from draplane.localenv.controlplane import ControlPlane
from draplane.localenv.kubescheduler import kube_scheduler
from draplane.localenv.processes import ServerProcess
from draplane.messages.inventory import SCHEMA_VERSION, FeedEntry, InventoryNames, encode
from draplane.simulation import scenario

KUBE_SCHEDULER, DRAPLANE = "kube-scheduler", "draplane"
SCHEDULERS = (KUBE_SCHEDULER, DRAPLANE)
TEMPLATE, STEADY, TOPOLOGY = "template", "steady", "topology"
CASES = (TEMPLATE, STEADY, TOPOLOGY)
# The components whose CPU every run counts; the scheduler's own are added per scheduler.
COMMON = ("etcd", "kube-apiserver", "kube-controller-manager")


# --- the cluster ------------------------------------------------------------------------------------

async def setup_nodes(kube: KubeClient, nc, nodes: int, gpus: int, tag: str) -> None:
    """Hand-made Ready nodes, each with its GPUs as one ResourceSlice in the apiserver (what
    kube-scheduler reads) and as the inventory feed entry in NATS (what draplane's shards read)."""
    js = nc.jetstream()
    names = InventoryNames(prefix=e2e.PREFIX)
    try:
        kv = await js.key_value(names.feed_bucket)
    except Exception:  # noqa: BLE001 - not there yet: create it as the inventory service would
        kv = await js.create_key_value(KeyValueConfig(bucket=names.feed_bucket, history=1))

    async def one(i: int) -> None:
        name = f"{tag}-node-{i:04d}"
        await kube.create(scenario.gpu_node(name))
        await e2e.make_ready(kube, name)
        slice_ = scenario.gpu_slice(name, gpus, "80Gi")
        await kube.create(slice_)
        key = InventoryNames.node_key(name)
        await kv.put(key, encode(FeedEntry(schema_version=SCHEMA_VERSION, key=key, node=name, slices=[slice_])))

    for start in range(0, nodes, 25):
        await asyncio.gather(*(one(i) for i in range(start, min(nodes, start + 25))))


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
    for template in e2e.topology_templates(namespace, class_name):
        await kube.create(template)
    return kube, nc, namespace


def start_server(process: ServerProcess) -> ServerProcess:
    process.start()
    return process


@dataclasses.dataclass
class Run:
    """One fresh cluster with one scheduler, as a case sees it."""

    kube: KubeClient
    namespace: str
    scheduler: str
    recorder: e2e.BindRecorder
    created_at: dict[str, float]
    components: dict[str, int]  # component -> pid, for its CPU

    @property
    def scheduler_name(self) -> str | None:
        return None if self.scheduler == KUBE_SCHEDULER else "draplane"


@contextlib.asynccontextmanager
async def cluster(args, scheduler: str, nodes: int, gpus: int):
    """A fresh control plane, kube-controller-manager, the nodes and one scheduler, up once a probe
    pod binds; torn down after."""
    workdir = Path(tempfile.mkdtemp(prefix=f"draplane-vs-{scheduler}-"))
    plane = ControlPlane.start(workdir / "plane")
    servers: list[ServerProcess] = []
    procs: dict[str, subprocess.Popen] = {}
    failed = True
    try:
        manager = controller_manager(plane, workdir / "kube-controller-manager.log",
                                     controllers="*,-node-lifecycle-controller")
        manager.argv += [f"--kube-api-qps={args.kcm_api_qps:g}", f"--kube-api-burst={int(args.kcm_api_qps * 1.5)}"]
        servers.append(start_server(manager))
        kube, nc, namespace = await prepare(plane, nodes, gpus)
        components = {"etcd": plane.process("etcd").pid, "kube-apiserver": plane.process("kube-apiserver").pid,
                      "kube-controller-manager": manager.pid}
        if scheduler == KUBE_SCHEDULER:
            qps = args.kube_scheduler_qps
            servers.append(start_server(kube_scheduler(plane, workdir / "kube-scheduler.log", qps=qps, burst=int(qps))))
            components["kube-scheduler"] = servers[-1].pid
        else:
            binder_args = () if args.feed_coalesce_ms is None else ("--feed-coalesce-ms", f"{args.feed_coalesce_ms:g}")
            procs = e2e.start_services(plane, args.shards, workdir, manage_claims=False, binder_args=binder_args)
            components.update({name: p.pid for name, p in procs.items()})
            components["nats"] = plane.process("nats-server").pid
        run = Run(kube, namespace, scheduler, e2e.BindRecorder(kube, namespace), {}, components)
        try:
            await create_pods(run, ["probe"])
            await run.recorder.wait_bound(["probe"], timeout=120)
            yield run
            failed = False
        finally:
            run.recorder.stop()
            await nc.close()
            await kube.close()
    finally:
        e2e.stop_services(list(procs.values()))
        for server in servers:
            server.terminate()
        for server in servers:
            server.stop()
        plane.stop()
        if failed:
            print(f"{scheduler}: the run failed; its servers' and services' logs are in {workdir}", file=sys.stderr)
        elif args.keep:
            print(f"# {scheduler}: logs kept in {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)  # a 5,000-pod etcd is not worth keeping


async def create_pods(run: Run, names: list[str], *, rate: float | None = None, batch: int = 64,
                      templates: dict[str, str] | None = None) -> None:
    """The pods, for this run's scheduler: `batch` creates in flight, or `rate` per second."""
    async def one(name: str) -> None:
        t = time.time()
        template = (templates or {}).get(name, "one-gpu")
        await run.kube.create(scenario.pod(run.namespace, name, template_name=template,
                                           scheduler_name=run.scheduler_name))
        run.created_at[name] = t

    if rate is None:
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


async def wait_bound_or_stalled(recorder: e2e.BindRecorder, names: list[str], *, stall: float, timeout: float) -> list[str]:
    """Until every pod is bound, or no pod of `names` has bound for `stall` seconds (a pod that
    cannot fit: kube-scheduler may leave one the mix could have held). The ones still unbound."""
    deadline = time.monotonic() + timeout
    bound = sum(n in recorder.bound_at for n in names)
    progress = time.monotonic()
    while bound < len(names):
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{len(names) - bound} pods not bound after {timeout}s")
        if now - progress > stall:
            break
        recorder.changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(recorder.changed.wait(), 1.0)
        now_bound = sum(n in recorder.bound_at for n in names)
        if now_bound > bound:
            bound, progress = now_bound, time.monotonic()
    return [n for n in names if n not in recorder.bound_at]


# --- what it cost ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Sample:
    cpu: dict[str, float]  # component -> CPU seconds so far
    requests: float  # apiserver_request_total, every verb
    writes: float  # of those, create/update/patch/apply/delete
    at: float


def apiserver_requests(metrics: str) -> tuple[float, float]:
    """(every request, the writes) from kube-apiserver's `apiserver_request_total` counters."""
    requests = writes = 0.0
    for line in metrics.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels_text, _, value = line[len("apiserver_request_total{"):].rpartition("} ")
        labels = dict(e2e._LABEL_RE.findall(labels_text))
        requests += float(value)
        if labels.get("verb") in e2e.WRITE_VERBS:
            writes += float(value)
    return requests, writes


async def sample(run: Run) -> Sample:
    at = time.time()
    cpu = {name: e2e.process_cpu_seconds(pid) for name, pid in run.components.items()}
    cpu["bench"] = time.process_time()
    metrics = (await run.kube.request("GET", "/metrics", headers={"Accept": "text/plain"})).decode()
    requests, writes = apiserver_requests(metrics)
    return Sample(cpu, requests, writes, at)


async def measure(run: Run, names: list[str], create, *, stall: float, timeout: float) -> dict:
    """Create `names` with `create`, wait for them to bind, and what it cost per bound pod."""
    before = await sample(run)
    await create(names)
    unbound = await wait_bound_or_stalled(run.recorder, names, stall=stall, timeout=timeout)
    await e2e.settle(run.kube)
    after = await sample(run)
    bound = [n for n in names if n in run.recorder.bound_at]
    if not bound:
        raise RuntimeError(f"{run.scheduler}: none of {len(names)} pods bound (see its log)")
    first = min(run.created_at[n] for n in names)
    last = max(run.recorder.bound_at[n] for n in bound)
    latencies = [(run.recorder.bound_at[n] - run.created_at[n]) * 1000 for n in bound]
    cpu = {name: (after.cpu[name] - before.cpu[name]) / len(bound) for name in after.cpu}
    bench_cpu = cpu.pop("bench")
    return {"pods_per_s": len(bound) / (last - first), "p50_ms": e2e.percentile(latencies, 50),
            "p99_ms": e2e.percentile(latencies, 99), "measured": len(bound), "unbound": len(unbound),
            "requests_per_pod": (after.requests - before.requests) / len(bound),
            "writes_per_pod": (after.writes - before.writes) / len(bound),
            "cpu_s_per_pod": sum(cpu.values()), "bench_cpu_s_per_pod": bench_cpu, "cpu": cpu,
            "window_s": after.at - before.at}


# --- the cases --------------------------------------------------------------------------------------

def case_label(args, case: str) -> str:
    """The case with the shape actually run."""
    if case == TEMPLATE:
        return f"template_{args.pods}x{args.nodes}"
    if case == STEADY:
        return f"steady_10pps_{int(args.steady_seconds * 10)}x{args.steady_nodes}"
    return f"topology_mix_{args.mix_pods}x{args.mix_nodes}"


async def template_case(args, scheduler: str) -> dict:
    async with cluster(args, scheduler, args.nodes, args.gpus) as run:
        names = [f"p-{i:05d}" for i in range(args.pods - 1)]  # the probe pod was the first
        warm, measured = names[: args.warmup - 1], names[args.warmup - 1 :]
        await create_pods(run, warm)
        await wait_bound_or_stalled(run.recorder, warm, stall=args.stall_seconds, timeout=args.timeout)
        await e2e.settle(run.kube)
        return await measure(run, measured, lambda ns: create_pods(run, ns), stall=args.stall_seconds,
                             timeout=args.timeout)


async def steady_case(args, scheduler: str) -> dict:
    async with cluster(args, scheduler, args.steady_nodes, args.gpus) as run:
        names = [f"s-{i:05d}" for i in range(int(args.steady_seconds * 10))]
        return await measure(run, names, lambda ns: create_pods(run, ns, rate=10.0), stall=args.stall_seconds,
                             timeout=args.timeout)


async def topology_case(args, scheduler: str) -> dict:
    rng = random.Random(args.seed)  # the same order for both schedulers
    names = [f"t-{i:05d}" for i in range(args.mix_pods)]
    weights = [share for _, _, share in e2e.TOPOLOGY_MIX]
    templates = {n: rng.choices([t for t, _, _ in e2e.TOPOLOGY_MIX], weights)[0] for n in names}
    async with cluster(args, scheduler, args.mix_nodes, 8) as run:
        return await measure(run, names, lambda ns: create_pods(run, ns, templates=templates),
                             stall=args.stall_seconds, timeout=args.timeout)


CASE_RUNNERS = {TEMPLATE: template_case, STEADY: steady_case, TOPOLOGY: topology_case}


# --- the report -----------------------------------------------------------------------------------

SCALARS = ("pods_per_s", "p50_ms", "p99_ms", "requests_per_pod", "writes_per_pod", "cpu_s_per_pod",
           "bench_cpu_s_per_pod", "measured", "unbound")


def run_lines(label: str, scheduler: str, round_: str, r: dict) -> list[str]:
    tag = f"case={label} scheduler={scheduler} round={round_}"
    return [
        f"BENCH name=vs_kube_scheduler {tag} pods_per_s={r['pods_per_s']:.1f} p50_ms={r['p50_ms']:.0f} "
        f"p99_ms={r['p99_ms']:.0f} requests_per_pod={r['requests_per_pod']:.2f} writes_per_pod={r['writes_per_pod']:.2f} "
        f"cpu_s_per_pod={r['cpu_s_per_pod']:.4f} bench_cpu_s_per_pod={r['bench_cpu_s_per_pod']:.4f} "
        f"measured={r['measured']:.0f} unbound={r['unbound']:.0f}",
        f"BENCH name=vs_kube_scheduler_cpu {tag} " + " ".join(f"{k}={v:.4f}" for k, v in r["cpu"].items()),
    ]


def median_result(results: list[dict]) -> dict:
    scalars = {k: statistics.median(r[k] for r in results) for k in SCALARS}
    keys = list(dict.fromkeys(k for r in results for k in r["cpu"]))
    return {**scalars, "cpu": {k: statistics.median(r["cpu"].get(k, 0.0) for r in results) for k in keys}}


def ratio_line(label: str, medians: dict[str, dict]) -> str:
    ours, theirs = medians[DRAPLANE], medians[KUBE_SCHEDULER]
    ratios = " ".join(f"{k}={ours[k] / theirs[k]:.2f}" if theirs[k] else f"{k}=nan"
                      for k in ("pods_per_s", "p50_ms", "p99_ms", "requests_per_pod", "cpu_s_per_pod"))
    return f"BENCH name=vs_kube_scheduler_ratio case={label} {ratios}"


def targets(args, medians: dict[str, dict[str, dict]]) -> list[str]:
    """The issue's targets, each met or not, from the medians."""
    lines = []
    if TEMPLATE in medians:
        m = medians[TEMPLATE]
        speed = m[DRAPLANE]["pods_per_s"] / m[KUBE_SCHEDULER]["pods_per_s"]
        cpu = m[DRAPLANE]["cpu_s_per_pod"] / m[KUBE_SCHEDULER]["cpu_s_per_pod"]
        lines.append(f"template: draplane {speed:.2f}x kube-scheduler's pods/s (target >= 2): "
                     + ("met" if speed >= 2 else "NOT met"))
        lines.append(f"template: draplane {cpu:.2f}x kube-scheduler's CPU-seconds per pod, all components "
                     "(target <= 1): " + ("met" if cpu <= 1 else "NOT met"))
    if STEADY in medians:
        p99 = medians[STEADY][DRAPLANE]["p99_ms"]
        lines.append(f"steady 10 pods/s: draplane p99 {p99:.0f} ms (target <= 50): "
                     + ("met" if p99 <= 50 else "NOT met"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--schedulers", nargs="+", choices=SCHEDULERS, default=list(SCHEDULERS))
    parser.add_argument("--rounds", type=int, default=3, help="runs of each scheduler per case, alternating their order")
    parser.add_argument("--nodes", type=int, default=500, help="nodes of the template case")
    parser.add_argument("--gpus", type=int, default=10, help="devices per node (template and steady cases)")
    parser.add_argument("--pods", type=int, default=5000, help="pods of the template case, warm-up included")
    parser.add_argument("--warmup", type=int, default=2500)
    parser.add_argument("--steady-seconds", type=float, default=30.0)
    parser.add_argument("--steady-nodes", type=int, default=50)
    parser.add_argument("--mix-nodes", type=int, default=200, help="8-GPU nodes of the topology mix")
    parser.add_argument("--mix-pods", type=int, default=400, help="pods of the topology mix (about 60%% of the GPUs)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--shards", type=int, default=1, help="draplane's allocator shards")
    parser.add_argument("--feed-coalesce-ms", type=float, default=None,
                        help="the binder's --feed-coalesce-ms (default: the binder's own)")
    parser.add_argument("--kube-scheduler-qps", type=float, default=5000.0,
                        help="kube-scheduler's client QPS and burst (scheduler_perf: 5000; its default: 50/100)")
    parser.add_argument("--kcm-api-qps", type=float, default=5000.0,
                        help="kube-controller-manager's --kube-api-qps (burst 1.5x), the same for both; at draplane "
                             "up's 100 its two writes per template pod would cap both schedulers near 50 pods/s")
    parser.add_argument("--stall-seconds", type=float, default=20.0,
                        help="stop waiting when no pod has bound this long; the rest count as unbound")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--keep", action="store_true", help="keep every run's work folder (servers' and services' logs)")
    args = parser.parse_args(argv)
    if TEMPLATE in args.cases:
        if not 0 < args.warmup < args.pods:
            parser.error("--warmup must be between 0 and --pods")
        # every template pod takes one device and waits for it: more pods than devices never finish
        if args.pods > args.nodes * args.gpus:
            parser.error("--pods must be at most --nodes x --gpus")
    if STEADY in args.cases and args.steady_seconds * 10 + 1 > args.steady_nodes * args.gpus:
        parser.error("--steady-seconds x 10 pods (and the probe) must fit on --steady-nodes x --gpus")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    import uvloop

    uvloop.install()
    medians: dict[str, dict[str, dict]] = {}
    for case in args.cases:
        label = case_label(args, case)
        results: dict[str, list[dict]] = {s: [] for s in args.schedulers}
        for round_ in range(args.rounds):
            # alternate the order, so that neither always runs on the machine's quieter side
            order = args.schedulers if round_ % 2 == 0 else list(reversed(args.schedulers))
            for scheduler in order:
                r = asyncio.run(CASE_RUNNERS[case](args, scheduler))
                results[scheduler].append(r)
                for line in run_lines(label, scheduler, str(round_ + 1), r):
                    print(line, flush=True)
        medians[case] = {s: median_result(rs) for s, rs in results.items()}
        for scheduler, r in medians[case].items():
            for line in run_lines(label, scheduler, "median", r):
                print(line, flush=True)
        if len(medians[case]) == 2:
            print(ratio_line(label, medians[case]), flush=True)
    if len(args.schedulers) == 2:
        for line in targets(args, medians):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

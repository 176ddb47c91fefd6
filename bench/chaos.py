"""The chaos run: a steady stream of pods through the whole control plane while it is being broken.

Everything runs as its own process on this machine, as in production: etcd and kube-apiserver,
a 3-server NATS JetStream cluster (R3 streams and buckets), kube-controller-manager (its
resourceclaim controller makes and cleans up the template claims), KWOK as the nodes' kubelets,
the inventory, 3 allocator shards, the binder, the audit subscriber, and node agents for
`--nodes` simulated nodes (dgx-h100, a100-mig, mixed, l4 and l4-shared, dealt round-robin; one
node of each profile has an agent process of its own, so that one agent can be lost).

Pods arrive at `--rate` per second, each with a claim from a template of the mix below, and are
deleted a random time after they are bound, so the cluster does not just fill up. First a
fault-free phase (`--calm-minutes`), then `--minutes` with faults at random, seeded intervals
(`--seed`, `--fault-interval`), one kind after another in a seeded order:

- `kill -9` of each service in turn (inventory, each shard, binder, audit), started again at once;
- SIGSTOP of a shard for longer than its lease, then SIGCONT (the paused process of split-brain);
- a NATS server killed (SIGKILL) and started again on its store;
- kube-apiserver restarted; etcd restarted;
- a node agent killed, and started again 20-50 s later (the inventory taints its devices after
  15 s, and withdraws them after 40 s);
- pods, and the claims of pods, deleted while in flight (created, not yet bound).

Then the load stops, every process is up again, and the run waits (`--settle-seconds`) for every
pod to be bound or pending with a reason. It prints one table, and exits 1 if anything was lost
or given twice:

- load: pods/s offered and bound, and create-to-bound latency, in each phase;
- faults injected, by kind, and any process that died on its own;
- pods bound, pending with a reason (by reason), deleted on purpose, and lost: neither bound, nor
  pending with a reason, nor deleted by us (gone, or pending with no word), or bound while their
  claim is not allocated for them;
- devices given twice: every allocated claim's devices, read from the apiserver every 10 s and at
  the end, against each other: a device at most once unless the claim has adminAccess, a shared
  device's memory never beyond its capacity, a MIG GPU's counters never beyond its counter set;
- slices stale or duplicated: the ResourceSlices against the devices each agent publishes;
- audit events missing or repeated: the audit log against the placements (pods seen bound) and
  releases (allocations seen ending) the run watched in the apiserver.

    .venv/bin/python bench/chaos.py                                  # 10 minutes, 200 nodes
    .venv/bin/python bench/chaos.py --minutes 2 --nodes 20 --rate 1  # what `make test` runs
    .venv/bin/python bench/chaos.py --no-faults                      # the fault-free rate alone

Prints `BENCH name=chaos phase=calm|faults offered_pods_per_s=... bound_pods_per_s=... p50_ms=...
p99_ms=...`, `BENCH name=chaos_ratio bound_rate_ratio=... p50_ratio=...` (faults over calm) and
`BENCH name=chaos_result lost=... doubled=... slices_stale=... slices_duplicated=...
audit_missing=... audit_repeated=...`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from fractions import Fraction
from pathlib import Path

from draplane.api.core import Pod
from draplane.api.quantity import parse_quantity
from draplane.api.resource import ResourceClaim, ResourceSlice
from draplane.kube import KubeApiError, KubeClient, watch_objects
from draplane.localenv import binaries
from draplane.localenv.controllermanager import controller_manager
from draplane.localenv.controlplane import ControlPlane, _http_ok
from draplane.localenv.environment import _apply, _ready, _register_node, node_names, standard_device_classes
from draplane.localenv.kwok import KwokProcess, kwok_arguments
from draplane.localenv.natscluster import NatsCluster
from draplane.localenv.processes import ServerProcess, free_port
from draplane.localenv.supervisor import describe_exit
from draplane.simulation import scenario
from draplane.scheduling.reservations import DEFAULT_LEASE_SECONDS

log = logging.getLogger("chaos")

HERE = Path(__file__).resolve().parent
PROFILES = ("dgx-h100", "a100-mig", "mixed", "l4", "l4-shared")
PROFILE_PATHS = {"l4-shared": str(HERE / "profiles" / "l4-shared.yaml")}
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
SHARDS = 3
TAINT_AFTER, REMOVE_AFTER = 15.0, 40.0
SCHEDULER = "draplane"
ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"
EXCLUSIVE = "!device.allowMultipleAllocations"
SHARED = "device.allowMultipleAllocations"


def _request(name: str, device_class: str, count: int = 1, *, selector: str | None = None,
             admin: bool = False, memory: str | None = None) -> dict:
    exactly: dict = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": count}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    if admin:
        exactly["adminAccess"] = True
    if memory:
        exactly["capacity"] = {"requests": {"memory": memory}}
    return {"name": name, "exactly": exactly}


def _mig(profile: str) -> str:
    return f'device.attributes["gpu.nvidia.com"].profile == "{profile}"'


# (template, share of pods in %, its claim spec). Whole GPUs never land on shared ones, so the
# shared GPUs' memory is given out only in the shared claims' steps.
CLAIM_MIX: tuple[tuple[str, int, dict], ...] = (
    ("gpu-1", 28, {"devices": {"requests": [_request("gpu", "gpu.nvidia.com", selector=EXCLUSIVE)]}}),
    ("gpu-2-one-root", 14, {"devices": {"requests": [_request("gpu", "gpu.nvidia.com", 2, selector=EXCLUSIVE)],
                                        "constraints": [{"requests": ["gpu"], "matchAttribute": PCIE_ROOT}]}}),
    ("gpu-4", 7, {"devices": {"requests": [_request("gpu", "gpu.nvidia.com", 4, selector=EXCLUSIVE)]}}),
    ("gpu-8", 4, {"devices": {"requests": [_request("gpu", "gpu.nvidia.com", 8, selector=EXCLUSIVE)]}}),
    ("mig-1g", 14, {"devices": {"requests": [_request("mig", "mig.nvidia.com", selector=_mig("1g.5gb"))]}}),
    ("mig-3g", 6, {"devices": {"requests": [_request("mig", "mig.nvidia.com", selector=_mig("3g.20gb"))]}}),
    ("shared-8gi", 22, {"devices": {"requests": [_request("gpu", "gpu.nvidia.com", selector=SHARED, memory="8Gi")]}}),
    ("admin-gpu", 5, {"devices": {"requests": [_request("gpu", "gpu.nvidia.com", admin=True)]}}),
)

SERVICES = ("inventory", *(f"allocator-{i}" for i in range(SHARDS)), "binder", "audit")
FAULT_KINDS = ("kill -9 service", "SIGSTOP shard", "NATS server killed", "kube-apiserver restarted",
               "etcd restarted", "node agent lost", "deleted in flight")
# One round of faults, shuffled: the kills come three times, so that each of the six services is
# killed within two rounds.
FAULT_ROUND = (*FAULT_KINDS, "kill -9 service", "kill -9 service")


# --- the checks (pure) ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceFacts:
    """What an agent publishes about one device that decides how often it may be given out."""

    shared: bool
    capacity: dict[str, Fraction]
    consumes: dict[tuple[str, str], Fraction]  # (counter set, counter) -> amount


@dataclasses.dataclass(slots=True)
class PoolFacts:
    devices: dict[str, DeviceFacts]
    counters: dict[tuple[str, str], Fraction]  # (counter set, counter) -> what the set has


@functools.lru_cache(maxsize=None)
def _profile(profile: str):
    from draplane.nodes.profile import load_profile

    return load_profile(PROFILE_PATHS.get(profile, profile))


def agent_devices(profile: str, node: str) -> dict:
    """driver -> the DriverDevices the node's agent publishes (what the slices must hold)."""
    from draplane.nodes.hardware import driver_devices

    return {d.driver: d for d in driver_devices(_profile(profile).hardware(node))}


def pool_facts(driver_devices) -> PoolFacts:
    devices = {}
    for d in driver_devices.devices:
        consumes = {}
        for consumption in d.consumes_counters or ():
            for counter, value in consumption.counters.items():
                consumes[(consumption.counter_set, counter)] = parse_quantity(value.value).value
        devices[d.name] = DeviceFacts(
            shared=bool(d.allow_multiple_allocations),
            capacity={k: parse_quantity(c.value).value for k, c in (d.capacity or {}).items()},
            consumes=consumes,
        )
    counters = {(s.name, c): parse_quantity(v.value).value for s in driver_devices.counter_sets or () for c, v in s.counters.items()}
    return PoolFacts(devices, counters)


def devices_given_twice(claims: list[ResourceClaim], pools: dict[tuple[str, str], PoolFacts]) -> list[str]:
    """Each over-allocation in one consistent list of claims, as a sentence naming the claims.

    adminAccess results take nothing. A device that does not allow multiple allocations goes to one
    claim; a shared one's consumed capacity adds up to at most its capacity; the devices of a pool
    that consume counters (MIG placements and their whole GPU) add up to at most its counter sets.
    """
    holders: dict[tuple[str, str, str], list[str]] = collections.defaultdict(list)
    consumed: dict[tuple[str, str, str, str], Fraction] = collections.defaultdict(Fraction)
    counted: dict[tuple[str, str, str, str], Fraction] = collections.defaultdict(Fraction)
    counter_users: dict[tuple[str, str, str, str], list[str]] = collections.defaultdict(list)
    problems = []
    for claim in claims:
        allocation = claim.status.allocation if claim.status else None
        name = f"{claim.metadata.namespace}/{claim.metadata.name}"
        for r in (allocation.devices.results if allocation and allocation.devices else None) or ():
            if r.admin_access:
                continue
            key = (r.driver, r.pool, r.device)
            facts = pools.get((r.driver, r.pool))
            device = facts.devices.get(r.device) if facts else None
            if device is None:
                problems.append(f"{name}: device {'/'.join(key)} is not one an agent publishes")
                continue
            if device.shared:
                for capacity, amount in (r.consumed_capacity or {}).items():
                    consumed[(*key, capacity)] += parse_quantity(amount).value
            else:
                holders[key].append(name)
            for (counter_set, counter), amount in device.consumes.items():
                ckey = (r.driver, r.pool, counter_set, counter)
                counted[ckey] += amount
                counter_users[ckey].append(f"{name}:{r.device}")
    for key, names in holders.items():
        if len(names) > 1:
            problems.append(f"device {'/'.join(key)} given to {len(names)} claims: {', '.join(sorted(names))}")
    for (driver, pool, device, capacity), amount in consumed.items():
        limit = pools[(driver, pool)].devices[device].capacity.get(capacity)
        if limit is None or amount > limit:
            problems.append(f"shared device {driver}/{pool}/{device}: {capacity} {float(amount):g} consumed of {float(limit or 0):g}")
    for (driver, pool, counter_set, counter), amount in counted.items():
        limit = pools[(driver, pool)].counters.get((counter_set, counter), Fraction(0))
        if amount > limit:
            users = counter_users[(driver, pool, counter_set, counter)]
            problems.append(f"pool {driver}/{pool} counter {counter_set}/{counter}: {float(amount):g} of {float(limit):g} "
                            f"consumed by {', '.join(sorted(users))}")
    return problems


def slice_problems(slices: list[ResourceSlice], expected: dict[tuple[str, str], set[str]]) -> tuple[list[str], list[str]]:
    """(stale, duplicated) against the agents' devices: `expected` is (driver, node) -> device names.

    Stale: a pool whose newest generation lacks a device the agent has, holds one it lacks, still
    carries a taint (every agent is heartbeating by now), or lingers at an older generation; a
    pool of an unknown node. Duplicated: a device in two slices of a pool's newest generation."""
    pools: dict[tuple[str, str], list[ResourceSlice]] = collections.defaultdict(list)
    for s in slices:
        if s.spec.node_name:
            pools[(s.spec.driver, s.spec.pool.name)].append(s)
    stale, duplicated = [], []
    for key, members in sorted(pools.items()):
        if key not in expected:
            stale.append(f"pool {key[0]}/{key[1]}: no agent publishes it")
            continue
        newest = max(s.spec.pool.generation for s in members)
        old = [s.metadata.name for s in members if s.spec.pool.generation < newest]
        if old:
            stale.append(f"pool {key[0]}/{key[1]}: slices of older generations still there: {old}")
        current = [s for s in members if s.spec.pool.generation == newest]
        counts = collections.Counter(d.name for s in current for d in s.spec.devices or ())
        twice = sorted(n for n, c in counts.items() if c > 1)
        if twice:
            duplicated.append(f"pool {key[0]}/{key[1]}: devices in two slices: {twice[:5]}")
        have = set(counts)
        if have != expected[key]:
            stale.append(f"pool {key[0]}/{key[1]}: {len(expected[key] - have)} of the agent's devices missing, "
                         f"{len(have - expected[key])} it does not have")
        tainted = sorted(d.name for s in current for d in s.spec.devices or () if d.taints)
        if tainted:
            stale.append(f"pool {key[0]}/{key[1]}: {len(tainted)} devices still tainted, e.g. {tainted[:3]}")
    for key in sorted(set(expected) - set(pools)):
        stale.append(f"pool {key[0]}/{key[1]}: no ResourceSlice")
    return stale, duplicated


def audit_differences(lines: list[dict], bound_pods: set[str], releases: dict[str, int]) -> dict[str, int]:
    """Audit log lines against what the run watched: `bound_pods` the uids of pods seen bound,
    `releases` claim uid -> allocations seen ending. Missing: a bound pod without a `placed`
    event, a release without a `released` one. Repeated: a second event of one fact (its id), a
    second placement of one pod, more releases of a claim than it had allocations."""
    ids = collections.Counter(line.get("id") for line in lines)
    placed = collections.Counter(line["pod"]["uid"] for line in lines if line.get("kind") == "placed" and line.get("pod"))
    released = collections.Counter(c["uid"] for line in lines if line.get("kind") == "released" for c in line.get("claims") or ())
    missing_placed = len(bound_pods - set(placed))
    missing_released = sum(max(0, n - released.get(uid, 0)) for uid, n in releases.items())
    repeated_ids = sum(n - 1 for n in ids.values() if n > 1)
    repeated_placed = sum(n - 1 for n in placed.values() if n > 1)
    repeated_released = sum(max(0, n - releases.get(uid, 0)) for uid, n in released.items())
    seqs = sorted(line["seq"] for line in lines if isinstance(line.get("seq"), int))
    gaps = (seqs[-1] - seqs[0] + 1 - len(set(seqs))) if seqs else 0
    return {"placed": sum(placed.values()), "released": sum(released.values()),
            "missing_placed": missing_placed, "missing_released": missing_released,
            "repeated_ids": repeated_ids, "repeated_placed": repeated_placed,
            "repeated_released": repeated_released, "sequence_gaps": gaps,
            "unreadable": sum(1 for line in lines if line.get("kind") == "unreadable")}


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def pod_scheduled_false(pod: Pod):
    for condition in (pod.status.conditions if pod.status else None) or ():
        if condition.type == "PodScheduled" and condition.status == "False":
            return condition
    return None


# --- the processes ------------------------------------------------------------------------------------


class Process:
    """One process the run keeps alive: started again by the watchdog when it dies on its own,
    held while a fault has it down on purpose."""

    def __init__(self, name: str, server: ServerProcess, *, ready=None, restart=None):
        self.name = name
        self.server = server
        self.ready = ready  # () -> bool, polled after a start
        self._restart = restart  # a blocking start of our own (NATS members, KWOK's leases)
        self.held = False
        self.unplanned: list[str] = []
        self.lock = asyncio.Lock()

    def alive(self) -> bool:
        return self.server.alive()

    async def start(self, timeout: float = 90.0) -> None:
        if self._restart is not None:
            await asyncio.to_thread(self._restart)
        else:
            self.server.start()
        if self.ready is not None:
            await asyncio.to_thread(self.server.wait_ready, self.ready, timeout)

    def signal(self, sig: int) -> None:
        os.killpg(self.server.pid, sig)


class Cluster:
    def __init__(self, workdir: Path, node_count: int, lease_seconds: float):
        self.workdir = workdir
        self.lease_seconds = lease_seconds
        self.logs = workdir / "logs"
        self.node_count = node_count
        self.plane: ControlPlane | None = None
        self.nats: NatsCluster | None = None
        self.processes: dict[str, Process] = {}
        self.nodes: dict[str, list[str]] = {}  # profile -> node names
        self.profile_of: dict[str, str] = {}
        self.loners: list[str] = []  # agent process names of the one-node agents
        self.audit_log = workdir / "audit" / "audit.jsonl"

    def add(self, process: Process) -> Process:
        self.processes[process.name] = process
        return process

    async def start(self) -> None:
        binaries.ensure_all(progress=lambda line: print(line, flush=True))
        self.plane = await asyncio.to_thread(ControlPlane.start, self.workdir / "plane", with_nats=False,
                                             logs=self.logs / "controlplane")
        plane = self.plane
        for name in ("etcd", "kube-apiserver"):
            probe = ((lambda: _http_ok(f"{plane.etcd_url}/health", expect=b'"health":"true"')) if name == "etcd"
                     else (lambda: _http_ok(f"{plane.apiserver_url}/readyz", plane.ssl_context())))
            self.add(Process(name, plane.process(name), ready=probe))
        self.nats = NatsCluster(self.workdir / "nats")
        await asyncio.to_thread(self.nats.start)
        for i, member in enumerate(self.nats.members):
            self.add(Process(member.name, self.nats.processes[i], restart=lambda i=i: self._restart_nats(i)))
        kwok = KwokProcess("kwok", [str(binaries.require(binaries.KWOK)),
                                    *kwok_arguments(plane.kubeconfig, self.workdir / "kwok.yaml")],
                           self.logs / "kwok.log", plane)
        kwok.start()
        self.add(Process("kwok", kwok))
        manager = controller_manager(plane, self.logs / "kube-controller-manager.log")
        manager.start()
        self.add(Process("kube-controller-manager", manager))

        self.nodes = node_names(PROFILES, self.node_count)
        async with await KubeClient.from_kubeconfig(plane.kubeconfig) as kube:
            for profile, names in self.nodes.items():
                for name in names:
                    self.profile_of[name] = profile
                    await _register_node(kube, name, profile)
            for device_class in standard_device_classes():
                await _apply(kube, device_class)

        urls = ",".join(self.nats.urls)
        env = dict(os.environ, KUBECONFIG=str(plane.kubeconfig), PYTHONUNBUFFERED="1")
        env.pop("DRAPLANE_NATS_URL", None)
        insecure = {m: _takes_insecure_dev(m) for m in ("draplane_inventory", "draplane_allocator", "draplane_binder",
                                                          "draplane_audit", "draplane_node_agent")}

        def service(name: str, module: str, *args: str, port: int | None = None) -> Process:
            argv = [sys.executable, "-m", module, f"--nats={urls}", *(["--insecure-dev"] if insecure[module] else []), *args]
            server = ServerProcess(name, argv, self.logs / f"{name}.log", env=env)
            ready = (lambda url=f"http://127.0.0.1:{port}/readyz": _ready(url)) if port else None
            return self.add(Process(name, server, ready=ready))

        port = free_port()
        service("inventory", "draplane_inventory", "--stream-replicas=3", f"--listen=127.0.0.1:{port}",
                f"--taint-after={TAINT_AFTER:g}", f"--remove-after={REMOVE_AFTER:g}", port=port)
        for shard in range(SHARDS):
            port = free_port()
            service(f"allocator-{shard}", "draplane_allocator", "--stream-replicas=3", f"--shards={SHARDS}",
                    f"--shard-index={shard}", f"--port={port}", f"--lease-seconds={self.lease_seconds:g}", port=port)
        port = free_port()
        service("binder", "draplane_binder", "--stream-replicas=3", f"--shards={SHARDS}", f"--scheduler-name={SCHEDULER}",
                "--no-manage-claims", f"--port={port}", f"--lease-seconds={self.lease_seconds:g}", port=port)
        port = free_port()
        service("audit", "draplane_audit", "--stream-replicas=3", f"--log-dir={self.audit_log.parent}", f"--port={port}",
                port=port)
        for profile, names in self.nodes.items():
            source = PROFILE_PATHS.get(profile, profile)
            # the last node of each profile has an agent of its own: the one a fault loses
            *fleet, loner = names
            if fleet:
                service(f"agents-{profile}", "draplane_node_agent", f"--profile={source}", f"--nodes={len(fleet)}",
                        f"--node-prefix={profile}", "--listen=")
            self.loners.append(service(f"agent-{loner}", "draplane_node_agent", f"--profile={source}",
                                       f"--node={loner}", "--listen=").name)
        for process in self.processes.values():
            if not process.alive():
                process.server.start()
        await asyncio.gather(*(asyncio.to_thread(p.server.wait_ready, p.ready, 120.0)
                               for p in self.processes.values() if p.ready is not None and p.name in SERVICES))
        # 200 nodes' slices (a100-mig ones hold 120 devices each) take the inventory a while on 2 cores
        await self.wait_for_slices(time.monotonic() + 60 + 1.5 * self.node_count)

    def _restart_nats(self, index: int) -> None:
        # NatsCluster starts a new ServerProcess on the member's ports and store
        self.nats.restart(index)
        self.processes[self.nats.members[index].name].server = self.nats.processes[index]

    async def wait_for_slices(self, deadline: float) -> None:
        async with await KubeClient.from_kubeconfig(self.plane.kubeconfig) as kube:
            while True:
                slices, _ = await kube.list(ResourceSlice)
                missing = set(self.profile_of) - {s.spec.node_name for s in slices}
                if not missing:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no ResourceSlices for {len(missing)} nodes, e.g. {sorted(missing)[:3]}; "
                                       f"see {self.logs}/inventory.log")
                await asyncio.sleep(1.0)

    async def wait_for_fresh_slices(self, deadline: float) -> None:
        """Until every pool is as its agent publishes it (or `deadline`). An agent that a fault
        killed is started again by then, but its devices stay tainted until its first heartbeat or
        snapshot reaches the inventory: a second or two of Python start-up on 2 loaded cores, which
        a check run at once mistook for a stale slice (CI: 120 devices "still tainted" 2 s after
        their agent's restart). What is still wrong at the deadline is reported by the final check."""
        expected, _ = self.expected_pools()
        async with await KubeClient.from_kubeconfig(self.plane.kubeconfig) as kube:
            while time.monotonic() < deadline:
                slices, _ = await kube.list(ResourceSlice)
                stale, duplicated = slice_problems(slices, expected)
                if not stale and not duplicated:
                    return
                await asyncio.sleep(1.0)

    def expected_pools(self) -> tuple[dict[tuple[str, str], set[str]], dict[tuple[str, str], PoolFacts]]:
        names, facts = {}, {}
        for node, profile in self.profile_of.items():
            for driver, devices in agent_devices(profile, node).items():
                names[(driver, node)] = {d.name for d in devices.devices}
                facts[(driver, node)] = pool_facts(devices)
        return names, facts

    async def watchdog(self, stop: asyncio.Event) -> None:
        """Starts again what died on its own (after a second, as `up`'s supervisor would), and
        remembers how it died."""
        while not stop.is_set():
            for process in self.processes.values():
                if process.held or process.alive() or process.lock.locked():
                    continue
                async with process.lock:
                    if process.held or process.alive():
                        continue
                    how = describe_exit(process.server.process.returncode if process.server.process else None)
                    process.unplanned.append(how)
                    log.warning("%s died on its own (%s); starting it again", process.name, how)
                    await asyncio.sleep(1.0)
                    try:
                        await process.start()
                    except Exception as exc:  # noqa: BLE001 - tried again on the next round
                        log.warning("%s did not start again: %s", process.name, exc)
            await asyncio.sleep(0.5)

    def stop(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError, TypeError):
                if process.alive():
                    process.signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
        services = [p.server for n, p in self.processes.items() if n not in ("etcd", "kube-apiserver")
                    and not n.startswith("nats-")]
        for server in services:
            server.terminate()
        for server in services:
            server.stop()
        if self.nats is not None:
            self.nats.stop()
        if self.plane is not None:
            self.plane.stop()


def _takes_insecure_dev(module: str) -> bool:
    """Whether the service has --insecure-dev (it refuses to start without credentials otherwise):
    the local NATS cluster here runs without TLS or credentials."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60).stdout
    return "--insecure-dev" in out


# --- the faults -----------------------------------------------------------------------------------------


class Faults:
    def __init__(self, cluster: Cluster, load: "Load", rng: random.Random):
        self.cluster = cluster
        self.load = load
        self.rng = rng
        self.counts: collections.Counter[str] = collections.Counter()
        self.log: list[str] = []
        self.background: set[asyncio.Task] = set()
        self._turn = collections.Counter()

    def _next(self, kind: str, choices: list[str]) -> str:
        choice = choices[self._turn[kind] % len(choices)]
        self._turn[kind] += 1
        return choice

    def note(self, what: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {what}"
        self.log.append(line)
        print(f"fault: {line}", flush=True)

    async def run(self, until: float, interval: float) -> None:
        order: list[str] = []
        while True:
            await asyncio.sleep(interval * self.rng.uniform(0.5, 1.5))
            if time.monotonic() >= until:
                return
            if not order:
                order = list(FAULT_ROUND)
                self.rng.shuffle(order)
            kind = order.pop()
            try:
                await self.inject(kind)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported, not fatal
                self.note(f"{kind}: could not inject: {exc!r}")

    async def inject(self, kind: str) -> None:
        processes = self.cluster.processes
        if kind == "kill -9 service":
            await self.kill_and_restart(processes[self._next(kind, list(SERVICES))])
        elif kind == "SIGSTOP shard":
            self.spawn(self.pause(processes[self._next(kind, [f"allocator-{i}" for i in range(SHARDS)])]))
        elif kind == "NATS server killed":
            member = processes[self._next(kind, [m.name for m in self.cluster.nats.members])]
            await self.kill_and_restart(member, down=self.rng.uniform(3, 8))
        elif kind in ("kube-apiserver restarted", "etcd restarted"):
            await self.restart(processes[kind.split()[0]])
        elif kind == "node agent lost":
            self.spawn(self.kill_and_restart(processes[self._next(kind, self.cluster.loners)], down=self.rng.uniform(20, 50)))
        elif kind == "deleted in flight":
            await self.delete_in_flight()
        self.counts[kind] += 1

    def spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def kill_and_restart(self, process: Process, down: float = 0.0) -> None:
        async with process.lock:
            process.held = True
            try:
                self.note(f"kill -9 {process.name}" + (f", down {down:.0f}s" if down else ""))
                with contextlib.suppress(ProcessLookupError):
                    process.signal(signal.SIGKILL)
                await asyncio.to_thread(process.server.process.wait)
                await asyncio.sleep(max(1.0, down))
                await process.start()
            finally:
                process.held = False

    async def pause(self, process: Process) -> None:
        seconds = self.cluster.lease_seconds + self.rng.uniform(3, 8)
        async with process.lock:
            process.held = True
            try:
                self.note(f"SIGSTOP {process.name} for {seconds:.0f}s (lease {self.cluster.lease_seconds:g}s)")
                process.signal(signal.SIGSTOP)
                await asyncio.sleep(seconds)
                process.signal(signal.SIGCONT)
            finally:
                process.held = False

    async def restart(self, process: Process) -> None:
        async with process.lock:
            process.held = True
            try:
                self.note(f"restart {process.name}")
                await asyncio.to_thread(process.server.stop)
                await process.start()
            finally:
                process.held = False

    async def delete_in_flight(self) -> None:
        """Up to 4 pods created but not bound yet: half of them deleted, the other half lose their
        claim (deleted), and then, the fault being done, the pod."""
        candidates = self.load.in_flight()
        chosen = self.rng.sample(candidates, min(4, len(candidates)))
        pods, claims = chosen[::2], chosen[1::2]
        for name in pods:
            self.load.delete_soon(name, 0.0, on_purpose="in flight")
        deleted_claims = 0
        for name in claims:
            self.load.deleted_on_purpose.setdefault(name, "claim deleted in flight")
            claim = await self.load.claim_of(name)
            if claim:
                with contextlib.suppress(KubeApiError):
                    await self.load.kube.delete(ResourceClaim, claim, self.load.namespace)
                    deleted_claims += 1
            self.load.delete_soon(name, 3.0, on_purpose="claim deleted in flight")
        self.counts["pods deleted in flight"] += len(pods)
        self.counts["claims deleted in flight"] += deleted_claims
        self.note(f"deleted in flight: pods {pods}, the claims of {claims}")

    async def drain(self) -> None:
        while self.background:
            await asyncio.gather(*list(self.background), return_exceptions=True)


async def _guarded(loop, what: str) -> None:
    """A loop of the run that must not end: logged and started again if it does."""
    while True:
        try:
            await loop()
            log.error("%s ended; starting it again", what)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the run's bookkeeping must go on
            log.exception("%s crashed; starting it again in 1 s", what)
        await asyncio.sleep(1.0)


# --- the load -----------------------------------------------------------------------------------------------


class Load:
    """Creates pods at a steady rate, watches them and their claims, deletes each a random time
    after it is bound."""

    def __init__(self, kube: KubeClient, namespace: str, rng: random.Random, lifetime: tuple[float, float]):
        self.kube = kube
        self.namespace = namespace
        self.rng = rng
        self.lifetime = lifetime
        self.created_at: dict[str, float] = {}
        self.create_failed: set[str] = set()
        self.template_of: dict[str, str] = {}
        self.bound_at: dict[str, float] = {}
        self.bound_uids: set[str] = set()
        self.deleted_on_purpose: dict[str, str] = {}  # name -> why, once its deletion was asked for
        self.to_delete: dict[str, tuple[float, str]] = {}  # name -> (when, why)
        self.settling = False  # no more deletions at the end of a lifetime: what runs stays
        self.pods: dict[str, Pod] = {}
        self.claims_allocated: set[str] = set()
        self.releases: collections.Counter[str] = collections.Counter()
        self.doubles: list[str] = []
        self.tasks: list[asyncio.Task] = []
        self._counter = 0

    def start(self) -> None:
        self.tasks = [asyncio.create_task(_guarded(loop, what)) for loop, what in (
            (self._watch_pods, "pods watch"), (self._watch_claims, "claims watch"), (self._deleter, "deleter"))]

    async def _watch_pods(self) -> None:
        async for event in watch_objects(self.kube, Pod, self.namespace):
            pod = event.object
            if pod is None:
                continue
            name = pod.metadata.name
            if event.type == "DELETED":
                self.pods.pop(name, None)
                self.to_delete.pop(name, None)
                continue
            self.pods[name] = pod
            if pod.spec.node_name and name not in self.bound_at:
                self.bound_at[name] = time.time()
                self.bound_uids.add(pod.metadata.uid)
                if name not in self.deleted_on_purpose and name not in self.to_delete and not self.settling:
                    self.delete_soon(name, self.rng.uniform(*self.lifetime), on_purpose="lifetime")

    async def _watch_claims(self) -> None:
        async for event in watch_objects(self.kube, ResourceClaim, self.namespace):
            claim = event.object
            if claim is None:
                continue
            uid = claim.metadata.uid
            allocated = event.type != "DELETED" and claim.status is not None and claim.status.allocation is not None
            if allocated:
                self.claims_allocated.add(uid)
            elif uid in self.claims_allocated:
                self.claims_allocated.discard(uid)
                self.releases[uid] += 1

    def delete_soon(self, name: str, after: float, *, on_purpose: str) -> None:
        when = time.monotonic() + after
        if name in self.to_delete:
            when = min(when, self.to_delete[name][0])
        self.to_delete[name] = (when, on_purpose)

    def settle(self) -> None:
        """Pods that would have finished stay: only the deletions of faults still happen."""
        self.settling = True
        for name, (_, why) in list(self.to_delete.items()):
            if why == "lifetime" and name not in self.deleted_on_purpose:
                del self.to_delete[name]

    async def _deleter(self) -> None:
        while True:
            now = time.monotonic()
            due = [(n, why) for n, (at, why) in self.to_delete.items() if at <= now]
            for name, why in due:
                # recorded before asking: a delete whose answer is lost may still have happened
                self.deleted_on_purpose.setdefault(name, why)
                try:
                    await self.kube.delete(Pod, name, self.namespace)
                    self.to_delete.pop(name, None)
                except KubeApiError:
                    self.to_delete[name] = (now + 2.0, why)  # the apiserver is down: again in a moment
            await asyncio.sleep(0.5)

    def in_flight(self) -> list[str]:
        return [n for n in self.created_at if n not in self.bound_at and n not in self.deleted_on_purpose
                and n not in self.to_delete and n in self.pods]

    async def claim_of(self, name: str) -> str | None:
        pod = self.pods.get(name)
        try:
            pod = await self.kube.get(Pod, name, self.namespace)
        except KubeApiError:
            pass
        for status in (pod.status.resource_claim_statuses if pod and pod.status else None) or ():
            if status.resource_claim_name:
                return status.resource_claim_name
        return None

    async def offer(self, rate: float, until: float) -> None:
        """One pod every 1/rate seconds until `until`, each created in a task of its own so a slow
        or failing create (the apiserver restarting) does not hold up the stream."""
        templates = [t for t, _, _ in CLAIM_MIX]
        weights = [w for _, w, _ in CLAIM_MIX]
        start = time.monotonic()
        pending: set[asyncio.Task] = set()
        i = 0
        while True:
            at = start + i / rate
            if at >= until:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            self._counter += 1
            name = f"c-{self._counter:05d}"
            template = self.rng.choices(templates, weights)[0]
            task = asyncio.create_task(self._create(name, template))
            pending.add(task)
            task.add_done_callback(pending.discard)
            i += 1
        await asyncio.gather(*pending, return_exceptions=True)

    async def _create(self, name: str, template: str) -> None:
        self.template_of[name] = template
        created = time.time()
        for attempt in range(30):
            try:
                await self.kube.create(scenario.pod(self.namespace, name, template_name=template, scheduler_name=SCHEDULER))
                self.created_at[name] = created
                return
            except KubeApiError as exc:
                if exc.is_already_exists:  # an earlier attempt did reach the apiserver
                    self.created_at[name] = created
                    return
                if not exc.retryable:
                    self.create_failed.add(name)
                    log.warning("creating pod %s failed: %s", name, exc)
                    return
            await asyncio.sleep(1.0)
        self.create_failed.add(name)

    async def check_devices(self, pools: dict[tuple[str, str], PoolFacts], stop: asyncio.Event) -> None:
        """Every 10 s, one consistent list of the claims, checked for devices given twice."""
        while not stop.is_set():
            with contextlib.suppress(KubeApiError):
                claims, _ = await self.kube.list(ResourceClaim, self.namespace)
                for problem in devices_given_twice(claims, pools):
                    if problem not in self.doubles:
                        self.doubles.append(problem)
                        print(f"DOUBLE: {problem}", flush=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 10.0)

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()


# --- one run ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Phase:
    name: str
    start: float  # unix time
    end: float

    def figures(self, load: Load) -> dict:
        created = [n for n, t in load.created_at.items() if self.start <= t < self.end]
        bound = [n for n, t in load.bound_at.items() if self.start <= t < self.end]
        latencies = [(load.bound_at[n] - load.created_at[n]) * 1000 for n in created if n in load.bound_at]
        seconds = self.end - self.start
        return {"seconds": seconds, "offered": len(created), "bound": len(bound),
                "offered_pods_per_s": len(created) / seconds, "bound_pods_per_s": len(bound) / seconds,
                "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99)}


async def create_namespace_and_templates(kube: KubeClient, namespace: str) -> None:
    await kube.request("POST", "/api/v1/namespaces", body={
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": namespace, "labels": {ADMIN_ACCESS_LABEL: "true"}}})
    for name, _, spec in CLAIM_MIX:
        await kube.apply_raw({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                              "metadata": {"name": name, "namespace": namespace}, "spec": {"spec": spec}})


async def settle(load: Load, cluster: Cluster, faults: Faults, seconds: float) -> float:
    """Every fault undone, every process up, then until every pod is bound, pending with a reason,
    or gone as asked (at most `seconds`). Returns how long it took."""
    started = time.monotonic()
    load.settle()
    await faults.drain()
    deadline = started + seconds
    while time.monotonic() < deadline:
        if all(p.alive() for p in cluster.processes.values()):
            break
        await asyncio.sleep(1.0)
    with contextlib.suppress(RuntimeError):
        await cluster.wait_for_slices(deadline)
    await cluster.wait_for_fresh_slices(deadline)
    while time.monotonic() < deadline:
        open_ = [n for n, p in load.pods.items()
                 if (n in load.deleted_on_purpose) or (not p.spec.node_name and pod_scheduled_false(p) is None)]
        if not open_ and not load.to_delete:
            break
        await asyncio.sleep(1.0)
    else:
        dead = [name for name, p in cluster.processes.items() if not p.alive()]
        print(f"chaos: not settled after {seconds:.0f}s: {len(open_)} pods open, e.g. {open_[:5]}; "
              f"{len(load.to_delete)} deletions waiting; processes down: {dead or 'none'}", flush=True)
    return time.monotonic() - started


async def final_pods(load: Load) -> dict:
    pods, _ = await load.kube.list(Pod, load.namespace)
    claims, _ = await load.kube.list(ResourceClaim, load.namespace)
    by_name = {p.metadata.name: p for p in pods}
    claims_by_name = {c.metadata.name: c for c in claims}
    bound, pending, lost, stuck, unreserved = [], collections.Counter(), [], [], []
    for name in load.created_at:
        pod = by_name.get(name)
        if name in load.deleted_on_purpose:
            if pod is not None:
                stuck.append(name)
            continue
        if pod is None:
            lost.append(f"{name}: gone, not deleted by the run")
        elif pod.spec.node_name:
            bound.append(name)
            for status in (pod.status.resource_claim_statuses if pod.status else None) or ():
                claim = claims_by_name.get(status.resource_claim_name or "")
                if claim is None or claim.status is None or claim.status.allocation is None or not any(
                        r.uid == pod.metadata.uid for r in claim.status.reserved_for or ()):
                    unreserved.append(name)
        elif (condition := pod_scheduled_false(pod)) is not None:
            pending[condition.reason or "?"] += 1
        else:
            lost.append(f"{name}: pending with no reason (template {load.template_of.get(name)})")
    return {"bound": bound, "pending": pending, "lost": lost, "stuck_deleting": stuck,
            "bound_without_claim": unreserved, "claims": claims}


def read_audit_log(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError:
        return []
    lines = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(line))
    return lines


async def audit_settled(path: Path, quiet: float = 3.0, limit: float = 30.0) -> list[dict]:
    """The audit log once it has stopped growing for `quiet` seconds (the subscriber caught up)."""
    deadline = time.monotonic() + limit
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        size = path.stat().st_size if path.exists() else 0
        if size != last:
            last, since = size, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
        await asyncio.sleep(0.5)
    return read_audit_log(path)


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" if k else "" for k, v in rows)


async def chaos(args) -> int:
    rng = random.Random(args.seed)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="draplane-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(workdir, args.nodes, args.lease_seconds)
    stop = asyncio.Event()
    started = time.monotonic()
    try:
        print(f"chaos: starting the cluster in {workdir} ({args.nodes} nodes, {SHARDS} shards, 3 NATS servers)", flush=True)
        await cluster.start()
        up_s = time.monotonic() - started
        expected, pools = cluster.expected_pools()
        kube = await KubeClient.from_kubeconfig(cluster.plane.kubeconfig)
        namespace = f"chaos-{uuid.uuid4().hex[:4]}"
        await create_namespace_and_templates(kube, namespace)
        load = Load(kube, namespace, rng, (args.min_lifetime, args.max_lifetime))
        load.start()
        faults = Faults(cluster, load, rng)
        watchdog = asyncio.create_task(cluster.watchdog(stop))
        checker = asyncio.create_task(load.check_devices(pools, stop))
        print(f"chaos: up in {up_s:.0f}s; {args.rate:g} pods/s, {args.calm_minutes:g} min without faults, then "
              f"{0 if args.no_faults else args.minutes:g} min with faults (seed {args.seed})", flush=True)

        phases = []
        t0 = time.time()
        await load.offer(args.rate, time.monotonic() + args.calm_minutes * 60)
        phases.append(Phase("calm", t0, time.time()))
        if not args.no_faults:
            t1 = time.time()
            until = time.monotonic() + args.minutes * 60
            injector = asyncio.create_task(faults.run(until, args.fault_interval))
            await load.offer(args.rate, until)
            phases.append(Phase("faults", t1, time.time()))  # the offered window; a last fault may still run
            await injector
        print("chaos: load stopped; undoing faults and settling", flush=True)
        settle_s = await settle(load, cluster, faults, args.settle_seconds)
        stop.set()
        await checker
        await watchdog
        result = await final_pods(load)
        for problem in devices_given_twice(result["claims"], pools):
            if problem not in load.doubles:
                load.doubles.append(problem)
        slices, _ = await kube.list(ResourceSlice)
        stale, duplicated = slice_problems(slices, expected)
        audit = audit_differences(await audit_settled(cluster.audit_log), load.bound_uids, dict(load.releases))
        load.stop()
        await kube.close()
    finally:
        stop.set()
        await asyncio.to_thread(cluster.stop)

    figures = {p.name: p.figures(load) for p in phases}
    unplanned = {name: p.unplanned for name, p in cluster.processes.items() if p.unplanned}
    audit_missing = audit["missing_placed"] + audit["missing_released"] + audit["sequence_gaps"]
    audit_repeated = audit["repeated_ids"] + audit["repeated_placed"] + audit["repeated_released"]
    lost = len(result["lost"]) + len(result["bound_without_claim"]) + len(result["stuck_deleting"])
    doubled = len(load.doubles)
    rows: list[tuple[str, str]] = []
    for name, f in figures.items():
        rows.append((f"load, {name} ({f['seconds']:.0f}s)",
                     f"offered {f['offered_pods_per_s']:.2f} pods/s ({f['offered']}), bound {f['bound_pods_per_s']:.2f} "
                     f"pods/s ({f['bound']}), create-to-bound p50 {f['p50_ms']:.0f} ms, p99 {f['p99_ms']:.0f} ms"))
    kinds = [k for k in (*FAULT_KINDS, "pods deleted in flight", "claims deleted in flight") if faults.counts.get(k)]
    rows.append(("faults injected", ", ".join(f"{k} {faults.counts[k]}" for k in kinds) or "none"))
    rows.append(("processes that died on their own",
                 "; ".join(f"{n}: {', '.join(h)}" for n, h in unplanned.items()) or "none"))
    rows.append(("pods offered", f"{len(load.created_at)} (creates that failed for good: {len(load.create_failed)})"))
    rows.append(("pods bound (still running)", str(len(result["bound"]))))
    rows.append(("pods pending with a reason", ", ".join(f"{r} {n}" for r, n in result["pending"].most_common()) or "0"))
    on_purpose = collections.Counter(load.deleted_on_purpose.values())
    rows.append(("pods deleted on purpose", ", ".join(f"{w} {n}" for w, n in on_purpose.most_common()) or "0"))
    rows.append(("pods lost", f"{len(result['lost'])}" + (f": {result['lost'][:5]}" if result["lost"] else "")))
    rows.append(("pods bound without their claim", f"{len(result['bound_without_claim'])}"
                 + (f": {result['bound_without_claim'][:5]}" if result["bound_without_claim"] else "")))
    rows.append(("pods deleted but still there", f"{len(result['stuck_deleting'])}"
                 + (f": {result['stuck_deleting'][:5]}" if result["stuck_deleting"] else "")))
    rows.append(("devices given twice", f"{doubled}" + (f": {load.doubles[:5]}" if doubled else "")))
    rows.append(("slices stale", f"{len(stale)}" + (f": {stale[:5]}" if stale else "")))
    rows.append(("slices duplicated", f"{len(duplicated)}" + (f": {duplicated[:5]}" if duplicated else "")))
    rows.append(("audit events", f"{audit['placed']} placed, {audit['released']} released"))
    rows.append(("audit events missing", f"{audit_missing} (placements {audit['missing_placed']}, releases "
                                         f"{audit['missing_released']}, sequence gaps {audit['sequence_gaps']})"))
    rows.append(("audit events repeated", f"{audit_repeated} (ids {audit['repeated_ids']}, placements "
                                          f"{audit['repeated_placed']}, releases {audit['repeated_released']})"))
    rows.append(("settled in", f"{settle_s:.0f}s; cluster up in {up_s:.0f}s; logs in {cluster.logs}"))
    print(f"\nchaos run: {args.nodes} nodes, seed {args.seed}\n" + table(rows), flush=True)
    if faults.log:
        print("\nfaults, in order:\n" + "\n".join(f"  {line}" for line in faults.log), flush=True)
    for name, f in figures.items():
        print(f"BENCH name=chaos phase={name} nodes={args.nodes} seconds={f['seconds']:.0f} "
              f"offered_pods_per_s={f['offered_pods_per_s']:.2f} bound_pods_per_s={f['bound_pods_per_s']:.2f} "
              f"p50_ms={f['p50_ms']:.0f} p99_ms={f['p99_ms']:.0f}", flush=True)
    if "faults" in figures and figures["calm"]["bound"]:
        calm, hit = figures["calm"], figures["faults"]
        print(f"BENCH name=chaos_ratio bound_rate_ratio={hit['bound_pods_per_s'] / calm['bound_pods_per_s']:.2f} "
              f"p50_ratio={hit['p50_ms'] / calm['p50_ms']:.2f} p99_ratio={hit['p99_ms'] / calm['p99_ms']:.2f}", flush=True)
    print(f"BENCH name=chaos_result lost={lost} doubled={doubled} slices_stale={len(stale)} "
          f"slices_duplicated={len(duplicated)} audit_missing={audit_missing} audit_repeated={audit_repeated} "
          f"faults={sum(faults.counts[k] for k in FAULT_KINDS)} unplanned_exits={sum(len(h) for h in unplanned.values())}",
          flush=True)
    failed = lost or doubled or stale or duplicated or audit_missing or audit_repeated
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="the phase with faults")
    parser.add_argument("--calm-minutes", type=float, default=None,
                        help="the fault-free phase before it (default: a tenth of --minutes, at least 0.5)")
    parser.add_argument("--no-faults", action="store_true", help="the fault-free phase alone")
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--rate", type=float, default=3.0, help="pods offered per second")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fault-interval", type=float, default=15.0,
                        help="mean seconds between faults (each interval drawn from 0.5x to 1.5x)")
    parser.add_argument("--min-lifetime", type=float, default=20.0, help="seconds a bound pod lives, at least")
    parser.add_argument("--max-lifetime", type=float, default=60.0)
    parser.add_argument("--lease-seconds", type=float, default=DEFAULT_LEASE_SECONDS,
                        help="the shards' and binder's reservation lease (default: theirs, %(default)g); a shard is "
                             "stopped a few seconds longer than this")
    parser.add_argument("--settle-seconds", type=float, default=180.0)
    parser.add_argument("--workdir", default=None, help="default: a fresh temporary folder (kept, with the logs)")
    args = parser.parse_args(argv)
    if args.calm_minutes is None:
        args.calm_minutes = max(0.5, args.minutes / 10)
    if args.nodes < len(PROFILES):
        parser.error(f"--nodes must be at least {len(PROFILES)}: one node of each profile")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvloop

    uvloop.install()
    return asyncio.run(chaos(args))


if __name__ == "__main__":
    sys.exit(main())

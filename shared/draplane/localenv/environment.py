"""The whole local environment of `draplane up` and `draplane demo`.

A real control plane (etcd, kube-apiserver, NATS), the services as separate processes
(inventory, N allocator shards, binder, the audit subscriber, node agents for a simulated
cluster), the Node objects a kubelet would have registered (KWOK then plays those kubelets), and
the standard DeviceClasses. Where the machine allows it (root, Debian's runc, CNI plugins and
busybox-static), one real node beside them: a real kubelet and containerd
(`draplane.localenv.realnode`), whose node agent is also its kubelet's DRA plugin, so pods there
run real containers with the devices the plugin prepared. Each run's logs go to a folder of
their own (`logs/run-<time>`, `logs/latest`), so a restarted `up` keeps the last runs' evidence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from draplane.localenv import binaries, natssecurity
from draplane.localenv.controlplane import ControlPlane
from draplane.localenv.controllermanager import controller_manager
from draplane.localenv.kwok import KWOK_ANNOTATION, KwokProcess, kwok_arguments
from draplane.localenv.processes import ServerProcess, StartupError, free_port
from draplane.messages.inventory import DEFAULT_PREFIX
from draplane.nats_roles import fleet_inbox_prefix

if TYPE_CHECKING:  # realnode is imported where a real node starts
    from draplane.localenv.realnode import RealNode  # noqa: F401

log = logging.getLogger(__name__)

# Profiles of the simulated cluster, in the order nodes are handed out. Their GPUs have 24 GB
# (L4), 40 GB (A100, with MIG) and 80 GB (H100) of memory: the seed's "more than 40Gi" fits only
# the H100 nodes, which is the point of the demo.
DEFAULT_PROFILES = ("l4", "a100-mig", "dgx-h100", "mixed")

NVIDIA_DRIVER = "gpu.nvidia.com"
NIC_DRIVER = "dra.net"
NIC_CLASS = "dranet"
# The real node: its agent simulates the mixed profile (H100, A100 with MIG, L4 and NICs of a second
# driver), so every class of the demo, the seed's high-memory one included, has a device there.
REAL_NODE_NAME = "real-0000"
REAL_NODE_PROFILE = "mixed"
NATS_PREFIX = DEFAULT_PREFIX  # the services' default subject prefix: `up` runs them with it


def standard_device_classes() -> list[dict]:
    """The classes NVIDIA's DRA driver installs, a high-memory class for the seed's intent, and
    `dranet` for the NICs the DGX and mixed nodes publish under the dra.net driver (DraNet
    installs no class of its own; `dranet` is the name its documentation gives one), so that a
    claim can ask for a GPU and the NIC beside it."""

    def device_class(name: str, expression: str) -> dict:
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expression}}]},
        }

    return [
        device_class("gpu.nvidia.com", "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"),
        device_class("mig.nvidia.com", "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"),
        device_class(
            "high-memory-gpu",
            '"memory" in device.capacity[device.driver] && '
            'device.capacity[device.driver].memory.isGreaterThan(quantity("40Gi"))',
        ),
        device_class(NIC_CLASS, f"device.driver == '{NIC_DRIVER}'"),
    ]


def node_names(profiles: tuple[str, ...], count: int) -> dict[str, list[str]]:
    """profile -> node names, `count` nodes dealt round-robin over the profiles."""
    names: dict[str, list[str]] = {p: [] for p in profiles}
    for index in range(count):
        profile = profiles[index % len(profiles)]
        names[profile].append(f"{profile}-{len(names[profile]):04d}")
    return {p: n for p, n in names.items() if n}


def state_dir() -> Path:
    configured = os.environ.get("DRAPLANE_STATE")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "draplane"


class AlreadyRunning(RuntimeError):
    pass


@dataclasses.dataclass
class Environment:
    workdir: Path
    plane: ControlPlane
    services: list[ServerProcess]
    nodes: dict[str, list[str]]  # the simulated (KWOK) nodes, by profile
    shards: int
    logs: Path  # this run's folder under workdir/logs; earlier runs' stay beside it
    real_node: "RealNode | None" = None
    real_node_absent: str = ""  # why there is no real node, when there is none
    _lock_file: object = None

    @property
    def processes(self) -> list[ServerProcess]:
        """Everything `up` supervises: the servers, the services, and the real node's processes."""
        return self.plane.processes + self.services + (self.real_node.processes if self.real_node else [])

    @property
    def kubeconfig(self) -> Path:
        return self.plane.kubeconfig

    def stop(self) -> None:
        # All services at once (each escalates to SIGKILL on its own), then the servers under them.
        for service in self.services:
            service.terminate()
        for service in self.services:
            service.stop()
        if self.real_node is not None:
            from draplane.localenv.realnode import remove_leftovers

            self.real_node.stop()  # its kubelet, containerd and containers; then the host as it was
            remove_leftovers(self.real_node.workdir, self.real_node.name)
            (self.workdir / "real-node").unlink(missing_ok=True)
        self.plane.stop()
        if self._lock_file is not None:
            (self.workdir / "up.json").unlink(missing_ok=True)
            self._lock_file.close()


def running_up(workdir: Path) -> dict | None:
    """What a `draplane up` running in `workdir` wrote to up.json (pid, kubeconfig, nats_url,
    nats_ca and nats_reader_seed, audit_log), or None when none runs there: a file left by a crash names a dead pid."""
    try:
        info = json.loads((workdir / "up.json").read_text())
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return info  # alive, someone else's
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info


def _take_lock(workdir: Path):
    workdir.mkdir(parents=True, exist_ok=True)
    lock = (workdir / "up.lock").open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        info = {}
        try:
            info = json.loads((workdir / "up.json").read_text())
        except (OSError, ValueError):
            pass
        raise AlreadyRunning(
            f"a draplane environment is already running in {workdir}"
            + (f" (pid {info['pid']}; kubeconfig {info['kubeconfig']})" if info else "")
            + "; stop it with Ctrl-C there, or use another --workdir"
        ) from None
    return lock


RUNS_KEPT = 10


def new_run_logs(workdir: Path, now: float | None = None) -> Path:
    """A fresh folder for this run's logs, `logs/run-<time>`, with `logs/latest` pointing at it;
    only the newest RUNS_KEPT runs are kept, so the folder stays bounded."""
    root = workdir / "logs"
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    run = root / f"run-{stamp}"
    suffix = 1
    while run.exists():
        suffix += 1
        run = root / f"run-{stamp}-{suffix}"
    run.mkdir()
    latest = root / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink()
    latest.symlink_to(run.name)
    for old in sorted((p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name.startswith("run-")),
                      key=lambda p: p.stat().st_mtime)[:-RUNS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)
    return run


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


async def start(
    *,
    node_count: int = 4,
    profiles: tuple[str, ...] = DEFAULT_PROFILES,
    shards: int = 2,
    workdir: Path | None = None,
    progress: Callable[[str], None] = print,
    timeout: float = 120.0,
    real_node: bool | None = None,
) -> Environment:
    """`real_node`: True requires one (StartupError when this machine cannot run it), False runs
    none, None runs one where `realnode.missing_prerequisites()` finds nothing missing."""
    from draplane.kube import KubeClient
    from draplane.localenv import realnode

    workdir = workdir or state_dir() / "up"
    lock = _take_lock(workdir)
    plane = None
    node: realnode.RealNode | None = None
    services: list[ServerProcess] = []
    try:
        # Each `up` starts from a clean cluster: the certificates are new, so old state is unusable.
        # The logs are evidence, though: every run keeps its own folder.
        logs = new_run_logs(workdir)
        shutil.rmtree(workdir / "controlplane", ignore_errors=True)
        shutil.rmtree(workdir / "nats-auth", ignore_errors=True)
        await asyncio.to_thread(binaries.ensure_all, progress=progress)
        nodes = node_names(profiles, node_count)
        real_node_absent = ""
        if real_node is not False:
            missing = realnode.missing_prerequisites()
            if missing and real_node:
                raise realnode.RealNodeError("the real node cannot run here; missing: " + "; ".join(missing))
            if missing:
                real_node_absent = "this machine cannot run one; missing: " + "; ".join(missing)
                progress(f"no real node: {real_node_absent}")
        else:
            real_node_absent = "not asked for"
        with_real_node = not real_node_absent
        agents = [natssecurity.NodeAgentIdentity(f"node-agent-{profile}", tuple(names), fleet_inbox_prefix(profile))
                  for profile, names in nodes.items()]
        if with_real_node:
            agents.append(natssecurity.NodeAgentIdentity("node-agent-real", (REAL_NODE_NAME,)))
        # NATS as deploy/ runs it: TLS, and each process its own key with its role's permissions
        # (draplane.nats_roles); each simulated fleet speaks for its own nodes only.
        security = await asyncio.to_thread(
            natssecurity.create, workdir / "nats-auth", prefix=NATS_PREFIX, agents=agents,
        )
        progress("starting etcd, kube-apiserver and NATS (TLS, a key per service)")
        plane = await asyncio.to_thread(ControlPlane.start, workdir / "controlplane", logs=logs / "controlplane",
                                        nats_security=security)
        audit_dir = logs / "audit"  # this run's: each run's NATS, and so its audit stream, is new
        (workdir / "up.json").write_text(json.dumps({"pid": os.getpid(), "kubeconfig": str(plane.kubeconfig),
                                                     "nats_url": plane.nats_url, "nats_ca": str(security.tls.ca_cert),
                                                     "nats_reader_seed": str(security.seed("reader")),
                                                     "audit_log": str(audit_dir / "audit.jsonl")}))
        # KWOK plays the kubelets of the simulated nodes: node heartbeats and Ready, pods Running,
        # graceful deletion completed. It only takes the nodes annotated for it.
        kwok = KwokProcess("kwok", [str(binaries.require(binaries.KWOK)), *kwok_arguments(plane.kubeconfig, workdir / "kwok.yaml")],
                           logs / "kwok.log", plane)
        kwok.start()
        services.append(kwok)
        manager = controller_manager(plane, logs / "kube-controller-manager.log")
        manager.start()
        services.append(manager)

        async with await KubeClient.from_kubeconfig(plane.kubeconfig) as kube:
            for profile, names in nodes.items():
                for name in names:
                    await _register_node(kube, name, profile)
            for device_class in standard_device_classes():
                await _apply(kube, device_class)

        env = dict(os.environ, KUBECONFIG=str(plane.kubeconfig), DRAPLANE_NATS_URL=plane.nats_url, PYTHONUNBUFFERED="1")
        python = sys.executable

        def service(name: str, identity: str, module: str, *args: str) -> ServerProcess:
            process = ServerProcess(name, [python, "-m", module, *args], logs / f"{name}.log",
                                    env={**env, **security.environment(identity)})
            process.start()
            services.append(process)
            return process

        probes: list[tuple[ServerProcess, str]] = []
        port = free_port()
        probes.append((service("inventory", "inventory", "draplane_inventory", f"--listen=127.0.0.1:{port}"), f"http://127.0.0.1:{port}/readyz"))
        for shard in range(shards):
            port = free_port()
            probes.append((
                service(f"allocator-{shard}", "allocator", "draplane_allocator", f"--shards={shards}", f"--shard-index={shard}", f"--port={port}"),
                f"http://127.0.0.1:{port}/readyz",
            ))
        port = free_port()
        probes.append((
            # kube-controller-manager's resourceclaim controller makes and cleans up claims here
            service("binder", "binder", "draplane_binder", f"--shards={shards}", "--scheduler-name=draplane",
                    "--scheduler-name=default-scheduler", "--no-manage-claims", f"--port={port}"),
            f"http://127.0.0.1:{port}/readyz",
        ))
        port = free_port()
        probes.append((service("audit", "audit", "draplane_audit", f"--log-dir={audit_dir}", f"--port={port}"),
                       f"http://127.0.0.1:{port}/readyz"))
        for profile, names in nodes.items():
            service(f"node-agent-{profile}", f"node-agent-{profile}", "draplane_node_agent", f"--profile={profile}", f"--nodes={len(names)}",
                    f"--node-prefix={profile}")

        progress(f"starting inventory, {shards} allocator shards, binder, audit and node agents for {node_count} nodes")
        deadline = time.monotonic() + timeout

        for process, url in probes:
            await asyncio.to_thread(process.wait_ready, lambda url=url: _ready(url), max(1.0, deadline - time.monotonic()))
        for process in services:
            if not process.alive():
                raise StartupError(f"{process.name} exited while starting (log: {process.log_path}):\n{process.log_tail()}")
        await _wait_for_slices(plane, nodes, deadline)
        if with_real_node:
            node, real_node_absent = await _add_real_node(
                workdir, logs, plane, service, services, required=bool(real_node), progress=progress, timeout=timeout)
        return Environment(workdir=workdir, plane=plane, services=services, nodes=nodes, shards=shards, logs=logs,
                           real_node=node, real_node_absent=real_node_absent, _lock_file=lock)
    except BaseException:
        for process in reversed(services):
            process.stop()
        if node is not None:
            await asyncio.to_thread(node.stop)
        if plane is not None:
            await asyncio.to_thread(plane.stop)
        (workdir / "up.json").unlink(missing_ok=True)  # it names this process, which runs no environment now
        lock.close()
        raise


def real_node_dir(workdir: Path) -> Path:
    """The real node's folder. The kubelet's sockets live under it and a Unix socket path holds
    107 bytes, so it is short, under /tmp, whatever `workdir` is; one per workdir, which `up`'s
    lock keeps to one user at a time."""
    import hashlib

    return Path("/tmp") / f"draplane-node-{hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:10]}"


async def _start_real_node(workdir: Path, logs: Path, plane: ControlPlane):
    from draplane.localenv import realnode

    # The agent serves the kubelet's gRPC API from stubs generated from k8s.io/kubelet's protos
    # (`make servers` does it once; this is a no-op then).
    generated = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "draplane_node_agent.kubelet_api"], capture_output=True, text=True)
    if generated.returncode != 0:
        raise realnode.RealNodeError(f"the kubelet's gRPC stubs could not be generated:\n{generated.stderr[-2000:]}")
    folder = real_node_dir(workdir)
    await asyncio.to_thread(realnode.remove_leftovers, folder, REAL_NODE_NAME)
    folder.mkdir(parents=True, exist_ok=True)
    (workdir / "real-node").unlink(missing_ok=True)
    (workdir / "real-node").symlink_to(folder)  # where to look, from the workdir
    try:
        return await asyncio.to_thread(
            realnode.RealNode.start, name=REAL_NODE_NAME, workdir=folder, logs=logs / "real-node",
            kubeconfig=plane.kubeconfig, ca_file=plane.ca_file, images=binaries.cache_dir() / "images",
            index=realnode.free_bridge_index())
    except BaseException as exc:
        # RealNode.start undid its own steps; the folder made for it goes too
        await asyncio.to_thread(realnode.remove_leftovers, folder, REAL_NODE_NAME)
        (workdir / "real-node").unlink(missing_ok=True)
        if isinstance(exc, StartupError) and not isinstance(exc, realnode.RealNodeError):
            raise realnode.RealNodeError(f"the real node {REAL_NODE_NAME} did not start: {exc}") from exc
        raise


async def _add_real_node(workdir: Path, logs: Path, plane: ControlPlane, service: Callable[..., ServerProcess],
                         services: list[ServerProcess], *, required: bool, progress: Callable[[str], None],
                         timeout: float):
    """(the started RealNode, "") once it is Ready with its slices published, or, where it is not
    `required`, (None, why not) after undoing what was started: a machine that seemed able to run
    it but cannot (a cgroup layout the kubelet refuses, say) still gets the simulated cluster."""
    from draplane.localenv import realnode

    progress(f"starting the real node {REAL_NODE_NAME}: containerd, the kubelet, and its node agent as the "
             "kubelet's DRA plugin")
    deadline = time.monotonic() + timeout
    node: realnode.RealNode | None = None
    agent: ServerProcess | None = None
    try:
        node = await _start_real_node(workdir, logs, plane)
        port = free_port()
        agent = service("node-agent-real", "node-agent-real", "draplane_node_agent", f"--profile={REAL_NODE_PROFILE}",
                        f"--node={REAL_NODE_NAME}", "--kubelet-plugin", f"--kubelet-dir={node.kubelet_dir}",
                        f"--cdi-dir={node.cdi_dir}", f"--kubeconfig={plane.kubeconfig}", "--health-switch",
                        f"--listen=127.0.0.1:{port}")
        await asyncio.to_thread(agent.wait_ready, lambda: _ready(f"http://127.0.0.1:{port}/readyz"),
                                max(1.0, deadline - time.monotonic()))
        await _wait_for_slices(plane, {REAL_NODE_PROFILE: [REAL_NODE_NAME]}, deadline)
        await _wait_for_real_node(plane, REAL_NODE_NAME, node, deadline)
        return node, ""
    except BaseException as exc:
        if agent is not None:
            services.remove(agent)
            agent.stop()
        if node is not None:
            await asyncio.to_thread(node.stop)
            await asyncio.to_thread(realnode.remove_leftovers, node.workdir, node.name)
        if required or not isinstance(exc, StartupError):
            raise
        why = f"it did not start: {exc}"
        progress(f"no real node: {why} (logs: {logs / 'real-node'}; `--real-node` makes this an error)")
        return None, why


async def _wait_for_real_node(plane: ControlPlane, name: str, node, deadline: float) -> None:
    """Ready, and schedulable: the node lifecycle controller of kube-controller-manager lifts the
    not-ready taint the apiserver gave the new Node once its kubelet reports Ready."""
    from draplane.api import core
    from draplane.kube import KubeApiError, KubeClient

    async with await KubeClient.from_kubeconfig(plane.kubeconfig) as kube:
        while True:
            try:
                found = await kube.get(core.Node, name)
            except KubeApiError as exc:
                if not exc.is_not_found:
                    raise
                found = None
            if found is not None:
                ready = any(c.type == "Ready" and c.status == "True" for c in (found.status.conditions or []))
                not_ready_taint = any(t.key.startswith("node.kubernetes.io/not-ready") for t in (found.spec.taints or []))
                if ready and not not_ready_taint:
                    return
            if time.monotonic() > deadline:
                raise StartupError(f"the real node {name} did not become Ready and untainted in time; see "
                                   f"{node.logs / 'kubelet.log'} and kube-controller-manager.log")
            await asyncio.sleep(0.5)


async def _register_node(kube, name: str, profile: str) -> None:
    """What a kubelet does at its start: register the Node with its allocatable CPU, memory and
    pods. KWOK, which the annotation hands the node to, keeps it Ready from then on."""
    from draplane.api import core
    from draplane.api.meta import ObjectMeta
    from draplane.kube import KubeApiError

    node = core.Node(metadata=ObjectMeta(name=name, labels={
        "kubernetes.io/hostname": name, "draplane.dev/profile": profile, "node.kubernetes.io/instance-type": profile,
    }, annotations={KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"}))
    try:
        await kube.create(node)
    except KubeApiError as exc:
        if not exc.is_already_exists:
            raise
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {"capacity": capacity, "allocatable": capacity,
              "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated by draplane up",
                              "lastHeartbeatTime": now, "lastTransitionTime": now}]}
    await kube.patch(core.Node, name, {"status": status}, subresource="status")
    # The TaintNodesByCondition admission plugin gives every new Node the not-ready taint; the
    # node lifecycle controller would lift it once the kubelet reports Ready. There is no such
    # controller here, so we lift it ourselves.
    await kube.patch(core.Node, name, {"spec": {"taints": None}})


async def _apply(kube, raw: dict) -> None:
    """Create, or replace what is there: the standard objects are ours to define."""
    from draplane.kube import KubeApiError
    from draplane.kube.client import raw_collection_path

    path = raw_collection_path(raw)
    try:
        await kube.request("POST", path, body=raw, query={"fieldValidation": "Strict"})
    except KubeApiError as exc:
        if not exc.is_already_exists:
            raise
        await kube.request("PATCH", f"{path}/{raw['metadata']['name']}", body=raw, content_type="application/merge-patch+json")


async def _wait_for_slices(plane: ControlPlane, nodes: dict[str, list[str]], deadline: float) -> None:
    from draplane.api import resource
    from draplane.kube import KubeClient

    expected = {name for names in nodes.values() for name in names}
    async with await KubeClient.from_kubeconfig(plane.kubeconfig) as kube:
        while True:
            slices, _ = await kube.list(resource.ResourceSlice)
            seen = {s.spec.node_name for s in slices if s.spec.node_name}
            if expected <= seen:
                return
            if time.monotonic() > deadline:
                raise StartupError(f"no ResourceSlices appeared for nodes {sorted(expected - seen)}; see the inventory and node-agent logs")
            await asyncio.sleep(0.5)

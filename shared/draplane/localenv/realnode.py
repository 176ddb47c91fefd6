"""One real node beside the KWOK nodes: a real kubelet and containerd run real containers, so a pod
that draplane binds there starts only if its devices were prepared (the node agent's kubelet
plugin, and CDI in containerd).

What it takes on this machine (checked; see the README's "The real node"):
- the kubelet (same wrapper build as the other Kubernetes binaries) and containerd v2 built from
  Go modules; runc, the CNI plugins and busybox-static from Debian's packages;
- cgroups v1 with cgroupfs, swap allowed; containerd must not raise oom_score_adj (no
  CAP_SYS_RESOURCE in this sandbox: runc fails with "can't get final child's PID from pipe");
- no image registry is reachable: containerd pulls docker.io and draplane.local from our own
  registry of busybox images (`images.py`).

The kubelet changes the host. Everything it can be pointed elsewhere for lives in `workdir`
(its root dir, pod logs, CNI state, netns mounts, a cgroup root of its own); the rest (sysctls,
iptables chains, /var/lib/kubelet/device-plugins, /var/log/containers) is recorded before the
start and put back by `stop()`. Each start step has its undo beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from draplane.localenv import binaries
from draplane.localenv.images import MIRRORED_REGISTRIES, PAUSE_IMAGE
from draplane.localenv.processes import ServerProcess, StartupError, free_port

RUNC = Path("/usr/sbin/runc")
CNI_BIN_DIR = Path("/usr/lib/cni")
DEBIAN_PACKAGES = "runc containernetworking-plugins busybox-static"
# Set by the kubelet at start (its protectKernelDefaults=false path); put back at stop.
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
HOST_PATHS = (Path("/var/lib/kubelet/device-plugins"), Path("/var/lib/kubelet"), Path("/var/log/containers"))
CGROUP_FS = Path("/sys/fs/cgroup")
POD_SUBNET = "10.244.{index}.0/24"
# Its kubelet registers the Node with this label: what pods meant for the real node select.
REAL_NODE_LABEL = ("draplane.dev/real-node", "true")


class RealNodeError(StartupError):
    pass


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run a real node; empty when it can."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (the kubelet and containerd manage cgroups, mounts and network namespaces)")
    for path in (RUNC, CNI_BIN_DIR / "bridge", CNI_BIN_DIR / "host-local", CNI_BIN_DIR / "loopback", Path("/usr/bin/busybox")):
        if not path.exists():
            missing.append(f"{path} (Debian packages: {DEBIAN_PACKAGES})")
    if not (CGROUP_FS / "memory").is_dir() and not (CGROUP_FS / "cgroup.controllers").is_file():
        missing.append(f"cgroups under {CGROUP_FS}")
    return missing


def _controllers() -> list[Path]:
    """The cgroup hierarchies: one folder per mounted v1 controller set, and the v2 one beside them
    (the kubelet makes its cgroup root in both)."""
    seen, result = set(), []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        if fields[separator + 1] in ("cgroup", "cgroup2"):
            path = Path(fields[4])
            if path not in seen:
                seen.add(path)
                result.append(path)
    return result


def _read_sysctls() -> dict[str, str]:
    values = {}
    for name in KUBELET_SYSCTLS:
        path = Path("/proc/sys") / name
        if path.exists():
            values[name] = path.read_text().strip()
    return values


def _restore_sysctls(values: dict[str, str]) -> None:
    for name, value in values.items():
        try:
            (Path("/proc/sys") / name).write_text(value)
        except OSError:
            pass


def _iptables_chains() -> dict[tuple[str, str], set[str]]:
    chains: dict[tuple[str, str], set[str]] = {}
    for tool in ("iptables", "ip6tables"):
        if shutil.which(tool) is None:
            continue
        for table in ("filter", "nat", "mangle"):
            out = subprocess.run([tool, "-t", table, "-S"], capture_output=True, text=True).stdout
            chains[(tool, table)] = {line.split()[1] for line in out.splitlines() if line.startswith("-N ")}
    return chains


def _remove_new_iptables_chains(before: dict[tuple[str, str], set[str]]) -> None:
    """Delete the rules that jump to chains created since `before`, then those chains."""
    for (tool, table), chains in _iptables_chains().items():
        new = chains - before.get((tool, table), set())
        if not new:
            continue
        rules = subprocess.run([tool, "-t", table, "-S"], capture_output=True, text=True).stdout.splitlines()
        for rule in rules:
            parts = rule.split()
            if parts[:1] == ["-A"] and parts[1] not in new and any(p in new for p in parts[2:]):
                subprocess.run([tool, "-t", table, "-D", *parts[1:]], capture_output=True)
        for chain in new:
            subprocess.run([tool, "-t", table, "-F", chain], capture_output=True)
        for chain in new:
            subprocess.run([tool, "-t", table, "-X", chain], capture_output=True)


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point.startswith(prefix) or point == prefix.rstrip("/"):
            found.append(point)
    return sorted(found, key=len, reverse=True)


def _unmount_all(root: Path) -> None:
    for _ in range(3):  # a mount may hide another under it
        points = _mounts_under(root)
        if not points:
            return
        for point in points:
            subprocess.run(["umount", "-l", point], capture_output=True)


def _kill_cgroup_tree(folder: Path) -> None:
    if not folder.is_dir():
        return
    for procs in folder.rglob("cgroup.procs"):
        try:
            pids = [int(p) for p in procs.read_text().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _remove_cgroup_tree(folder: Path) -> None:
    if not folder.is_dir():
        return
    for child in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        try:
            child.rmdir()
        except OSError:
            pass
    try:
        folder.rmdir()
    except OSError:
        pass


def _shim_pids(socket: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # The cache's binary is versioned (containerd-shim-runc-v2-v2.4.2), and containerd runs it by
        # its resolved path: match the name's stem, and the socket of this node's containerd.
        if cmdline and b"containerd-shim-runc-v2" in cmdline[0].rsplit(b"/", 1)[-1] and str(socket).encode() in cmdline:
            pids.append(int(proc.name))
    return pids


def remove_leftovers(workdir: Path, name: str) -> None:
    """What a real node killed without its stop left behind (`up` killed by -9, a crash): its
    containers' shims, its cgroups, mounts under its folder, then the folder. Mounts go first, so
    that removing the folder never follows a bind mount into the host's files."""
    for pid in _shim_pids(workdir / "containerd.sock"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    controllers = _controllers()
    for controller in controllers:
        _kill_cgroup_tree(controller / f"draplane-{name}")
    time.sleep(0.2 if controllers else 0)
    for controller in controllers:
        _remove_cgroup_tree(controller / f"draplane-{name}")
    _unmount_all(workdir)
    if not _mounts_under(workdir):
        shutil.rmtree(workdir, ignore_errors=True)


def free_bridge_index(first: int = 2) -> int:
    """The first `dpl<N>` bridge (and pod subnet 10.244.N.0/24) no other real node on this machine uses."""
    for index in range(first, 250):
        if not Path(f"/sys/class/net/dpl{index}").exists():
            return index
    raise RealNodeError("no free bridge dpl2..dpl249 for the real node's pods")


def containerd_config(workdir: Path, *, cdi_dir: Path, registry: str) -> str:
    state, root = workdir / "containerd-state", workdir / "containerd-root"
    return f"""version = 3
root = '{root}'
state = '{state}'

[grpc]
  address = '{workdir / "containerd.sock"}'

[ttrpc]
  address = '{workdir / "containerd.sock.ttrpc"}'

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '{PAUSE_IMAGE}'
    [plugins.'io.containerd.cri.v1.images'.registry]
      config_path = '{workdir / "registry-hosts"}'

  [plugins.'io.containerd.cri.v1.runtime']
    enable_cdi = true
    cdi_spec_dirs = ['{cdi_dir}']
    # No CAP_SYS_RESOURCE in this sandbox: runc cannot raise a container's oom_score_adj.
    restrict_oom_score_adj = true
    # The pods' network namespaces under the state folder, not /run/netns: removed with it.
    netns_mounts_under_state_dir = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '{RUNC}'
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{CNI_BIN_DIR}']
      conf_dir = '{workdir / "cni"}'

  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = '127.0.0.1'
    stream_server_port = '0'

  [plugins.'io.containerd.nri.v1.nri']
    disable = true
"""


def registry_hosts(registry: str) -> dict[str, str]:
    """hosts.toml per mirrored registry: every pull goes to our registry, plain HTTP."""
    return {name: f"server = 'http://{registry}'\n\n[host.'http://{registry}']\n  capabilities = ['pull', 'resolve']\n"
            for name in MIRRORED_REGISTRIES}


def cni_config(name: str, workdir: Path, index: int) -> dict:
    # A bridge of its own, addresses on this machine only: no uplink, no NAT.
    return {"cniVersion": "1.0.0", "name": f"draplane-{name}", "plugins": [
        {"type": "bridge", "bridge": f"dpl{index}", "isGateway": True, "ipMasq": False, "hairpinMode": True,
         "ipam": {"type": "host-local", "dataDir": str(workdir / "cni-ipam"),
                  "ranges": [[{"subnet": POD_SUBNET.format(index=index)}]], "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "loopback"},
    ]}


def kubelet_config(workdir: Path, *, port: int, healthz_port: int, cgroup_root: str, ca_file: Path) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": f"unix://{workdir / 'containerd.sock'}",
        "cgroupDriver": "cgroupfs", "cgroupRoot": cgroup_root, "failSwapOn": False, "failCgroupV1": False,
        # The API server calls it at the node's InternalIP for logs and exec, with a certificate of
        # the cluster's CA: nothing else is let in.
        "address": "0.0.0.0", "port": port, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(ca_file)}},
        "authorization": {"mode": "AlwaysAllow"},
        "podLogsDir": str(workdir / "pod-logs"),
        "resolvConf": "",
        # The images come from our registry: never collect them, never evict for a full disk.
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "0%", "imagefs.available": "0%"},
        "registerNode": True, "nodeStatusUpdateFrequency": "4s", "syncFrequency": "10s",
        "serializeImagePulls": False, "maxPods": 20,
        "kubeReserved": {}, "systemReserved": {},
        "enforceNodeAllocatable": ["pods"],
    }


@dataclasses.dataclass
class RealNode:
    name: str
    workdir: Path
    logs: Path
    kubeconfig: Path
    ca_file: Path
    registry: str = ""
    processes: list[ServerProcess] = dataclasses.field(default_factory=list)
    _undo: list = dataclasses.field(default_factory=list)

    @property
    def kubelet_dir(self) -> Path:
        return self.workdir / "kubelet"

    @property
    def cdi_dir(self) -> Path:
        return self.workdir / "cdi"

    @property
    def cgroup_root(self) -> str:
        return f"/draplane-{self.name}"

    @classmethod
    def start(cls, *, name: str, workdir: Path, logs: Path, kubeconfig: Path, ca_file: Path, images: Path, index: int = 1,
              timeout: float = 120.0) -> "RealNode":
        """Start the registry, containerd and the kubelet; returns once the kubelet serves. The
        node registers itself; `wait_ready` waits for the API server to see it Ready."""
        missing = missing_prerequisites()
        if missing:
            raise RealNodeError("the real node cannot run here; missing: " + "; ".join(missing))
        # Unix socket paths hold 107 bytes: keep the folder short.
        if len(str(workdir / "kubelet" / "plugins_registry" / "gpu.nvidia.com-reg.sock")) > 107:
            raise RealNodeError(f"{workdir}: too long for the sockets under it; use a shorter folder")
        node = cls(name=name, workdir=workdir, logs=logs, kubeconfig=kubeconfig, ca_file=ca_file)
        try:
            node._start_registry(images, timeout)
            node._record_host()
            node._start_containerd(index, timeout)
            node._start_kubelet(timeout)
        except BaseException:
            node.stop()
            raise
        return node

    # --- start steps, each with its undo -------------------------------------------------------

    def _process(self, name: str, argv: list[str], env: dict | None = None) -> ServerProcess:
        process = ServerProcess(name, argv, self.logs / f"{name}.log", env=env)
        process.start()
        self.processes.append(process)
        return process

    def _start_registry(self, images: Path, timeout: float) -> None:
        import sys

        port = free_port()
        self.registry = f"127.0.0.1:{port}"
        process = self._process("registry", [sys.executable, "-m", "draplane.localenv.images", "--layout", str(images),
                                             "--listen", self.registry])
        process.wait_ready(lambda: _http_ok(f"http://{self.registry}/v2/"), timeout)

    def _record_host(self) -> None:
        sysctls = _read_sysctls()
        chains = _iptables_chains()
        absent = [p for p in HOST_PATHS if not p.exists()]
        existing_links = set(os.listdir("/var/log/containers")) if Path("/var/log/containers").is_dir() else set()

        def undo() -> None:
            _restore_sysctls(sysctls)
            _remove_new_iptables_chains(chains)
            if Path("/var/log/containers").is_dir():
                for entry in set(os.listdir("/var/log/containers")) - existing_links:
                    Path("/var/log/containers", entry).unlink(missing_ok=True)
            for path in absent:
                shutil.rmtree(path, ignore_errors=True)

        self._undo.append(undo)

    def _start_containerd(self, index: int, timeout: float) -> None:
        work = self.workdir
        for folder in ("cni", "registry-hosts", "bin", "pod-logs", "cdi"):
            (work / folder).mkdir(parents=True, exist_ok=True)
        (work / "containerd.toml").write_text(containerd_config(work, cdi_dir=self.cdi_dir, registry=self.registry))
        for registry, text in registry_hosts(self.registry).items():
            (work / "registry-hosts" / registry).mkdir(exist_ok=True)
            (work / "registry-hosts" / registry / "hosts.toml").write_text(text)
        (work / "cni" / "10-draplane.conflist").write_text(json.dumps(cni_config(self.name, work, index), indent=1))
        # containerd finds its shim on PATH by its plain name.
        shim = work / "bin" / "containerd-shim-runc-v2"
        shim.unlink(missing_ok=True)
        shim.symlink_to(binaries.require(binaries.CONTAINERD_SHIM))
        containerd = binaries.require(binaries.CONTAINERD)
        socket = work / "containerd.sock"
        process = self._process("containerd", [str(containerd), "--config", str(work / "containerd.toml")],
                                env={**os.environ, "PATH": f"{work / 'bin'}:{os.environ.get('PATH', '')}"})

        def undo() -> None:
            # Containers outlive containerd in their shims: kill the shims, then what they ran.
            for pid in _shim_pids(socket):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            bridge = f"dpl{index}"
            subprocess.run(["ip", "link", "delete", bridge], capture_output=True)

        self._undo.append(undo)
        process.wait_ready(socket.exists, timeout)

    def _start_kubelet(self, timeout: float) -> None:
        controllers = _controllers()
        for controller in controllers:
            (controller / self.cgroup_root.lstrip("/")).mkdir(exist_ok=True)

        def undo_cgroups() -> None:
            for controller in controllers:
                _kill_cgroup_tree(controller / self.cgroup_root.lstrip("/"))
            time.sleep(0.2)
            for controller in controllers:
                _remove_cgroup_tree(controller / self.cgroup_root.lstrip("/"))
            _unmount_all(self.workdir)

        self._undo.append(undo_cgroups)
        port, healthz = free_port(), free_port()
        config = kubelet_config(self.workdir, port=port, healthz_port=healthz, cgroup_root=self.cgroup_root,
                                ca_file=self.ca_file)
        (self.workdir / "kubelet.yaml").write_text(json.dumps(config, indent=1))
        self.kubelet_dir.mkdir(parents=True, exist_ok=True)
        kubelet = binaries.require(binaries.KUBELET)
        process = self._process("kubelet", [
            str(kubelet), f"--config={self.workdir / 'kubelet.yaml'}", f"--kubeconfig={self.kubeconfig}",
            f"--root-dir={self.kubelet_dir}", f"--cert-dir={self.workdir / 'kubelet-pki'}",
            f"--hostname-override={self.name}", f"--node-labels={REAL_NODE_LABEL[0]}={REAL_NODE_LABEL[1]}", "--v=2",
        ])
        process.wait_ready(lambda: _http_ok(f"http://127.0.0.1:{healthz}/healthz"), timeout)

    def restart_kubelet(self, timeout: float = 60.0) -> None:
        kubelet = next(p for p in self.processes if p.name == "kubelet")
        kubelet.stop()
        kubelet.start()
        port = json.loads((self.workdir / "kubelet.yaml").read_text())["healthzPort"]
        kubelet.wait_ready(lambda: _http_ok(f"http://127.0.0.1:{port}/healthz"), timeout)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        for undo in reversed(self._undo):
            try:
                undo()
            except Exception:  # the rest must still run
                pass
        self._undo.clear()
        self.processes.clear()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False

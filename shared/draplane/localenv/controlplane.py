"""Start a real local control plane on free loopback ports: etcd, kube-apiserver and NATS JetStream.

Used by the tests, `draplane up` and the demo. Everything runs as child processes of ours that die
with us; `stop()` shuts them down in reverse order and escalates to SIGKILL if one hangs.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import re
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from draplane.localenv import binaries, pki
from draplane.localenv.processes import ServerProcess, StartupError, ensure_port_free, free_port

log = logging.getLogger(__name__)

# The resource.k8s.io versions served next to v1: older clients and DeviceTaintRules still use them.
RESOURCE_API_VERSIONS = ("v1beta1", "v1beta2", "v1alpha3")

# The Workload API (KEP-4671) that gangs are read from: Workload and PodGroup in
# scheduling.k8s.io/v1beta1 and the pod's spec.schedulingGroup (GenericWorkload, beta in 1.37 and
# off by default), a PodGroup's schedulingConstraints.topology (TopologyAwareWorkloadScheduling,
# alpha) and its resourceClaims (DRAWorkloadResourceClaims, beta, which needs GenericWorkload).
WORKLOAD_FEATURE_GATES = ("GenericWorkload", "TopologyAwareWorkloadScheduling", "DRAWorkloadResourceClaims")
WORKLOAD_API_VERSION = "scheduling.k8s.io/v1beta1"

_FEATURE_GATE_RE = re.compile(r"^\s+(?:kube:)?(\w+)=true\|false \((ALPHA|BETA) - default=(true|false)\)", re.M)


@dataclasses.dataclass(slots=True)
class Ports:
    etcd_client: int = 0
    etcd_peer: int = 0
    apiserver: int = 0
    nats: int = 0
    nats_monitor: int = 0

    def resolve(self) -> "Ports":
        """Pick free ports for the ones left at 0; check the ones given explicitly."""
        names = {
            "etcd_client": "etcd client",
            "etcd_peer": "etcd peer",
            "apiserver": "kube-apiserver",
            "nats": "nats-server",
            "nats_monitor": "nats-server monitoring",
        }
        for field, what in names.items():
            port = getattr(self, field)
            if port:
                ensure_port_free(port, what)
            else:
                setattr(self, field, free_port())
        return self


def dra_feature_gates(apiserver: Path) -> dict[str, bool]:
    """Every DRA feature gate this kube-apiserver knows that is not locked on, switched on, and
    the Workload API's gates (`WORKLOAD_FEATURE_GATES`) that it knows.

    Read from the binary's own --help, so the list is right for whatever version is built; a gate
    that the version does not know would make the apiserver refuse to start.
    """
    cached = _feature_gate_cache(apiserver)
    if cached.is_file():
        return json.loads(cached.read_text())
    help_text = subprocess.run([str(apiserver), "--help"], capture_output=True, text=True, timeout=60).stdout
    gates = {
        name: True
        for name, _stage, _default in _FEATURE_GATE_RE.findall(help_text)
        if name.startswith("DRA") or name == "DynamicResourceAllocation" or name in WORKLOAD_FEATURE_GATES
    }
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(gates, sort_keys=True))
    return gates


def _feature_gate_cache(apiserver: Path) -> Path:
    # "-workload": the lists cached before the Workload API's gates joined them lack those gates.
    return binaries.cache_dir() / "feature-gates" / f"{apiserver.name}-{apiserver.stat().st_size}-workload.json"


@dataclasses.dataclass
class ControlPlane:
    """A running local control plane. Create with `ControlPlane.start()`; stop with `stop()`."""

    workdir: Path
    ports: Ports
    kubeconfig: Path
    ca_file: Path
    client_cert: Path
    client_key: Path
    processes: list[ServerProcess]
    feature_gates: dict[str, bool]
    _owns_workdir: bool = False
    # The CA that signed nats-server's certificate, when it was started with TLS (`nats_security`).
    nats_ca: Path | None = None

    @property
    def apiserver_url(self) -> str:
        return f"https://127.0.0.1:{self.ports.apiserver}"

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.ports.nats}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.etcd_client}"

    def process(self, name: str) -> ServerProcess:
        return next(p for p in self.processes if p.name == name)

    @classmethod
    def start(
        cls,
        workdir: Path | None = None,
        *,
        ports: Ports | None = None,
        with_nats: bool = True,
        with_kubernetes: bool = True,
        startup_timeout: float = 90.0,
        logs: Path | None = None,
        nats_security=None,
    ) -> "ControlPlane":
        """`logs`: where the servers' logs go (default `workdir/logs`); `draplane up` keeps them
        per run, outside the workdir it clears. `nats_security` (a `natssecurity.NatsSecurity`):
        nats-server takes TLS and only its users, each with its role's permissions; without it
        NATS is open to any client on loopback (the tests' shared server)."""
        owns = workdir is None
        workdir = Path(tempfile.mkdtemp(prefix="draplane-")) if workdir is None else Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            (workdir / "logs").symlink_to(logs.resolve(), target_is_directory=True)
        ports = (ports or Ports()).resolve()
        # Find every binary before starting anything, so a missing one fails fast and alone.
        etcd_bin = binaries.require(binaries.ETCD) if with_kubernetes else None
        apiserver_bin = binaries.require(binaries.KUBE_APISERVER) if with_kubernetes else None
        nats_bin = binaries.require(binaries.NATS_SERVER) if with_nats else None

        started: list[ServerProcess] = []
        plane = cls(
            workdir=workdir, ports=ports, kubeconfig=workdir / "kubeconfig", ca_file=workdir / "pki" / "ca.crt",
            client_cert=workdir / "pki" / "admin.crt", client_key=workdir / "pki" / "admin.key",
            processes=started, feature_gates={}, _owns_workdir=owns,
        )
        try:
            if with_kubernetes:
                started.append(_start_etcd(etcd_bin, workdir, ports, startup_timeout))
                certs = pki.create(workdir / "pki")
                plane.feature_gates = dra_feature_gates(apiserver_bin)
                started.append(_start_apiserver_dropping_unmet_gates(apiserver_bin, workdir, ports, certs, plane, startup_timeout))
                _write_kubeconfig(plane.kubeconfig, plane.apiserver_url, certs)
            if with_nats:
                extra = nats_security.server_config() if nats_security is not None else ""
                started.append(_start_nats(nats_bin, workdir, ports, startup_timeout, extra))
                plane.nats_ca = nats_security.tls.ca_cert if nats_security is not None else None
        except BaseException:
            plane.stop()
            raise
        log.info("control plane up in %s: apiserver %s, nats %s", workdir, plane.apiserver_url, plane.nats_url)
        return plane

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "ControlPlane":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


def _http_ok(url: str, context: ssl.SSLContext | None = None, expect: bytes | None = None) -> bool:
    with urllib.request.urlopen(url, timeout=2, context=context) as response:
        body = response.read()
        return response.status == 200 and (expect is None or expect in body)


def _start_etcd(binary: Path, workdir: Path, ports: Ports, timeout: float) -> ServerProcess:
    client = f"http://127.0.0.1:{ports.etcd_client}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    process = ServerProcess(
        "etcd",
        [
            str(binary),
            "--name=draplane",
            f"--data-dir={workdir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=draplane={peer}",
            "--log-level=warn",
            # A throwaway test store: durability across power loss buys nothing and costs fsyncs.
            "--unsafe-no-fsync",
        ],
        workdir / "logs" / "etcd.log",
    )
    process.start()
    process.wait_ready(lambda: _http_ok(f"{client}/health", expect=b'"health":"true"'), timeout)
    return process


_UNMET_DEPENDENCY_RE = re.compile(r"(\w+) is enabled, but depends on features that are disabled")


def _start_apiserver_dropping_unmet_gates(
    binary: Path, workdir: Path, ports: Ports, certs: pki.Pki, plane: ControlPlane, timeout: float
) -> ServerProcess:
    """Start kube-apiserver; a DRA gate that needs a feature we do not switch on is switched off
    and remembered, rather than switching on unrelated features."""
    for _ in range(len(plane.feature_gates) + 1):
        try:
            return _start_apiserver(binary, workdir, ports, certs, plane, timeout)
        except StartupError as exc:
            unmet = _UNMET_DEPENDENCY_RE.search(str(exc))
            if not unmet or unmet.group(1) not in plane.feature_gates:
                raise
            log.info("feature gate %s needs non-DRA features; leaving it off", unmet.group(1))
            del plane.feature_gates[unmet.group(1)]
            _feature_gate_cache(binary).write_text(json.dumps(plane.feature_gates, sort_keys=True))
    raise StartupError("kube-apiserver: could not find a set of DRA feature gates it accepts")


def _start_apiserver(
    binary: Path, workdir: Path, ports: Ports, certs: pki.Pki, plane: ControlPlane, timeout: float
) -> ServerProcess:
    gates = ",".join(f"{name}={'true' if on else 'false'}" for name, on in sorted(plane.feature_gates.items()))
    runtime_config = ",".join(f"resource.k8s.io/{v}=true" for v in RESOURCE_API_VERSIONS)
    if plane.feature_gates.get("GenericWorkload"):
        # A beta API version is not served unless asked for, even with its gate on.
        runtime_config += f",{WORKLOAD_API_VERSION}=true"
    argv = [
        str(binary),
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={ports.apiserver}",
        f"--tls-cert-file={certs.serving_cert}",
        f"--tls-private-key-file={certs.serving_key}",
        f"--client-ca-file={certs.ca_cert}",
        f"--token-auth-file={certs.token_file}",
        f"--service-account-key-file={certs.service_account_pub}",
        f"--service-account-signing-key-file={certs.service_account_key}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        "--service-cluster-ip-range=10.0.0.0/24",
        "--authorization-mode=RBAC",
        # There is no controller-manager to create each namespace's `default` ServiceAccount.
        "--disable-admission-plugins=ServiceAccount",
        f"--runtime-config={runtime_config}",
        f"--cert-dir={workdir / 'pki'}",
        "--endpoint-reconciler-type=none",
        # `kubectl logs` and `exec` on the real node (realnode.py): the API server reaches its
        # kubelet by IP, as the admin, and the kubelet trusts only this cluster's CA.
        f"--kubelet-client-certificate={certs.admin_cert}",
        f"--kubelet-client-key={certs.admin_key}",
        "--kubelet-preferred-address-types=InternalIP,ExternalIP,Hostname",
        "--profiling=false",
        "--v=1",
    ]
    if gates:
        argv.append(f"--feature-gates={gates}")
    process = ServerProcess("kube-apiserver", argv, workdir / "logs" / "kube-apiserver.log")
    process.start()
    process.wait_ready(lambda: _http_ok(f"{plane.apiserver_url}/readyz", plane.ssl_context()), timeout)
    return process


def _write_kubeconfig(path: Path, server: str, certs: pki.Pki) -> None:
    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "draplane", "cluster": {"server": server, "certificate-authority-data": b64(certs.ca_cert)}}
        ],
        "users": [
            {
                "name": "draplane-admin",
                # a token, not the admin certificate: see `pki.Pki.admin_token`
                "user": {"token": certs.admin_token.read_text()},
            }
        ],
        "contexts": [{"name": "draplane", "context": {"cluster": "draplane", "user": "draplane-admin"}}],
        "current-context": "draplane",
    }
    path.write_text(json.dumps(config, indent=2))
    path.chmod(0o600)


def nats_config(ports: Ports, store_dir: Path, extra: str = "") -> str:
    return "\n".join(
        [
            f"listen: 127.0.0.1:{ports.nats}",
            f"http: 127.0.0.1:{ports.nats_monitor}",
            "jetstream {",
            f'  store_dir: "{store_dir}"',
            "  max_memory_store: 256MB",
            "  max_file_store: 2GB",
            "}",
            "max_payload: 8MB",
            extra,
        ]
    )


def _start_nats(binary: Path, workdir: Path, ports: Ports, timeout: float, extra: str = "") -> ServerProcess:
    config = workdir / "nats.conf"
    config.write_text(nats_config(ports, workdir / "jetstream", extra))
    process = ServerProcess("nats-server", [str(binary), "-c", str(config)], workdir / "logs" / "nats-server.log")
    process.start()
    process.wait_ready(
        lambda: _http_ok(f"http://127.0.0.1:{ports.nats_monitor}/healthz?js-enabled-only=true"), timeout
    )
    return process

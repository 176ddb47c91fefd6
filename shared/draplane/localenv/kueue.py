"""Kueue on the local cluster, as its release manifests install it, less what needs a pod network.

Kueue (sigs.k8s.io/kueue, built from its Go module like the other servers) holds a Job suspended
until its ClusterQueue has quota for it, then unsuspends it; the Job controller makes the pods and
their scheduler places them. The tests run it to show that draplane places what Kueue admits.

What differs from a cluster install, and why:
- Kueue runs as a process here, not as a pod behind a Service. Its admission webhooks (which set
  `suspend: true` on a queued Job, among other things) are not registered: the apiserver could
  reach them only through the Service's DNS name, which the local cluster does not resolve. So a
  Job is created suspended, as Kueue's webhook would make it.
- Its CRDs serve only their storage version (v1beta2): with v1beta1 served too, the apiserver
  would call Kueue's conversion webhook, by that DNS name again. Each keeps its conversion webhook
  entry, which Kueue's certificate rotator fills in (with no such entry it never reports ready).
- The certificate rotator (internalCertManagement) fills its Secret, which the release manifests
  create empty; the webhook server's own certificate is a local one in `certDir` (it serves
  nobody).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path

import yaml

from draplane.localenv import binaries, pki
from draplane.localenv.controlplane import ControlPlane
from draplane.localenv.processes import ServerProcess, free_port

NAMESPACE = "kueue-system"
CERT_SECRET = "kueue-webhook-server-cert"  # the config's default internalCertManagement.webhookSecretName
API_VERSION = "kueue.x-k8s.io/v1beta2"


class KueueError(RuntimeError):
    """Kueue could not be set up or did not become ready; the message says where to look."""


def source_dir() -> Path:
    """Kueue's module in the Go module cache (downloaded when missing): its CRDs come from there."""
    go = os.environ.get("GO") or "go"
    try:
        out = subprocess.run([go, "mod", "download", "-json", f"{binaries.KUEUE.module}@{binaries.KUEUE.version}"],
                             capture_output=True, text=True, check=True, cwd="/",
                             env=dict(os.environ, GOFLAGS="", GOTOOLCHAIN="local"))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise KueueError(f"downloading {binaries.KUEUE.module} {binaries.KUEUE.version} for its CRDs failed: "
                         f"{detail.strip()}") from None
    return Path(json.loads(out.stdout)["Dir"])


def crds(webhook_port: int) -> list[dict]:
    """Kueue's CRDs as applied here (see the module's docstring)."""
    found = []
    for path in sorted((source_dir() / "config" / "components" / "crd" / "bases").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        versions = crd["spec"]["versions"]
        if len(versions) > 1:
            for version in versions:
                version["served"] = bool(version.get("storage"))
            crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                "conversionReviewVersions": ["v1"],
                "clientConfig": {"url": f"https://127.0.0.1:{webhook_port}/convert"}}}
        found.append(crd)
    if not found:
        raise KueueError(f"no CRDs under {source_dir()}/config/components/crd/bases")
    return found


def configuration(workdir: Path, *, webhook_port: int, health_port: int) -> str:
    return yaml.safe_dump({
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(workdir / "certs")},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True},
        "integrations": {"frameworks": ["batch/job"]},
    })


class Kueue:
    """One Kueue manager for a control plane. `start()` installs its CRDs, namespace and Secret
    (kubectl apply, idempotent) and waits until it is ready; `stop()` ends the process."""

    def __init__(self, plane: ControlPlane, workdir: Path) -> None:
        self.plane = plane
        self.workdir = workdir
        self.health_port = free_port()
        self.webhook_port = free_port()
        self.process: ServerProcess | None = None

    def _kubectl(self, *args: str, stdin: str | None = None) -> str:
        proc = subprocess.run([str(binaries.require(binaries.KUBECTL)), f"--kubeconfig={self.plane.kubeconfig}", *args],
                              input=stdin, capture_output=True, text=True)
        if proc.returncode != 0:
            raise KueueError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def install(self) -> None:
        definitions = crds(self.webhook_port)
        self._kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                      stdin="---\n".join(yaml.safe_dump(crd) for crd in definitions))
        self._kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": CERT_SECRET, "namespace": NAMESPACE}},
        ]))
        self._kubectl("wait", "--for=condition=Established", "--timeout=60s",
                      *(f"crd/{crd['metadata']['name']}" for crd in definitions))

    def start(self, timeout: float = 90.0) -> None:
        binary = binaries.require(binaries.KUEUE)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.install()
        pki.create_nats_tls(self.workdir / "certs", file_names=("ca.crt", "tls.crt", "tls.key"))
        config = self.workdir / "config.yaml"
        config.write_text(configuration(self.workdir, webhook_port=self.webhook_port, health_port=self.health_port))
        self.process = ServerProcess(
            "kueue", [str(binary), f"--config={config}", f"--visibility-server-port={free_port()}",
                      # its on-demand visibility API is an aggregated apiserver: not served here
                      "--feature-gates=VisibilityOnDemand=false"],
            self.workdir / "kueue.log", env=dict(os.environ, KUBECONFIG=str(self.plane.kubeconfig)))
        self.process.start()
        try:
            self.process.wait_ready(self._ready, timeout)
        except Exception as exc:
            self.stop()
            raise KueueError(f"kueue did not become ready in {timeout:.0f} s: {exc} (log: {self.process.log_path})") \
                from None

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


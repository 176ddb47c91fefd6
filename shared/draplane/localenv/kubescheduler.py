"""kube-scheduler on a local control plane: Kubernetes' own scheduler, to compare draplane with.

draplane never needs it. `bench/vs_kube_scheduler.py` runs the same workload once with it and once
with draplane, and tests use it to show what kube-scheduler does where draplane differs. It
schedules the pods whose `schedulerName` is `default-scheduler` (a pod without one gets it), so it
and draplane's services can share a cluster without taking each other's pods.
"""

from __future__ import annotations

import json
from pathlib import Path

from draplane.localenv import binaries
from draplane.localenv.controlplane import ControlPlane
from draplane.localenv.processes import ServerProcess, free_port

SCHEDULER_NAME = "default-scheduler"


def scheduler_configuration(kubeconfig: Path, *, qps: float, burst: int) -> dict:
    """A KubeSchedulerConfiguration: the default profile (DynamicResources among its plugins),
    one instance without leader election, and its client's rate limit."""
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig), "qps": qps, "burst": burst},
        "leaderElection": {"leaderElect": False},
    }


def kube_scheduler(
    plane: ControlPlane, log_path: Path, *, qps: float = 50.0, burst: int = 100, verbosity: int = 1
) -> ServerProcess:
    """kube-scheduler for `plane`, with the apiserver's DRA feature gates. `qps`/`burst` are its
    client's limits: 50/100 is kube-scheduler's default; scheduler_perf, kube-scheduler's own
    benchmark, runs it at 5000/5000. `verbosity` 2 logs each scheduling attempt and binding, which
    a test wants when it fails and a benchmark does not pay for."""
    config = log_path.parent / f"{log_path.stem}-config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    # JSON is YAML: kube-scheduler's --config reads either
    config.write_text(json.dumps(scheduler_configuration(plane.kubeconfig, qps=qps, burst=burst), indent=2))
    gates = ",".join(f"{name}={'true' if on else 'false'}" for name, on in sorted(plane.feature_gates.items()))
    argv = [
        str(binaries.require(binaries.KUBE_SCHEDULER)),
        f"--config={config}",
        f"--authentication-kubeconfig={plane.kubeconfig}",
        f"--authorization-kubeconfig={plane.kubeconfig}",
        # the local apiserver has no front proxy: nothing to look up for request headers
        "--authentication-skip-lookup=true",
        "--bind-address=127.0.0.1",
        f"--secure-port={free_port()}",
        *([f"--feature-gates={gates}"] if gates else []),
        f"--v={verbosity}",
    ]
    return ServerProcess("kube-scheduler", argv, log_path)

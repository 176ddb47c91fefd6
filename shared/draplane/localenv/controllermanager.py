"""kube-controller-manager for `draplane up`: the cluster's controllers, as in a real cluster.

With it, Deployments and Jobs make pods, the garbage collector and the namespace controller clean
up, and its resourceclaim controller creates claims from templates, takes finished pods out of
`reservedFor` and deallocates claims nobody reserves: so the binder leaves that to it
(`--no-manage-claims`), as it does in production.
"""

from __future__ import annotations

from pathlib import Path

from draplane.localenv import binaries
from draplane.localenv.controlplane import ControlPlane
from draplane.localenv.processes import ServerProcess, free_port


def controller_manager(plane: ControlPlane, log_path: Path, *, controllers: str = "*") -> ServerProcess:
    """kube-controller-manager for `plane`. `controllers` is its --controllers list: where no KWOK
    renews the nodes' leases (the test fixtures' hand-made nodes), the node lifecycle controller
    would mark every node unreachable and taint it, so the fixtures leave it out."""
    pki = plane.workdir / "pki"
    gates = ",".join(f"{name}={'true' if on else 'false'}" for name, on in sorted(plane.feature_gates.items()))
    argv = [
        str(binaries.require(binaries.KUBE_CONTROLLER_MANAGER)),
        f"--kubeconfig={plane.kubeconfig}",
        f"--authentication-kubeconfig={plane.kubeconfig}",
        f"--authorization-kubeconfig={plane.kubeconfig}",
        # the local apiserver has no front proxy: nothing to look up for request headers
        "--authentication-skip-lookup=true",
        "--bind-address=127.0.0.1",
        f"--secure-port={free_port()}",
        "--leader-elect=false",
        f"--controllers={controllers}",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        "--use-service-account-credentials=false",
        # KWOK renews the nodes' leases; a node it stopped renewing is NotReady after this
        "--node-monitor-grace-period=60s",
        # Its client's default 20 requests/s (burst 30) caps a cluster at ~10 template pods/s,
        # as the resourceclaim controller makes two writes per pod (bench/e2e.py measured 10.5);
        # one machine's apiserver takes more, as many production clusters allow.
        "--kube-api-qps=100",
        "--kube-api-burst=150",
        *([f"--feature-gates={gates}"] if gates else []),
        "--v=1",
    ]
    return ServerProcess("kube-controller-manager", argv, log_path)

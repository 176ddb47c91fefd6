"""KWOK as the kubelets of `draplane up`'s simulated nodes (sigs.k8s.io/kwok, built from Go modules).

KWOK takes the nodes annotated for it and plays a kubelet's part of their lifecycle, as written in
the Stages below (draplane's own, in KWOK's Stage API): a node is made Ready and heartbeats (KWOK
also renews its Lease), a bound pod starts Running, and a pod being deleted is removed once the
deletion is asked for, as a kubelet would after stopping it.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from draplane.localenv.processes import ServerProcess, free_port

if TYPE_CHECKING:
    from draplane.localenv.controlplane import ControlPlane

log = logging.getLogger(__name__)

KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")

KWOK_STAGES = """
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: draplane-node-ready}
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: NotIn
      values: ['True']
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - type: Ready
        status: "True"
        reason: KubeletReady
        message: kwok is this simulated node's kubelet
        lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $now | Quote }}
      phase: Running
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: draplane-node-heartbeat}
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: In
      values: ['True']
  delay: {durationMilliseconds: 10000, jitterDurationMilliseconds: 15000}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - type: Ready
        status: "True"
        reason: KubeletReady
        message: kwok is this simulated node's kubelet
        lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ or .metadata.creationTimestamp $now | Quote }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: draplane-pod-running}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - key: .metadata.deletionTimestamp
      operator: DoesNotExist
    - key: .status.phase
      operator: In
      values: [Pending]
  next:
    statusTemplate: |
      {{ $now := Now }}
      phase: Running
      startTime: {{ $now | Quote }}
      hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
      podIP: {{ PodIPWith .spec.nodeName false .metadata.uid .metadata.name .metadata.namespace | Quote }}
      conditions:
      - {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
      - {type: PodScheduled, status: "True", lastTransitionTime: {{ $now | Quote }}}
      containerStatuses:
      {{ range .spec.containers }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        ready: true
        restartCount: 0
        started: true
        state:
          running: {startedAt: {{ $now | Quote }}}
      {{ end }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: draplane-pod-deleted}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - key: .metadata.deletionTimestamp
      operator: Exists
  next:
    delete: true
"""


def kwok_arguments(kubeconfig: Path, config: Path) -> list[str]:
    """kwok, run beside the control plane, in charge of the nodes we annotate. The pod and node
    addresses it writes are loopback ones: nothing here is ever sent to them."""
    config.write_text(KWOK_STAGES.lstrip())
    return [
        f"--config={config}",
        f"--kubeconfig={kubeconfig}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION[0]}={KWOK_ANNOTATION[1]}",
        "--cidr=127.16.0.0/16",
        "--node-ip=127.0.0.1",
        "--node-lease-duration-seconds=40",
        f"--server-address=127.0.0.1:{free_port()}",
    ]


NODE_LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"


class KwokProcess(ServerProcess):
    """KWOK, restarted without leaving the nodes unattended.

    KWOK holds each node's Lease under an identity of its own, new at every start
    (hostname_uuid), and takes over a lease another holds only once it has expired,
    --node-lease-duration-seconds after its last renewal. Started again after a crash, it would
    leave every node unattended that long: bound pods not started, deleted pods not removed. Its
    predecessor is dead by then (the supervisor starts only dead processes), and in this cluster
    KWOK is every node's kubelet, so the node leases are all that predecessor's: they are deleted
    first, and the new KWOK creates them afresh at once."""

    def __init__(self, name: str, argv: list[str], log_path: Path, plane: "ControlPlane"):
        super().__init__(name, argv, log_path)
        self.plane = plane

    def start(self) -> None:
        if self.process is not None:
            self.release_node_leases()
        super().start()

    def release_node_leases(self) -> None:
        request = urllib.request.Request(self.plane.apiserver_url + NODE_LEASES, method="DELETE")
        try:
            with urllib.request.urlopen(request, timeout=5, context=self.plane.ssl_context()):
                pass
        except (OSError, urllib.error.HTTPError) as exc:
            # not fatal: the new KWOK then takes the leases over as they expire
            log.warning("kwok: could not delete the node leases of the KWOK before it (%s); the new one takes "
                        "them over as they expire", exc)

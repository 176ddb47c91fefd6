"""KWOK as the kubelets of `draplane up`'s simulated nodes (sigs.k8s.io/kwok, built from Go modules).

KWOK takes the nodes annotated for it and plays a kubelet's part of their lifecycle, as written in
the Stages below (draplane's own, in KWOK's Stage API): a node is made Ready and heartbeats (KWOK
also renews its Lease), a bound pod starts Running, and a pod being deleted is removed once the
deletion is asked for, as a kubelet would after stopping it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
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
    # KWOK's own delete (grace period 0) first shortens the grace period, an update it sees
    # before the pod's removal: without this it played the stage again on a pod already gone and
    # logged an ERROR "failed to delete pod ...: not found" for almost every pod deleted.
    # (tostring: KWOK compares only strings, and numbers reach it as floats.)
    - key: .metadata.deletionGracePeriodSeconds | tostring
      operator: NotIn
      values: ['0']
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
# Where a restarted KWOK's pods are looked at again: the annotation written to a pod that KWOK left
# Pending, its value the time of the resync.
RESYNC_ANNOTATION = "draplane.dev/kubelet-resync"
# After the new KWOK holds every node's lease: how long its lease informer gets to see them before
# the first look, and when to look again (a loaded apiserver delivers the watch events late).
RESYNC_AFTER_SECONDS = (2.0, 10.0)
HAND_OVER_TIMEOUT_SECONDS = 60.0


class KwokProcess(ServerProcess):
    """KWOK, restarted without leaving the nodes or their pods unattended.

    KWOK holds each node's Lease under an identity of its own, new at every start
    (hostname_uuid), and takes over a lease another holds only once it has expired,
    --node-lease-duration-seconds after its last renewal. Started again after a crash, it would
    leave every node unattended that long: bound pods not started, deleted pods not removed. Its
    predecessor is dead by then (the supervisor starts only dead processes), and in this cluster
    KWOK is every node's kubelet, so the node leases are all that predecessor's: they are deleted
    first, and the new KWOK creates them afresh at once.

    A pod bound while the new KWOK starts can still be passed over for good: KWOK v0.8.0 skips a
    pod whose node lease it does not hold yet (read from its lease informer's cache), and the one
    re-list of a node's pods it makes on taking the lease runs right after its create of the lease,
    before its own cache has it, so it skips them again and nothing makes it look once more (CI saw
    two pods stay bound and Pending for 55 s). A kubelet that restarts syncs every pod of its node;
    here `hand_over` stands in for that: once the new KWOK holds the leases, each pod bound to a
    KWOK node and still Pending gets an annotation, a change KWOK's pod watch hands it again."""

    def __init__(self, name: str, argv: list[str], log_path: Path, plane: "ControlPlane"):
        super().__init__(name, argv, log_path)
        self.plane = plane

    def start(self) -> None:
        restarted = self.process is not None
        if restarted:
            self.release_node_leases()
        super().start()
        if restarted:
            # The supervisor's loop must not wait on it: the apiserver round trips run beside it.
            threading.Thread(target=self.hand_over, args=(self.process,), daemon=True, name="kwok hand-over").start()

    def release_node_leases(self) -> None:
        try:
            self._request("DELETE", NODE_LEASES)
        except (OSError, urllib.error.HTTPError) as exc:
            # not fatal: the new KWOK then takes the leases over as they expire
            log.warning("kwok: could not delete the node leases of the KWOK before it (%s); the new one takes "
                        "them over as they expire", exc)

    def hand_over(self, process) -> list[str]:
        """Wait until `process` (the new KWOK) holds every KWOK node's lease, then resync the pods it
        may have passed over (see the class). Returns the pods resynced, as namespace/name."""
        deadline = time.monotonic() + HAND_OVER_TIMEOUT_SECONDS
        resynced: list[str] = []
        try:
            while not self._holds_every_lease():
                if process.poll() is not None:
                    return resynced  # died again: the supervisor restarts it, and a new hand-over runs
                if time.monotonic() > deadline:
                    log.warning("kwok: the restarted KWOK (pid %d) did not take every node's lease within %.0f s; "
                                "its pods are not looked at again", process.pid, HAND_OVER_TIMEOUT_SECONDS)
                    return resynced
                time.sleep(0.5)
            held_at = time.monotonic()
            for after in RESYNC_AFTER_SECONDS:
                time.sleep(max(0.0, held_at + after - time.monotonic()))
                if process.poll() is not None:
                    return resynced
                resynced += self.resync_pending_pods()
        except (OSError, urllib.error.HTTPError, ValueError) as exc:
            log.warning("kwok: could not look at the restarted KWOK's pods again (%s); a pod bound while it "
                        "started may stay Pending until it changes", exc)
        return resynced

    def kwok_nodes(self) -> set[str]:
        nodes = self._request("GET", "/api/v1/nodes")["items"]
        return {n["metadata"]["name"] for n in nodes
                if (n["metadata"].get("annotations") or {}).get(KWOK_ANNOTATION[0]) == KWOK_ANNOTATION[1]}

    def _holds_every_lease(self) -> bool:
        # The leases were all deleted before the start, so every one there is the new KWOK's.
        leases = self._request("GET", NODE_LEASES)["items"]
        held = {lease["metadata"]["name"] for lease in leases if (lease.get("spec") or {}).get("holderIdentity")}
        return self.kwok_nodes() <= held

    def resync_pending_pods(self) -> list[str]:
        """Annotate every pod bound to a KWOK node, not being deleted and still Pending: a change
        that KWOK's pod watch delivers, so it plays the pod's stages. Returns namespace/name of each."""
        nodes = self.kwok_nodes()
        selector = urllib.parse.quote("status.phase=Pending,spec.nodeName!=")
        pods = self._request("GET", f"/api/v1/pods?fieldSelector={selector}")["items"]
        resynced = []
        for pod in pods:
            meta = pod["metadata"]
            if pod["spec"].get("nodeName") not in nodes or meta.get("deletionTimestamp"):
                continue
            patch = {"metadata": {"annotations": {RESYNC_ANNOTATION: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}}
            try:
                self._request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", patch,
                              content_type="application/merge-patch+json")
            except urllib.error.HTTPError as exc:
                if exc.code != 404:  # a pod deleted meanwhile needs nothing
                    raise
                continue
            resynced.append(f"{meta['namespace']}/{meta['name']}")
        if resynced:
            log.warning("kwok: %d pod(s) bound to its nodes were still Pending after its restart; asked it to "
                        "start them again: %s", len(resynced), ", ".join(resynced[:10]))
        return resynced

    def _request(self, method: str, path: str, body: dict | None = None,
                 content_type: str = "application/json") -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.plane.apiserver_url + path, data=data, method=method,
                                         headers={"Content-Type": content_type} if data is not None else {})
        with urllib.request.urlopen(request, timeout=5, context=self.plane.ssl_context()) as response:
            return json.loads(response.read() or b"{}")

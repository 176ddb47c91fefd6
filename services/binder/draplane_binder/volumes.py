"""The binder's part of kube-scheduler's VolumeBinding: caches of PersistentVolumeClaims,
PersistentVolumes and StorageClasses, the PreFilter that goes into each PendingPod, and the
PreBind step that binds or provisions the pod's unbound claims on the chosen node and waits until
they are bound.

The decisions are draplane.scheduling.volume_binding's; this component owns the caches and the
writes. Writes are merge patches guarded by the object's resourceVersion, so a volume another
scheduler took meanwhile fails the write (409) instead of being given twice.

PreBind, as kube-scheduler's:
- `bind_volumes`: each volume matched to a claim gets the claim in its claimRef (the PV
  controller completes the binding); each claim to provision gets the node in its
  `volume.kubernetes.io/selected-node` annotation (its provisioner makes the volume there);
- `wait_bound`: until every claim of the pod is fully bound, at most `bind_timeout` seconds; a
  claim whose selected-node annotation is taken away was refused by its provisioner.
- the undo: none through the API, as in kube-scheduler. A volume bound to a claim stays bound to
  it (the claim can only ever use that one); a provisioner that fails removes the annotation.
  The placement itself is abandoned and the pod tried again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from draplane.api.core import Node, Pod
from draplane.api.storage import (
    ANNOTATION_BOUND_BY_CONTROLLER, ANNOTATION_SELECTED_NODE, PersistentVolume, PersistentVolumeClaim, StorageClass,
)
from draplane.kube import KubeApiError, KubeClient, watch_objects
from draplane.scheduling import volume_binding as vb
from draplane_binder.lifecycle import pod_is_done

log = logging.getLogger(__name__)

Key = tuple[str, str]
# How often PreBind looks at its claims while it waits, besides when a claim's watch event wakes it.
WAIT_POLL_SECONDS = 1.0


class VolumeBinder:
    def __init__(self, kube: KubeClient, *, bind_timeout: float,
                 wake_pods: Callable[[list[Key]], None], wake_all: Callable[[], None],
                 pod_of: Callable[[Key], Pod | None] = lambda key: None) -> None:
        self.kube = kube
        self.bind_timeout = bind_timeout
        # pods to look at again when a claim they use changes, and every unschedulable pod when a
        # volume or class changes (a new volume may fit any of them)
        self._wake_pods = wake_pods
        self._wake_all = wake_all
        self._pod_of = pod_of  # the binder's pod cache
        self.claims: dict[str, dict[str, PersistentVolumeClaim]] = {}  # namespace -> name -> claim
        self.volumes: dict[str, PersistentVolume] = {}
        self.classes: dict[str, StorageClass] = {}
        self.node_labels: dict[str, dict[str, str]] = {}
        # (namespace, claim name) -> pods whose volumes use it
        self.pods_by_claim: dict[Key, set[Key]] = {}
        self.synced = {what: asyncio.Event() for what in ("persistentvolumeclaims", "persistentvolumes",
                                                          "storageclasses")}
        self._changed = asyncio.Condition()

    # --- caches ------------------------------------------------------------------------------------

    def watches(self) -> list[tuple[str, Callable[[], Awaitable]]]:
        """(name, loop) for the binder to run under its guard."""
        return [
            ("persistent volume claims watch",
             lambda: self._watch(PersistentVolumeClaim, "persistentvolumeclaims", self._on_claim)),
            ("persistent volumes watch", lambda: self._watch(PersistentVolume, "persistentvolumes", self._on_volume)),
            ("storage classes watch", lambda: self._watch(StorageClass, "storageclasses", self._on_class)),
        ]

    @property
    def ready(self) -> bool:
        return all(e.is_set() for e in self.synced.values())

    async def wait_synced(self) -> None:
        await asyncio.gather(*(e.wait() for e in self.synced.values()))

    async def _watch(self, model, what: str, handle) -> None:
        async for event in watch_objects(self.kube, model):
            if event.type == "SYNCED":
                self.synced[what].set()
                self._wake_all()
                continue
            handle(event.type, event.object)
            await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _on_claim(self, kind: str, claim: PersistentVolumeClaim) -> None:
        namespace, name = claim.metadata.namespace or "", claim.metadata.name or ""
        if kind == "DELETED":
            self.claims.get(namespace, {}).pop(name, None)
        else:
            self.claims.setdefault(namespace, {})[name] = claim
        self._wake_pods(sorted(self.pods_by_claim.get((namespace, name), ())))

    def _on_volume(self, kind: str, volume: PersistentVolume) -> None:
        if kind == "DELETED":
            self.volumes.pop(volume.metadata.name or "", None)
        else:
            self.volumes[volume.metadata.name or ""] = volume
        self._wake_all()

    def _on_class(self, kind: str, storage_class: StorageClass) -> None:
        if kind == "DELETED":
            self.classes.pop(storage_class.metadata.name or "", None)
        else:
            self.classes[storage_class.metadata.name or ""] = storage_class
        self._wake_all()

    def node_changed(self, kind: str, node: Node, changed: bool) -> None:
        """The cluster cache's listener: the node labels a volume's node affinity is matched to."""
        name = node.metadata.name or ""
        if kind == "DELETED":
            self.node_labels.pop(name, None)
        else:
            self.node_labels[name] = node.metadata.labels or {}

    def pod_changed(self, kind: str, old: Pod | None, pod: Pod) -> None:
        """The cluster cache's listener: `pods_by_claim` kept in step with the pod cache. A pod
        that goes wakes the other pods of its claims: a ReadWriteOncePod claim it held is free."""
        key = (pod.metadata.namespace or "", pod.metadata.name or "")
        if (kind == "DELETED" or pod_is_done(pod)) and pod.spec.volumes:
            self._wake_pods(self._pods_sharing_claims(key, pod))
        for tracked, add in ((old, False), (None if kind == "DELETED" else pod, True)):
            if tracked is None:
                continue
            for claim, _ in vb.pod_claim_names(tracked):
                pods = self.pods_by_claim.setdefault((key[0], claim), set())
                if add:
                    pods.add(key)
                else:
                    pods.discard(key)
                    if not pods:
                        del self.pods_by_claim[(key[0], claim)]

    # --- PreFilter ---------------------------------------------------------------------------------

    def pre_filter(self, pod: Pod) -> vb.PodVolumes | None:
        """What the shard's Filter needs of the pod's claims; raises vb.VolumeUnschedulable."""
        namespace = pod.metadata.namespace or ""

        def used_by_other_pod(claim: str) -> bool:
            # kube-scheduler counts the pods on nodes: scheduled, not finished (terminating ones too)
            for key in self.pods_by_claim.get((namespace, claim), ()):
                other = self._pod_of(key)
                if other is not None and other.metadata.uid != pod.metadata.uid and other.spec.node_name and \
                        not (other.status is not None and other.status.phase in ("Succeeded", "Failed")):
                    return True
            return False

        return vb.pre_filter(pod, self.claims.get(namespace, {}), self.volumes, self.classes, used_by_other_pod)

    def _pods_sharing_claims(self, key: Key, pod: Pod) -> list[Key]:
        """The other pods that use a claim of this pod's (woken when it goes: a ReadWriteOncePod
        claim it held is free again)."""
        return sorted({other for claim, _ in vb.pod_claim_names(pod)
                       for other in self.pods_by_claim.get((key[0], claim), ()) if other != key})

    # --- PreBind -----------------------------------------------------------------------------------

    async def pre_bind(self, pod: Pod, node: str, keep_leases: Callable[[], Awaitable[None]]) -> str | None:
        """Bind or provision the pod's unbound claims on `node` and wait until all of its claims are
        bound. None when they are (or the pod has none), else why not: the placement is then
        abandoned. `keep_leases` renews the placement's reservations while PreBind waits."""
        if not vb.pod_claim_names(pod):
            return None
        try:
            volumes = self.pre_filter(pod)
        except vb.VolumeUnschedulable as exc:
            return exc.message
        plan = vb.plan_for_node(volumes, node, self.node_labels.get(node, {}))
        if isinstance(plan, list):
            return f"node {node} no longer fits the pod's volumes: {', '.join(plan)}"
        why = await self.bind_volumes(pod, node, plan)
        if why is not None:
            return why
        return await self.wait_bound(pod, node, keep_leases)

    async def bind_volumes(self, pod: Pod, node: str, plan: vb.VolumePlan) -> str | None:
        """The plan's writes, in kube-scheduler's order (static bindings, then provisioning); the
        first that fails says why. No undo through the API (see the module's docstring)."""
        namespace = pod.metadata.namespace or ""
        claims = self.claims.get(namespace, {})
        for claim_name, volume_name in plan.bindings:
            claim, volume = claims.get(claim_name), self.volumes.get(volume_name)
            if claim is None or volume is None:
                return f"persistentvolumeclaim {namespace}/{claim_name} or persistentvolume {volume_name} is gone"
            if vb.volume_is_bound_to(volume, claim):
                continue  # pre-bound by the user: the PV controller binds it without us
            why = await self._bind_volume_to_claim(volume, claim)
            if why is not None:
                return why
            log.info("pod %s/%s: persistentvolume %s bound to persistentvolumeclaim %s for node %s",
                     namespace, pod.metadata.name, volume_name, claim_name, node)
        for claim_name in plan.provisions:
            claim = claims.get(claim_name)
            if claim is None:
                return f"persistentvolumeclaim {namespace}/{claim_name} is gone"
            why = await self._ask_provisioning(claim, node)
            if why is not None:
                return why
            log.info("pod %s/%s: persistentvolumeclaim %s to be provisioned on node %s (%s)",
                     namespace, pod.metadata.name, claim_name, node, ANNOTATION_SELECTED_NODE)
        return None

    async def _bind_volume_to_claim(self, volume: PersistentVolume, claim: PersistentVolumeClaim) -> str | None:
        """The volume's claimRef names the claim (and bound-by-controller, as the PV controller
        marks what it binds); the PV controller completes the binding on the claim's side."""
        patch = {
            "metadata": {"resourceVersion": volume.metadata.resource_version,
                         "annotations": {ANNOTATION_BOUND_BY_CONTROLLER: "yes"}},
            "spec": {"claimRef": {"kind": "PersistentVolumeClaim", "apiVersion": "v1",
                                  "namespace": claim.metadata.namespace, "name": claim.metadata.name,
                                  "uid": claim.metadata.uid, "resourceVersion": claim.metadata.resource_version}},
        }
        updated = await self._patch_guarded(PersistentVolume, volume.metadata.name or "", patch, None,
                                            f"persistentvolume {volume.metadata.name}")
        if isinstance(updated, str):
            return updated
        self._on_volume("MODIFIED", updated)
        return None

    async def _ask_provisioning(self, claim: PersistentVolumeClaim, node: str) -> str | None:
        """The claim's selected-node annotation: its provisioner makes a volume reachable from the node."""
        patch = {"metadata": {"resourceVersion": claim.metadata.resource_version,
                              "annotations": {ANNOTATION_SELECTED_NODE: node}}}
        updated = await self._patch_guarded(PersistentVolumeClaim, claim.metadata.name or "", patch,
                                            claim.metadata.namespace,
                                            f"persistentvolumeclaim {claim.metadata.namespace}/{claim.metadata.name}")
        if isinstance(updated, str):
            return updated
        self._on_claim("MODIFIED", updated)
        return None

    async def _patch_guarded(self, model, name: str, patch: dict, namespace: str | None, what: str):
        """The patch (its resourceVersion makes it a compare-and-set), or why it was refused: the
        object changed or went since the cache saw it (another scheduler took the volume, say)."""
        try:
            return await self.kube.patch(model, name, patch, namespace)
        except KubeApiError as exc:
            if exc.is_conflict or exc.is_not_found:
                return f"{what} changed since it was read: {exc.message}"
            raise

    async def wait_bound(self, pod: Pod, node: str, keep_leases: Callable[[], Awaitable[None]]) -> str | None:
        namespace = pod.metadata.namespace or ""
        deadline = time.monotonic() + self.bind_timeout
        renew_every = WAIT_POLL_SECONDS * 5
        renewed = time.monotonic()
        while True:
            waiting = []
            for claim_name, _ in vb.pod_claim_names(pod):
                claim = self.claims.get(namespace, {}).get(claim_name)
                if claim is None:
                    return f"persistentvolumeclaim {namespace}/{claim_name} is gone"
                if vb.is_fully_bound(claim):
                    continue
                selected = (claim.metadata.annotations or {}).get(ANNOTATION_SELECTED_NODE)
                storage_class = self.classes.get(vb.claim_class(claim))
                delayed = storage_class is not None and storage_class.volume_binding_mode == vb.WAIT_FOR_FIRST_CONSUMER
                if delayed and not claim.spec.volume_name and selected != node and not self._volume_names(claim):
                    # its provisioner took the annotation away: it could not make the volume there
                    return f'provisioning failed for PVC "{claim_name}"'
                waiting.append(claim_name)
            if not waiting:
                return None
            now = time.monotonic()
            if now >= deadline:
                return (f"binding volumes: timed out waiting for the condition: persistentvolumeclaim(s) "
                        f"{', '.join(waiting)} not bound within {self.bind_timeout:.0f} s")
            if now - renewed >= renew_every:
                await keep_leases()
                renewed = now
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=min(WAIT_POLL_SECONDS, deadline - now))
                except asyncio.TimeoutError:
                    pass

    def _volume_names(self, claim: PersistentVolumeClaim) -> list[str]:
        """Volumes whose claimRef names the claim (a static binding the PV controller has not completed yet)."""
        return [name for name, volume in self.volumes.items() if vb.volume_is_bound_to(volume, claim)]

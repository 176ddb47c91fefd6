"""The binder's part of kube-scheduler's VolumeBinding: caches of PersistentVolumeClaims,
PersistentVolumes and StorageClasses, the PreFilter that goes into each PendingPod, and the
PreBind step that binds or provisions the pod's unbound claims on the chosen node and waits until
they are bound.

The decisions are draplane.scheduling.framework.plugins.volume_binding's; this component owns the caches and the
writes. Writes are merge patches guarded by the object's resourceVersion, so a volume another
scheduler took meanwhile fails the write (409) instead of being given twice.

NodeVolumeLimits is evaluated here too, over caches of CSINodes, CSIDrivers and VolumeAttachments
and an index of the pods on each node that use claims (draplane.scheduling.framework.plugins.node_volume_limits):
the nodes it refuses go into the PendingPod; PreBind checks the chosen node again, counting the pods
being bound there meanwhile (kube-scheduler's assumed pods), and holds the pod's volumes on it
until the pod is bound or the placement undone (`forget_attachments`).

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
from collections.abc import Awaitable, Callable, Iterable

import msgspec

from draplane.api.core import Node, Pod
from draplane.api.storage import (
    ANNOTATION_BOUND_BY_CONTROLLER, ANNOTATION_SELECTED_NODE, CSIDriver, CSINode, PersistentVolume,
    PersistentVolumeClaim, StorageClass, VolumeAttachment,
)
from draplane.kube import KubeApiError, KubeClient, watch_objects
from draplane.scheduling.framework.plugins import node_volume_limits as nvl
from draplane.scheduling.framework.plugins import volume_binding as vb
from draplane.scheduling.framework.runtime import volume_plan
from draplane_binder.lifecycle import pod_is_done

log = logging.getLogger(__name__)

Key = tuple[str, str]
# How often PreBind looks at its claims while it waits, besides when a claim's watch event wakes it.
WAIT_POLL_SECONDS = 1.0



def _keep_by_name(store: dict, kind: str, obj) -> None:
    """A cluster-scoped object kept by name as its watch reports it (gone when DELETED)."""
    name = obj.metadata.name or ""
    if kind == "DELETED":
        store.pop(name, None)
    else:
        store[name] = obj

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
        # NodeVolumeLimits: CSINodes by node, CSIDrivers by name, each node's VolumeAttachments
        # (name -> (attacher, persistent volume name)), the pods on each node that use claims,
        # and the volumes of pods PreBind passed on a node until they are bound there
        self.csinodes: dict[str, CSINode] = {}
        self.csidrivers: dict[str, CSIDriver] = {}
        self.attachments: dict[str, dict[str, tuple[str, str]]] = {}
        self._attachment_node: dict[str, str] = {}
        self.pods_on_node: dict[str, set[Key]] = {}
        # node -> how many claims the pods in pods_on_node and _binding mount there (with
        # duplicates): a bound on its volumes in use that spares counting them far from a limit
        self._claims_on_node: dict[str, int] = {}
        self._binding: dict[str, dict[str, Pod]] = {}  # node -> pod uid -> pod
        self._binding_node: dict[str, str] = {}  # pod uid -> node
        self.synced = {what: asyncio.Event() for what in ("persistentvolumeclaims", "persistentvolumes",
                                                          "storageclasses", "csinodes", "csidrivers",
                                                          "volumeattachments")}
        self._changed = asyncio.Condition()

    # --- caches ------------------------------------------------------------------------------------

    def watches(self) -> list[tuple[str, Callable[[], Awaitable]]]:
        """(name, loop) for the binder to run under its guard."""
        return [
            ("persistent volume claims watch",
             lambda: self._watch(PersistentVolumeClaim, "persistentvolumeclaims", self._on_claim)),
            ("persistent volumes watch", lambda: self._watch(PersistentVolume, "persistentvolumes", self._on_volume)),
            ("storage classes watch", lambda: self._watch(StorageClass, "storageclasses", self._on_class)),
            ("csi nodes watch", lambda: self._watch(CSINode, "csinodes", self._on_csinode)),
            ("csi drivers watch", lambda: self._watch(CSIDriver, "csidrivers", self._on_csidriver)),
            ("volume attachments watch",
             lambda: self._watch(VolumeAttachment, "volumeattachments", self._on_attachment)),
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
        _keep_by_name(self.volumes, kind, volume)
        self._wake_all()

    def _on_class(self, kind: str, storage_class: StorageClass) -> None:
        _keep_by_name(self.classes, kind, storage_class)
        self._wake_all()

    def _on_csinode(self, kind: str, csinode: CSINode) -> None:
        _keep_by_name(self.csinodes, kind, csinode)
        self._wake_all()  # a raised limit or a newly registered driver may fit any pod

    def _on_csidriver(self, kind: str, driver: CSIDriver) -> None:
        _keep_by_name(self.csidrivers, kind, driver)
        self._wake_all()

    def _on_attachment(self, kind: str, attachment: VolumeAttachment) -> None:
        name = attachment.metadata.name or ""
        before = self._attachment_node.pop(name, None)
        if before is not None:
            on_node = self.attachments.get(before, {})
            on_node.pop(name, None)
            if not on_node:
                self.attachments.pop(before, None)
        if kind != "DELETED" and attachment.spec.node_name:
            node = attachment.spec.node_name
            self._attachment_node[name] = node
            self.attachments.setdefault(node, {})[name] = (
                attachment.spec.attacher, attachment.spec.source.persistent_volume_name or "")
        elif kind == "DELETED":
            self._wake_all()  # a volume detached frees room on its node

    def node_changed(self, kind: str, node: Node, changed: bool) -> None:
        """The cluster cache's listener: the node labels a volume's node affinity is matched to."""
        name = node.metadata.name or ""
        if kind == "DELETED":
            self.node_labels.pop(name, None)
        else:
            self.node_labels[name] = node.metadata.labels or {}

    def pod_changed(self, kind: str, old: Pod | None, pod: Pod) -> None:
        """The cluster cache's listener: `pods_by_claim` and `pods_on_node` kept in step with the
        pod cache. A pod that goes wakes the other pods of its claims (a ReadWriteOncePod claim it
        held is free), and every waiting pod when it leaves a node with claims (its volumes no
        longer count against the node's attach limits)."""
        key = (pod.metadata.namespace or "", pod.metadata.name or "")
        gone = kind == "DELETED" or pod_is_done(pod)
        if gone and pod.spec.volumes:
            self._wake_pods(self._pods_sharing_claims(key, pod))
            if pod.spec.node_name and nvl.uses_claims(pod):
                self._wake_all()
        self._index_by_node(key, old, None if gone else pod)
        if gone or pod.spec.node_name:
            self.forget_attachments(pod.metadata.uid or "", wake=False)  # counted by the node index now, or gone
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

    def _index_by_node(self, key: Key, old: Pod | None, new: Pod | None) -> None:
        """`pods_on_node`: the pods scheduled to each node that use claims (kube-scheduler's node
        infos hold the pods not finished)."""
        before = old.spec.node_name if old is not None and nvl.uses_claims(old) else None
        after = new.spec.node_name if new is not None and nvl.uses_claims(new) else None
        if before == after and (old is None or new is None or old.metadata.uid == new.metadata.uid):
            return  # (a pod recreated under the same name is taken out and put back: its claims differ)
        if before:
            pods = self.pods_on_node.get(before, set())
            if key in pods:
                pods.discard(key)
                self._count_claims(before, -len(vb.pod_claim_names(old)))
            if not pods:
                self.pods_on_node.pop(before, None)
        if after:
            pods = self.pods_on_node.setdefault(after, set())
            if key not in pods:
                pods.add(key)
                self._count_claims(after, len(vb.pod_claim_names(new)))

    def _count_claims(self, node: str, change: int) -> None:
        count = self._claims_on_node.get(node, 0) + change
        if count > 0:
            self._claims_on_node[node] = count
        else:
            self._claims_on_node.pop(node, None)

    def _at_most_in_use(self, node: str) -> int:
        return self._claims_on_node.get(node, 0) + len(self.attachments.get(node, ()))

    # --- PreFilter ---------------------------------------------------------------------------------

    def pre_filter(self, pod: Pod) -> vb.PodVolumes | None:
        """What the shard's Filter needs of the pod's claims, the nodes NodeVolumeLimits refuses
        among it; raises vb.VolumeUnschedulable."""
        volumes = self._claims_pre_filter(pod)
        if volumes is None:
            return None
        over_limit = self.nodes_over_limit(pod)
        return msgspec.structs.replace(volumes, over_limit=over_limit) if over_limit else volumes

    def _claims_pre_filter(self, pod: Pod) -> vb.PodVolumes | None:
        """VolumeRestrictions' and VolumeBinding's PreFilters."""
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

    # --- NodeVolumeLimits --------------------------------------------------------------------------

    def nodes_over_limit(self, pod: Pod, nodes: Iterable[str] | None = None) -> dict[str, str]:
        """NodeVolumeLimits' Filter over every node (or `nodes`): the nodes it refuses, with why."""
        objects = nvl.VolumeObjects(
            claims=lambda namespace: self.claims.get(namespace, {}), volumes=self.volumes, classes=self.classes,
            csinodes=self.csinodes, drivers=self.csidrivers.values(), pods_on=self._pods_on,
            attachments_on=lambda node: self.attachments.get(node, {}).values())
        return nvl.nodes_over_limit(pod, self.node_labels if nodes is None else nodes, objects,
                                    at_most=self._at_most_in_use)

    def _pods_on(self, node: str) -> list[Pod]:
        """The pods on the node that use claims, and those PreBind passed there, not bound yet."""
        pods = [pod for pod in map(self._pod_of, self.pods_on_node.get(node, ())) if pod is not None]
        return pods + list(self._binding.get(node, {}).values())

    def assume_attachments(self, pod: Pod, node: str) -> str | None:
        """PreBind's check of the chosen node, then the pod's volumes held on it until the pod is
        bound there (the node index counts it then) or `forget_attachments`. None when it fits."""
        why = self.nodes_over_limit(pod, [node]).get(node)
        if why is None and nvl.uses_claims(pod):
            uid = pod.metadata.uid or ""
            self.forget_attachments(uid)
            self._binding_node[uid] = node
            self._binding.setdefault(node, {})[uid] = pod
            self._count_claims(node, len(vb.pod_claim_names(pod)))
        return why

    def forget_attachments(self, pod_uid: str, *, wake: bool = True) -> None:
        """The undo of assume_attachments: the placement failed after PreBind passed. Its room on
        the node is free again: the waiting pods are tried again (unless `wake` is off: the pod is
        bound there, and still takes it)."""
        node = self._binding_node.pop(pod_uid, None)
        if node is not None:
            if wake:
                self._wake_all()
            on_node = self._binding.get(node, {})
            pod = on_node.pop(pod_uid, None)
            if pod is not None:
                self._count_claims(node, -len(vb.pod_claim_names(pod)))
            if not on_node:
                self._binding.pop(node, None)

    # --- PreBind -----------------------------------------------------------------------------------

    async def pre_bind(self, pod: Pod, node: str, keep_leases: Callable[[], Awaitable[None]]) -> str | None:
        """Bind or provision the pod's unbound claims on `node` and wait until all of its claims are
        bound. None when they are (or the pod has none), else why not: the placement is then
        abandoned. `keep_leases` renews the placement's reservations while PreBind waits."""
        if not vb.pod_claim_names(pod):
            return None
        try:
            volumes = self._claims_pre_filter(pod)
        except vb.VolumeUnschedulable as exc:
            return exc.message
        plan = volume_plan(volumes, node, self.node_labels.get(node, {}))
        if isinstance(plan, list):
            return f"node {node} no longer fits the pod's volumes: {', '.join(plan)}"
        over_limit = self.assume_attachments(pod, node)
        if over_limit is not None:
            return f"node {node} no longer fits the pod's volumes: {over_limit}"
        why = await self.bind_volumes(pod, node, plan)
        if why is None:
            why = await self.wait_bound(pod, node, keep_leases)
        if why is not None:
            self.forget_attachments(pod.metadata.uid or "")
        return why

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

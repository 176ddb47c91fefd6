"""The binder's cluster cache: one list-then-watch per kind, kept in memory with the indexes the
other components look things up by. It is read-only to them: they learn of changes through its
listeners, as kube-scheduler's plugins learn through informer event handlers.

Every object watched is also offered to the cluster bucket (draplane_binder.cluster_publisher),
the shards' one view of Kubernetes. DeviceClasses, DeviceTaintRules, PodGroups and disruption
budgets are watched for the shards; of those the binder keeps DeviceClasses only, for the
extended resources that DRA backs (KEP-5004).

The binder's own writes go through `apply_*` too, before their watch events come back, so that
what it just wrote is what it reads. An older watch event of a claim is then dropped (`_older`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from draplane.api.core import Node, Pod
from draplane.api.policy import PodDisruptionBudget
from draplane.api.resource import DeviceClass, DeviceTaintRule, ResourceClaim, ResourceClaimTemplate
from draplane.api.scheduling import PodGroup
from draplane.kube import KubeApiError, KubeClient, watch_objects
from draplane.scheduling import extended_resources as er
from draplane_binder import lifecycle as lc
from draplane_binder.cluster_publisher import ClusterPublisher
from draplane_binder.objects import Key, key_of
from draplane_binder.requeue import node_fit_fingerprint
from draplane_binder.settings import BinderSettings

log = logging.getLogger(__name__)

PodListener = Callable[[str, "Pod | None", Pod], None]  # (event type, the pod before, the pod now)
ClaimListener = Callable[[str, "ResourceClaim | None", ResourceClaim], None]
TemplateListener = Callable[[str, ResourceClaimTemplate], None]
NodeListener = Callable[[str, Node, bool], None]  # (event type, node, what node fit reads changed)
SyncListener = Callable[[str], None]  # the kind ("pods", "claims", ...) listed afresh

KINDS = ("pods", "claims", "templates", "nodes", "classes", "taint rules", "pod groups", "budgets")
# How long a kind the apiserver does not serve is left before it is asked about again.
NOT_SERVED_RETRY_SECONDS = 60.0


class ClusterCache:
    def __init__(self, kube: KubeClient, settings: BinderSettings, publisher: ClusterPublisher) -> None:
        self.kube = kube
        self.settings = settings
        self.publisher = publisher
        self.pods: dict[Key, Pod] = {}
        self.pods_by_uid: dict[str, Pod] = {}
        self.claims: dict[Key, ResourceClaim] = {}
        self.claims_by_namespace: dict[str, dict[str, ResourceClaim]] = {}
        self.templates: dict[str, dict[str, ResourceClaimTemplate]] = {}
        # node name -> what node fit reads of it (draplane_binder.requeue)
        self.nodes: dict[str, bytes] = {}
        # namespace/claim name -> pods that name it (to wake them when the claim appears)
        self.pods_by_claim: dict[Key, set[Key]] = {}
        # pod uid -> claims that reserve it or are owned by it (to clean them up when it goes)
        self.claims_by_pod: dict[str, set[Key]] = {}
        # DeviceClasses: which extended resources DRA backs (KEP-5004)
        self.device_classes: dict[str, DeviceClass] = {}
        self._class_resolver: er.ClassResolver | None = None  # built from device_classes when first needed
        # extended resource -> nodes offering it in allocatable (a device plugin): those keep that path
        self.extended_offered: dict[str, set[str]] = {}
        self.synced: dict[str, asyncio.Event] = {k: asyncio.Event() for k in KINDS}
        self.pod_listeners: list[PodListener] = []
        self.claim_listeners: list[ClaimListener] = []
        self.template_listeners: list[TemplateListener] = []
        self.node_listeners: list[NodeListener] = []
        self.sync_listeners: list[SyncListener] = []

    # --- watches -----------------------------------------------------------------------------------

    def watches(self) -> list[tuple[str, Callable[[], Awaitable]]]:
        return [
            ("pods watch", lambda: self._watch(Pod, "pods", self.apply_pod)),
            ("claims watch", lambda: self._watch(ResourceClaim, "claims", self.apply_claim)),
            ("templates watch", lambda: self._watch(ResourceClaimTemplate, "templates", self.apply_template)),
            ("nodes watch", lambda: self._watch(Node, "nodes", self.apply_node)),
            ("classes watch", lambda: self._watch(DeviceClass, "classes", self.apply_class)),
            # for the shards alone: the binder keeps no cache of these
            ("disruption budgets watch", lambda: self._watch(PodDisruptionBudget, "budgets", self._offer)),
            ("device taint rules watch", lambda: self._watch_if_served(
                DeviceTaintRule, "taint rules", "devicetaintrules (gate DRADeviceTaintRules)")),
            ("pod groups watch", lambda: self._watch_if_served(
                PodGroup, "pod groups", "podgroups (gate GenericWorkload): no gangs")),
        ]

    @property
    def ready(self) -> bool:
        return all(e.is_set() for e in self.synced.values())

    async def wait_synced(self, *kinds: str) -> None:
        if not all(self.synced[k].is_set() for k in kinds):
            await asyncio.gather(*(self.synced[k].wait() for k in kinds))

    async def _watch(self, model, what: str, handle: Callable[[str, object], None]) -> None:
        self.publisher.listing_begins(model)
        async for event in watch_objects(self.kube, model):
            if event.type == "SYNCED":
                self.synced[what].set()
                self.publisher.listed(model)
                for listener in self.sync_listeners:
                    listener(what)
                continue
            handle(event.type, event.object)

    async def _watch_if_served(self, model, what: str, served_by: str) -> None:
        """A kind the cluster may not serve (DeviceTaintRules, PodGroups): an apiserver with its
        gate off answers 404, which means there are none, not a broken binder."""
        while True:
            try:
                await self.kube.list(model)  # a watch retries a 404 for ever: ask once first
            except KubeApiError as exc:
                if not exc.is_not_found:
                    raise
                if not self.synced[what].is_set():
                    log.warning("binder: the apiserver does not serve %s (%s); the shards schedule without them, "
                                "looking again every %.0f s", served_by, exc, NOT_SERVED_RETRY_SECONDS)
                    self.synced[what].set()
                    self.publisher.listing_begins(model)
                    self.publisher.listed(model)  # none: keys of that kind left in the bucket go
                await asyncio.sleep(NOT_SERVED_RETRY_SECONDS)
                continue
            await self._watch(model, what, self._offer)
            return

    def _offer(self, kind: str, obj) -> None:
        self.publisher.offer(obj, kind == "DELETED")

    # --- changes, from the watches and from the binder's own writes ---------------------------------

    def apply_pod(self, kind: str, pod: Pod) -> None:
        self.publisher.offer(pod, kind == "DELETED")
        key = key_of(pod)
        old = self.pods.get(key)
        if old is not None:
            self.pods_by_uid.pop(old.metadata.uid or "", None)
            for pc in old.spec.resource_claims or ():
                if pc.resource_claim_name:
                    self.pods_by_claim.get((key[0], pc.resource_claim_name), set()).discard(key)
        if kind == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = pod
            self.pods_by_uid[pod.metadata.uid or ""] = pod
            for pc in pod.spec.resource_claims or ():
                if pc.resource_claim_name:
                    self.pods_by_claim.setdefault((key[0], pc.resource_claim_name), set()).add(key)
        for listener in self.pod_listeners:
            listener(kind, old, pod)

    def apply_claim(self, kind: str, claim: ResourceClaim) -> None:
        key = key_of(claim)
        old = self.claims.get(key)
        if kind != "DELETED" and old is not None and _older(claim, old):
            # The cache holds what we wrote ourselves, and the watch has not caught up: this event
            # (the claim as created, say) is older. Taken in, it would look like a deallocation and
            # release the reservation of a claim that is allocated. The newer event follows.
            return
        self.publisher.offer(claim, kind == "DELETED")
        namespace_claims = self.claims_by_namespace.setdefault(key[0], {})
        for pod_uid in _pods_named_by(old) if old is not None else ():
            self.claims_by_pod.get(pod_uid, set()).discard(key)
        if kind == "DELETED":
            self.claims.pop(key, None)
            namespace_claims.pop(key[1], None)
        else:
            for pod_uid in _pods_named_by(claim):
                self.claims_by_pod.setdefault(pod_uid, set()).add(key)
            self.claims[key] = claim
            namespace_claims[key[1]] = claim
        for listener in self.claim_listeners:
            listener(kind, old, claim)

    def apply_template(self, kind: str, template: ResourceClaimTemplate) -> None:
        namespace, name = key_of(template)
        if kind == "DELETED":
            self.templates.get(namespace, {}).pop(name, None)
        else:
            self.templates.setdefault(namespace, {})[name] = template
        for listener in self.template_listeners:
            listener(kind, template)

    def apply_class(self, kind: str, device_class: DeviceClass) -> None:
        self._offer(kind, device_class)
        self._class_resolver = None
        if kind == "DELETED":
            self.device_classes.pop(device_class.metadata.name or "", None)
        else:
            self.device_classes[device_class.metadata.name or ""] = device_class

    def apply_node(self, kind: str, node: Node) -> None:
        self.publisher.offer(node, kind == "DELETED")
        name = node.metadata.name or ""
        for nodes in self.extended_offered.values():
            nodes.discard(name)
        if kind != "DELETED":
            for resource, amount in ((node.status.allocatable or {}) if node.status else {}).items():
                if er.is_dra_extended_resource_name(resource) and amount not in ("0", ""):
                    self.extended_offered.setdefault(resource, set()).add(name)
        if kind == "DELETED":
            changed = self.nodes.pop(name, None) is not None
        else:
            fingerprint = node_fit_fingerprint(node)
            changed = self.nodes.get(name) != fingerprint
            self.nodes[name] = fingerprint
        for listener in self.node_listeners:
            listener(kind, node, changed)

    # --- lookups -----------------------------------------------------------------------------------

    def is_ours(self, pod: Pod) -> bool:
        return (pod.spec.scheduler_name or "default-scheduler") in self.settings.scheduler_names

    def pending_pod_needs_work(self, pod: Pod) -> bool:
        """One of our pods, not bound, not being deleted and not finished: it needs a node."""
        return (
            self.is_ours(pod)
            and not pod.spec.node_name
            and pod.metadata.deletion_timestamp is None
            and not lc.pod_is_done(pod)
        )

    def claims_still_cached(self, namespace: str, claims: Iterable[ResourceClaim]) -> bool:
        cached = self.claims_by_namespace.get(namespace, {})
        return all((now := cached.get(c.metadata.name or "")) is not None and now.metadata.uid == c.metadata.uid
                   for c in claims)

    def claims_related_to(self, pod_uid: str) -> list[ResourceClaim]:
        """The claims that reserve the pod or are owned by it."""
        return [self.claims[k] for k in self.claims_by_pod.get(pod_uid, ()) if k in self.claims]

    def pods_using_template(self, namespace: str, name: str) -> list[Key]:
        return [key for key, pod in self.pods.items() if key[0] == namespace and any(
            pc.resource_claim_template_name == name for pc in pod.spec.resource_claims or ())]

    def class_resolver(self) -> er.ClassResolver:
        if self._class_resolver is None:
            self._class_resolver = er.ClassResolver(self.device_classes.values())
        return self._class_resolver

    def offers_extended_resource(self, resource: str) -> bool:
        """Some node offers the resource in its allocatable (a device plugin)."""
        return bool(self.extended_offered.get(resource))


def _older(new: ResourceClaim, cached: ResourceClaim) -> bool:
    """`new` is an earlier state of the very object `cached` is. resourceVersions are etcd
    revisions; compared as numbers, as kube-scheduler's assume cache does. Any other form is news."""
    if new.metadata.uid != cached.metadata.uid:
        return False
    try:
        return int(new.metadata.resource_version or "") < int(cached.metadata.resource_version or "")
    except ValueError:
        return False


def _pods_named_by(claim: ResourceClaim) -> set[str]:
    uids = {r.uid for r in (claim.status.reserved_for if claim.status else None) or ()}
    uids.update(r.uid for r in claim.metadata.owner_references or () if r.kind == "Pod")
    return uids

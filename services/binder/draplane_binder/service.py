"""The binder: watches Kubernetes, feeds the shards, and writes their placements back.

Tasks (all guarded, cancelled together on shutdown):
- one list-then-watch per kind (pods, claims, templates, nodes, and for the shards only device
  classes, device taint rules, pod groups and disruption budgets) into in-memory caches, each
  object also offered to the cluster bucket, the shards' one view of Kubernetes
  (draplane_binder.cluster_publisher);
- a pod queue: resolve the pod's claims (creating template claims), then publish a PendingPod;
- a claim queue: the claim lifecycle (reservedFor, deallocation, template claims of gone pods),
  and releases when a claim's allocation disappears;
- the results consumer: Placements are written with kube-scheduler's protocol, Unschedulable
  results become an Event and a PodScheduled=False condition;
- a retry loop for unschedulable pods, flushed early when devices are released or nodes change.

The decisions are in draplane_binder.lifecycle (claims) and draplane.scheduling.reservation_protocol
(hold, abandon, confirm, release and the start-up reconcile of reservations); this module does I/O
and bookkeeping only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient

from draplane.allocation.nodefit import node_names_required
from draplane.api.core import Node, Pod, PodResourceClaimStatus
from draplane.api.meta import ObjectMeta
from draplane.api.policy import PodDisruptionBudget
from draplane.api.resource import (
    DeviceClass, DeviceTaintRule, ResourceClaim, ResourceClaimConsumerReference, ResourceClaimTemplate,
)
from draplane.api.scheduling import PodGroup
from draplane.audit_publisher import AuditPublisher
from draplane.jetstream_setup import until_answered
from draplane.kube import KubeApiError, KubeClient, watch_objects
from draplane.messages import audit
from draplane.scheduling import cluster_feed
from draplane.scheduling import extended_resources as er
from draplane.scheduling import reservation_protocol as protocol
from draplane.scheduling import reservations as rv
from draplane.scheduling import streams
from draplane.scheduling.messages import (
    ClaimRef,
    ClaimReleased,
    MessageError,
    PendingPod,
    Placement,
    PodRef,
    Preemption,
    Subjects,
    Unschedulable,
    decode_message,
    encode_message,
    partition_key,
    shard_for,
)
from draplane.scheduling.placing import allocation_node
from draplane.scheduling.reservation_store import ReservationStore
from draplane.metrics import counter_value
from draplane.scheduling.unschedulable import (
    CLAIM_ERROR, CONDITION_REASON, ERROR_CONDITION_REASON, EVENT_REASON, GANG_WAITING, VOLUME_UNBOUND, claim_problem,
    failure_label, pre_filter_problem,
)
from draplane.scheduling.volume_binding import VolumeUnschedulable, pod_claim_names
from draplane.structured_logs import fields
from draplane.tasks import cancel_all
from draplane_binder import in_flight as inf
from draplane_binder.cluster_publisher import ClusterPublisher
from draplane_binder import lifecycle as lc
from draplane_binder.double_allocation import DoubleAllocation, DeviceHolders
from draplane_binder.metrics import BinderMetrics, seconds_since
from draplane_binder.requeue import node_fit_fingerprint
from draplane_binder.settings import BinderSettings
from draplane_binder.volumes import VolumeBinder

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)
MAX_QUEUED_EVENTS = 1000
EVENT_WRITERS = 4
# How often PendingPods unanswered for long are looked for: with 20,000 pods queued, looking at
# each of them ten times a second cost more CPU than the rest of the retry loop.
IN_FLIGHT_CHECK_SECONDS = 5.0


# A claim's allocation is not written later than this before its reservation's lease ends
# (see Binder._write_deadline): room for the request in flight and for clocks a little apart.
WRITE_DEADLINE_MARGIN_SECONDS = 3.0
# How often PreBind looks at claims whose devices' binding conditions it waits for (the watch
# updates the cache; kube-scheduler polls every 5 s), and renews the placement's leases meanwhile.
BINDING_POLL_SECONDS = 0.5
BINDING_LEASE_RENEW_SECONDS = 5.0
# How long a ClaimReleased publish is tried again (see _tell_released).
RELEASE_PUBLISH_RETRY_SECONDS = 10.0


# JetStream's error code for a message not in the stream: a work queue's message acknowledged
# (taken and answered) by its shard already
NO_MESSAGE_FOUND = 10057


def _now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _key(obj) -> Key:
    return (obj.metadata.namespace or "", obj.metadata.name or "")


class WorkQueue:
    """A set-backed queue with client-go's workqueue guarantees: a key queued twice before it is
    taken is processed once, and a key is never processed by two workers at once. A key put while
    a worker has it is held back and queued again when that worker calls `done`.

    Why the second guarantee: two workers reconciling one pod at once would each create a claim
    from its template (the claims cache learns of the first create only when it returns).
    """

    __slots__ = ("_queue", "_queued", "_processing", "_again", "_failures", "_initial", "_max")

    def __init__(self, *, initial_backoff: float = 0.1, max_backoff: float = 30.0) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._queued: set = set()
        self._processing: set = set()
        self._again: set = set()
        # key -> failures in a row, for client-go's per-item exponential backoff
        self._failures: dict = {}
        self._initial = initial_backoff
        self._max = max_backoff

    def retry_later(self, key) -> float:
        """Put the key back after a backoff that doubles with each failure in a row (an error
        that lasts is retried ever more slowly, never in a hot loop). Returns the delay."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay = min(self._max, self._initial * 2 ** failures)
        asyncio.get_running_loop().call_later(delay, self.put, key)
        return delay

    def forget(self, key) -> None:
        """The key was handled: its next failure starts the backoff afresh."""
        self._failures.pop(key, None)

    def put(self, key) -> None:
        if key in self._processing:
            self._again.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    async def get(self):
        key = await self._queue.get()
        self._queued.discard(key)
        self._processing.add(key)
        return key

    def done(self, key) -> None:
        self._processing.discard(key)
        if key in self._again:
            self._again.discard(key)
            self.put(key)

    def __len__(self) -> int:
        return len(self._queued) + len(self._again)


# The reason of the Warning Event on each claim of a double allocation.
DOUBLE_ALLOCATION_REASON = "DeviceAllocatedTwice"


class Binder:
    def __init__(self, settings: BinderSettings, kube: KubeClient, nc: NatsClient, *,
                 metrics: BinderMetrics | None = None):
        self.settings = settings
        self.kube = kube
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = Subjects(prefix=settings.prefix)
        self.store: ReservationStore | None = None
        self.instance = f"draplane-binder-{uuid.uuid4().hex[:8]}"
        self.audit = AuditPublisher(self.js, settings.prefix)

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
        self.device_holders = DeviceHolders()  # every claim's devices: double allocations by anyone
        # DeviceClasses (also offered to the shards): which extended resources DRA backs (KEP-5004)
        self.device_classes: dict[str, DeviceClass] = {}
        self._class_resolver: er.ClassResolver | None = None  # built from device_classes when first needed
        # extended resource -> nodes offering it in allocatable (a device plugin): those keep that path
        self.extended_offered: dict[str, set[str]] = {}
        self.synced: dict[str, asyncio.Event] = {k: asyncio.Event() for k in (
            "pods", "claims", "templates", "nodes", "classes", "taint rules", "pod groups", "budgets")}
        self.cluster = ClusterPublisher(instance=self.instance)
        # PersistentVolumeClaims, PersistentVolumes, StorageClasses: VolumeBinding's PreFilter and PreBind
        self.volumes = VolumeBinder(kube, bind_timeout=settings.volume_bind_timeout_seconds,
                                    wake_pods=self._wake_pods, wake_all=self._flush_retries, pod_of=self.pods.get)

        self.pod_queue = WorkQueue()
        self.claim_queue = WorkQueue()
        # pod uid -> its PendingPod, published and not yet answered
        self.in_flight: dict[str, inf.InFlight] = {}
        # pod uid -> (retry at, current backoff)
        self.retry: dict[str, tuple[float, float]] = {}
        # pod uid -> first time seen pending, carried to the shards for latency figures
        self.first_seen: dict[str, float] = {}
        # gang members told they wait (the condition) but not yet warned (the Event)
        self.unwarned: set[str] = set()
        # pod uid -> the last unschedulable message written, to avoid rewriting the same one
        self.last_reason: dict[str, str] = {}
        # pod uid -> why its last attempt failed, as a metric label (failure_label, SchedulerError)
        self.failure_reason: dict[str, str] = {}
        self.placement_slots = asyncio.Semaphore(settings.concurrency)
        # node -> claim uids written to Kubernetes whose reservation is still under a lease
        self.to_confirm: dict[str, set[str]] = {}
        self._confirm_wanted = asyncio.Event()
        # Events written aside, never holding up a binding: a bounded queue, as client-go's event
        # broadcaster keeps one (1,000 deep) and drops what does not fit. One task per event would
        # pile up without bound whenever the apiserver answers slower than pods are bound.
        self.events: asyncio.Queue = asyncio.Queue(maxsize=MAX_QUEUED_EVENTS)
        self._tasks: list[asyncio.Task] = []
        self._one_offs: set[asyncio.Task] = set()  # releases and reconciles in progress
        self.metrics = metrics if metrics is not None else BinderMetrics()
        self.metrics.export_claims(self._waiting_claims)

    @property
    def counters(self) -> dict[str, int]:
        """The binder's counts, read back from its metrics (diagnostics and tests)."""
        m = self.metrics
        counters = {"pods_bound": m.pods_bound, "claims_allocated": m.claims_allocated,
                    "placements_abandoned": m.placements_abandoned, "scheduling_failures": m.failures,
                    "claims_released": m.claims_released, "claims_created": m.claims_created,
                    "pending_published": m.pending_published, "pending_publish_failures": m.pending_publish_failures,
                    "pending_withdrawn": m.pending_withdrawn,
                    "errors": m.errors}
        return {name: int(counter_value(counter)) for name, counter in counters.items()}

    def _waiting_claims(self):
        """Per pending pod of ours: (its claims not allocated yet, why its last attempt failed)."""
        for pod in list(self.pods_by_uid.values()):
            if not self._pending_pod_needs_work(pod):
                continue
            namespace = pod.metadata.namespace or ""
            statuses = {s.name: s.resource_claim_name for s in (pod.status.resource_claim_statuses if pod.status else None) or ()}
            waiting = 0
            for pod_claim in pod.spec.resource_claims or ():
                name = pod_claim.resource_claim_name or statuses.get(pod_claim.name)
                claim = self.claims.get((namespace, name)) if name else None
                if claim is None or claim.status is None or claim.status.allocation is None:
                    waiting += 1
            yield waiting, self.failure_reason.get(pod.metadata.uid or "")

    # --- lifecycle of the service ------------------------------------------------------------------

    async def start(self) -> None:
        await streams.ensure_streams(self.js, self.subjects, replicas=self.settings.stream_replicas)
        await self.audit.start(replicas=self.settings.stream_replicas)
        kv = await streams.reservation_bucket(self.js, self.subjects, replicas=self.settings.stream_replicas)
        self.store = ReservationStore(kv)
        cluster_kv = await streams.cluster_bucket(self.js, self.subjects, replicas=self.settings.stream_replicas)
        # reading it back makes a consumer: a JetStream request, as likely as the others to go unanswered
        await until_answered(lambda: self.cluster.load(cluster_kv), f"reading bucket {self.subjects.cluster_bucket}",
                             log=log)
        self._spawn(self.cluster.run, "cluster feed writer")
        self._spawn(self.cluster.heartbeat, "cluster feed heartbeat")
        self._spawn(self.store.watch, "reservations watch")
        self._spawn(lambda: self._watch(Pod, "pods", self._on_pod), "pods watch")
        self._spawn(lambda: self._watch(ResourceClaim, "claims", self._on_claim), "claims watch")
        self._spawn(lambda: self._watch(ResourceClaimTemplate, "templates", self._on_template), "templates watch")
        self._spawn(lambda: self._watch(Node, "nodes", self._on_node), "nodes watch")
        for name, loop in self.volumes.watches():
            self._spawn(loop, name)
        # for the shards alone: the binder keeps no cache of these
        self._spawn(lambda: self._watch(DeviceClass, "classes", self._on_class), "classes watch")
        self._spawn(lambda: self._watch(PodDisruptionBudget, "budgets", self._offer), "disruption budgets watch")
        self._spawn(lambda: self._watch_if_served(DeviceTaintRule, "taint rules",
                                                  "devicetaintrules (gate DRADeviceTaintRules)"),
                    "device taint rules watch")
        self._spawn(lambda: self._watch_if_served(PodGroup, "pod groups", "podgroups (gate GenericWorkload): no gangs"),
                    "pod groups watch")
        for i in range(32):
            self._spawn(self._pod_worker, f"pod worker {i}")
        for i in range(4):
            self._spawn(self._claim_worker, f"claim worker {i}")
        self._spawn(self._consume_results, "results consumer")
        self._spawn(self._retry_loop, "retry loop")
        for i in range(EVENT_WRITERS):
            self._spawn(self._write_events, f"event writer {i}")
        self._spawn(self._confirm_loop, "confirm loop")
        self._spawn(lambda: self.metrics.consumer_lag.poll_forever(self.js, [(self.subjects.results_stream, "binder")]),
                    "consumer lag")

    @property
    def ready(self) -> bool:
        return (all(e.is_set() for e in self.synced.values()) and self.volumes.ready and self.store is not None
                and self.store.synced)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready:
            if time.monotonic() > deadline:
                raise TimeoutError("binder: caches did not sync")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for task in list(self._one_offs):
            task.cancel()
        pending = await cancel_all(self._tasks, timeout=10)
        if pending:
            log.error("binder: %d tasks did not stop within 10 s: %s", len(pending), [t.get_name() for t in pending])
        self._tasks.clear()

    def _spawn(self, loop: Callable[[], Awaitable], name: str) -> None:
        """Run a long-lived loop; if it crashes it is logged and started again, never silently lost."""

        async def guarded():
            while True:
                try:
                    await loop()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001
                    log.exception("binder: %s crashed; restarting it in 1 s", name)
                    await asyncio.sleep(1.0)

        self._tasks.append(asyncio.create_task(guarded(), name=name))

    # --- watches -----------------------------------------------------------------------------------

    async def _watch(self, model, what: str, handle: Callable[[str, object], None]) -> None:
        self.cluster.listing_begins(model)
        async for event in watch_objects(self.kube, model):
            if event.type == "SYNCED":
                self.synced[what].set()
                self.cluster.listed(model)
                if what == "claims":
                    # what happened to claims while no binder watched (deleted, deallocated) left
                    # their confirmed reservations behind; a re-list may have missed some too
                    self._spawn_once(self.reconcile_reservations(), "reconcile reservations")
                if what in ("pods", "claims"):
                    # after a (re-)list every object is looked at again
                    for key in list(self.pods):
                        self.pod_queue.put(key)
                    for key in list(self.claims):
                        self.claim_queue.put(key)
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
                                "looking again every 60 s", served_by, exc)
                    self.synced[what].set()
                    self.cluster.listing_begins(model)
                    self.cluster.listed(model)  # none: keys of that kind left in the bucket go
                await asyncio.sleep(60.0)
                continue
            await self._watch(model, what, self._offer)
            return

    def _offer(self, kind: str, obj) -> None:
        self.cluster.offer(obj, kind == "DELETED")

    def _is_ours(self, pod: Pod) -> bool:
        return (pod.spec.scheduler_name or "default-scheduler") in self.settings.scheduler_names

    def _on_pod(self, kind: str, pod: Pod) -> None:
        self.cluster.offer(pod, kind == "DELETED")
        key = _key(pod)
        old = self.pods.get(key)
        if old is not None:
            self.pods_by_uid.pop(old.metadata.uid or "", None)
            for pc in old.spec.resource_claims or ():
                if pc.resource_claim_name:
                    self.pods_by_claim.get((key[0], pc.resource_claim_name), set()).discard(key)
        if (kind == "DELETED" or lc.pod_is_done(pod)) and pod.spec.volumes:
            # a ReadWriteOncePod claim it used may be free for the pods that wait for it
            self._wake_pods(self.volumes.pods_sharing_claims(key, pod))
        if kind == "DELETED" or pod.spec.node_name or lc.pod_is_done(pod):
            # bound, finished or gone: nothing left to schedule, so nothing to remember for it
            uid = pod.metadata.uid or ""
            sent = self.in_flight.get(uid)
            if sent is not None and sent.sequence is not None and (kind == "DELETED" or lc.pod_is_done(pod)):
                self._spawn_once(self._withdraw_pending(pod, sent), f"withdraw-{uid}")
            for table in (self.in_flight, self.retry, self.first_seen, self.last_reason, self.failure_reason):
                table.pop(uid, None)
            self.unwarned.discard(uid)
        self.volumes.track_pod(key, old, None if kind == "DELETED" else pod)
        if kind == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = pod
            self.pods_by_uid[pod.metadata.uid or ""] = pod
            for pc in pod.spec.resource_claims or ():
                if pc.resource_claim_name:
                    self.pods_by_claim.setdefault((key[0], pc.resource_claim_name), set()).add(key)
            self.pod_queue.put(key)
        # claims reserved for this pod, or generated for it, may now need cleaning up
        for claim_key in self.claims_by_pod.get(pod.metadata.uid or "", ()):
            self.claim_queue.put(claim_key)

    def _on_claim(self, kind: str, claim: ResourceClaim) -> None:
        key = _key(claim)
        old = self.claims.get(key)
        if kind != "DELETED" and old is not None and _older(claim, old):
            # The cache holds what we wrote ourselves, and the watch has not caught up: this event
            # (the claim as created, say) is older. Taken in, it would look like a deallocation and
            # release the reservation of a claim that is allocated. The newer event follows.
            return
        self.cluster.offer(claim, kind == "DELETED")
        namespace_claims = self.claims_by_namespace.setdefault(key[0], {})
        for pod_uid in _pods_named_by(old) if old is not None else ():
            self.claims_by_pod.get(pod_uid, set()).discard(key)
        if kind != "DELETED":
            for pod_uid in _pods_named_by(claim):
                self.claims_by_pod.setdefault(pod_uid, set()).add(key)
        if kind == "DELETED":
            self.device_holders.forget(claim.metadata.uid or "")
        else:
            for double in self.device_holders.update(claim):
                self._report_double_allocation(double)
        if kind == "DELETED":
            self.claims.pop(key, None)
            namespace_claims.pop(key[1], None)
            if claim.status and claim.status.allocation:
                self._spawn_once(self._release(claim), f"release {key}")
        else:
            self.claims[key] = claim
            namespace_claims[key[1]] = claim
            had = old is not None and old.status is not None and old.status.allocation is not None
            has = claim.status is not None and claim.status.allocation is not None
            if had and not has and old.metadata.uid == claim.metadata.uid:
                self._spawn_once(self._release(old), f"release {key}")
            self.claim_queue.put(key)
        # wake the pods that use it, backoff or not: a claim that appears or changes is what a
        # pod told "not found" waits for
        waiting = list(self.pods_by_claim.get(key, ()))
        self._wake_pods(waiting)
        for pod_key in waiting:
            self.pod_queue.put(pod_key)
        for ref in claim.metadata.owner_references or ():
            if ref.kind == "Pod" and ref.controller:
                owner = self.pods_by_uid.get(ref.uid)
                if owner is not None:
                    self.pod_queue.put(_key(owner))

    def _on_template(self, kind: str, template: ResourceClaimTemplate) -> None:
        namespace, name = _key(template)
        if kind == "DELETED":
            self.templates.get(namespace, {}).pop(name, None)
        else:
            self.templates.setdefault(namespace, {})[name] = template
        for key, pod in self.pods.items():
            if key[0] == namespace and any(
                pc.resource_claim_template_name == name for pc in pod.spec.resource_claims or ()
            ):
                self.pod_queue.put(key)

    def _on_class(self, kind: str, device_class: DeviceClass) -> None:
        self._offer(kind, device_class)
        self._class_resolver = None
        if kind == "DELETED":
            self.device_classes.pop(device_class.metadata.name or "", None)
        else:
            self.device_classes[device_class.metadata.name or ""] = device_class

    def _on_node(self, kind: str, node: Node) -> None:
        self.cluster.offer(node, kind == "DELETED")
        name = node.metadata.name or ""
        for nodes in self.extended_offered.values():
            nodes.discard(name)
        if kind != "DELETED":
            for resource, amount in ((node.status.allocatable or {}) if node.status else {}).items():
                if er.is_dra_extended_resource_name(resource) and amount not in ("0", ""):
                    self.extended_offered.setdefault(resource, set()).add(name)
        self.volumes.set_node(name, None if kind == "DELETED" else (node.metadata.labels or {}))
        if kind == "DELETED":
            changed = self.nodes.pop(name, None) is not None
        else:
            fingerprint = node_fit_fingerprint(node)
            changed = self.nodes.get(name) != fingerprint
            self.nodes[name] = fingerprint
        if changed and self.synced["nodes"].is_set():
            self._flush_retries()

    def _spawn_once(self, coro: Awaitable, name: str) -> None:
        """A one-off task (a release, a reconcile), cancelled by `stop` if still running."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(_log_failure)
        self._one_offs.add(task)
        task.add_done_callback(self._one_offs.discard)

    # --- pods --------------------------------------------------------------------------------------

    async def _pod_worker(self) -> None:
        while True:
            key = await self.pod_queue.get()
            try:
                await self._reconcile_pod(key)
                self.pod_queue.forget(key)
            except KubeApiError as exc:
                if exc.is_conflict or exc.retryable:
                    delay = self.pod_queue.retry_later(key)
                    log.log(logging.DEBUG if exc.is_conflict else logging.WARNING,
                            "pod %s/%s: %s; retrying in %.1f s", *key, exc, delay)
                elif not exc.is_not_found:
                    log.warning("pod %s/%s: %s", *key, exc)
            except Exception as exc:  # noqa: BLE001 - one bad pod must not stop the worker
                self.metrics.errors.inc()
                delay = self.pod_queue.retry_later(key)
                log.exception("pod %s/%s: reconcile failed; retrying in %.1f s", *key, delay)
                pod = self.pods.get(key)
                if pod is not None:
                    await self._report_error(pod.metadata.uid or "", f"draplane binder: preparing the pod failed: "
                                             f"{exc!r}; retrying in {delay:.0f} s")
            finally:
                self.pod_queue.done(key)

    def _pending_pod_needs_work(self, pod: Pod) -> bool:
        return (
            self._is_ours(pod)
            and not pod.spec.node_name
            and pod.metadata.deletion_timestamp is None
            and not lc.pod_is_done(pod)
        )

    async def _reconcile_pod(self, key: Key) -> None:
        if not (self.synced["claims"].is_set() and self.synced["templates"].is_set()):
            await asyncio.gather(self.synced["claims"].wait(), self.synced["templates"].wait())
        pod = self.pods.get(key)
        if pod is None or not self._pending_pod_needs_work(pod):
            return
        uid = pod.metadata.uid or ""
        namespace = key[0]
        resolved = lc.resolve_pod_claims(
            pod,
            self.claims_by_namespace.get(namespace, {}),
            self.templates.get(namespace, {}),
            manage_templates=self.settings.manage_claims,
            related=[self.claims[k] for k in self.claims_by_pod.get(uid, ()) if k in self.claims],
        )
        new_statuses = list(resolved.statuses_to_record)
        for pod_claim_name, template in resolved.to_create:
            claim = lc.claim_from_template(pod, pod_claim_name, template)
            created = await self.kube.create(claim)
            self.metrics.claims_created.inc()
            log.info("pod %s/%s: created resourceclaim %s from template %s for pod claim %s",
                     namespace, key[1], created.metadata.name, template.metadata.name, pod_claim_name,
                     extra=fields(pod=f"{namespace}/{key[1]}", claim=f"{namespace}/{created.metadata.name}"))
            self._on_claim("ADDED", created)
            new_statuses.append(PodResourceClaimStatus(name=pod_claim_name, resource_claim_name=created.metadata.name))
        if new_statuses:
            merged = lc.merged_claim_statuses(pod, new_statuses)
            patch = {
                "metadata": {"resourceVersion": pod.metadata.resource_version},
                "status": {"resourceClaimStatuses": msgspec.to_builtins(merged)},
            }
            updated = await self.kube.patch(Pod, key[1], patch, namespace, subresource="status")
            self._on_pod("MODIFIED", updated)
            return  # the updated pod is queued again and continues from there
        if lc.pod_is_gated(pod):
            # Its claims exist (kube-controller-manager makes them for gated pods too, and so do
            # we when we manage claims), but no scheduling is tried and nothing is written on the
            # pod: the apiserver set PodScheduled=False/SchedulingGated when it took the pod.
            # Removing the last gate is a pod update, which queues the pod again.
            log.debug("pod %s/%s: waiting for scheduling gates %s", namespace, key[1],
                      [g.name for g in pod.spec.scheduling_gates or ()])
            return
        self.first_seen.setdefault(uid, time.time())
        try:
            extended = await self._extended_resource_claim(pod)
        except er.ExtendedResourceError as exc:
            await self._mark_unschedulable(pod, claim_problem(f"extended resources: {exc}"), reason=CLAIM_ERROR)
            return
        if extended is False:
            return  # the claim was made or the pod's status written: the update queues the pod again
        if resolved.problems and all(p.waiting for p in resolved.problems):
            # The claim's creation or its watch event is on the way and requeues the pod: writing
            # a condition and an Event now would cost two writes per template pod, for nothing.
            log.debug("pod %s/%s: %s", namespace, key[1], "; ".join(p.message for p in resolved.problems))
            return
        if resolved.problems:
            message = claim_problem("; ".join(f"pod claim {p.pod_claim}: {p.message}" for p in resolved.problems))
            await self._mark_unschedulable(pod, message, reason=CLAIM_ERROR)
            return
        if uid in self.in_flight or (uid in self.retry and self.retry[uid][0] > time.monotonic()):
            return
        volumes = None
        # kube-scheduler's NodeAffinity PreFilter runs before VolumeBinding's: a pod whose required
        # node names cancel out is refused for that, by the shard, whatever its volumes
        if pod_claim_names(pod) and node_names_required(pod) != frozenset():
            await self.volumes.wait_synced()
            try:
                volumes = self.volumes.pre_filter(pod)
            except VolumeUnschedulable as exc:
                # kube-scheduler's VolumeBinding PreFilter: no node is tried until the claims change,
                # which wakes the pod (draplane_binder.volumes)
                await self._mark_unschedulable(pod, pre_filter_problem(len(self.nodes), exc.message),
                                               reason=VOLUME_UNBOUND)
                return
        claims = [self.claims_by_namespace[namespace][name] for name in resolved.names.values()]
        dra_extended: list[str] | None = None
        if extended is not None:
            special, dra_extended = extended
            claims.append(special)
        # the shard reads the claims from the cluster bucket: from this revision on, it has them
        keys = [cluster_feed.key_of(c) for c in claims]
        if cluster_feed.published_pod(pod):
            keys.append(cluster_feed.key_of(pod))  # a gang member: the shard must know it exists
        try:
            revision = await self.cluster.revision_of(keys)
        except TimeoutError:
            # NATS does not take the writes (its leader moving, the connection down): not the pod's
            # fault, so no condition on it; sent again after the first backoff.
            self.retry[uid] = (time.monotonic() + self.settings.retry_initial_seconds,
                               self.retry.get(uid, (0.0, self.settings.retry_initial_seconds))[1])
            log.warning("pod %s/%s: the cluster bucket did not take its claims in time; retrying in %.1f s",
                        namespace, key[1], self.settings.retry_initial_seconds)
            return
        current = self.pods.get(key)
        if current is None or current.metadata.uid != uid or not self._pending_pod_needs_work(current) or \
                not self._claims_still_cached(namespace, claims):
            return  # bound, deleted, done or a claim replaced while the bucket was written: queued again
        pending = PendingPod(
            pod=PodRef(namespace=namespace, name=key[1], uid=uid),
            claims=[ClaimRef(namespace=namespace, name=c.metadata.name or "", uid=c.metadata.uid or "") for c in claims],
            first_seen=self.first_seen[uid],
            spec=pod.spec,
            labels=pod.metadata.labels,
            cluster_revision=revision,
            volumes=volumes,
            dra_extended_resources=dra_extended,
        )
        shard = shard_for(partition_key(pending), self.settings.shards)
        self.in_flight[uid] = sent = inf.InFlight(since=time.monotonic(), shard=shard)
        try:
            ack = await self.js.publish(self.subjects.pending(shard), encode_message(pending))
            sent.sequence = ack.seq
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            # Not in the stream (its leader is being re-elected after a NATS server died, or the
            # connection is down): the pod is not in flight, so retry it soon rather than after the
            # 60 s in-flight backstop. A publish that landed but lost its ack makes a duplicate
            # PendingPod, which the shards already handle (JetStream redelivery makes them too).
            self.in_flight.pop(uid, None)
            self.retry[uid] = (time.monotonic() + self.settings.retry_initial_seconds,
                               self.retry.get(uid, (0.0, self.settings.retry_initial_seconds))[1])
            self.metrics.pending_publish_failures.inc()
            log.warning("pod %s/%s: PendingPod not published to shard %d (%r); retrying in %.1f s",
                        namespace, key[1], shard, exc, self.settings.retry_initial_seconds)
            return
        self.metrics.pending_published.inc()

    async def _withdraw_pending(self, pod: Pod, sent: inf.InFlight) -> None:
        """A pod deleted (or finished) while its PendingPod waits in its shard's queue: the message
        is deleted from the stream, so no shard places the pod and holds devices for it. One the
        shard has taken already is placed, and that placement abandoned when it reaches the binder
        (write_placement finds no pod)."""
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        try:
            await self.js.delete_msg(self.subjects.pending_stream, sent.sequence)
        except nats.js.errors.APIError as exc:
            if exc.err_code == NO_MESSAGE_FOUND:
                log.debug("pod %s: gone; its PendingPod (sequence %d) was taken by shard %d already",
                          key, sent.sequence, sent.shard)
                return
            log.warning("pod %s: gone, but its PendingPod (sequence %d) could not be withdrawn from shard "
                        "%d's queue (%s); its placement will be abandoned", key, sent.sequence, sent.shard, exc)
            return
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            # not fatal: the shard places it and the binder abandons that placement
            log.warning("pod %s: gone, but its PendingPod (sequence %d) could not be withdrawn from shard "
                        "%d's queue (%r); its placement will be abandoned", key, sent.sequence, sent.shard, exc)
            return
        self.metrics.pending_withdrawn.inc()
        log.info("pod %s: gone while waiting for shard %d; its PendingPod (sequence %d) withdrawn",
                 key, sent.shard, sent.sequence, extra=fields(pod=key))

    async def _extended_resource_claim(self, pod: Pod) -> tuple[ResourceClaim, list[str]] | None | bool:
        """KEP-5004: the claim that serves the pod's extended resources through DRA, and which
        resources those are; None when it asks for none that DRA backs. False when this made the
        claim or recorded it in the pod's status.extendedResourceClaimStatus (the pod comes back).
        Raises ExtendedResourceError for a request that cannot be made into one."""
        if not any(c.resources and c.resources.requests for c in [*(pod.spec.init_containers or ()),
                                                                     *pod.spec.containers]):
            return None
        await asyncio.gather(self.synced["classes"].wait(), self.synced["nodes"].wait())
        if self._class_resolver is None:
            self._class_resolver = er.ClassResolver(self.device_classes.values())
        resources = er.dra_backed_resources(pod, self._class_resolver,
                                            lambda resource: bool(self.extended_offered.get(resource)))
        if not resources:
            return None
        namespace, name = _key(pod)
        claim = er.find_special_claim(pod, self.claims_by_namespace.get(namespace, {}).values())
        recorded = pod.status.extended_resource_claim_status if pod.status else None
        if claim is not None and recorded is not None and recorded.resource_claim_name == claim.metadata.name:
            return claim, sorted(resources)  # made and recorded by an earlier attempt
        requests, mappings = er.claim_requests(pod, resources)
        if claim is None:
            claim = await self.kube.create(er.special_claim(pod, requests))
            self.metrics.claims_created.inc()
            self._on_claim("ADDED", claim)
            log.info("pod %s/%s: created resourceclaim %s for its extended resources %s (backed by DeviceClasses %s)",
                     namespace, name, claim.metadata.name, ", ".join(sorted(resources)),
                     ", ".join(sorted(set(resources.values()))),
                     extra=fields(pod=f"{namespace}/{name}", claim=f"{namespace}/{claim.metadata.name}"))
        patch = {"metadata": {"resourceVersion": pod.metadata.resource_version},
                 "status": {"extendedResourceClaimStatus": {"requestMappings": mappings,
                                                            "resourceClaimName": claim.metadata.name}}}
        updated = await self.kube.patch(Pod, name, patch, namespace, subresource="status")
        self._on_pod("MODIFIED", updated)
        return False

    def _claims_still_cached(self, namespace: str, claims: list[ResourceClaim]) -> bool:
        cached = self.claims_by_namespace.get(namespace, {})
        return all((now := cached.get(c.metadata.name or "")) is not None and now.metadata.uid == c.metadata.uid
                   for c in claims)

    async def _mark_unschedulable(self, pod: Pod, message: str, *, reason: str, shard: int | None = None,
                                  answer: str = "", condition: str = CONDITION_REASON) -> None:
        """`reason` is why as a metric label (failure_label); `shard` and `answer` (its
        results-stream sequence) name a shard's verdict, for the audit. `condition` is the
        PodScheduled condition's reason: Unschedulable, or SchedulerError for an attempt that
        ended on an error."""
        uid = pod.metadata.uid or ""
        self.failure_reason[uid] = reason
        self.in_flight.pop(uid, None)
        _, backoff = self.retry.get(uid, (0.0, self.settings.retry_initial_seconds / 2))
        backoff = min(self.settings.retry_max_seconds, backoff * 2)
        self.retry[uid] = (time.monotonic() + backoff, backoff)
        first_seen = self.first_seen.get(uid)
        # waiting for the gang's other members is no failure yet: the condition says it, and a
        # Warning follows only once the wait has lasted (gang_wait_warning_seconds)
        quiet = reason == GANG_WAITING and first_seen is not None and \
            time.time() - first_seen < self.settings.gang_wait_warning_seconds
        if self.last_reason.get(uid) == message:
            if uid in self.unwarned and not quiet:
                self.unwarned.discard(uid)
                await self._event(pod, EVENT_REASON, message)
            return
        self.last_reason[uid] = message
        self.metrics.failures.labels(reason).inc()
        log.info("pod %s/%s: unschedulable, retry in %.1f s: %s", *_key(pod), backoff, message,
                 extra=fields(pod="/".join(_key(pod))))
        await self._not_scheduled(pod, condition, message, warn=not quiet)
        if quiet:
            self.unwarned.add(uid)
        else:
            self.unwarned.discard(uid)
        await self.audit.publish_and_wait(audit.AuditEvent(
            id=audit.rejected_id(uid, message, answer), kind="rejected", at=time.time(),
            by=[*([f"shard-{shard}"] if shard is not None else []), self.instance],
            pod=audit.PodName(namespace=pod.metadata.namespace or "", name=pod.metadata.name or "", uid=uid),
            reason=message, latency=time.time() - first_seen if first_seen else None,
        ))

    async def _not_scheduled(self, pod: Pod, reason: str, message: str, *, warn: bool = True) -> None:
        """PodScheduled=False with `reason`, and (`warn`) a FailedScheduling Event, as kube-scheduler
        writes them. A pod deleted meanwhile gets neither."""
        namespace, name = _key(pod)
        condition = {"type": "PodScheduled", "status": "False", "reason": reason, "message": message,
                     "lastTransitionTime": _now_rfc3339()}
        try:
            await self.kube.patch(Pod, name, {"status": {"conditions": [condition]}}, namespace,
                                  subresource="status", patch_type="application/strategic-merge-patch+json")
        except KubeApiError as exc:
            if not exc.is_not_found:
                raise
            return
        if warn:
            await self._event(pod, EVENT_REASON, message)

    async def _event(self, pod: Pod, reason: str, message: str, type_: str = "Warning") -> None:
        namespace, name = _key(pod)
        await self._object_event({"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name,
                                  "uid": pod.metadata.uid}, reason, message, type_)

    # --- double allocations --------------------------------------------------------------------

    def _report_double_allocation(self, double: DoubleAllocation) -> None:
        """A device in two claims beyond what adminAccess and shares allow (double_allocation.py):
        counted, logged, a Warning Event on each claim and an audit record. draplane's own
        placements never do this (the shards commit through one reservation bucket); another
        scheduler over the same slices can."""
        self.metrics.double_allocations.inc()
        log.error("%s", double.message(), extra=fields(claim=double.first.key, node=double.device[1]))
        self._spawn_once(self._tell_double_allocation(double), f"double allocation {double.id}")

    async def _tell_double_allocation(self, double: DoubleAllocation) -> None:
        for holder in (double.first, double.second):
            await self._object_event(
                {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "namespace": holder.namespace,
                 "name": holder.name, "uid": holder.uid}, DOUBLE_ALLOCATION_REASON, double.message())
        driver, pool, device = double.device
        await self.audit.publish_and_wait(audit.AuditEvent(
            id=audit.double_allocation_id(double.id), kind="conflict", at=time.time(), by=[self.instance], node=pool,
            claims=[audit.ClaimDevices(namespace=h.namespace, name=h.name, uid=h.uid, devices=[audit.DeviceRef(
                driver=driver, pool=pool, device=device, share_id=h.share_id, admin_access=h.admin_access)])
                for h in (double.first, double.second)],
            reason=double.message(),
        ))

    async def _object_event(self, involved: dict, reason: str, message: str, type_: str = "Warning") -> None:
        now = _now_rfc3339()
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{involved['name']}.", "namespace": involved["namespace"]},
            "involvedObject": involved, "reason": reason, "message": message[:1024], "type": type_,
            "source": {"component": "draplane"}, "reportingComponent": "draplane", "reportingInstance": self.instance,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            await self.kube.apply_raw(event)
        except KubeApiError as exc:
            log.warning("event %s for %s %s/%s not written: %s", reason, involved["kind"], involved["namespace"],
                        involved["name"], exc)

    def _queue_event(self, pod: Pod, reason: str, message: str, type_: str = "Warning") -> None:
        try:
            self.events.put_nowait((pod, reason, message, type_))
        except asyncio.QueueFull:
            self.metrics.events_dropped.inc()
            log.debug("event %s for pod %s/%s dropped: %d events wait already", reason, *_key(pod), self.events.qsize())

    async def _write_events(self) -> None:
        while True:
            pod, reason, message, type_ = await self.events.get()
            await self._event(pod, reason, message, type_)

    # --- retries -----------------------------------------------------------------------------------

    def _next_backoff(self, uid: str) -> float:
        """The pod's backoff after one more failed attempt: doubling, up to retry_max_seconds."""
        return min(self.settings.retry_max_seconds,
                   self.retry.get(uid, (0.0, self.settings.retry_initial_seconds / 2))[1] * 2)

    def _back_off(self, uid: str, backoff: float) -> None:
        """Retry a pod whose PreBind failed after `backoff` (kube-scheduler's backoff queue), not
        _abandon's quick retry, which is for a lapsed lease: a volume or a device that keeps
        failing would otherwise be tried three times a second."""
        if uid in self.retry:
            self.retry[uid] = (time.monotonic() + backoff, backoff)

    def _wake_pods(self, keys: list[Key]) -> None:
        """Pods something they wait for changed (a PersistentVolumeClaim): tried again soon, backoff or not."""
        soon = time.monotonic() + self.settings.retry_flush_seconds
        for key in keys:
            pod = self.pods.get(key)
            uid = pod.metadata.uid or "" if pod is not None else ""
            if uid in self.retry and self.retry[uid][0] > soon:
                self.retry[uid] = (soon, self.retry[uid][1])

    def _flush_retries(self) -> None:
        soon = time.monotonic() + self.settings.retry_flush_seconds
        for uid, (at, backoff) in list(self.retry.items()):
            if at > soon:
                self.retry[uid] = (soon, backoff)

    async def _retry_loop(self) -> None:
        next_backstop = time.monotonic() + IN_FLIGHT_CHECK_SECONDS
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            for uid, (at, _) in list(self.retry.items()):
                if at <= now:
                    pod = self.pods_by_uid.get(uid)
                    if pod is None:
                        self.retry.pop(uid, None)
                        continue
                    # keep the backoff, mark the moment passed
                    self.retry[uid] = (float("-inf"), self.retry[uid][1])
                    self.pod_queue.put(_key(pod))
            if now >= next_backstop:
                next_backstop = now + IN_FLIGHT_CHECK_SECONDS
                await self._send_lost_again(now)

    async def _send_lost_again(self, now: float) -> None:
        """PendingPods a shard acknowledged without an answer (draplane_binder.in_flight) are
        sent again. JetStream redelivers unacknowledged ones, so this is only a backstop; one
        that is still queued for a shard that has not reached it is never sent twice."""
        if not inf.waiting_for_answers(self.in_flight, now):
            return
        floors: dict[int, int | None] = {}
        for shard in inf.to_ask_about(self.in_flight, now):
            floors[shard] = await self._ack_floor(self.subjects.pending_stream, f"shard-{shard}")
        # read after the floors: an answer published before a floor moved is at or below this
        pending_last = await self._last_sequence(self.subjects.pending_stream)
        results_last = await self._last_sequence(self.subjects.results_stream)
        results_handled = await self._ack_floor(self.subjects.results_stream, "binder")
        for uid in inf.lost(self.in_flight, floors, now, pending_last=pending_last, results_last=results_last,
                            results_handled=results_handled):
            self.in_flight.pop(uid, None)
            pod = self.pods_by_uid.get(uid)
            if pod is not None:
                self.pod_queue.put(_key(pod))

    async def _last_sequence(self, stream: str) -> int | None:
        try:
            return (await self.js.stream_info(stream)).state.last_seq
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
            return None

    async def _ack_floor(self, stream: str, durable: str) -> int | None:
        """The stream sequence a consumer has acknowledged everything up to; None when there is
        no such consumer yet (no shard started) or NATS does not answer."""
        try:
            info = await self.js.consumer_info(stream, durable)
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
            return None
        return info.ack_floor.stream_seq if info.ack_floor else None

    # --- results from the shards -------------------------------------------------------------------

    async def _consume_results(self) -> None:
        sub = await self.js.pull_subscribe(
            self.subjects.results, durable="binder", stream=self.subjects.results_stream,
            config=streams.work_consumer("binder"),
        )
        try:
            await asyncio.gather(self.synced["pods"].wait(), self.synced["claims"].wait())
            while True:
                try:
                    messages = await sub.fetch(64, timeout=1.0)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    continue
                results = []
                for msg in messages:
                    try:
                        results.append((msg, decode_message(msg.data)))
                    except MessageError as exc:
                        log.error("dropping a result that is not ours: %s", exc)
                        await msg.term()
                await self._extend_received([result for _, result in results])
                for msg, result in results:
                    slot = _PlacementSlot(self.placement_slots)
                    await slot.take()
                    task = asyncio.create_task(self._handle_result(msg, result, slot))
                    task.add_done_callback(lambda t, slot=slot: (slot.give_up(), _log_failure(t)))
        finally:
            await _unsubscribe(sub)

    async def _extend_received(self, results) -> None:
        """Renew the leases of a fetched batch at once, one write per node: a placement waiting
        here behind slow apiserver writes must not lapse and be given to someone else."""
        by_node: dict[str, dict[str, list]] = {}
        pods_by_node: dict[str, set[str]] = {}
        for result in results:
            if isinstance(result, Placement):
                expected = by_node.setdefault(result.node, {})
                for c in result.claims:
                    expected[c.claim.uid] = rv.devices_of(c.allocation)
                pods_by_node.setdefault(result.node, set()).add(result.pod.uid)

        async def renew(node: str, expected: dict[str, list]) -> None:
            try:
                await self.store.hold(node, expected, self.settings.lease_seconds, pods=pods_by_node[node])
            except Exception:  # noqa: BLE001 - best effort; each placement checks its lease again
                log.warning("could not renew %d leases on node %s", len(expected), node, exc_info=True)

        # one write per node, all nodes at once: a batch spread over 64 nodes waited for 64 round trips
        await asyncio.gather(*(renew(node, expected) for node, expected in by_node.items()))

    async def _handle_result(self, msg, result, slot: "_PlacementSlot | None" = None) -> None:
        try:
            if isinstance(result, Placement):
                if await self.write_placement(result, in_progress=msg.in_progress, slot=slot):
                    # Before the acknowledgement: a crash in between redelivers the placement,
                    # which finds the pod bound and publishes this again (one event by its id).
                    await self.audit.publish_and_wait(self._placed_event(result))
            elif isinstance(result, Unschedulable):
                pod = self.pods_by_uid.get(result.pod.uid)
                if pod is not None and self._pending_pod_needs_work(pod):
                    message = result.message
                    if result.preemption is not None:
                        message = await self.preempt(pod, result.preemption, message, shard=result.shard)
                    await self._mark_unschedulable(
                        pod, message, shard=result.shard, answer=_stream_sequence(msg),
                        reason=ERROR_CONDITION_REASON if result.error else (
                            result.label or failure_label(result.failures, result.claim_error)),
                        condition=ERROR_CONDITION_REASON if result.error else CONDITION_REASON)
            else:
                log.error("unexpected %s on the results subject", type(result).__name__)
        except Exception as exc:  # noqa: BLE001 - counted, logged, told to the pod, redelivered with backoff
            deliveries = streams.deliveries(msg)
            delay = streams.redelivery_delay(deliveries)
            self.metrics.errors.inc()
            log.exception("pod %s: handling its %s failed (delivery %d); redelivering in %.0f s",
                          result.pod.key(), type(result).__name__, deliveries, delay)
            await msg.nak(delay=delay)
            await self._report_error(result.pod.uid, f"draplane binder: {type(result).__name__.lower()} of the pod "
                                     f"failed: {exc!r}; retrying in {delay:.0f} s")
            return
        await msg.ack()

    async def preempt(self, pod: Pod, preemption: Preemption, message: str, shard: int | None = None) -> str:
        """Evict the victims a shard chose through the Eviction API (it refuses what a
        PodDisruptionBudget forbids), tell each why with kube-scheduler's `Preempted` Event, and
        nominate the node on the preemptor. Returns the preemptor's message, with any refusal.

        Idempotent: a redelivered answer evicts pods already gone (404, or the UID precondition
        fails on a namesake: 409) and nominates the same node again."""
        namespace, name = _key(pod)
        refused = []
        for victim in preemption.victims:
            try:
                await self.kube.evict_pod(victim.namespace, victim.name, victim.uid)
            except KubeApiError as exc:
                if exc.is_not_found or exc.is_conflict:
                    continue  # gone already, or a new pod under its name: not ours to evict
                if exc.refused_by_disruption_budget:
                    refused.append(f"{victim.key()}: {exc.message}")
                    continue
                raise
            self.metrics.preemption_evictions.inc()
            log.info("pod %s: evicted to make room for %s/%s on node %s", victim.key(), namespace, name,
                     preemption.node, extra=fields(pod=victim.key(), node=preemption.node))
            victim_pod = Pod(metadata=ObjectMeta(namespace=victim.namespace, name=victim.name, uid=victim.uid))
            await self._event(victim_pod, "Preempted",
                              f"Preempted by pod {pod.metadata.uid} on node {preemption.node}", type_="Normal")
            await self.audit.publish_and_wait(audit.AuditEvent(
                id=audit.preempted_id(victim.uid), kind="preempted", at=time.time(),
                by=[f"shard-{shard}", self.instance] if shard is not None else [self.instance], node=preemption.node,
                pod=audit.PodName(namespace=victim.namespace, name=victim.name, uid=victim.uid),
                reason=f"evicted for {namespace}/{name}: {preemption.explanation}",
            ))
        try:
            await self.kube.patch(Pod, name, {"status": {"nominatedNodeName": preemption.node}}, namespace,
                                  subresource="status")
        except KubeApiError as exc:
            if not exc.is_not_found:
                raise
        if refused:
            return f"{message} Evictions refused: {'; '.join(refused)}."
        return message

    def _placed_event(self, placement: Placement) -> audit.AuditEvent:
        pod = placement.pod
        return audit.AuditEvent(
            id=audit.placed_id(pod.uid), kind="placed", at=time.time(), by=[f"shard-{placement.shard}", self.instance],
            node=placement.node, pod=audit.PodName(namespace=pod.namespace, name=pod.name, uid=pod.uid),
            claims=[audit.ClaimDevices(namespace=c.claim.namespace, name=c.claim.name, uid=c.claim.uid,
                                       devices=audit.devices_of(c.allocation)) for c in placement.claims],
            reason=(f"the best-scoring node under policy {placement.policy}" if placement.policy
                    else "its claims were allocated there already"),
            policy=placement.policy, score=placement.score,
            latency=time.time() - placement.first_seen if placement.first_seen else None,
        )

    async def _report_error(self, pod_uid: str, message: str) -> None:
        """An internal error, on the pod as kube-scheduler reports one: PodScheduled=False with
        reason SchedulerError, and a FailedScheduling Event. Best effort: the error may be the
        apiserver's own."""
        pod = self.pods_by_uid.get(pod_uid)
        if pod is None or not self._pending_pod_needs_work(pod) or self.last_reason.get(pod_uid) == message:
            return
        self.last_reason[pod_uid] = message
        self.failure_reason[pod_uid] = ERROR_CONDITION_REASON
        self.metrics.failures.labels(ERROR_CONDITION_REASON).inc()
        try:
            await self._not_scheduled(pod, ERROR_CONDITION_REASON, message)
        except Exception:  # noqa: BLE001
            log.warning("pod %s/%s: could not record the error on the pod", *_key(pod), exc_info=True)

    async def write_placement(self, placement: Placement, *,
                              in_progress: Callable[[], Awaitable] | None = None,
                              slot: "_PlacementSlot | None" = None) -> bool:
        """PreBind (volumes, then the claims' finalizer and status), then the binding; idempotent.
        On failure, undo and release. True when bound. `in_progress` tells the results stream
        that the placement is still being worked on (PreBind may wait for volumes for minutes)."""
        pod = self.pods_by_uid.get(placement.pod.uid)
        if pod is None:
            try:
                pod = await self.kube.get(Pod, placement.pod.name, placement.pod.namespace)
            except KubeApiError as exc:
                if not exc.is_not_found:
                    raise
                pod = None
        if pod is None or pod.metadata.uid != placement.pod.uid or lc.pod_is_done(pod) or pod.metadata.deletion_timestamp:
            await self._abandon(placement, pod, "the pod is gone")
            return False
        if pod.spec.node_name and pod.spec.node_name != placement.node:
            await self._abandon(placement, pod, f"the pod is already bound to node {pod.spec.node_name}")
            return False
        claim_uids = [c.claim.uid for c in placement.claims]
        # Only write devices the bucket still reserves for these claims: a lapsed reservation may
        # have been given to another claim, and a claim placed again after a restart may hold
        # other devices now. The check renews the leases in the same compare-and-set.
        held = await self.store.hold(
            placement.node, {c.claim.uid: rv.devices_of(c.allocation) for c in placement.claims},
            self.settings.lease_seconds, pods=[placement.pod.uid],
        )
        plan = protocol.plan_write(claim_uids, placement.pod.uid, held, node=placement.node,
                                   pod_bound_here=pod.spec.node_name == placement.node)
        if isinstance(plan, protocol.Abandon):
            self.metrics.lease_lapses.inc()
            await self._abandon(placement, pod, plan.why)
            return False
        for item in placement.claims:
            if item.claim.uid not in plan.verify:
                continue
            try:
                current = await self.kube.get(ResourceClaim, item.claim.name, item.claim.namespace)
            except KubeApiError as exc:
                if not exc.is_not_found:
                    raise
                current = None
            already = (current is not None and current.metadata.uid == item.claim.uid and current.status is not None
                       and lc.same_allocation(current.status.allocation, item.allocation))
            if not already:
                self.metrics.lease_lapses.inc()
                await self._abandon(placement, pod, f"resourceclaim {item.claim.key()}: its reservation is no longer held")
                return False

        if not pod.spec.node_name:
            why = await self._bind_pod_volumes(placement, pod, in_progress, slot)
            if why is not None:
                return False
        written: list[ClaimRef] = []
        deadline = self._write_deadline(placement.node, claim_uids)
        for item in placement.claims:
            outcome = await self._write_claim(item.claim, item.allocation, pod, deadline=deadline)
            if outcome is not None:
                await self._undo(placement, pod, written, outcome)
                return False
            written.append(item.claim)
        if not pod.spec.node_name:
            why = await self._wait_binding_conditions(placement, pod, written, in_progress, slot)
            if why is not None:
                uid = placement.pod.uid
                backoff = self._next_backoff(uid)
                # the claims are deallocated (no other pod shares them), so the next attempt may
                # pick other devices, as kube-scheduler's PostFilter deallocates them
                await self._undo(placement, pod, written, f"binding conditions: {why}")
                self._back_off(uid, backoff)
                await self._report_error(uid, f'running PreBind plugin "DynamicResources": {why}')
                return False
        if not pod.spec.node_name:
            try:
                await self.kube.bind_pod(placement.pod.namespace, placement.pod.name, placement.node, placement.pod.uid)
                self.metrics.pods_bound.inc()
                waited = seconds_since(pod.metadata.creation_timestamp, datetime.now(timezone.utc))
                if waited is not None:
                    self.metrics.create_to_bound.observe(waited)
            except KubeApiError as exc:
                if exc.status == 409:
                    current = await self.kube.get(Pod, placement.pod.name, placement.pod.namespace)
                    if current.spec.node_name != placement.node:
                        await self._undo(placement, pod, written, f"binding failed: {exc.message}")
                        return False
                elif exc.is_not_found:
                    await self._undo(placement, pod, written, "the pod is gone")
                    return False
                else:
                    raise
        self.to_confirm.setdefault(placement.node, set()).update(claim_uids)
        self._confirm_wanted.set()
        if not pod.spec.node_name:
            # kube-scheduler's Normal event for a binding; written aside, it never holds up the next one
            self._queue_event(pod, "Scheduled", f"Successfully assigned {placement.pod.key()} to {placement.node}",
                              type_="Normal")
        uid = placement.pod.uid
        if pod.spec.node_name:
            # A placement delivered again (a restarted shard republishes what its reservations
            # hold): the claims were checked and the leases renewed, nothing was bound again.
            log.info("pod %s was already bound to node %s: placement from shard %d delivered again, nothing "
                     "rebound", placement.pod.key(), placement.node, placement.shard,
                     extra=fields(pod=placement.pod.key(), node=placement.node, shard=placement.shard))
            for table in (self.retry, self.last_reason, self.failure_reason):
                table.pop(uid, None)
            return True
        log.info("pod %s bound to node %s with %s (shard %d, %.0f ms after it was first seen)",
                 placement.pod.key(), placement.node,
                 "; ".join(f"resourceclaim {c.claim.name}: {_devices_text(c.allocation)}" for c in placement.claims)
                 or "no claims",
                 placement.shard, max(0.0, time.time() - placement.first_seen) * 1000 if placement.first_seen else 0.0,
                 extra=fields(pod=placement.pod.key(), node=placement.node, shard=placement.shard,
                              claim=placement.claims[0].claim.key() if len(placement.claims) == 1 else None))
        # in_flight stays until the pod watch shows the pod bound: an older event of the pod,
        # still on its way, must not make it look pending and be sent to the shards again
        for table in (self.retry, self.last_reason, self.failure_reason):
            table.pop(uid, None)
        return True

    async def _bind_pod_volumes(self, placement: Placement, pod: Pod, in_progress: Callable[[], Awaitable] | None,
                                slot: "_PlacementSlot | None" = None) -> str | None:
        """VolumeBinding's PreBind: the pod's claims bound or provisioned on the node, waited for
        with the placement's leases (and its results message) kept alive. On failure the placement
        is abandoned, and the pod says why as kube-scheduler's SchedulerError does."""
        keeper = _LeaseKeeper(self, placement, in_progress, "its volumes are bound")
        expected = keeper.expected
        if not pod_claim_names(pod):
            return None
        async with _aside(slot):  # binding or provisioning can take minutes
            why = await self.volumes.pre_bind(pod, placement.node, keeper.keep)
        if why is None:
            # a lease may have lapsed meanwhile (a renewal failed, or taking the slot back was
            # slow), and its devices gone to another pod: checked once more before writing
            held = await self.store.hold(placement.node, expected, self.settings.lease_seconds,
                                         pods=[placement.pod.uid])
            plan = protocol.plan_write(list(expected), placement.pod.uid, held, node=placement.node,
                                       pod_bound_here=False)
            if isinstance(plan, protocol.Abandon):
                why = plan.why
            elif plan.verify:
                why = f"the reservation of {len(plan.verify)} claim(s) lapsed while the volumes were bound"
        if why is None:
            return None
        uid = placement.pod.uid
        backoff = self._next_backoff(uid)
        await self._abandon(placement, pod, why if why.startswith("binding volumes") else f"binding volumes: {why}")
        self._back_off(uid, backoff)
        await self._report_error(placement.pod.uid, f"running PreBind plugin \"VolumeBinding\": {why}")
        return why

    async def _wait_binding_conditions(self, placement: Placement, pod: Pod, written: list[ClaimRef],
                                       in_progress: Callable[[], Awaitable] | None,
                                       slot: "_PlacementSlot | None" = None) -> str | None:
        """DynamicResources' PreBind wait: a device allocated with binding conditions (a device
        that must be attached first) keeps the pod unbound until every condition is True in the
        claim's status.devices. None when they are (or there are none), else the error: a binding
        failure condition, or none of it within `binding_timeout_seconds` of the allocation."""
        waiting = [ref for ref in written if lc.has_binding_conditions(
            next(c.allocation for c in placement.claims if c.claim.uid == ref.uid))]
        if not waiting:
            return None
        self._queue_event(pod, "BindingConditionsPending",
                          f"waiting for binding conditions for device on node {placement.node}", type_="Normal")
        log.info("pod %s: waiting for the binding conditions of %s on node %s", placement.pod.key(),
                 ", ".join(f"resourceclaim {r.name}" for r in waiting), placement.node,
                 extra=fields(pod=placement.pod.key(), node=placement.node))
        keeper = _LeaseKeeper(self, placement, in_progress, "its devices' binding conditions are awaited",
                              claims_written=True)
        async with _aside(slot):  # attaching a device can take minutes
            why = await self._poll_binding_conditions(placement, waiting, keeper)
        if why is None and keeper.failures:
            why = f"the reservation of pod {placement.pod.key()} on node {placement.node} lapsed while its devices " \
                  f"were attached"
        return why

    async def _poll_binding_conditions(self, placement: Placement, waiting: list[ClaimRef],
                                       keeper: "_LeaseKeeper") -> str | None:
        renewed = time.monotonic()
        # As kube-scheduler's poll, the wait itself is bounded too: a claim whose allocation
        # went, or that has no timestamp, must not hold the placement (and its message) for ever.
        deadline = renewed + self.settings.binding_timeout_seconds
        allocations = {c.claim.uid: c.allocation for c in placement.claims}
        while True:
            if time.monotonic() >= deadline:
                return f"{lc.BINDING_TIMEOUT}: claim={', '.join(r.name for r in waiting)}"
            pod = self.pods_by_uid.get(placement.pod.uid)
            if pod is None or lc.pod_is_done(pod) or pod.metadata.deletion_timestamp:
                return "the pod is gone"
            pending = []
            for ref in waiting:
                claim = self.claims.get((ref.namespace, ref.name))
                if claim is None or claim.metadata.uid != ref.uid:
                    return f"resourceclaim {ref.key()} is gone"
                if claim.status is None or not lc.same_allocation(claim.status.allocation, allocations[ref.uid]):
                    return f"resourceclaim {ref.key()} was deallocated while its devices were attached"
                state = lc.binding_readiness(claim, datetime.now(timezone.utc), self.settings.binding_timeout_seconds)
                if state.error:
                    return state.error
                if not state.ready:
                    pending.append(ref)
            if not pending:
                return None
            if time.monotonic() - renewed >= BINDING_LEASE_RENEW_SECONDS:
                await keeper.keep()
                renewed = time.monotonic()
            await asyncio.sleep(BINDING_POLL_SECONDS)

    def _write_deadline(self, node: str, claim_uids: list[str]) -> float:
        """When (monotonic) the last attempt at writing these claims' allocation may start: the
        soonest lease of their reservations, just held, less WRITE_DEADLINE_MARGIN_SECONDS. After
        it a shard may prune the reservation and give the devices to another claim, so a write
        that the client retried past it (the apiserver restarting, say) could allocate one device
        twice; the chaos run saw exactly that with a write that landed 10 s after its lease."""
        _, entry = self.store.entry(node)
        leases = [entry.claims[u].expires_at for u in claim_uids
                  if u in entry.claims and entry.claims[u].expires_at is not None]
        left = (min(leases) - time.time()) if leases else self.settings.lease_seconds / 2
        return time.monotonic() + max(0.0, left - WRITE_DEADLINE_MARGIN_SECONDS)

    async def _write_claim(self, ref: ClaimRef, allocation, pod: Pod, *, deadline: float | None = None) -> str | None:
        """Steps 1 and 2 for one claim, retried on conflict. None on success, else why it failed."""
        cached = self.claims.get((ref.namespace, ref.name))
        for attempt in range(20):
            from_cache = attempt == 0 and cached is not None and cached.metadata.uid == ref.uid
            if from_cache:
                # Saves a read per claim. A copy: the cache keeps the old state for release
                # detection. A stale copy fails the write with a conflict and is read afresh.
                claim = msgspec.structs.replace(cached, metadata=msgspec.structs.replace(cached.metadata))
            else:
                try:
                    claim = await self.kube.get(ResourceClaim, ref.name, ref.namespace)
                except KubeApiError as exc:
                    if exc.is_not_found:
                        return f"resourceclaim {ref.key()} is gone"
                    raise
            if claim.metadata.uid != ref.uid:
                return f"resourceclaim {ref.key()} was replaced"
            if claim.metadata.deletion_timestamp:
                return f"resourceclaim {ref.key()} is being deleted"
            try:
                finalizers = claim.metadata.finalizers or []
                if lc.DELETE_PROTECTION_FINALIZER not in finalizers:
                    claim.metadata.finalizers = [*finalizers, lc.DELETE_PROTECTION_FINALIZER]
                    claim = await self.kube.update(claim, deadline=deadline)
                plan = lc.plan_claim_write(claim, allocation, pod, now=_now_rfc3339())
                if from_cache and not isinstance(plan, lc.WriteStatus):
                    continue  # "done" or "taken" is only believed from a fresh read
                if isinstance(plan, lc.AllocatedElsewhere):
                    return plan.message
                if isinstance(plan, lc.WriteStatus):
                    newly_allocated = claim.status is None or claim.status.allocation is None
                    claim.status = plan.status
                    claim = await self.kube.update_status(claim, deadline=deadline)
                    if newly_allocated:
                        self.metrics.claims_allocated.inc()
                self._on_claim("MODIFIED", claim)
                return None
            except KubeApiError as exc:
                if exc.is_conflict:
                    continue
                if exc.is_not_found:
                    return f"resourceclaim {ref.key()} is gone"
                if exc.past_deadline:
                    self.metrics.lease_lapses.inc()
                    return (f"resourceclaim {ref.key()}: not written before its reservation's lease could run out "
                            f"({exc.reason}: {exc.message})")
                raise
        return f"resourceclaim {ref.key()}: 20 conflicting updates in a row"

    async def _undo(self, placement: Placement, pod: Pod | None, written: list[ClaimRef], why: str) -> None:
        """Take this pod out of the claims it was written into, then release the reservation."""
        if written:
            log.info("pod %s: taking it out of the reservedFor of %s: %s", placement.pod.key(),
                     ", ".join(f"resourceclaim {r.name}" for r in written), why)
        for ref in written:
            for _ in range(20):
                try:
                    claim = await self.kube.get(ResourceClaim, ref.name, ref.namespace)
                    status = lc.status_without_pod(claim, placement.pod.uid)
                    if status is None:
                        break
                    claim.status = status
                    self._on_claim("MODIFIED", await self.kube.update_status(claim))
                    break
                except KubeApiError as exc:
                    if exc.is_not_found:
                        break
                    if not exc.is_conflict:
                        raise
        await self._abandon(placement, pod, why)

    async def _abandon(self, placement: Placement, pod: Pod | None, why: str) -> None:
        """Release the reservations of claims that did not end up allocated, and retry the pod."""
        self.metrics.placements_abandoned.inc()
        log.info("placement of pod %s on %s abandoned: %s", placement.pod.key(), placement.node, why,
                 extra=fields(pod=placement.pod.key(), node=placement.node, shard=placement.shard))

        def allocated_here(uid: str) -> bool:
            item = next(c for c in placement.claims if c.claim.uid == uid)
            claim = self.claims.get((item.claim.namespace, item.claim.name))
            return (claim is not None and claim.metadata.uid == uid and claim.status is not None
                    and lc.same_allocation(claim.status.allocation, item.allocation))

        give_back = protocol.what_to_abandon(
            {c.claim.uid: rv.devices_of(c.allocation) for c in placement.claims}, allocated_here,
            placement.pod.uid, pod_bound_here=pod is not None and pod.spec.node_name == placement.node)
        if not give_back.empty:
            await self.store.release_matching(placement.node, give_back.claims, pods=give_back.pods)
        uid = placement.pod.uid
        self.in_flight.pop(uid, None)
        if pod is not None and self._pending_pod_needs_work(pod):
            self.retry[uid] = (time.monotonic() + self.settings.retry_flush_seconds, self.settings.retry_initial_seconds)

    async def _confirm_loop(self) -> None:
        """Clear the leases of written placements, one bucket write per node for all of them.

        Batched because placements land on the same busy nodes in bursts, and every bucket write
        is read and decoded by every shard. A crash before the flush loses nothing: a lapsed lease
        whose claim is allocated in Kubernetes is confirmed by the shards' pruning instead.
        """
        while True:
            await self._confirm_wanted.wait()
            self._confirm_wanted.clear()
            await asyncio.sleep(0.05)  # let a burst gather
            batch, self.to_confirm = self.to_confirm, {}
            for node, uids in batch.items():
                try:
                    await self.store.confirm(node, uids)
                except Exception:  # noqa: BLE001 - the lease then lapses into a confirmation
                    log.warning("could not confirm %d reservations on node %s", len(uids), node, exc_info=True)

    # --- claims ------------------------------------------------------------------------------------

    async def _release(self, claim: ResourceClaim) -> None:
        """A claim's allocation is gone (cleared or deleted): free its reservation, tell everyone.

        Tried again until it is done (0.25 s doubling to 5 s apart): while a killed NATS server's
        streams and buckets elect new leaders, the bucket write or the publishes fail for a few
        seconds, and a release given up then would leave the reservation, or the audit's release
        event, missing (the chaos run saw both). Each step is idempotent."""
        delay = 0.25
        while True:
            try:
                await self._release_once(claim)
                return
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
                log.warning("resourceclaim %s/%s: release not done (%r); trying again in %.2f s",
                            claim.metadata.namespace, claim.metadata.name, exc, delay,
                            extra=fields(claim=f"{claim.metadata.namespace}/{claim.metadata.name}"))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _release_once(self, claim: ResourceClaim) -> None:
        uid = claim.metadata.uid or ""
        found = self.store.find_claim(uid) if self.store else None
        node = found[0] if found else allocation_node(claim.status.allocation if claim.status else None)
        if found:
            await self.store.release(found[0], [uid])
        log.info("resourceclaim %s/%s: allocation gone (%s); reservation %s, release published",
                 claim.metadata.namespace, claim.metadata.name,
                 "claim deleted" if claim.metadata.deletion_timestamp else "cleared",
                 f"on node {found[0]} released" if found else "already gone",
                 extra=fields(claim=f"{claim.metadata.namespace}/{claim.metadata.name}", node=node))
        await self._tell_released(
            claim.metadata.namespace or "", claim.metadata.name or "", uid, node,
            claim.status.allocation if claim.status else None, claim.metadata.resource_version or "",
            "claim deleted" if claim.metadata.deletion_timestamp else "allocation cleared: no pod reserves the claim")

    async def _tell_released(self, namespace: str, name: str, uid: str, node: str | None, allocation,
                             version: str, why: str) -> None:
        """A claim's devices are free again: the shards' and our retries, the audit log."""
        released = ClaimReleased(claim=ClaimRef(namespace=namespace, name=name, uid=uid), node=node)
        # A NATS server dying makes the stream elect a new leader, and publishes get no answer for
        # a few seconds: try again for a while, as the audit publisher does. The release is a
        # hint (shards also see the claim change in their watch), so giving up logs and goes on
        # to the audit event: the chaos run lost 12 release events when this publish raised.
        deadline = time.monotonic() + RELEASE_PUBLISH_RETRY_SECONDS
        delay = 0.25
        while True:
            try:
                await self.js.publish(self.subjects.released, encode_message(released))
                break
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                if time.monotonic() + delay >= deadline:
                    log.warning("resourceclaim %s/%s: ClaimReleased not published (%r); the shards see the "
                                "claim change in their watch", namespace, name, exc,
                                extra=fields(claim=f"{namespace}/{name}", node=node))
                    break
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.metrics.claims_released.inc()
        await self.audit.publish_and_wait(audit.AuditEvent(
            id=audit.released_id(uid, version), kind="released", at=time.time(), by=[self.instance], node=node,
            claims=[audit.ClaimDevices(namespace=namespace, name=name, uid=uid, devices=audit.devices_of(allocation))],
            reason=why,
        ))
        self._flush_retries()

    async def reconcile_reservations(self) -> int:
        """protocol.stale_confirmations over every node's entry: release the confirmed reservations
        whose claim is gone or no longer allocated with those devices. Returns how many.

        The claims cache may lag (a claim written a moment ago by this binder is in it, but one
        re-listed is as old as the list): a reservation is only released after a live read of its
        claim agrees, and then only where it still holds the same devices."""
        await self.store.wait_synced()
        by_uid = {c.metadata.uid: c for c in list(self.claims.values())}
        released = 0
        for node, (_, entry) in list(self.store.entries.items()):
            stale = protocol.stale_confirmations(entry, lambda r: _allocated_devices(by_uid.get(r.claim_uid), r.claim_uid))
            really: dict[str, list] = {}
            gone: dict[str, rv.Reservation] = {}
            for uid, devices in stale.items():
                reservation = entry.claims[uid]
                try:
                    live = await self.kube.get(ResourceClaim, reservation.claim_name, reservation.claim_namespace)
                except KubeApiError as exc:
                    if not exc.is_not_found:
                        raise
                    live = None
                if protocol.stale_confirmations(
                        rv.NodeReservations(node=node, claims={uid: reservation}),
                        lambda r: _allocated_devices(live, r.claim_uid)):
                    really[uid] = devices
                    gone[uid] = reservation
            if not really or not await self.store.release_matching(node, really):
                continue
            released += len(really)
            for uid, reservation in gone.items():
                log.info("resourceclaim %s/%s: its reservation on node %s was confirmed but the claim is gone or "
                         "allocated otherwise (changed while no binder ran): released",
                         reservation.claim_namespace, reservation.claim_name, node,
                         extra=fields(claim=f"{reservation.claim_namespace}/{reservation.claim_name}", node=node))
                await self._tell_released(reservation.claim_namespace, reservation.claim_name, uid, node,
                                          reservation.allocation, f"reconciled-{reservation.reserved_at}",
                                          "its claim was deleted or deallocated while no binder ran")
        return released

    async def _claim_worker(self) -> None:
        while True:
            key = await self.claim_queue.get()
            try:
                await self._reconcile_claim(key)
                self.claim_queue.forget(key)
            except KubeApiError as exc:
                if exc.is_conflict or exc.retryable:
                    delay = self.claim_queue.retry_later(key)
                    log.log(logging.DEBUG if exc.is_conflict else logging.WARNING,
                            "resourceclaim %s/%s: %s; retrying in %.1f s", *key, exc, delay)
                elif not exc.is_not_found:
                    log.warning("resourceclaim %s/%s: %s", *key, exc)
            except Exception:  # noqa: BLE001
                self.metrics.errors.inc()
                delay = self.claim_queue.retry_later(key)
                log.exception("resourceclaim %s/%s: reconcile failed; retrying in %.1f s", *key, delay)
            finally:
                self.claim_queue.done(key)

    async def _pods_really_gone(self, claim: ResourceClaim, refs) -> list:
        """Confirm with a live read that pods missing from the cache are gone (the cache may lag)."""
        namespace = claim.metadata.namespace or ""
        gone = []
        for ref in refs:
            if ref.uid in self.pods_by_uid:
                gone.append(ref)  # cached and done
                continue
            try:
                live = await self.kube.get(Pod, ref.name, namespace)
            except KubeApiError as exc:
                if exc.is_not_found:
                    gone.append(ref)
                    continue
                raise
            if live.metadata.uid != ref.uid or lc.pod_is_done(live):
                gone.append(ref)
        return gone

    async def _reconcile_claim(self, key: Key) -> None:
        if not self.settings.manage_claims:
            return
        await self.synced["pods"].wait()
        claim = self.claims.get(key)
        if claim is None:
            return
        drop = lc.reserved_for_to_drop(claim, self.pods_by_uid)
        if drop:
            drop = await self._pods_really_gone(claim, drop)
        if drop or lc.needs_deallocation(claim):
            # never mutate the cached object: _on_claim compares old and new to detect releases
            changed = msgspec.structs.replace(claim, status=lc.status_without_consumers(claim, drop))
            updated = await self.kube.update_status(changed)
            what = [f"removed finished or deleted pods {[r.name for r in drop]} from reservedFor"] if drop else []
            if changed.status.allocation is None:
                what.append("deallocated: nobody reserves it")
            log.info("resourceclaim %s/%s: %s", *key, "; ".join(what))
            self._on_claim("MODIFIED", updated)
            return  # continues from the new state
        if lc.is_template_claim_of_gone_pod(claim, self.pods_by_uid):
            owner_uid = next(r.uid for r in claim.metadata.owner_references if r.controller and r.kind == "Pod")
            owner = self.pods_by_uid.get(owner_uid)
            if owner is None:
                owner_ref = next(r for r in claim.metadata.owner_references if r.controller and r.kind == "Pod")
                gone = await self._pods_really_gone(
                    claim, [ResourceClaimConsumerReference(resource="pods", name=owner_ref.name, uid=owner_uid)]
                )
                if not gone:
                    return
            finalizers = lc.finalizers_without_protection(claim)
            if finalizers is not None:
                claim = await self.kube.update(_with_finalizers(claim, finalizers))
                self._on_claim("MODIFIED", claim)
            await self.kube.delete(ResourceClaim, key[1], key[0])
            log.info("resourceclaim %s/%s: deleted, the pod it was generated for is gone or finished", *key)
            return
        if claim.metadata.deletion_timestamp and not (claim.status and claim.status.allocation):
            finalizers = lc.finalizers_without_protection(claim)
            if finalizers is not None:
                self._on_claim("MODIFIED", await self.kube.update(_with_finalizers(claim, finalizers)))


async def _unsubscribe(sub) -> None:
    # a pull subscription left behind makes the connection's drain wait for it
    try:
        await asyncio.wait_for(sub.unsubscribe(), 2.0)
    except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the connection may be gone already
        pass


def _stream_sequence(msg) -> str:
    """The message's sequence in its stream, which names it across redeliveries ("" if unknown)."""
    try:
        return str(msg.metadata.sequence.stream)
    except (AttributeError, TypeError, ValueError, nats.errors.Error):
        return ""


def _older(new: ResourceClaim, cached: ResourceClaim) -> bool:
    """`new` is an earlier state of the very object `cached` is. resourceVersions are etcd
    revisions; compared as numbers, as kube-scheduler's assume cache does. Any other form is news."""
    if new.metadata.uid != cached.metadata.uid:
        return False
    try:
        return int(new.metadata.resource_version or "") < int(cached.metadata.resource_version or "")
    except ValueError:
        return False


def _devices_text(allocation) -> str:
    results = allocation.devices.results if allocation.devices and allocation.devices.results else []
    return ", ".join(f"{r.pool}/{r.device}" + (f" (share {r.share_id})" if r.share_id else "") for r in results) or "no devices"


def _allocated_devices(claim: ResourceClaim | None, uid: str) -> list[rv.ReservedDevice] | None:
    """The devices a claim (the one of this uid) is allocated with in Kubernetes; None if not."""
    if claim is None or claim.metadata.uid != uid or claim.status is None or claim.status.allocation is None:
        return None
    return rv.devices_of(claim.status.allocation)


def _pods_named_by(claim: ResourceClaim) -> set[str]:
    uids = {r.uid for r in (claim.status.reserved_for if claim.status else None) or ()}
    uids.update(r.uid for r in claim.metadata.owner_references or () if r.kind == "Pod")
    return uids


def _with_finalizers(claim: ResourceClaim, finalizers: list[str]) -> ResourceClaim:
    return msgspec.structs.replace(claim, metadata=msgspec.structs.replace(claim.metadata, finalizers=finalizers))


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("binder task %s failed", task.get_name(), exc_info=task.exception())


class _LeaseKeeper:
    """Keeps a placement alive while PreBind waits (volumes being bound, devices being
    attached): its reservations' leases renewed in the bucket, its results message marked in
    progress. `failures` counts renewals that did not land; the caller checks the leases again."""

    def __init__(self, binder: Binder, placement: Placement, in_progress: Callable[[], Awaitable] | None,
                 while_what: str, *, claims_written: bool = False) -> None:
        self.claims_written = claims_written
        self.binder, self.placement, self.in_progress, self.while_what = binder, placement, in_progress, while_what
        self.expected = {c.claim.uid: rv.devices_of(c.allocation) for c in placement.claims}
        self.failures = 0

    async def keep(self) -> None:
        placement = self.placement
        if self.in_progress is not None:
            try:
                await self.in_progress()
            except Exception:  # noqa: BLE001 - redelivery is the worst case, and writing is idempotent
                log.debug("pod %s: could not tell the results stream it is in progress", placement.pod.key())
        try:
            held = await self.binder.store.hold(placement.node, self.expected, self.binder.settings.lease_seconds,
                                                pods=[placement.pod.uid])
        except Exception:  # noqa: BLE001 - checked again once the wait is over
            self.failures += 1
            log.warning("pod %s: could not renew its leases on node %s while %s", placement.pod.key(),
                        placement.node, self.while_what, exc_info=True)
            return
        claims_lost = not self.claims_written and any(uid not in held for uid in self.expected)
        if placement.pod.uid not in held or claims_lost:
            # a lease lapsed and was pruned: its devices (or the pod's CPU and memory) may be
            # another's by now. Once the claims are written, Kubernetes holds their devices.
            self.failures += 1
            log.warning("pod %s: its reservation on node %s lapsed while %s", placement.pod.key(), placement.node,
                        self.while_what)


class _PlacementSlot:
    """One of the binder's `concurrency` placement slots, held by a placement being written,
    and given up while PreBind waits for volumes to be bound or devices to be attached: a wait
    of minutes must not keep the other placements from being written."""

    def __init__(self, semaphore: asyncio.Semaphore) -> None:
        self.semaphore = semaphore
        self.held = False

    async def take(self) -> None:
        await self.semaphore.acquire()
        self.held = True

    def give_up(self) -> None:
        if self.held:
            self.held = False
            self.semaphore.release()


@contextlib.asynccontextmanager
async def _aside(slot: _PlacementSlot | None):
    """The slot given up for the block, taken again after it (a placement called without one,
    from a test, waits holding nothing)."""
    if slot is None:
        yield
        return
    slot.give_up()
    try:
        yield
    finally:
        await slot.take()

"""The pending queue: a pod that needs a node is prepared (its claims resolved, template claims
and the KEP-5004 extended-resource claim made, its volumes pre-filtered), published to its shard
as a PendingPod, retried with backoff, and told why it is unschedulable.

State owned here: the pod work queue, the PendingPods in flight, the backoff table, and what was
last told each pod. Lookups go to the cluster cache; the answers come back through
draplane_binder.results.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from draplane.scheduling.framework.plugins import scheduling_gates
from draplane.scheduling.framework.plugins.node_affinity import node_names_required
from draplane.api.core import Pod, PodResourceClaimStatus
from draplane.api.resource import ResourceClaim, ResourceClaimTemplate
from draplane.audit_publisher import AuditPublisher
from draplane.kube import KubeApiError, KubeClient
from draplane.messages import audit
from draplane.scheduling import cluster_feed
from draplane.scheduling import extended_resources as er
from draplane.scheduling.messages import (
    MAX_CLAIM_SNAPSHOT_BYTES, ClaimRef, ClaimSnapshot, PendingPod, PodRef, Subjects, encode_message, partition_key,
    shard_for,
)
from draplane.scheduling.unschedulable import (
    CLAIM_ERROR, CONDITION_REASON, ERROR_CONDITION_REASON, EVENT_REASON, GANG_WAITING, VOLUME_UNBOUND, claim_problem,
    pre_filter_problem,
)
from draplane.scheduling.framework.plugins.volume_binding import PodVolumes, VolumeUnschedulable, pod_claim_names
from draplane.structured_logs import fields
from draplane_binder import in_flight as inf
from draplane_binder import lifecycle as lc
from draplane_binder.backoff import PodBackoff
from draplane_binder.cache import ClusterCache
from draplane_binder.cluster_publisher import ClusterPublisher
from draplane_binder.events import EventRecorder
from draplane_binder.metrics import BinderMetrics
from draplane_binder.objects import Key, key_of, now_rfc3339
from draplane_binder.settings import BinderSettings
from draplane_binder.spreading import DefaultSpreading
from draplane_binder.volumes import VolumeBinder
from draplane_binder.work_queue import WorkQueue, work

log = logging.getLogger(__name__)

POD_WORKERS = 32
# How often the backoff table is looked at for pods whose retry has come.
RETRY_TICK_SECONDS = 0.1
# How often PendingPods unanswered for long are looked for: with 20,000 pods queued, looking at
# each of them ten times a second cost more CPU than the rest of the retry loop.
IN_FLIGHT_CHECK_SECONDS = 5.0
# JetStream's error code for a message not in the stream: a work queue's message acknowledged
# (taken and answered) by its shard already
NO_MESSAGE_FOUND = 10057


class PendingQueue:
    def __init__(self, settings: BinderSettings, kube: KubeClient, js: JetStreamContext, subjects: Subjects, *,
                 cache: ClusterCache, publisher: ClusterPublisher, volumes: VolumeBinder, events: EventRecorder,
                 audit_publisher: AuditPublisher, metrics: BinderMetrics, instance: str,
                 spawn_once: Callable[[Awaitable, str], None], spreading: DefaultSpreading | None = None) -> None:
        self.settings, self.kube, self.js, self.subjects = settings, kube, js, subjects
        self.cache, self.publisher, self.volumes, self.events = cache, publisher, volumes, events
        self.spreading = spreading
        self.audit, self.metrics, self.instance, self._spawn_once = audit_publisher, metrics, instance, spawn_once
        self.pod_queue = WorkQueue()
        # pod uid -> its PendingPod, published and not yet answered
        self.in_flight: dict[str, inf.InFlight] = {}
        self.backoff = PodBackoff(initial=settings.retry_initial_seconds, maximum=settings.retry_max_seconds,
                                  flush=settings.retry_flush_seconds)
        # pod uid -> first time seen pending, carried to the shards for latency figures
        self.first_seen: dict[str, float] = {}
        # gang members told they wait (the condition) but not yet warned (the Event)
        self.unwarned: set[str] = set()
        # pod uid -> the last unschedulable message written, to avoid rewriting the same one
        self.last_reason: dict[str, str] = {}
        # pod uid -> why its last attempt failed, as a metric label (failure_label, SchedulerError)
        self.failure_reason: dict[str, str] = {}
        # The cluster bucket revision through which every change that woke the pods in backoff (a
        # release, a node's change) is written: a pod tried again after a failed attempt is placed
        # from no older a view (see wake_once_written).
        self.woken_through = 0
        self._wake_keys: set[str] = set()  # their keys, while their writes are waited for
        self._waking = False
        cache.pod_listeners.append(self._pod_changed)
        cache.claim_listeners.append(self._claim_changed)
        cache.template_listeners.append(self._template_changed)
        cache.node_listeners.append(self._node_changed)
        cache.sync_listeners.append(self._listed)

    def loops(self) -> list[tuple[str, Callable[[], Awaitable]]]:
        return [*((f"pod worker {i}", self._work) for i in range(POD_WORKERS)), ("retry loop", self._retry_loop)]

    def waiting_claims(self):
        """Per pending pod of ours: (its claims not allocated yet, why its last attempt failed)."""
        for pod in list(self.cache.pods_by_uid.values()):
            if not self.cache.pending_pod_needs_work(pod):
                continue
            namespace = pod.metadata.namespace or ""
            statuses = {s.name: s.resource_claim_name for s in (pod.status.resource_claim_statuses if pod.status else None) or ()}
            waiting = 0
            for pod_claim in pod.spec.resource_claims or ():
                name = pod_claim.resource_claim_name or statuses.get(pod_claim.name)
                claim = self.cache.claims.get((namespace, name)) if name else None
                if claim is None or claim.status is None or claim.status.allocation is None:
                    waiting += 1
            yield waiting, self.failure_reason.get(pod.metadata.uid or "")

    # --- what wakes a pod --------------------------------------------------------------------------

    def _pod_changed(self, kind: str, old: Pod | None, pod: Pod) -> None:
        if kind == "DELETED" or pod.spec.node_name or lc.pod_is_done(pod):
            # bound, finished or gone: nothing left to schedule, so nothing to remember for it
            uid = pod.metadata.uid or ""
            sent = self.in_flight.get(uid)
            if sent is not None and sent.sequence is not None and (kind == "DELETED" or lc.pod_is_done(pod)):
                self._spawn_once(self.withdraw_pending(pod, sent), f"withdraw-{uid}")
            self._forget(uid)
        if kind != "DELETED":
            self.pod_queue.put(key_of(pod))

    def _forget(self, uid: str) -> None:
        for table in (self.in_flight, self.first_seen, self.last_reason, self.failure_reason):
            table.pop(uid, None)
        self.backoff.forget(uid)
        self.unwarned.discard(uid)

    def _claim_changed(self, kind: str, old: ResourceClaim | None, claim: ResourceClaim) -> None:
        # wake the pods that use it, backoff or not: a claim that appears or changes is what a
        # pod told "not found" waits for
        waiting = list(self.cache.pods_by_claim.get(key_of(claim), ()))
        self.wake_pods(waiting)
        for pod_key in waiting:
            self.pod_queue.put(pod_key)
        for ref in claim.metadata.owner_references or ():
            if ref.kind == "Pod" and ref.controller:
                owner = self.cache.pods_by_uid.get(ref.uid)
                if owner is not None:
                    self.pod_queue.put(key_of(owner))

    def _template_changed(self, kind: str, template: ResourceClaimTemplate) -> None:
        for key in self.cache.pods_using_template(*key_of(template)):
            self.pod_queue.put(key)

    def _node_changed(self, kind: str, node, changed: bool) -> None:
        if changed and self.cache.synced["nodes"].is_set():
            self.wake_once_written(cluster_feed.key_of(node))

    def _listed(self, what: str) -> None:
        if what in ("pods", "claims"):
            # after a (re-)list every pod is looked at again
            for key in list(self.cache.pods):
                self.pod_queue.put(key)

    def wake_pods(self, keys: Iterable[Key]) -> None:
        """Pods something they wait for changed (a PersistentVolumeClaim): tried again soon, backoff or not."""
        pods = (self.cache.pods.get(key) for key in keys)
        self.backoff.wake((pod.metadata.uid or "" for pod in pods if pod is not None), time.monotonic())

    def flush_retries(self) -> None:
        """Every pod waiting out a backoff is tried soon (a volume's change; see wake_once_written)."""
        self.backoff.wake_all(time.monotonic())

    def wake_once_written(self, key: str) -> None:
        """What the pods in backoff wait for changed (`key` in the cluster bucket: a released
        claim's, a node's): they are tried again once that change is written there, and placed
        from a view that holds it. The bucket is written in rounds; a retry placed before the
        change reached its shard would find the devices taken or the node tainted still, and back
        off again, longer, while a pod created after took what it waited for (tests/cli/test_demo.py lost its taker so, under CI's load).
        kube-scheduler's cache likewise takes an event in before the pods it wakes are tried."""
        self._wake_keys.add(key)
        if not self._waking:
            self._waking = True
            self._spawn_once(self._wake_when_written(), "wake the pods in backoff")

    async def _wake_when_written(self) -> None:
        try:
            while self._wake_keys:  # the keys that came while a wait ran get one wait more
                keys, self._wake_keys = sorted(self._wake_keys), set()
                try:
                    self.woken_through = max(self.woken_through, await self.publisher.written_through(keys))
                except TimeoutError:
                    log.warning("cluster feed: %d changes that wake the pods in backoff (%s) are not written after "
                                "10 s; those pods are tried again with the view their shard has", len(keys), keys[0])
                self.flush_retries()
        finally:
            self._waking = False

    # --- preparing and publishing a pod ------------------------------------------------------------

    async def _work(self) -> None:
        await work(self.pod_queue, self.reconcile_pod, kind="pod", errors=self.metrics.errors,
                   on_failure=self._tell_failure)

    async def _tell_failure(self, key: Key, exc: Exception, delay: float) -> None:
        pod = self.cache.pods.get(key)
        if pod is not None:
            await self.report_error(pod.metadata.uid or "", f"draplane binder: preparing the pod failed: "
                                    f"{exc!r}; retrying in {delay:.0f} s")

    async def reconcile_pod(self, key: Key) -> None:
        """One pass over a pod: each step either lets the pod go on, or stops (the pod is queued
        again by the change it waits for, or told why it is unschedulable)."""
        await self.cache.wait_synced("claims", "templates")
        pod = self.cache.pods.get(key)
        if pod is None or not self.cache.pending_pod_needs_work(pod):
            return
        uid = pod.metadata.uid or ""
        namespace = key[0]
        resolved = lc.resolve_pod_claims(
            pod, self.cache.claims_by_namespace.get(namespace, {}), self.cache.templates.get(namespace, {}),
            manage_templates=self.settings.manage_claims, related=self.cache.claims_related_to(uid),
        )
        if await self._record_pod_claims(pod, resolved):
            return  # the updated pod is queued again and continues from there
        if lc.pod_is_gated(pod):
            # Its claims exist (kube-controller-manager makes them for gated pods too, and so do
            # we when we manage claims), but no scheduling is tried and nothing is written on the
            # pod: the apiserver set PodScheduled=False/SchedulingGated when it took the pod.
            # Removing the last gate is a pod update, which queues the pod again.
            log.debug("pod %s/%s: %s", namespace, key[1], scheduling_gates.pre_enqueue(pod))
            return
        self.first_seen.setdefault(uid, time.time())
        try:
            extended = await self._extended_resource_claim(pod)
        except er.ExtendedResourceError as exc:
            await self.mark_unschedulable(pod, claim_problem(f"extended resources: {exc}"), reason=CLAIM_ERROR)
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
            await self.mark_unschedulable(pod, message, reason=CLAIM_ERROR)
            return
        if uid in self.in_flight or self.backoff.waiting(uid, time.monotonic()):
            return
        volumes = await self._pre_filter_volumes(pod)
        if volumes is False:
            return
        claims = [self.cache.claims_by_namespace[namespace][name] for name in resolved.names.values()]
        dra_extended: list[str] | None = None
        if extended is not None:
            special, dra_extended = extended
            claims.append(special)
        await self._publish(pod, claims, volumes, dra_extended)

    async def _record_pod_claims(self, pod: Pod, resolved: lc.PodClaims) -> bool:
        """The pod's claims made from its templates and recorded in status.resourceClaimStatuses,
        as kube-controller-manager's resourceclaim controller does when we manage claims. True
        when the pod was updated."""
        namespace, name = key_of(pod)
        new_statuses = list(resolved.statuses_to_record)
        for pod_claim_name, template in resolved.to_create:
            claim = lc.claim_from_template(pod, pod_claim_name, template)
            created = await self.kube.create(claim)
            self.metrics.claims_created.inc()
            log.info("pod %s/%s: created resourceclaim %s from template %s for pod claim %s",
                     namespace, name, created.metadata.name, template.metadata.name, pod_claim_name,
                     extra=fields(pod=f"{namespace}/{name}", claim=f"{namespace}/{created.metadata.name}"))
            self.cache.apply_claim("ADDED", created)
            new_statuses.append(PodResourceClaimStatus(name=pod_claim_name, resource_claim_name=created.metadata.name))
        if not new_statuses:
            return False
        merged = lc.merged_claim_statuses(pod, new_statuses)
        patch = {
            "metadata": {"resourceVersion": pod.metadata.resource_version},
            "status": {"resourceClaimStatuses": msgspec.to_builtins(merged)},
        }
        self.cache.apply_pod("MODIFIED", await self.kube.patch(Pod, name, patch, namespace, subresource="status"))
        return True

    async def _extended_resource_claim(self, pod: Pod) -> tuple[ResourceClaim, list[str]] | None | bool:
        """KEP-5004: the claim that serves the pod's extended resources through DRA, and which
        resources those are; None when it asks for none that DRA backs. False when this made the
        claim or recorded it in the pod's status.extendedResourceClaimStatus (the pod comes back).
        Raises ExtendedResourceError for a request that cannot be made into one."""
        if not any(c.resources and c.resources.requests for c in [*(pod.spec.init_containers or ()),
                                                                     *pod.spec.containers]):
            return None
        await self.cache.wait_synced("classes", "nodes")
        resources = er.dra_backed_resources(pod, self.cache.class_resolver(), self.cache.offers_extended_resource)
        if not resources:
            return None
        namespace, name = key_of(pod)
        claim = er.find_special_claim(pod, self.cache.claims_by_namespace.get(namespace, {}).values())
        recorded = pod.status.extended_resource_claim_status if pod.status else None
        if claim is not None and recorded is not None and recorded.resource_claim_name == claim.metadata.name:
            return claim, sorted(resources)  # made and recorded by an earlier attempt
        requests, mappings = er.claim_requests(pod, resources)
        if claim is None:
            claim = await self.kube.create(er.special_claim(pod, requests))
            self.metrics.claims_created.inc()
            self.cache.apply_claim("ADDED", claim)
            log.info("pod %s/%s: created resourceclaim %s for its extended resources %s (backed by DeviceClasses %s)",
                     namespace, name, claim.metadata.name, ", ".join(sorted(resources)),
                     ", ".join(sorted(set(resources.values()))),
                     extra=fields(pod=f"{namespace}/{name}", claim=f"{namespace}/{claim.metadata.name}"))
        patch = {"metadata": {"resourceVersion": pod.metadata.resource_version},
                 "status": {"extendedResourceClaimStatus": {"requestMappings": mappings,
                                                            "resourceClaimName": claim.metadata.name}}}
        self.cache.apply_pod("MODIFIED", await self.kube.patch(Pod, name, patch, namespace, subresource="status"))
        return False

    async def _pre_filter_volumes(self, pod: Pod) -> PodVolumes | None | bool:
        """VolumeBinding's PreFilter: what the shard needs of the pod's volumes (None: it has
        none), or False when the pod was told it is unschedulable. kube-scheduler's NodeAffinity
        PreFilter runs before VolumeBinding's: a pod whose required node names cancel out is
        refused for that, by the shard, whatever its volumes."""
        if not pod_claim_names(pod) or node_names_required(pod) == frozenset():
            return None
        await self.volumes.wait_synced()
        try:
            return self.volumes.pre_filter(pod)
        except VolumeUnschedulable as exc:
            # no node is tried until the claims change, which wakes the pod (draplane_binder.volumes)
            await self.mark_unschedulable(pod, pre_filter_problem(len(self.cache.nodes), exc.message),
                                          reason=VOLUME_UNBOUND)
            return False

    def _claim_snapshots(self, namespace: str, claims: list[ResourceClaim], *,
                         limit: int | None = MAX_CLAIM_SNAPSHOT_BYTES) -> list[ClaimSnapshot] | None:
        """The claims as the binder's cache holds them now, each with the bucket revision that holds
        the same value (0 while its write is on its way); None when together they exceed `limit`
        (the shard then reads them from the bucket)."""
        snapshots, size = [], 0
        for claim in claims:
            claim = self.cache.claims.get((namespace, claim.metadata.name or ""), claim)
            value = cluster_feed.encode(claim)
            size += len(value)
            if limit is not None and size > limit:
                return None
            snapshots.append(ClaimSnapshot(claim=cluster_feed.trimmed(claim), revision=self.publisher.settled_revision(
                cluster_feed.key_of(claim), value)))
        return snapshots

    async def _publish(self, pod: Pod, claims: list[ResourceClaim], volumes: PodVolumes | None,
                       dra_extended: list[str] | None) -> None:
        namespace, name = key_of(pod)
        uid = pod.metadata.uid or ""
        snapshots = self._claim_snapshots(namespace, claims)
        # What the shard must find in the cluster bucket before it places the pod: the claims when
        # they travel by reference alone, and a gang member's own pod (the shard must know it exists).
        keys = [] if snapshots is not None else [cluster_feed.key_of(c) for c in claims]
        if cluster_feed.published_pod(pod):
            keys.append(cluster_feed.key_of(pod))
        try:
            revision = await self.publisher.revision_of(keys) if keys else 0
            if uid in self.backoff:  # tried before: see wake_once_written
                revision = max(revision, self.woken_through)
        except TimeoutError:
            # NATS does not take the writes (its leader moving, the connection down): not the pod's
            # fault, so no condition on it; sent again after the first backoff.
            self.backoff.not_sent(uid, time.monotonic())
            log.warning("pod %s/%s: the cluster bucket did not take its claims in time; retrying in %.1f s",
                        namespace, name, self.settings.retry_initial_seconds)
            return
        current = self.cache.pods.get((namespace, name))
        if current is None or current.metadata.uid != uid or not self.cache.pending_pod_needs_work(current) or \
                not self.cache.claims_still_cached(namespace, claims):
            return  # bound, deleted, done or a claim replaced while the bucket was written: queued again
        if keys and snapshots is not None:
            snapshots = self._claim_snapshots(namespace, claims, limit=None)  # as they are after the wait
        pending = PendingPod(
            pod=PodRef(namespace=namespace, name=name, uid=uid),
            claims=[ClaimRef(namespace=namespace, name=c.metadata.name or "", uid=c.metadata.uid or "") for c in claims],
            first_seen=self.first_seen[uid],
            spec=pod.spec,
            labels=pod.metadata.labels,
            cluster_revision=revision,
            claim_snapshots=snapshots,
            volumes=volumes,
            dra_extended_resources=dra_extended,
            default_spread=self.spreading.selector_for(pod) if self.spreading is not None else None,
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
            self.backoff.not_sent(uid, time.monotonic())
            self.metrics.pending_publish_failures.inc()
            log.warning("pod %s/%s: PendingPod not published to shard %d (%r); retrying in %.1f s",
                        namespace, name, shard, exc, self.settings.retry_initial_seconds)
            return
        self.metrics.pending_published.inc()

    async def withdraw_pending(self, pod: Pod, sent: inf.InFlight) -> None:
        """A pod deleted (or finished) while its PendingPod waits in its shard's queue: the message
        is deleted from the stream, so no shard places the pod and holds devices for it. One the
        shard has taken already is placed, and that placement abandoned when it reaches the binder
        (the placement writer finds no pod)."""
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

    # --- what the pod is told ----------------------------------------------------------------------

    async def mark_unschedulable(self, pod: Pod, message: str, *, reason: str, shard: int | None = None,
                                 answer: str = "", condition: str = CONDITION_REASON) -> None:
        """`reason` is why as a metric label (failure_label); `shard` and `answer` (its
        results-stream sequence) name a shard's verdict, for the audit. `condition` is the
        PodScheduled condition's reason: Unschedulable, or SchedulerError for an attempt that
        ended on an error."""
        uid = pod.metadata.uid or ""
        self.failure_reason[uid] = reason
        self.in_flight.pop(uid, None)
        backoff = self.backoff.failed(uid, time.monotonic())
        first_seen = self.first_seen.get(uid)
        # waiting for the gang's other members is no failure yet: the condition says it, and a
        # Warning follows only once the wait has lasted (gang_wait_warning_seconds)
        quiet = reason == GANG_WAITING and first_seen is not None and \
            time.time() - first_seen < self.settings.gang_wait_warning_seconds
        if self.last_reason.get(uid) == message:
            if uid in self.unwarned and not quiet:
                self.unwarned.discard(uid)
                await self.events.pod_event(pod, EVENT_REASON, message)
            return
        self.last_reason[uid] = message
        self.metrics.failures.labels(reason).inc()
        log.info("pod %s/%s: unschedulable, retry in %.1f s: %s", *key_of(pod), backoff, message,
                 extra=fields(pod="/".join(key_of(pod))))
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

    async def report_error(self, pod_uid: str, message: str) -> None:
        """An internal error, on the pod as kube-scheduler reports one: PodScheduled=False with
        reason SchedulerError, and a FailedScheduling Event. Best effort: the error may be the
        apiserver's own."""
        pod = self.cache.pods_by_uid.get(pod_uid)
        if pod is None or not self.cache.pending_pod_needs_work(pod) or self.last_reason.get(pod_uid) == message:
            return
        self.last_reason[pod_uid] = message
        self.failure_reason[pod_uid] = ERROR_CONDITION_REASON
        self.metrics.failures.labels(ERROR_CONDITION_REASON).inc()
        try:
            await self._not_scheduled(pod, ERROR_CONDITION_REASON, message)
        except Exception:  # noqa: BLE001
            log.warning("pod %s/%s: could not record the error on the pod", *key_of(pod), exc_info=True)

    async def _not_scheduled(self, pod: Pod, reason: str, message: str, *, warn: bool = True) -> None:
        """PodScheduled=False with `reason`, and (`warn`) a FailedScheduling Event, as kube-scheduler
        writes them. A pod deleted meanwhile gets neither."""
        namespace, name = key_of(pod)
        condition = {"type": "PodScheduled", "status": "False", "reason": reason, "message": message,
                     "lastTransitionTime": now_rfc3339()}
        try:
            await self.kube.patch(Pod, name, {"status": {"conditions": [condition]}}, namespace,
                                  subresource="status", patch_type="application/strategic-merge-patch+json")
        except KubeApiError as exc:
            if not exc.is_not_found:
                raise
            return
        if warn:
            await self.events.pod_event(pod, EVENT_REASON, message)

    # --- what the placement writer tells it --------------------------------------------------------

    def placement_written(self, uid: str) -> None:
        """The pod is bound: its backoff and what it was told go. It stays in flight until the pod
        watch shows it bound, so that an older event of the pod, still on its way, does not make
        it look pending and send it to the shards again."""
        self.backoff.forget(uid)
        self.last_reason.pop(uid, None)
        self.failure_reason.pop(uid, None)

    def placement_abandoned(self, uid: str, pod: Pod | None) -> None:
        self.in_flight.pop(uid, None)
        if pod is not None and self.cache.pending_pod_needs_work(pod):
            self.backoff.placement_abandoned(uid, time.monotonic())

    # --- retries -----------------------------------------------------------------------------------

    async def _retry_loop(self) -> None:
        next_backstop = time.monotonic() + IN_FLIGHT_CHECK_SECONDS
        while True:
            await asyncio.sleep(RETRY_TICK_SECONDS)
            now = time.monotonic()
            for uid in self.backoff.due(now):
                pod = self.cache.pods_by_uid.get(uid)
                if pod is None:
                    self.backoff.forget(uid)
                else:
                    self.pod_queue.put(key_of(pod))
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
            pod = self.cache.pods_by_uid.get(uid)
            if pod is not None:
                self.pod_queue.put(key_of(pod))

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

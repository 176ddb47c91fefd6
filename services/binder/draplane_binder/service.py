"""The binder: watches Kubernetes, feeds the shards, and writes their placements back.

This module only builds the binder's components and runs their loops (all guarded, cancelled
together on shutdown). Each component owns its state:

- draplane_binder.cache: one list-then-watch per kind into indexed in-memory caches, each
  object also offered to the cluster bucket, the shards' one view of Kubernetes
  (draplane_binder.cluster_publisher); read-only to the others, which listen to its changes;
- draplane_binder.pending: a pod's claims resolved (template claims created), its volumes
  pre-filtered, a PendingPod published to its shard; retries with backoff; Unschedulable told;
- draplane_binder.results: the shards' answers, Placements to the placement writer
  (draplane_binder.placement_writer: Permit, PreBind, Bind and their undo) and preemptions to
  draplane_binder.preemption; a gang's members wait for each other after Permit
  (draplane_binder.gang_permits);
- draplane_binder.reservation_keeper: confirmations, releases, and the start-up reconcile of
  reservations;
- draplane_binder.claim_reconciler: the claim lifecycle (reservedFor, deallocation, template
  claims of gone pods) where the binder manages claims;
- draplane_binder.volumes: PersistentVolumeClaims, PersistentVolumes and StorageClasses for
  VolumeBinding; draplane_binder.events: the Events; draplane_binder.double_allocation_reporter.

The decisions are in draplane_binder.lifecycle (claims), draplane_binder.backoff and
draplane.scheduling.reservation_protocol (hold, abandon, confirm, release, reconcile).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable

from nats.aio.client import Client as NatsClient

from draplane.audit_publisher import AuditPublisher
from draplane.jetstream.setup import until_answered
from draplane.kube import KubeClient
from draplane.metrics import counter_value
from draplane.jetstream import streams
from draplane.scheduling.messages import Subjects
from draplane.tasks import cancel_all, guarded_task, log_task_failure
from draplane_binder.cache import ClusterCache
from draplane_binder.claim_reconciler import ClaimReconciler
from draplane_binder.cluster_publisher import ClusterPublisher
from draplane_binder.double_allocation_reporter import DoubleAllocationReporter
from draplane_binder.events import EventRecorder
from draplane_binder.gang_permits import RETAIN_SECONDS, GangPermitMarks, GangPermits
from draplane_binder.metrics import BinderMetrics
from draplane_binder.pending import PendingQueue
from draplane_binder.placement_writer import PlacementWriter
from draplane_binder.preemption import Preemptor
from draplane_binder.reservation_keeper import ReservationKeeper
from draplane_binder.results import ResultsConsumer
from draplane_binder.settings import BinderSettings
from draplane_binder.spreading import DefaultSpreading
from draplane_binder.volumes import VolumeBinder

log = logging.getLogger(__name__)

STOP_TIMEOUT_SECONDS = 10.0


class Binder:
    def __init__(self, settings: BinderSettings, kube: KubeClient, nc: NatsClient, *,
                 metrics: BinderMetrics | None = None):
        self.settings = settings
        self.kube = kube
        self.js = nc.jetstream()
        self.subjects = Subjects(prefix=settings.prefix)
        self.instance = f"draplane-binder-{uuid.uuid4().hex[:8]}"
        self.metrics = metrics if metrics is not None else BinderMetrics()
        self.audit = AuditPublisher(self.js, settings.prefix)
        self._tasks: list[asyncio.Task] = []
        self._one_offs: set[asyncio.Task] = set()  # releases and reconciles in progress

        self.publisher = ClusterPublisher(instance=self.instance, coalesce_seconds=settings.feed_coalesce_seconds,
                                          new_claim_hold_seconds=settings.feed_new_claim_hold_seconds)
        self.cache = ClusterCache(kube, settings, self.publisher)
        self.events = EventRecorder(kube, instance=self.instance, metrics=self.metrics)
        # PersistentVolumeClaims, PersistentVolumes, StorageClasses: VolumeBinding's PreFilter and PreBind
        self.volumes = VolumeBinder(kube, bind_timeout=settings.volume_bind_timeout_seconds,
                                    wake_pods=lambda keys: self.pending.wake_pods(keys),
                                    wake_all=lambda: self.pending.flush_retries(), pod_of=self.cache.pods.get)
        self.cache.pod_listeners.append(self.volumes.pod_changed)
        self.cache.node_listeners.append(self.volumes.node_changed)
        # Services and workload controllers: the selector of kube-scheduler's default spreading
        self.spreading = DefaultSpreading(kube)
        self.pending = PendingQueue(settings, kube, self.js, self.subjects, cache=self.cache,
                                    publisher=self.publisher, volumes=self.volumes, spreading=self.spreading,
                                    events=self.events,
                                    audit_publisher=self.audit, metrics=self.metrics, instance=self.instance,
                                    spawn_once=self._spawn_once)
        self.reservations = ReservationKeeper(settings, kube, self.js, self.subjects, cache=self.cache,
                                              audit_publisher=self.audit, metrics=self.metrics,
                                              instance=self.instance, spawn_once=self._spawn_once,
                                              devices_freed=self.pending.wake_once_written)
        self.claims = ClaimReconciler(settings, kube, cache=self.cache, metrics=self.metrics)
        self.doubles = DoubleAllocationReporter(events=self.events, audit_publisher=self.audit,
                                                metrics=self.metrics, instance=self.instance,
                                                spawn_once=self._spawn_once)
        self.cache.claim_listeners.append(self.doubles.claim_changed)
        self.gang_permits = GangPermits()
        self.writer = PlacementWriter(settings, kube, cache=self.cache, reservations=self.reservations,
                                      pending=self.pending, volumes=self.volumes, events=self.events,
                                      metrics=self.metrics, gang_permits=self.gang_permits)
        self.results = ResultsConsumer(settings, self.js, self.subjects, cache=self.cache, writer=self.writer,
                                       pending=self.pending,
                                       preemptor=Preemptor(kube, events=self.events, audit_publisher=self.audit,
                                                           metrics=self.metrics, instance=self.instance),
                                       reservations=self.reservations, audit_publisher=self.audit,
                                       metrics=self.metrics, instance=self.instance)
        self.metrics.export_claims(self.pending.waiting_claims)

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

    # --- lifecycle of the service ------------------------------------------------------------------

    async def start(self) -> None:
        await streams.ensure_streams(self.js, self.subjects, replicas=self.settings.stream_replicas)
        await self.audit.start(replicas=self.settings.stream_replicas)
        await self.reservations.open()
        cluster_kv = await streams.cluster_bucket(self.js, self.subjects, replicas=self.settings.stream_replicas)
        # reading it back makes a consumer: a JetStream request, as likely as the others to go unanswered
        await until_answered(lambda: self.publisher.load(cluster_kv),
                             f"reading bucket {self.subjects.cluster_bucket}", log=log)
        loops = [
            ("cluster feed writer", self.publisher.run),
            ("cluster feed heartbeat", self.publisher.heartbeat),
            *self.reservations.loops(),
            *self.cache.watches(),
            *self.volumes.watches(),
            *self.spreading.watches(),
            *self.pending.loops(),
            *self.claims.loops(),
            ("results consumer", self.results.consume),
            *self.events.loops(),
            ("consumer lag", lambda: self.metrics.consumer_lag.poll_forever(
                self.js, [(self.subjects.results_stream, "binder")])),
            ("gang permit marks", self._open_gang_permit_marks),
        ]
        for name, loop in loops:
            self._tasks.append(guarded_task(loop, name, log, owner="binder"))

    async def _open_gang_permit_marks(self) -> None:
        """Open the bucket of opened gang barriers aside from start-up: until it is open (a NATS
        account whose permissions predate it never opens it), gangs wait for each other in memory
        only, as before it existed."""
        kv = await streams.gang_permits_bucket(self.js, self.subjects, ttl=RETAIN_SECONDS,
                                               replicas=self.settings.stream_replicas)
        self.gang_permits.marks = GangPermitMarks(kv)
        log.info("binder: gang permit marks in bucket %s", self.subjects.gang_permits_bucket)

    @property
    def ready(self) -> bool:
        return self.cache.ready and self.volumes.ready and self.reservations.ready

    async def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready:
            if time.monotonic() > deadline:
                raise TimeoutError("binder: caches did not sync")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        for task in list(self._one_offs):
            task.cancel()
        pending = await cancel_all(self._tasks, timeout=STOP_TIMEOUT_SECONDS)
        if pending:
            log.error("binder: %d tasks did not stop within %.0f s: %s", len(pending), STOP_TIMEOUT_SECONDS,
                      [t.get_name() for t in pending])
        self._tasks.clear()

    def _spawn_once(self, coro: Awaitable, name: str) -> None:
        """A one-off task (a release, a reconcile), cancelled by `stop` if still running."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(_log_failure)
        self._one_offs.add(task)
        task.add_done_callback(self._one_offs.discard)


def _log_failure(task: asyncio.Task) -> None:
    log_task_failure(task, log)

"""One allocator shard: consume its partition of pending pods, place them, commit, publish.

This module builds the shard's components and runs their loops (all guarded, cancelled together
on stop); each owns its state:
- draplane_allocator.view: the feed and cache, rebuilt on start from NATS alone (a shard holds no
  Kubernetes client): the inventory feed, the cluster bucket the binder fills, the reservations;
- draplane_allocator.placer: placing and committing a batch of pods in rounds, with typed records
  (draplane_allocator.records), and the preemption holds;
- draplane_allocator.gangs: the gangs' waiting room, joint search and commit;
- draplane_allocator.lease_pruner: lapsed reservations released;
- draplane_allocator.answers: the Placements and Unschedulables published, with back-pressure.

Pending pods are fetched in batches; a batch's messages are acknowledged once its answers are
published. A crash before that means redelivery; the reservation already in the bucket makes the
retry republish the same placement rather than make a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import nats.errors
from nats.aio.client import Client as NatsClient

from draplane.audit_publisher import AuditPublisher
from draplane.messages.inventory import InventoryNames
from draplane.metrics import counter_value
from draplane.scheduling import reservations as rv
from draplane.jetstream import streams
from draplane.scheduling.gangs import pod_group_key
from draplane.scheduling.messages import MessageError, PendingPod, Subjects, decode_message
from draplane.structured_logs import fields, with_fields
from draplane.tasks import cancel_all, guarded_task
from draplane_allocator.answers import Answers
from draplane_allocator.gangs import GangPlacer
from draplane_allocator.lease_pruner import LeasePruner
from draplane_allocator.metrics import AllocatorMetrics
from draplane_allocator.placer import BatchPlacer, PreemptionHolds
from draplane_allocator.records import PodToPlace
from draplane_allocator.view import ShardView

log = logging.getLogger(__name__)

FETCH_BATCH = 32
FETCH_WAIT_SECONDS = 1.0
STOP_TIMEOUT_SECONDS = 10.0
# How long the consumer waits for the shard's view to be ready before it starts.
READY_WAIT_SECONDS = 3600.0


class Shard:
    def __init__(
        self,
        nc: NatsClient,
        *,
        index: int,
        prefix: str,
        policy: str | None = None,
        lease_seconds: float = rv.DEFAULT_LEASE_SECONDS,
        stream_replicas: int = 1,
        metrics: AllocatorMetrics | None = None,
        gang_scheduling: bool = True,
        follow_nc: NatsClient | None = None,
    ):
        """`follow_nc`: the connection the shard's watches read through (a paced one, see
        draplane.jetstream.paced_reading); `nc` by default."""
        self.js = nc.jetstream()
        follow_js = follow_nc.jetstream() if follow_nc is not None else None
        self.index = index
        self.subjects = Subjects(prefix=prefix)
        self.stream_replicas = stream_replicas
        # Gangs: off, every pod is placed alone as it comes (as kube-scheduler without the
        # Workload API does), whatever PodGroup it names.
        self.gang_scheduling = gang_scheduling
        self._tasks: list[asyncio.Task] = []
        self.audit = AuditPublisher(self.js, prefix)
        # The process' metrics (several shards may share them, each with its shard label); a
        # shard made alone (tests) gets a registry of its own.
        self.metrics = metrics if metrics is not None else AllocatorMetrics()
        self.m = self.metrics.shard(index)
        self.log = with_fields(log, shard=index)
        self.view = ShardView(self.js, self.subjects, InventoryNames(prefix=prefix), index=index, policy=policy,
                              stream_replicas=stream_replicas, gang_scheduling=gang_scheduling,
                              audit_publisher=self.audit, metrics=self.m, log=self.log, follow_js=follow_js,
                              unpaced_following=getattr(follow_nc, "unpaced", contextlib.nullcontext))
        if index == 0:
            self.metrics.export_fragmentation(self.view.state)
        self.answers = Answers(self.js, self.subjects, index=index)
        holds = PreemptionHolds(self.view, index=index, lease_seconds=lease_seconds, log=self.log)
        self.placer = BatchPlacer(self.view, self.answers, holds, index=index, lease_seconds=lease_seconds,
                                  metrics=self.m, log=self.log)
        self.gangs = GangPlacer(self.view, self.answers, holds, self.placer, index=index,
                                lease_seconds=lease_seconds, metrics=self.m, log=self.log)
        self.pruner = LeasePruner(self.view, index=index, metrics=self.m, log=self.log)

    @property
    def state(self):
        """The view's SchedulingState (what placing reads)."""
        return self.view.state

    @property
    def store(self):
        return self.view.store

    @property
    def counters(self) -> dict[str, int]:
        """This shard's counts, read back from its metrics (diagnostics and tests)."""
        m, shard = self.metrics, str(self.index)

        def count(counter, **labels: str) -> int:
            return int(counter_value(counter, shard=shard, **labels))

        return {"placed": count(m.placements), "unschedulable": count(m.unschedulable),
                "commit_conflicts": count(m.conflicts, kind="compare_and_set"),
                "republished": count(m.republished), "errors": count(m.errors), "gone": count(m.pods_gone)}

    # --- service lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await streams.ensure_streams(self.js, self.subjects, replicas=self.stream_replicas)
        await self.audit.start(replicas=self.stream_replicas)
        await self.view.open()
        loops = [
            *self.view.loops(),
            ("pending consumer", self._consume),
            ("lease reconciler", self.pruner.run),
            ("consumer lag", lambda: self.metrics.consumer_lag.poll_forever(
                self.js, [(self.subjects.pending_stream, f"shard-{self.index}")])),
        ]
        for name, loop in loops:
            self._tasks.append(guarded_task(loop, name, self.log, owner=f"shard-{self.index}"))

    @property
    def ready(self) -> bool:
        return self.view.ready

    async def wait_ready(self, timeout: float = 60.0) -> None:
        await self.view.wait_ready(timeout)

    async def stop(self) -> None:
        pending = await cancel_all(self._tasks, timeout=STOP_TIMEOUT_SECONDS)
        if pending:
            self.log.error("shard %d: tasks did not stop: %s", self.index, [t.get_name() for t in pending])
        self._tasks.clear()

    # --- pending pods ------------------------------------------------------------------------------

    async def _consume(self) -> None:
        await self.view.wait_ready(timeout=READY_WAIT_SECONDS)
        durable = f"shard-{self.index}"
        config = streams.work_consumer(durable)
        config.filter_subject = self.subjects.pending(self.index)
        sub = await self.js.pull_subscribe(
            self.subjects.pending(self.index), durable=durable, stream=self.subjects.pending_stream, config=config
        )
        try:
            while True:
                await self.answers.wait_for_binder()
                try:
                    messages = await sub.fetch(FETCH_BATCH, timeout=FETCH_WAIT_SECONDS)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    continue
                await self._handle_messages(messages)
        finally:
            try:
                await asyncio.wait_for(sub.unsubscribe(), 2.0)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the connection may be gone
                pass

    async def _handle_messages(self, messages) -> None:
        fetched_at = time.monotonic()
        decoded = []
        for msg in messages:
            try:
                pending = decode_message(msg.data)
                if not isinstance(pending, PendingPod):
                    raise MessageError(f"{type(pending).__name__} on a pending subject")
                if pending.spec is None:
                    raise MessageError(f"pod {pending.pod.key()}: a PendingPod without the pod's spec "
                                       f"(from a binder older than this shard)")
            except MessageError as exc:
                self.log.error("shard %d: dropping a pending message: %s", self.index, exc)
                await msg.term()
                continue
            decoded.append((msg, pending))
        fetched = await asyncio.gather(*(self.view.to_place(p) for _, p in decoded), return_exceptions=True)
        batch = []
        for (msg, pending), inputs in zip(decoded, fetched):
            if isinstance(inputs, BaseException):
                delay = streams.redelivery_delay(streams.deliveries(msg))
                self.m.errors.inc()
                self.log.error("shard %d: pod %s: its claims are not known yet (%s); redelivering in "
                               "%.0f s", self.index, pending.pod.key(), inputs, delay,
                               extra=fields(pod=pending.pod.key()))
                await msg.nak(delay=delay)
            else:
                batch.append((msg, pending, inputs))
        try:
            await self.handle_batch([(pending, inputs) for _, pending, inputs in batch], started=fetched_at)
        except Exception:
            # Placements already committed are published again on redelivery (their
            # reservations are in the bucket); the binder writes a placement once.
            # Errors of one pod are answered in handle_batch; what reaches here is NATS
            # failing under the whole batch.
            self.m.errors.inc()
            self.log.exception("shard %d: a batch of %d pods failed; redelivering it with backoff",
                               self.index, len(batch))
            await asyncio.gather(*(msg.nak(delay=streams.redelivery_delay(streams.deliveries(msg)))
                                   for msg, _, _ in batch), return_exceptions=True)
            return
        await asyncio.gather(*(msg.ack() for msg, _, _ in batch))

    async def handle(self, pending: PendingPod, to_place: PodToPlace | None = None) -> None:
        if to_place is None:
            to_place = await self.view.to_place(pending)
        await self.handle_batch([(pending, to_place)])

    async def handle_batch(self, batch: list[tuple[PendingPod, PodToPlace | None]], *,
                           started: float | None = None) -> None:
        """Place a fetched batch of pods, commit it with one compare-and-set per node, publish.

        Placing stays one pod at a time and each pod sees the devices the pods before it took; the
        round trips to NATS (one bucket write per node, then the placements) are made together.
        One at a time, those round trips, not placing, were what limited a shard.
        `started` (monotonic, default now) is when the batch was fetched: placement latency counts
        from there.
        """
        started = time.monotonic() if started is None else started
        todo: list[PodToPlace] = []
        gangs: dict[str, list[PodToPlace]] = {}
        seen: set[str] = set()
        for pending, to_place in batch:
            if to_place is None or pending.pod.uid in seen:
                continue  # gone, a claim vanished, or the same pod twice in one batch
            seen.add(pending.pod.uid)
            if self.view.bound_meanwhile(pending):
                continue
            gang = pod_group_key(pending.pod.namespace, to_place.pod.spec) if self.gang_scheduling else None
            if gang is not None:
                gangs.setdefault(gang, []).append(to_place)
            else:
                todo.append(to_place)
        for gang, arrivals in gangs.items():
            todo.extend(await self.gangs.arrive(gang, arrivals, started))
        await self.placer.place(todo, started)

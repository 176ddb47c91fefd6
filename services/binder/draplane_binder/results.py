"""The results consumer: the shards' answers, in order of arrival, each handled in a placement
slot of its own. A Placement is written (draplane_binder.placement_writer) and its audit record
published before the message is acknowledged; an Unschedulable becomes the pod's condition and
Event, after any preemption it carries. A result that fails is redelivered with backoff."""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
from nats.js import JetStreamContext

from draplane.audit_publisher import AuditPublisher
from draplane.messages import audit
from draplane.scheduling import reservations as rv
from draplane.jetstream import streams
from draplane.scheduling.messages import MessageError, Placement, Subjects, Unschedulable, decode_message
from draplane.scheduling.unschedulable import CONDITION_REASON, ERROR_CONDITION_REASON, failure_label
from draplane.tasks import log_task_failure
from draplane_binder.cache import ClusterCache
from draplane_binder.metrics import BinderMetrics
from draplane_binder.pending import PendingQueue
from draplane_binder.placement_writer import PlacementSlot, PlacementWriter
from draplane_binder.preemption import Preemptor
from draplane_binder.reservation_keeper import ReservationKeeper
from draplane_binder.settings import BinderSettings

log = logging.getLogger(__name__)

FETCH_BATCH = 64
FETCH_WAIT_SECONDS = 1.0
# Results delivered and not yet acknowledged, at most: above the concurrency, because a gang's
# members wait for each other unacknowledged (draplane_binder.gang_permits), so a gang of up to
# this many members can gather. A consumer made by an older binder keeps its own limit.
RESULTS_MAX_ACK_PENDING = 16_384


class ResultsConsumer:
    def __init__(self, settings: BinderSettings, js: JetStreamContext, subjects: Subjects, *, cache: ClusterCache,
                 writer: PlacementWriter, pending: PendingQueue, preemptor: Preemptor,
                 reservations: ReservationKeeper, audit_publisher: AuditPublisher, metrics: BinderMetrics,
                 instance: str) -> None:
        self.settings, self.js, self.subjects, self.cache = settings, js, subjects, cache
        self.writer, self.pending, self.preemptor, self.reservations = writer, pending, preemptor, reservations
        self.audit, self.metrics, self.instance = audit_publisher, metrics, instance
        self.placement_slots = asyncio.Semaphore(settings.concurrency)

    async def consume(self) -> None:
        config = streams.work_consumer("binder")
        config.max_ack_pending = RESULTS_MAX_ACK_PENDING
        sub = await self.js.pull_subscribe(
            self.subjects.results, durable="binder", stream=self.subjects.results_stream, config=config,
        )
        try:
            limit = (await sub.consumer_info()).config.max_ack_pending
            self.writer.gang_permits.max_members = limit if limit and limit > 0 else None
            await self.cache.wait_synced("pods", "claims")
            while True:
                try:
                    messages = await sub.fetch(FETCH_BATCH, timeout=FETCH_WAIT_SECONDS)
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
                    slot = PlacementSlot(self.placement_slots)
                    await slot.take()
                    task = asyncio.create_task(self.handle(msg, result, slot))
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
                await self.reservations.store.hold(node, expected, self.settings.lease_seconds,
                                                   pods=pods_by_node[node])
            except Exception:  # noqa: BLE001 - best effort; each placement checks its lease again
                log.warning("could not renew %d leases on node %s", len(expected), node, exc_info=True)

        # one write per node, all nodes at once: a batch spread over 64 nodes waited for 64 round trips
        await asyncio.gather(*(renew(node, expected) for node, expected in by_node.items()))

    async def handle(self, msg, result, slot: PlacementSlot | None = None) -> None:
        try:
            if isinstance(result, Placement):
                if await self.writer.write_placement(result, in_progress=msg.in_progress, slot=slot):
                    # Before the acknowledgement: a crash in between redelivers the placement,
                    # which finds the pod bound and publishes this again (one event by its id).
                    await self.audit.publish_and_wait(self._placed_event(result))
            elif isinstance(result, Unschedulable):
                await self._unschedulable(result, msg)
            else:
                log.error("unexpected %s on the results subject", type(result).__name__)
        except Exception as exc:  # noqa: BLE001 - counted, logged, told to the pod, redelivered with backoff
            deliveries = streams.deliveries(msg)
            delay = streams.redelivery_delay(deliveries)
            self.metrics.errors.inc()
            log.exception("pod %s: handling its %s failed (delivery %d); redelivering in %.0f s",
                          result.pod.key(), type(result).__name__, deliveries, delay)
            await msg.nak(delay=delay)
            await self.pending.report_error(result.pod.uid, f"draplane binder: {type(result).__name__.lower()} of "
                                            f"the pod failed: {exc!r}; retrying in {delay:.0f} s")
            return
        await msg.ack()

    async def _unschedulable(self, result: Unschedulable, msg) -> None:
        pod = self.cache.pods_by_uid.get(result.pod.uid)
        if pod is None or not self.cache.pending_pod_needs_work(pod):
            return
        message = result.message
        if result.preemption is not None:
            message = await self.preemptor.preempt(pod, result.preemption, message, shard=result.shard)
        await self.pending.mark_unschedulable(
            pod, message, shard=result.shard, answer=_stream_sequence(msg),
            reason=ERROR_CONDITION_REASON if result.error else (
                result.label or failure_label(result.failures, result.claim_error)),
            condition=ERROR_CONDITION_REASON if result.error else CONDITION_REASON)

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


def _log_failure(task: asyncio.Task) -> None:
    log_task_failure(task, log)

"""The audit subscriber's asyncio shell: the audit stream in, the append-only log out.

One loop: fetch a batch from the durable consumer, turn it into lines (draplane_audit.resume),
append and fsync them in a thread, then acknowledge. Errors back off (0.5 s doubling to 30 s) and
are counted; a batch whose write failed is kept (bounded: one batch) and written again, never
acknowledged before it is on disk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from draplane.audit_log import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, LOG_NAME, RECENT_IDS, LogFile
from draplane.audit_publisher import ensure_audit_stream
from draplane.messages.audit import AuditNames
from draplane_audit.metrics import AuditMetrics
from draplane_audit.resume import ConsumerState, RecentIds, Resume, StartAt, plan_batch, resume_plan

log = logging.getLogger(__name__)

FETCH_BATCH = 256
ACK_WAIT_SECONDS = 60.0
MAX_BACKOFF_SECONDS = 30.0


class AuditSubscriber:
    def __init__(self, js: JetStreamContext, log_dir: Path, *, prefix: str, metrics: AuditMetrics,
                 stream_replicas: int = 1, on_batch=None, max_bytes: int | None = DEFAULT_MAX_BYTES,
                 backups: int = DEFAULT_BACKUPS):
        self.js = js
        self.names = AuditNames(prefix=prefix)
        self.file = LogFile(log_dir / LOG_NAME, max_bytes=max_bytes, backups=backups)
        self.metrics = metrics
        self.stream_replicas = stream_replicas
        self.last_seq = 0
        self.recent = RecentIds(limit=RECENT_IDS)
        self.ready = asyncio.Event()
        # Called with each batch written (the cluster metrics count allocations from it).
        self.on_batch = on_batch
        self._sub = None

    @property
    def path(self) -> Path:
        return self.file.path

    async def start(self) -> None:
        tail = await asyncio.to_thread(self.file.open)
        if tail.torn_bytes:
            log.warning("audit log %s: dropped %d bytes of a line cut short by a crash (its event was not "
                        "acknowledged and is read again)", self.path, tail.torn_bytes)
        if tail.unreadable_lines:
            log.warning("audit log %s: %d lines near its end do not parse; skipped", self.path, tail.unreadable_lines)
        self.last_seq = tail.last_seq
        self.recent = RecentIds(tail.recent_ids, limit=RECENT_IDS)
        self.metrics.last_sequence.set(self.last_seq)
        log.info("audit log %s: %d bytes, last event seq %d", self.path, tail.valid_size, self.last_seq)

    async def _subscribe(self):
        await ensure_audit_stream(self.js, self.names, replicas=self.stream_replicas)
        stream = await self.js.stream_info(self.names.stream)
        try:
            info = await self.js.consumer_info(self.names.stream, self.names.consumer)
            consumer = ConsumerState(ack_floor=info.ack_floor.stream_seq if info.ack_floor else 0,
                                     delivered=info.delivered.stream_seq if info.delivered else 0,
                                     ack_pending=info.num_ack_pending or 0)
        except nats.js.errors.NotFoundError:
            consumer = None
        plan = resume_plan(self.last_seq, consumer, stream.state.first_seq, stream.state.last_seq)
        if isinstance(plan, StartAt):
            log.info("audit: reading the stream from sequence %d (%s)", plan.sequence, plan.why)
            if consumer is not None:
                await self.js.delete_consumer(self.names.stream, self.names.consumer)
            if plan.sequence <= self.last_seq:
                self.last_seq = plan.sequence - 1  # a new stream: its sequences start over
            config = ConsumerConfig(
                durable_name=self.names.consumer, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=plan.sequence, ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_SECONDS,
                max_ack_pending=FETCH_BATCH * 2, max_deliver=-1, filter_subject=self.names.wildcard,
            )
            await self.js.add_consumer(self.names.stream, config=config)
        else:
            log.info("audit: resuming the consumer after sequence %d", self.last_seq)
        return await self.js.pull_subscribe_bind(durable=self.names.consumer, stream=self.names.stream)

    async def run(self) -> None:
        """Until cancelled. Never returns on an error: it is logged, counted and retried later."""
        failures = 0
        while True:
            try:
                if self._sub is None:
                    self._sub = await self._subscribe()
                    self.ready.set()
                try:
                    messages = await self._sub.fetch(FETCH_BATCH, timeout=2.0)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    self.metrics.consumer_pending.set(0)
                    continue
                await self._write(messages)
                failures = 0
            except asyncio.CancelledError:
                raise
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                failures += 1
                delay = min(MAX_BACKOFF_SECONDS, 0.5 * 2 ** (failures - 1))
                self.metrics.errors.labels(what="nats").inc()
                log.warning("audit: reading the stream failed (%r); retrying in %.1f s", exc, delay)
                if isinstance(exc, nats.js.errors.NotFoundError):
                    self._sub = None  # the consumer or stream is gone: make them again
                await asyncio.sleep(delay)

    async def _write(self, messages) -> None:
        fetched = [(msg.metadata.sequence.stream, msg.data) for msg in messages]
        batch = plan_batch(fetched, self.last_seq, self.recent, time.time())
        for seq, why in batch.unreadable:
            # once per message: it is terminated below and never comes back
            log.error("audit: stream message %d is not an audit event, recorded as unreadable and skipped: %s",
                      seq, why)
        for first, last in batch.gaps:
            log.warning("audit: stream sequences %d..%d were gone before they were read (older than the "
                        "stream's max age?)", first, last)
        failures = 0
        while batch.data:
            try:
                await asyncio.to_thread(self.file.append, batch.data)
                break
            except OSError as exc:
                failures += 1
                delay = min(MAX_BACKOFF_SECONDS, 0.5 * 2 ** (failures - 1))
                self.metrics.errors.labels(what="write").inc()
                log.error("audit: writing %s failed (%s); %d events kept, retrying in %.1f s",
                          self.path, exc, len(batch.ids), delay)
                await asyncio.sleep(delay)
        # Acknowledged only now: what the server counts as done is on disk.
        for index in batch.ack:
            await _settle(messages[index].ack())
        for index in batch.term:
            await _settle(messages[index].term())
        self.last_seq = batch.last_seq
        for event_id in batch.ids:
            self.recent.add(event_id)
        m = self.metrics
        for kind, count in batch.kinds.items():
            m.events.labels(kind=kind).inc(count)
        m.unreadable.inc(len(batch.unreadable))
        m.duplicates.labels(why="redelivered").inc(batch.redelivered)
        m.duplicates.labels(why="published twice").inc(batch.repeated)
        m.gaps.inc(sum(last - first + 1 for first, last in batch.gaps))
        m.last_sequence.set(self.last_seq)
        try:
            m.consumer_pending.set(messages[-1].metadata.num_pending)
        except (AttributeError, IndexError):
            pass
        if self.on_batch is not None and batch.ids:
            self.on_batch(batch)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await asyncio.wait_for(self._sub.unsubscribe(), 2.0)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the connection may be gone
                pass
            self._sub = None
        self.file.close()


async def _settle(ack) -> None:
    try:
        await ack
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        # Written already: a redelivery is recognised by its sequence and not written twice.
        log.debug("audit: acknowledgement failed (%s)", exc)

"""Publishing audit events from the services that know them, without holding them up.

`AuditPublisher.publish` never raises and never waits: it hands the event to a task and returns.
A failed publish is logged (once per burst, not once per event) and counted in `counters`; an
event that finds `max_in_flight` publishes still going is dropped and counted, so a NATS that
stalls costs the caller bounded memory, never a blocked placement. `publish_and_wait` is for the
few places that can afford one round trip (the binder, before it acknowledges the placement it
just wrote: if it dies in between, the placement is redelivered and published again, and the
event id makes that second publish a duplicate JetStream drops).
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from draplane.jetstream.setup import JetStreamNotAnswering, until_answered
from draplane.messages.audit import (
    AUDIT_DUPLICATE_WINDOW_SECONDS,
    AUDIT_MAX_AGE_SECONDS,
    AuditEvent,
    AuditNames,
    encode_event,
)

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT_SECONDS = 2.0
# A failed publish is tried again, 0.25 s doubling to 2 s apart, for this long: longer than a
# JetStream leader election after a NATS server dies (a few seconds), short enough that a NATS
# that is really gone costs a caller of publish_and_wait little.
RETRY_FOR_SECONDS = 10.0
RETRY_FIRST_DELAY_SECONDS = 0.25
RETRY_MAX_DELAY_SECONDS = 2.0
MAX_IN_FLIGHT = 1024
# How long a service waits at start for JetStream to create the audit stream before it goes on
# without it: the audit is not the service's job, and whoever starts next creates the stream.
START_WAIT_SECONDS = 20.0
# Failures are logged at most once per this many seconds (with the count since the last line).
LOG_EVERY_SECONDS = 30.0


def audit_stream_config(names: AuditNames, *, replicas: int = 1) -> StreamConfig:
    return StreamConfig(
        name=names.stream,
        subjects=[names.wildcard],
        retention=RetentionPolicy.LIMITS,
        # Bounded by age, not size: a size limit is reserved up front in the account's JetStream
        # storage, and every event of the last week is worth more than the space it takes.
        max_age=AUDIT_MAX_AGE_SECONDS,
        duplicate_window=AUDIT_DUPLICATE_WINDOW_SECONDS,
        storage=StorageType.FILE,
        num_replicas=replicas,
    )


async def ensure_audit_stream(js: JetStreamContext, names: AuditNames, *, replicas: int = 1) -> None:
    """Idempotent: every publisher and the subscriber call it, whichever starts first creates it."""
    config = audit_stream_config(names, replicas=replicas)
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != 10058:  # exists with another config: ours is fixed, so make it so
            raise
        await js.update_stream(config)


class AuditPublisher:
    def __init__(self, js: JetStreamContext, prefix: str, *, max_in_flight: int = MAX_IN_FLIGHT,
                 retry_for: float = RETRY_FOR_SECONDS):
        self.js = js
        self.names = AuditNames(prefix=prefix)
        self.max_in_flight = max_in_flight
        self.retry_for = retry_for
        self.counters = {"published": 0, "failed": 0, "dropped": 0}
        self._in_flight: set[asyncio.Task] = set()
        self._failures_unlogged = 0
        self._last_logged = float("-inf")

    async def start(self, *, replicas: int = 1) -> None:
        """Make sure the stream exists. A failure here is logged, not fatal: the service's job
        does not depend on the audit, and the stream is made by whoever starts next."""
        try:
            await until_answered(lambda: ensure_audit_stream(self.js, self.names, replicas=replicas),
                                 f"creating stream {self.names.stream}", log=log, give_up_after=START_WAIT_SECONDS)
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError, JetStreamNotAnswering) as exc:
            log.warning("audit stream %s not created (%r); events published meanwhile are lost", self.names.stream, exc)

    def publish(self, event: AuditEvent) -> None:
        if len(self._in_flight) >= self.max_in_flight:
            self.counters["dropped"] += 1
            self._failed(f"{len(self._in_flight)} audit publishes in flight; event {event.id} dropped")
            return
        task = asyncio.create_task(self.publish_and_wait(event), name=f"audit {event.id}")
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def publish_and_wait(self, event: AuditEvent) -> bool:
        """One publish with its acknowledgement, tried again for up to RETRY_FOR_SECONDS; False
        (counted, logged) when it still failed.

        Why retry: a NATS server dying makes the stream elect a new leader, and for a few seconds
        publishes get no answer (NoStreamResponseError, timeouts). The chaos run lost 13 of 3,825
        events that way when they were tried once. Trying again is safe: the event id is the
        Nats-Msg-Id, so a publish that landed but lost its answer is dropped as a duplicate."""
        deadline = time.monotonic() + self.retry_for
        delay = RETRY_FIRST_DELAY_SECONDS
        while True:
            try:
                await self.js.publish(self.names.subject(event.kind), encode_event(event),
                                      timeout=PUBLISH_TIMEOUT_SECONDS, headers={"Nats-Msg-Id": event.id})
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError, OSError) as exc:
                if time.monotonic() + delay < deadline:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_DELAY_SECONDS)
                    continue
                self.counters["failed"] += 1
                self._failed(f"audit event {event.id} not published after {self.retry_for:.0f} s of tries: {exc!r}")
                return False
            self.counters["published"] += 1
            return True

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait for the publishes in flight (shutdown, tests)."""
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=timeout)

    def _failed(self, message: str) -> None:
        self._failures_unlogged += 1
        now = time.monotonic()
        if now - self._last_logged >= LOG_EVERY_SECONDS:
            more = self._failures_unlogged - 1
            log.warning("%s%s", message, f" (and {more} more audit failures since the last report)" if more else "")
            self._failures_unlogged = 0
            self._last_logged = now

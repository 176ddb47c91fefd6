"""The JetStream streams and the reservation bucket, created idempotently by whichever service starts
first. The one I/O module of this package next to `reservation_store`; the rest is pure."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE, KeyValue

from draplane.jetstream.setup import until_answered
from draplane.scheduling.messages import Subjects

log = logging.getLogger(__name__)

# A pending pod or a placement not acknowledged within this is redelivered: the consumer died.
ACK_WAIT_SECONDS = 15.0
# Releases are for live subscribers and audit; an hour is plenty to read them back.
RELEASED_MAX_AGE_SECONDS = 3600.0


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as exc:
        # 10058: a stream of that name exists with another config. Ours are fixed per prefix, so
        # the existing one is the one we want; update keeps subjects right after an upgrade.
        if exc.err_code != 10058:
            raise
        await js.update_stream(config)


async def ensure_streams(js: JetStreamContext, subjects: Subjects, *, replicas: int = 1) -> None:
    """`replicas`: 3 on a 3-server NATS cluster, so that losing one server loses nothing."""
    # Work-queue retention for pending pods and placements: a message is gone once acknowledged,
    # so a restarted consumer resumes with exactly what is left. Releases are kept for an hour.
    streams = [
        (subjects.pending_stream, subjects.pending_all, RetentionPolicy.WORK_QUEUE, None),
        (subjects.results_stream, subjects.results, RetentionPolicy.WORK_QUEUE, None),
        (subjects.released_stream, subjects.released, RetentionPolicy.LIMITS, RELEASED_MAX_AGE_SECONDS),
    ]
    for name, subject, retention, max_age in streams:
        config = StreamConfig(name=name, subjects=[subject], retention=retention, max_age=max_age,
                              storage=StorageType.FILE, num_replicas=replicas)
        await until_answered(lambda config=config: _ensure_stream(js, config), f"creating stream {name}", log=log)


async def _bucket(js: JetStreamContext, name: str, replicas: int, ttl: float | None = None) -> KeyValue:
    return await until_answered(lambda: _find_or_create_bucket(js, name, replicas, ttl), f"opening bucket {name}",
                                log=log)


async def _find_or_create_bucket(js: JetStreamContext, name: str, replicas: int, ttl: float | None) -> KeyValue:
    try:
        return await js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        pass
    try:
        return await js.create_key_value(KeyValueConfig(bucket=name, history=1, storage=StorageType.FILE,
                                                        replicas=replicas, ttl=ttl))
    except nats.js.errors.BadRequestError:
        return await js.key_value(name)  # another service created it first


async def reservation_bucket(js: JetStreamContext, subjects: Subjects, *, replicas: int = 1) -> KeyValue:
    return await _bucket(js, subjects.reservations_bucket, replicas)


async def cluster_bucket(js: JetStreamContext, subjects: Subjects, *, replicas: int = 1) -> KeyValue:
    """The binder's view of Kubernetes for the shards; one revision per key (the latest)."""
    return await _bucket(js, subjects.cluster_bucket, replicas)


async def gang_permits_bucket(js: JetStreamContext, subjects: Subjects, *, ttl: float, replicas: int = 1) -> KeyValue:
    """The gang commits whose Permit barrier opened, each kept `ttl` seconds."""
    return await _bucket(js, subjects.gang_permits_bucket, replicas, ttl)


# How long a watch waits for entries after nats-py said, before any came, that there are none.
EMPTY_BUCKET_GRACE_SECONDS = 0.5


async def bucket_entries(kv: KeyValue, keys: str = ">") -> AsyncIterator[KeyValue.Entry | None]:
    """Every entry a bucket holds (of the `keys` wildcard), then None (the ones it held when the watch began are all
    delivered), then every change, for ever. Use with contextlib.aclosing to stop the watcher
    when the caller stops reading.

    The end of the replay is the first entry with nothing pending behind it (`delta == 0`), not
    nats-py's own None: that one is put first when the consumer's info, read after subscribing,
    shows nothing pending while the replayed messages are still on their way to the client, so
    a reader taking it would think the bucket empty or its replay over too early (seen: a
    restarted binder that missed keys, so never deleted them). nats-py's None is believed only
    when no entry follows it within EMPTY_BUCKET_GRACE_SECONDS."""
    watcher = await kv.watch(keys)
    replayed = False
    said_empty = False  # nats-py said there is nothing, before any entry came
    reads = 0
    try:
        while True:
            try:
                reads += 1
                update = await _next_update(watcher, EMPTY_BUCKET_GRACE_SECONDS if said_empty else None,
                                            pause=reads % YIELD_EVERY_ENTRIES == 0)
            except nats.errors.TimeoutError:
                if said_empty:
                    said_empty, replayed = False, True
                    yield None  # nothing came: the bucket was empty
                continue
            if update is _STOPPED:
                # only KeyWatcher.stop() queues it, and only this function's own finally calls
                # that: should nats-py ever stop a watcher itself, the caller's watch restarts
                raise nats.errors.Error("nats: the bucket's watcher was stopped")
            if update is None:
                said_empty = not replayed
                continue
            said_empty = False
            yield update
            if not replayed and update.delta == 0:
                replayed = True
                yield None
    finally:
        try:
            await asyncio.wait_for(watcher.stop(), 2.0)
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the connection may be gone already
            pass


_STOPPED = KeyValue.KeyWatcher.STOP_ITER
YIELD_EVERY_ENTRIES = 64


async def _next_update(watcher: KeyValue.KeyWatcher, timeout: float | None, *, pause: bool = False):
    """The watcher's next update. nats-py's `updates(timeout)` wraps every read in
    asyncio.wait_for, a task per entry: most of what a shard spends per cluster change it follows
    besides decoding it. Its queue is read directly where it has one (an internal of nats-py's,
    hence the fallback); the timeout is only needed while an empty bucket is being confirmed."""
    queue = getattr(watcher, "_updates", None)
    if not isinstance(queue, asyncio.Queue):
        return await watcher.updates(timeout=timeout if timeout is not None else 30.0)
    if timeout is not None:
        try:
            return await asyncio.wait_for(queue.get(), timeout)
        except asyncio.TimeoutError:
            raise nats.errors.TimeoutError from None
    if pause:
        # Now and then through the event loop even with entries queued, as nats-py's own read did
        # on every entry: a replay of thousands must not hold up pings, leases and placements.
        await asyncio.sleep(0)
    return await queue.get()  # no suspension while the queue holds an entry


class StreamEntry(msgspec.Struct, frozen=True, gc=False):
    """A bucket's message read from its stream (`follow_bucket_from`, `bucket_message_from`), as
    the bucket's readers take an entry: `revision` is its stream sequence, `operation` "DEL" or
    "PURGE" for a delete marker, else None."""

    key: str
    value: bytes | None
    revision: int
    delta: int = 0  # the messages of the stream (of the keys followed) still behind this one
    operation: str | None = None


def _operation(headers) -> str | None:
    """The key-value operation a message's headers say, as nats-py's watch reads them."""
    if not headers:
        return None
    operation = headers.get(KV_OP)
    if operation is None and KV_MARKER_REASON in headers:
        # nats-server 2.11+ marks what it removed itself (a TTL, a max age) this way; a reason
        # newer than this code is taken as a removal
        operation = KV_DEL if headers[KV_MARKER_REASON] == "Remove" else KV_PURGE
    return operation


# Bounded as nats-py's own key-value watcher is: a reader that falls behind holds the
# subscription back rather than filling this process.
FOLLOW_QUEUE_SIZE = 256


class BucketFollower:
    """Every message of a bucket's stream on `keys` (a key wildcard) from stream sequence
    `sequence` on, in order, for ever (`async for`): nats-py's ordered consumer, whose gaps,
    resets, flow control and heartbeats are nats-py's, which a key-value watch cannot start at a
    sequence. `stop` ends it."""

    def __init__(self, js: JetStreamContext, bucket: str, keys: str, sequence: int):
        self._js, self._bucket, self._keys, self._sequence = js, bucket, keys, max(1, sequence)
        self._prefix = f"$KV.{bucket}."
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=FOLLOW_QUEUE_SIZE)
        self._sub = None

    async def start(self) -> "BucketFollower":
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._sequence)
        self._sub = await self._js.subscribe(f"{self._prefix}{self._keys}", stream=f"KV_{self._bucket}",
                                             cb=self._on_message, ordered_consumer=True, config=config,
                                             inactive_threshold=WATCH_INACTIVE_SECONDS)
        return self

    async def _on_message(self, msg) -> None:
        metadata = msg.metadata
        entry = StreamEntry(msg.subject[len(self._prefix):], msg.data, metadata.sequence.stream,
                            metadata.num_pending, _operation(msg.headers))
        if self._queue.full():
            await self._queue.put(entry)
        else:
            self._queue.put_nowait(entry)

    def __aiter__(self) -> "BucketFollower":
        return self

    async def __anext__(self) -> StreamEntry:
        return await self._queue.get()

    async def pending(self) -> int:
        """The messages on their way to the reader: held by the server for this consumer, or
        received and not read yet. Those received only, when the server does not answer."""
        held = 0
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
            held = (await self._sub.consumer_info()).num_pending or 0
        return held + self._queue.qsize()

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):  # the connection may be gone already
                await asyncio.wait_for(self._sub.unsubscribe(), 2.0)


# nats-py's default for its key-value watch: the server drops an ephemeral consumer 5 minutes after
# its client went.
WATCH_INACTIVE_SECONDS = 300.0


async def bucket_message_from(js: JetStreamContext, bucket: str, sequence: int) -> StreamEntry | None:
    """The bucket's first message at or after stream sequence `sequence` (of any key), read
    straight from its stream; None when there is none."""
    try:
        msg = await js.get_msg(f"KV_{bucket}", seq=max(1, sequence), subject=f"$KV.{bucket}.>", next=True)
    except nats.js.errors.NotFoundError:
        return None
    return StreamEntry(msg.subject[len(f"$KV.{bucket}."):], msg.data or None, msg.seq, 0, _operation(msg.headers))


async def stream_last_sequence(js: JetStreamContext, stream: str) -> int:
    return (await js.stream_info(stream)).state.last_seq


async def bucket_snapshot(kv: KeyValue, *, keys: str = ">", timeout: float = 10.0) -> list[KeyValue.Entry]:
    """The entries a bucket holds now (of the `keys` wildcard), delete and purge markers included,
    read to the real end of the replay as `bucket_entries` finds it; asyncio.TimeoutError when
    `timeout` seconds pass with no entry (a big bucket may take longer in all, as long as it keeps
    coming)."""
    held = []
    async with contextlib.aclosing(bucket_entries(kv, keys)) as entries:
        while True:
            entry = await asyncio.wait_for(anext(entries), timeout)
            if entry is None:
                return held
            held.append(entry)


def entry_value(entry: KeyValue.Entry) -> bytes | None:
    """The entry's value; None for a delete or purge marker."""
    return None if entry.operation in ("DEL", "PURGE") or not entry.value else entry.value


def work_consumer(durable: str) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ACK_WAIT_SECONDS,
        max_ack_pending=1024,
    )


# A message that could not be handled is redelivered after this, doubling per delivery up to the cap.
REDELIVERY_DELAY_SECONDS = 1.0
MAX_REDELIVERY_DELAY_SECONDS = 30.0


def redelivery_delay(deliveries: int) -> float:
    """Backoff for the n-th failed delivery of one message: never a hot loop on a lasting error."""
    return min(MAX_REDELIVERY_DELAY_SECONDS, REDELIVERY_DELAY_SECONDS * 2 ** max(0, deliveries - 1))


def deliveries(msg) -> int:
    """How often JetStream has delivered this message, this time included."""
    metadata = getattr(msg, "metadata", None)
    try:
        return max(1, int(metadata.num_delivered)) if metadata is not None else 1
    except (AttributeError, TypeError, ValueError):
        return 1

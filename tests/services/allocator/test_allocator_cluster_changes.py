"""A shard follows the cluster bucket through the binder's change batches
(draplane.scheduling.cluster_changes), on a real NATS: what a batch names is taken from it, and a
write no batch names (another writer, a binder gone between its puts and their batch) is read
from the bucket's stream, within a second or at once for a pod that waits for it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from draplane.api.meta import ObjectMeta
from draplane.api.resource import DeviceClass
from draplane.jetstream import streams
from draplane.messages.inventory import InventoryNames
from draplane.scheduling import cluster_changes, cluster_feed
from draplane.scheduling.messages import Subjects
from draplane_allocator import view as view_module
from draplane_allocator.metrics import AllocatorMetrics
from draplane_allocator.view import ShardView
from draplane_binder.cluster_publisher import ClusterPublisher

pytestmark = pytest.mark.integration


class _Audit:
    def publish(self, event):
        pass


def _class(name: str) -> DeviceClass:
    return DeviceClass(metadata=ObjectMeta(name=name))


async def _until(condition, what: str, timeout: float = 10.0) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


@contextlib.asynccontextmanager
async def _following_view(nats, prefix: str):
    view = ShardView(nats.jetstream(), Subjects(prefix=prefix), InventoryNames(prefix=prefix), index=0, policy=None,
                     stream_replicas=1, gang_scheduling=True, audit_publisher=_Audit(),
                     metrics=AllocatorMetrics().shard(0), log=logging.getLogger("test"))
    task = asyncio.create_task(view._watch_cluster())
    try:
        yield view
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_batches_are_followed_and_what_no_batch_named_is_read_from_the_stream(
        nats, subject_prefix, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    js = nats.jetstream()
    kv = await streams.cluster_bucket(js, Subjects(prefix=subject_prefix))
    await kv.put(cluster_feed.key_of(_class("before")), cluster_feed.encode(_class("before")))
    read_from_stream = []
    real_read = streams.bucket_message_from

    async def counted(js, bucket, sequence):
        message = await real_read(js, bucket, sequence)
        read_from_stream.append(message.key if message else None)
        return message
    monkeypatch.setattr(view_module.streams, "bucket_message_from", counted)

    async with _following_view(nats, subject_prefix) as view:
        await _until(lambda: "class.before" in view.bucket_objects, "the replay")

        # the binder's writes come in its batches: none is read from the stream
        publisher = ClusterPublisher(instance="binder-1", kinds=(DeviceClass,))
        await publisher.load(kv)
        writer = asyncio.create_task(publisher.run())
        try:
            for i in range(20):
                publisher.offer(_class(f"batched-{i}"))
            publisher.offer(_class("before"), deleted=True)
            await _until(lambda: all(f"class.batched-{i}" in view.bucket_objects for i in range(20))
                         and "class.before" not in view.bucket_objects, "the batched writes")
        finally:
            writer.cancel()
        assert read_from_stream == []
        assert view._cluster_taken.missing() is None

        # a write no batch names: read from the stream within about CLUSTER_GAP_SECONDS
        await kv.put("class.direct", cluster_feed.encode(_class("direct")))
        waited = await _until(lambda: "class.direct" in view.bucket_objects, "the write no batch named")
        assert waited < view_module.CLUSTER_GAP_SECONDS * 3
        assert "read 1 cluster bucket changes that no batch of the binder named" in caplog.text

        # a pod that waits for such a write asks for it at once
        revision = await kv.put("class.waited-for", cluster_feed.encode(_class("waited-for")))
        started = time.monotonic()
        await view._caught_up(revision)
        assert time.monotonic() - started < view_module.CLUSTER_GAP_SECONDS
        assert "class.waited-for" in view.bucket_objects
        assert view.cluster_revision >= revision


async def test_a_batch_that_cannot_be_read_is_logged_and_what_it_named_is_read_from_the_stream(
        nats, subject_prefix, caplog):
    js = nats.jetstream()
    kv = await streams.cluster_bucket(js, Subjects(prefix=subject_prefix))
    async with _following_view(nats, subject_prefix) as view:
        await _until(lambda: view._cluster_replayed, "the replay")
        await asyncio.sleep(0.2)  # following the batches
        put = await kv.put("class.named", cluster_feed.encode(_class("named")))
        await kv.create(cluster_changes.changes_key("junk", 1), b"\xc1 not msgpack",
                        msg_ttl=cluster_changes.CHANGES_TTL_SECONDS)
        await _until(lambda: "class.named" in view.bucket_objects, "the value the broken batch named")
        assert "cluster bucket change batch 'meta.changes.junk.1'" in caplog.text
        assert view._cluster_taken.has(put)


async def test_while_batches_come_the_stream_is_not_asked_and_what_none_named_is_still_read(
        nats, subject_prefix, monkeypatch, caplog):
    """The batches say how far the stream reached: a write none of them named lies below a later
    batch and is read from the stream all the same, without asking the stream's last sequence."""
    caplog.set_level(logging.INFO)
    js = nats.jetstream()
    kv = await streams.cluster_bucket(js, Subjects(prefix=subject_prefix))
    asked = []
    real_last = streams.stream_last_sequence

    async def counted(js, stream):
        asked.append(stream)
        return await real_last(js, stream)
    monkeypatch.setattr(view_module.streams, "stream_last_sequence", counted)

    async with _following_view(nats, subject_prefix) as view:
        await _until(lambda: view._cluster_replayed, "the replay")
        publisher = ClusterPublisher(instance="binder-1", kinds=(DeviceClass,))
        await publisher.load(kv)
        writer = asyncio.create_task(publisher.run())
        try:
            publisher.offer(_class("first"))
            await _until(lambda: "class.first" in view.bucket_objects and view._batches_taken > 0,
                         "the first batched write")
            asked.clear()
            direct = None
            for i in range(int(view_module.CLUSTER_GAP_SECONDS * 4 / 0.05)):
                publisher.offer(_class(f"steady-{i}"))
                if i == 10:
                    direct = await kv.put("class.between", cluster_feed.encode(_class("between")))
                await asyncio.sleep(0.05)
            await _until(lambda: "class.between" in view.bucket_objects, "the write no batch named",
                         timeout=view_module.CLUSTER_GAP_SECONDS * 3)
        finally:
            writer.cancel()
        assert view._cluster_taken.has(direct)
        assert asked == [], f"the stream was asked while batches came: {asked}"
        assert "read 1 cluster bucket changes that no batch of the binder named" in caplog.text

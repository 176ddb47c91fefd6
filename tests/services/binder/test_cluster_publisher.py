"""The binder's writer of the cluster bucket, against a real NATS (draplane_binder.cluster_publisher)."""

from __future__ import annotations

import asyncio

from nats.js.errors import KeyNotFoundError
import pytest

from draplane.api.core import Node, NodeStatus, Pod, PodSpec
from draplane.api.meta import Condition, ObjectMeta
from draplane.api.resource import DeviceClass, ResourceClaim
from draplane.scheduling import cluster_feed, streams
from draplane.scheduling.messages import Subjects
from draplane_binder.cluster_publisher import ClusterPublisher

pytestmark = pytest.mark.integration


def _node(name: str, heartbeat: str = "True") -> Node:
    return Node(metadata=ObjectMeta(name=name), status=NodeStatus(
        allocatable={"cpu": "8"}, conditions=[Condition(type="Ready", status=heartbeat)]))


async def _started(kv, instance: str) -> tuple[ClusterPublisher, asyncio.Task]:
    publisher = ClusterPublisher(instance=instance, kinds=(Node, DeviceClass))
    await publisher.load(kv)
    for kind in (Node, DeviceClass):
        publisher.listing_begins(kind)  # as the binder's watches do before they list
    return publisher, asyncio.create_task(publisher.run())


async def _keys(kv) -> dict[str, int]:
    return {e.key: e.revision for e in await streams.bucket_snapshot(kv) if e.operation not in ("DEL", "PURGE")}


async def test_changes_only_then_a_restart_sweeps_what_went(nats, subject_prefix):
    kv = await streams.cluster_bucket(nats.jetstream(), Subjects(prefix=subject_prefix))
    publisher, task = await _started(kv, "first")
    try:
        publisher.offer(_node("a"))
        publisher.offer(_node("b"))
        publisher.offer(DeviceClass(metadata=ObjectMeta(name="gpu")))
        publisher.listed(Node)
        assert not publisher.synced  # DeviceClass has not listed yet
        publisher.listed(DeviceClass)
        revision = await publisher.revision_of(["node.a", "node.b"])
        keys = await _keys(kv)
        assert set(keys) == {"node.a", "node.b", "class.gpu", cluster_feed.SYNCED_KEY}
        assert revision == max(keys["node.a"], keys["node.b"])

        # a heartbeat changes nothing the shards read: not written
        publisher.offer(_node("a", heartbeat="Unknown"))
        assert await publisher.revision_of(["node.a"]) == keys["node.a"]
        publisher.offer(_node("b"), deleted=True)
        await publisher.revision_of(["node.b"])
        assert "node.b" not in await _keys(kv)
    finally:
        task.cancel()

    # a new binder: node a is still there, unchanged; class gpu went while none watched
    publisher, task = await _started(kv, "second")
    try:
        before = (await kv.get("node.a")).revision
        publisher.offer(_node("a"))
        publisher.listed(Node)
        publisher.listed(DeviceClass)
        await publisher.revision_of(["class.gpu", cluster_feed.SYNCED_KEY])
        assert (await kv.get("node.a")).revision == before  # not rewritten
        with pytest.raises(KeyNotFoundError):  # purged (KeyDeletedError is one)
            await kv.get("class.gpu")
        assert cluster_feed.decode_synced((await kv.get(cluster_feed.SYNCED_KEY)).value).binder == "second"
    finally:
        task.cancel()


def test_an_object_it_cannot_key_is_logged_not_published(caplog):
    publisher = ClusterPublisher(instance="x")
    publisher.offer(ResourceClaim(metadata=ObjectMeta(name="c", namespace="ns")))  # no uid yet
    assert not publisher.wanted
    assert "ResourceClaim ns/c: no uid" in caplog.text
    # a pending pod outside any gang is not published; published once bound
    pod = Pod(metadata=ObjectMeta(name="p", namespace="ns", uid="u"), spec=PodSpec())
    publisher.offer(pod)
    assert not publisher.wanted
    publisher.offer(Pod(metadata=pod.metadata, spec=PodSpec(node_name="n")))
    assert "pod.u" in publisher.wanted

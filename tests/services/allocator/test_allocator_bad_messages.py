"""A shard given what is not ours on each of its NATS inputs (the pending subject, the inventory
feed, the reservation bucket, the cluster bucket) logs it, drops it (a pending message is termed, not redelivered)
and keeps placing. The decoders themselves are fuzzed in tests/shared/*/test_fuzz_*.py."""

from __future__ import annotations

import logging
import uuid

import msgspec
import pytest

from draplane.messages.inventory import SCHEMA_VERSION, FeedEntry, encode
from draplane.jetstream import streams
from draplane.simulation import scenario
from draplane.scheduling.messages import ClaimRef, PendingPod, PodRef, Subjects, encode_message
from conftest import ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration


async def test_a_shard_drops_what_is_not_ours_and_keeps_placing(scheduling, kube, nats, namespace, caplog):
    caplog.set_level(logging.INFO)
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"bad-msg-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 1, "80Gi")])
    await scheduling.start()
    js = nats.jetstream()
    subjects = Subjects(prefix=scheduling.prefix)

    feed = await scheduling.feed_bucket()
    await feed.put("node.junk-1", b"\xc1 not msgpack")
    await feed.put("node.junk-2", encode(FeedEntry(schema_version=SCHEMA_VERSION + 1, key="node.junk-2")))
    reservations = await streams.reservation_bucket(js, subjects)
    await reservations.put("junk-node", b"{not json")
    cluster = await streams.cluster_bucket(js, subjects)
    await cluster.put("pod.junk", b"\xc1 not msgpack")
    await cluster.put("widget.junk", b"a kind of a newer binder")
    newer = PendingPod(version=2, pod=PodRef(namespace=namespace, name="x", uid="u"),
                       claims=[ClaimRef(namespace=namespace, name="x", uid="c")], first_seen=0.0)
    for junk in (b"\x93junk", msgspec.msgpack.encode({"type": "released", "claim": 5}), encode_message(newer)):
        await js.publish(subjects.pending(0), junk, stream=subjects.pending_stream)

    await kube.create(scenario.claim(namespace, "mine", class_name))
    await kube.create(scheduling.pod(namespace, "mine", claim_name="mine"))
    assert (await scheduling.bound_pod(namespace, "mine", timeout=60)).spec.node_name == node

    async def all_answered():
        info = await js.consumer_info(subjects.pending_stream, "shard-0")
        return info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0

    await scheduling.wait_for(all_answered, what="the pending messages to be termed, none redelivered")

    async def cluster_junk_logged():
        # written by no binder, so named by no change batch: read from the bucket's stream within
        # about a second (draplane.scheduling.cluster_changes)
        return sum("unreadable cluster bucket entry" in r.getMessage() for r in caplog.records) >= 2
    await scheduling.wait_for(cluster_junk_logged, what="the cluster bucket's junk read and logged")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("dropping a pending message" in m for m in messages) == 3
    assert any("field version is 2" in m for m in messages)
    assert sum("unreadable inventory feed entry node.junk-" in m for m in messages) == 2
    assert any("unreadable reservation entry" in m and "junk-node" in m for m in messages)
    assert any("unreadable cluster bucket entry" in m and "'pod.junk': not a Pod" in m for m in messages)
    assert any("unreadable cluster bucket entry" in m and "'widget.junk': not a kind" in m for m in messages)

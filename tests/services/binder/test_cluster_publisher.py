"""The binder's writer of the cluster bucket, against a real NATS (draplane_binder.cluster_publisher)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.js.errors import KeyNotFoundError
import pytest

from draplane.api.core import Node, NodeStatus, Pod, PodSpec
from draplane.api.meta import Condition, ObjectMeta
from draplane.api.resource import (
    AllocationResult, DeviceAllocationResult, DeviceClass, DeviceRequestAllocationResult, ResourceClaim,
    ResourceClaimStatus,
)
from draplane.jetstream import streams
from draplane.scheduling import cluster_changes, cluster_feed
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
    return {e.key: e.revision for e in await streams.bucket_snapshot(kv)
            if e.operation not in ("DEL", "PURGE") and not cluster_changes.is_changes_key(e.key)}


async def _batched(kv) -> dict[int, cluster_changes.Change]:
    """revision -> the change a batch of the bucket names for it"""
    batches = [cluster_changes.decode_changes(e.key, e.value) for e in await streams.bucket_snapshot(kv)
               if cluster_changes.is_changes_key(e.key)]
    return {c.revision: c for batch in batches for c in batch.changes}


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
        await publisher.revision_of(["class.gpu", cluster_feed.SYNCED_KEY])  # the rest, gathered, then synced
        keys = await _keys(kv)
        assert set(keys) == {"node.a", "node.b", "class.gpu", cluster_feed.SYNCED_KEY}
        assert revision == max(keys["node.a"], keys["node.b"])

        # a heartbeat changes nothing the shards read: not written
        publisher.offer(_node("a", heartbeat="Unknown"))
        assert await publisher.revision_of(["node.a"]) == keys["node.a"]
        publisher.offer(_node("b"), deleted=True)
        await publisher.revision_of(["node.b"])
        assert "node.b" not in await _keys(kv)

        # every write, the purge too, is named by a batch with its revision and value
        batched = await _batched(kv)
        for key, written in keys.items():
            assert batched[written].key == key and batched[written].value is not None
            if key != "node.b":
                assert batched[written].value == (await kv.get(key)).value
        purge = [c for c in batched.values() if c.key == "node.b" and c.value is None]
        assert len(purge) == 1 and purge[0].revision > keys["node.b"]
        assert all(c.binder == "first" for c in [cluster_changes.decode_changes(e.key, e.value)
                                                  for e in await streams.bucket_snapshot(kv)
                                                  if cluster_changes.is_changes_key(e.key)])
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


class _GatedBucket:
    """A stand-in for the bucket whose puts wait for the test to let them land (or fail): a
    pure test of what the publisher writes while a write is in flight."""

    def __init__(self):
        self.puts: list[tuple[str, bytes]] = []
        self.gate = asyncio.Event()
        self.fail_next = False

    async def put(self, key: str, value: bytes) -> int:
        self.puts.append((key, value))
        await self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("nats: connection closed")
        return len(self.puts)

    async def purge(self, key: str, msg_ttl: float | None = None) -> None:
        self.puts.append((key, None))


async def _until(condition, timeout: float = 2.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), timeout)


@contextlib.asynccontextmanager
async def _gated_publisher(*, fail_next: bool = False, coalesce_seconds: float = 0.005,
                           new_claim_hold_seconds: float = 2.0, kinds: tuple[type, ...] = (Node,)):
    """A publisher of `kinds` running against a _GatedBucket: (publisher, bucket)."""
    bucket = _GatedBucket()
    bucket.fail_next = fail_next
    publisher = ClusterPublisher(instance="x", kinds=kinds, coalesce_seconds=coalesce_seconds,
                                 new_claim_hold_seconds=new_claim_hold_seconds)
    publisher.kv = bucket
    task = asyncio.create_task(publisher.run())
    try:
        yield publisher, bucket
    finally:
        task.cancel()


@pytest.mark.parametrize("coalesce_seconds", [0.0, 0.05])
async def test_the_keys_waited_on_are_not_kept_once_written(coalesce_seconds):
    async with _gated_publisher(coalesce_seconds=coalesce_seconds) as (publisher, bucket):
        bucket.gate.set()
        for i in range(50):
            publisher.offer(_node(f"n{i}"))
            await publisher.revision_of([f"node.n{i}"], timeout=2.0)
        assert not publisher.urgent_keys


async def test_synced_is_written_last_even_when_waited_on():
    async with _gated_publisher(coalesce_seconds=0.2) as (publisher, bucket):
        bucket.gate.set()
        publisher.listing_begins(Node)
        publisher.offer(_node("a"))
        publisher.listed(Node)
        await publisher.revision_of([cluster_feed.SYNCED_KEY], timeout=2.0)
        assert [k for k, _ in bucket.puts] == ["node.a", cluster_feed.SYNCED_KEY]


async def test_offers_gather_for_the_coalescing_window_and_go_out_together():
    async with _gated_publisher(coalesce_seconds=0.3) as (publisher, bucket):
        bucket.gate.set()
        publisher.offer(_node("a"))
        await asyncio.sleep(0.1)
        assert bucket.puts == []  # still gathering
        publisher.offer(_node("b"))
        await _until(lambda: len(bucket.puts) == 2)
        assert sorted(k for k, _ in bucket.puts) == ["node.a", "node.b"]


async def test_offers_made_while_a_round_is_written_gather_for_the_next():
    async with _gated_publisher(coalesce_seconds=0.3) as (publisher, bucket):
        publisher.offer(_node("a"))
        await _until(lambda: bucket.puts, timeout=2.0)  # a's round is in flight
        publisher.offer(_node("b"))
        publisher.offer(_node("c"))
        bucket.gate.set()
        await asyncio.sleep(0.1)
        # under a steady load too the shards get bursts: b and c wait for the next gathering
        assert [k for k, _ in bucket.puts] == ["node.a"]
        await _until(lambda: len(bucket.puts) == 3, timeout=2.0)
        assert sorted(k for k, _ in bucket.puts[1:]) == ["node.b", "node.c"]


async def test_synced_is_not_starved_by_a_cluster_that_keeps_changing():
    async with _gated_publisher(coalesce_seconds=0.02) as (publisher, bucket):
        bucket.gate.set()
        publisher.listing_begins(Node)
        publisher.offer(_node("listed"))
        publisher.listed(Node)

        async def busy():
            for i in range(1000):
                publisher.offer(_node(f"n{i}"))
                await asyncio.sleep(0.005)

        churn = asyncio.create_task(busy())
        try:
            await publisher.revision_of([cluster_feed.SYNCED_KEY], timeout=2.0)
        finally:
            churn.cancel()
        keys = [k for k, _ in bucket.puts]
        assert keys.index("node.listed") < keys.index(cluster_feed.SYNCED_KEY)


async def test_a_key_a_pending_pod_waits_on_goes_out_at_once():
    async with _gated_publisher(coalesce_seconds=30.0) as (publisher, bucket):
        bucket.gate.set()
        publisher.offer(_node("a"))
        publisher.offer(_node("b"))
        # the binder's PendingPod waits for node.a's revision: it goes at once, alone; node.b
        # keeps gathering
        assert await publisher.revision_of(["node.a"], timeout=2.0) > 0
        assert [k for k, _ in bucket.puts] == ["node.a"]
        assert "node.b" in publisher.wanted


async def test_the_same_object_offered_while_its_write_is_in_flight_is_written_once():
    async with _gated_publisher() as (publisher, bucket):
        publisher.offer(_node("a"))  # the binder's own write of the object...
        await _until(lambda: bucket.puts)
        publisher.offer(_node("a", heartbeat="Unknown"))  # ...and its watch event, the same once trimmed
        bucket.gate.set()
        await publisher.revision_of(["node.a"])
        assert [k for k, _ in bucket.puts] == ["node.a"]

        # a change offered while a write is in flight is written after it
        bucket.gate.clear()
        changed = Node(metadata=ObjectMeta(name="a"), status=NodeStatus(allocatable={"cpu": "16"}))
        publisher.offer(changed)
        await _until(lambda: len(bucket.puts) == 2)
        publisher.offer(_node("a"))  # back to what the bucket held before the write in flight
        bucket.gate.set()
        await publisher.revision_of(["node.a"])
        assert [v for _, v in bucket.puts[1:]] == [cluster_feed.encode(changed), cluster_feed.encode(_node("a"))]
        assert publisher.published["node.a"] == cluster_feed.encode(_node("a"))


async def test_a_failed_write_is_written_again_even_if_the_offer_repeated_meanwhile():
    async with _gated_publisher(fail_next=True) as (publisher, bucket):
        publisher.offer(_node("a"))
        await _until(lambda: bucket.puts)
        publisher.offer(_node("a"))  # skipped: the write in flight holds it...
        bucket.gate.set()  # ...which fails, and is queued again
        await publisher.revision_of(["node.a"], timeout=5.0)
        assert [k for k, _ in bucket.puts] == ["node.a", "node.a"]
        assert publisher.published["node.a"] == cluster_feed.encode(_node("a"))


async def test_a_relist_without_an_object_whose_first_write_is_in_flight_deletes_it_after():
    async with _gated_publisher() as (publisher, bucket):
        publisher.listing_begins(Node)
        publisher.offer(_node("a"))
        await _until(lambda: bucket.puts)
        publisher.listed(Node)
        publisher.listing_begins(Node)  # the watch failed and lists again: node a is gone
        publisher.listed(Node)
        bucket.gate.set()
        await publisher.revision_of(["node.a"])
        assert [p for p in bucket.puts if p[0] == "node.a"] == [("node.a", cluster_feed.encode(_node("a"))), ("node.a", None)]
        assert "node.a" not in publisher.published


async def test_a_relist_sweeps_its_own_kind_by_an_index_that_forgets_deleted_keys():
    """The stale sweep reads the re-listed kind's keys only (issue 23, item 7: it read every key in
    the bucket, pods and claims included, at each re-list of any kind); a key deleted in the
    bucket leaves the index, so it does not grow with every object the cluster ever had."""
    async with _gated_publisher() as (publisher, bucket):
        bucket.gate.set()
        publisher.published.update({f"pod.p{i}": b"a pod" for i in range(1000)})  # as `load` leaves them
        for i in range(1000):
            publisher._index(f"pod.p{i}")
        for name in ("a", "b", "c"):
            publisher.offer(_node(name))
        await publisher.revision_of(["node.a", "node.b", "node.c"])
        assert set(publisher.keys_by_prefix["node"]) == {"node.a", "node.b", "node.c"}

        class Watching(dict):
            """Records the keys the sweep looks at."""
            read: list = []

            def __contains__(self, key):
                Watching.read.append(key)
                return dict.__contains__(self, key)

            def __iter__(self):
                for key in dict.__iter__(self):
                    Watching.read.append(key)
                    yield key

        publisher.published = Watching(publisher.published)
        publisher.listing_begins(Node)
        publisher.offer(_node("a"))
        publisher.listed(Node)  # b and c went while the watch was down
        await publisher.revision_of(["node.b", "node.c"])
        assert not [k for k in Watching.read if k.startswith("pod.")]
        assert [p for p in bucket.puts if p[1] is None] == [("node.b", None), ("node.c", None)]
        assert set(publisher.keys_by_prefix["node"]) == {"node.a"}
        assert len(publisher.keys_by_prefix["pod"]) == 1000


CLAIMS = (Node, ResourceClaim)


def _claim(uid: str, *, allocated: bool = False) -> ResourceClaim:
    status = ResourceClaimStatus(allocation=AllocationResult(devices=DeviceAllocationResult(results=[
        DeviceRequestAllocationResult(request="gpu", driver="gpu.example.com", pool="n1", device="gpu-0")])))
    return ResourceClaim(metadata=ObjectMeta(namespace="ns", name=f"c-{uid}", uid=uid),
                         status=status if allocated else None)


async def _synced(publisher: ClusterPublisher) -> None:
    publisher.listing_begins(Node)
    publisher.listing_begins(ResourceClaim)
    publisher.listed(Node)
    publisher.listed(ResourceClaim)
    await publisher.revision_of([cluster_feed.SYNCED_KEY], timeout=2.0)


async def test_a_new_claim_allocated_within_its_hold_is_written_once_allocated():
    async with _gated_publisher(new_claim_hold_seconds=30.0, kinds=CLAIMS) as (publisher, bucket):
        bucket.gate.set()
        await _synced(publisher)
        publisher.offer(_claim("c1"))  # the binder made it for a pod: no devices yet
        publisher.offer(_node("a"))
        await _until(lambda: [k for k, _ in bucket.puts][-1:] == ["node.a"])
        assert "claim.c1" in publisher.held  # held back while the node went out
        publisher.offer(_claim("c1", allocated=True))
        await publisher.revision_of(["claim.c1"], timeout=2.0)
        assert [v for k, v in bucket.puts if k == "claim.c1"] == [cluster_feed.encode(_claim("c1", allocated=True))]


async def test_a_held_claim_does_not_hold_the_heartbeat_back():
    async with _gated_publisher(new_claim_hold_seconds=30.0, kinds=CLAIMS) as (publisher, bucket):
        bucket.gate.set()
        await _synced(publisher)
        publisher.offer(_claim("c1"))
        now = time.time() + 10
        # it has no devices: a shard that lapses a lease meanwhile cannot give them twice
        assert cluster_feed.decode_synced(publisher.heartbeat_value(now)).at == now
        bucket.gate.clear()
        publisher.offer(_claim("c1", allocated=True))  # an allocation does hold it back until written
        assert cluster_feed.decode_synced(publisher.heartbeat_value(now)).at < now
        publisher.offer(_claim("c1"))  # deallocated before its write: unallocated again, and held
        assert "claim.c1" in publisher.held
        assert cluster_feed.decode_synced(publisher.heartbeat_value(now)).at == now


async def test_a_new_claim_not_allocated_is_written_when_its_hold_ends():
    async with _gated_publisher(new_claim_hold_seconds=0.3, kinds=CLAIMS) as (publisher, bucket):
        bucket.gate.set()
        await _synced(publisher)
        publisher.offer(_claim("c1"))
        await asyncio.sleep(0.1)
        assert "claim.c1" not in [k for k, _ in bucket.puts]
        await _until(lambda: "claim.c1" in [k for k, _ in bucket.puts], timeout=2.0)
        assert not publisher.held and not publisher.wanted


async def test_a_held_claim_a_pending_pod_waits_on_goes_out_at_once():
    async with _gated_publisher(coalesce_seconds=0.0, new_claim_hold_seconds=30.0, kinds=CLAIMS) as (publisher, bucket):
        bucket.gate.set()
        await _synced(publisher)
        publisher.offer(_claim("c1"))
        # a PendingPod too large to carry its claims waits for them in the bucket
        assert await publisher.revision_of(["claim.c1"], timeout=2.0) > 0
        assert not publisher.held


async def test_claims_are_not_held_before_the_bucket_is_synced_nor_once_in_it():
    async with _gated_publisher(new_claim_hold_seconds=30.0, kinds=CLAIMS) as (publisher, bucket):
        bucket.gate.set()
        publisher.offer(_claim("listed"))  # the first list: written before SYNCED_KEY, as everything
        assert not publisher.held
        await _synced(publisher)
        assert [k for k, _ in bucket.puts] == ["claim.listed", cluster_feed.SYNCED_KEY]
        publisher.offer(_claim("gone-after", allocated=True))
        await publisher.revision_of(["claim.gone-after"], timeout=2.0)
        publisher.offer(_claim("gone-after"))  # deallocated: the bucket must say so, not wait
        assert not publisher.held


async def test_written_through_waits_for_the_round_without_hurrying_it():
    async with _gated_publisher(coalesce_seconds=0.3) as (publisher, bucket):
        bucket.gate.set()
        publisher.offer(_node("a"))
        publisher.offer(_node("b"))
        started = time.monotonic()
        # a release waits for its claim's change; unlike a PendingPod's key it is not urgent: it
        # goes with its round (two puts, one batch), not alone
        assert await publisher.written_through(["node.a"], timeout=2.0) == 2
        assert time.monotonic() - started >= 0.25
        assert sorted(k for k, _ in bucket.puts) == ["node.a", "node.b"]
        assert await publisher.written_through(["node.nothing"], timeout=2.0) == 2  # nothing on its way


async def test_written_through_a_key_never_written_times_out():
    async with _gated_publisher(coalesce_seconds=0.0) as (publisher, bucket):
        publisher.offer(_node("a"))  # the gate stays shut: NATS does not take the write
        with pytest.raises(TimeoutError):
            await publisher.written_through(["node.a"], timeout=0.2)


async def test_written_through_a_deleted_claim_covers_its_purge(nats, subject_prefix):
    kv = await streams.cluster_bucket(nats.jetstream(), Subjects(prefix=subject_prefix))
    publisher = ClusterPublisher(instance="x", kinds=CLAIMS, coalesce_seconds=0.01)
    await publisher.load(kv)
    task = asyncio.create_task(publisher.run())
    try:
        claim = _claim("u1", allocated=True)
        publisher.offer(claim)
        key = cluster_feed.claim_key("u1")
        assert key == cluster_feed.key_of(claim)
        await publisher.revision_of([key], timeout=2.0)
        publisher.offer(claim, deleted=True)
        through = await publisher.written_through([key], timeout=2.0)
        purges = [e.revision for e in await streams.bucket_snapshot(kv) if e.key == key and e.operation == "PURGE"]
        assert purges and through >= purges[0]  # a shard whose view reaches it has the claim gone
        assert await publisher.revision_of([key], timeout=2.0) == 0  # what revision_of cannot say
    finally:
        task.cancel()

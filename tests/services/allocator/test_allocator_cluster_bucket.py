"""Shards know Kubernetes only through the binder's cluster bucket (draplane.scheduling.cluster_feed).

A restarted shard rebuilds its state from the bucket alone; a restarted binder brings the bucket
up to date (objects gone while no binder watched are deleted, unchanged ones are not rewritten);
leases lapse only up to the binder's last heartbeat."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from draplane.api.resource import ResourceClaim
from draplane.jetstream import streams
from draplane.scheduling import cluster_feed
from draplane.simulation import scenario
from draplane.scheduling import reservations as rv
from draplane.scheduling.messages import Subjects
from draplane_allocator.lease_pruner import PRUNE_INTERVAL_SECONDS
from draplane_allocator.shard import Shard
from draplane_binder.service import Binder
from conftest import ensure_class, lapsed_reservation  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration


async def _bucket_revision(kv, key: str) -> int | None:
    try:
        return (await kv.get(key)).revision
    except Exception:  # noqa: BLE001 - nats raises KeyNotFoundError or KeyDeletedError
        return None


async def test_a_restarted_shard_rebuilds_from_the_bucket_and_a_restarted_binder_sweeps_it(
        scheduling, kube, nats, namespace):
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"bucket-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 2, "80Gi")])
    await scheduling.start()
    for name in ("first", "second"):
        await kube.create(scenario.claim(namespace, name, class_name))
    await kube.create(scheduling.pod(namespace, "first", claim_name="first"))
    first = await scheduling.bound_pod(namespace, "first", timeout=60)
    first_claim = await kube.get(ResourceClaim, "first", namespace)
    kv = await streams.cluster_bucket(nats.jetstream(), Subjects(prefix=scheduling.prefix))

    async def bucket_has_the_bound_pod():
        return await _bucket_revision(kv, f"pod.{first.metadata.uid}") is not None
    await scheduling.wait_for(bucket_has_the_bound_pod, what="the bound pod in the cluster bucket")

    # a new shard in the old one's place: nothing but NATS to start from
    old = scheduling.shards[0]
    await old.stop()
    started = time.monotonic()
    shard = Shard(nats, index=0, prefix=scheduling.prefix, lease_seconds=30.0)
    scheduling.shards[0] = shard
    await shard.start()
    await shard.wait_ready(timeout=30)
    cold_start = time.monotonic() - started
    assert cold_start < 10, f"rebuilding from the bucket took {cold_start:.1f} s"
    assert first.metadata.uid in shard.view.pods
    assert shard.state.claims[first_claim.metadata.uid].status.allocation is not None
    assert shard.state.pods_on_node.get(node, {}).get(first.metadata.uid) is not None

    # the second pod gets the other device, placed by the new shard
    await kube.create(scheduling.pod(namespace, "second", claim_name="second"))
    await scheduling.bound_pod(namespace, "second", timeout=60)
    second_claim = await kube.get(ResourceClaim, "second", namespace)
    devices = {r.device for c in (first_claim, second_claim) for r in c.status.allocation.devices.results}
    assert len(devices) == 2, devices

    # the binder goes; the first pod goes while none watches; a new binder sweeps its key away
    node_revision = await _bucket_revision(kv, f"node.{node}")
    await scheduling.binder.stop()
    await kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/first", query={"gracePeriodSeconds": 0})
    binder = Binder(scheduling.binder.settings, kube, nats)
    scheduling.binder = binder
    await binder.start()
    await binder.wait_ready(timeout=30)

    async def swept():
        return first.metadata.uid not in shard.view.pods and \
            await _bucket_revision(kv, f"pod.{first.metadata.uid}") is None
    await scheduling.wait_for(swept, what="the gone pod's key deleted and the shard told")
    # what did not change is not written again
    assert await _bucket_revision(kv, f"node.{node}") == node_revision
    assert await _bucket_revision(kv, cluster_feed.SYNCED_KEY) is not None


async def test_no_lease_lapses_while_no_binder_is_heard(scheduling, kube, nats, namespace):
    """A lapsed reservation is released only when its claim is not allocated; with the binder gone
    quiet, the bucket may lack an allocation it wrote. So nothing lapses until a binder is heard
    again, and then the orphan goes."""
    node = f"quiet-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 1, "80Gi")])
    await scheduling.start()
    await scheduling.binder.stop()
    kv = await streams.reservation_bucket(nats.jetstream(), Subjects(prefix=scheduling.prefix))
    await kv.put(rv.node_key(node), rv.encode_entry(lapsed_reservation(node, namespace, "written-maybe")))

    async def reserved() -> bool:
        return "written-maybe" in rv.decode_entry((await kv.get(rv.node_key(node))).value, node).claims

    await asyncio.sleep(2 * PRUNE_INTERVAL_SECONDS + 1)
    assert await reserved(), "a lease lapsed while no binder was heard"

    binder = Binder(scheduling.binder.settings, kube, nats)
    scheduling.binder = binder
    await binder.start()

    async def released() -> bool:
        return not await reserved()
    await scheduling.wait_for(released, timeout=30, what="the orphan released once the binder is heard")

"""A PendingPod carries its pod's claims (issue 26): the shard places the pod without waiting for
the cluster bucket to hold the claims the binder has just seen, so the binder no longer hurries
their writes to every shard. Claims too large to carry travel by reference, as before, and the
shard waits for the bucket to hold them."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from draplane.api.resource import CELDeviceSelector, DeviceSelector
from draplane.scheduling.messages import MAX_CLAIM_SNAPSHOT_BYTES, PendingPod, Subjects, decode_message
from draplane.simulation import scenario
from draplane_allocator.shard import Shard
from conftest import ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration


def _large_claim(namespace: str, name: str, class_name: str):
    """A claim whose CEL selectors (each true, each under the apiserver's 10 Ki limit) together
    exceed what a PendingPod carries."""
    claim = scenario.claim(namespace, name, class_name)
    padding = "x" * 9000
    selectors = [DeviceSelector(cel=CELDeviceSelector(expression=f'"{padding}{i}".size() > 0'))
                 for i in range(MAX_CLAIM_SNAPSHOT_BYTES // 9000 + 1)]
    claim.spec.devices.requests[0].exactly.selectors = selectors
    return claim


async def test_claims_travel_in_the_pending_pod_unless_too_large(scheduling, kube, nats, namespace):
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"snap-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 2, "80Gi")])
    await scheduling.start()
    await scheduling.shards[0].stop()  # the PendingPods stay in the stream, to be read here
    binder = scheduling.binder

    js = nats.jetstream()
    subjects = Subjects(prefix=scheduling.prefix)

    async def sent(name: str, pod) -> PendingPod:
        uid = pod.metadata.uid

        async def published():
            flight = binder.pending.in_flight.get(uid)
            return flight is not None and flight.sequence is not None

        await scheduling.wait_for(published, what=f"pod {name}'s PendingPod to be published")
        raw = await js.get_msg(subjects.pending_stream, binder.pending.in_flight[uid].sequence)
        return decode_message(raw.data)

    small = await kube.create(scenario.claim(namespace, "small", class_name))
    carried = await sent("small", await kube.create(scheduling.pod(namespace, "small", claim_name="small")))
    assert [s.claim.metadata.uid for s in carried.claim_snapshots] == [small.metadata.uid]
    assert carried.claim_snapshots[0].claim.spec == small.spec
    assert carried.cluster_revision == 0  # nothing to wait for in the bucket

    large = await kube.create(_large_claim(namespace, "large", class_name))
    assert len(msgspec.msgpack.encode(large)) > MAX_CLAIM_SNAPSHOT_BYTES
    by_reference = await sent("large", await kube.create(scheduling.pod(namespace, "large", claim_name="large")))
    assert by_reference.claim_snapshots is None
    assert [c.uid for c in by_reference.claims] == [large.metadata.uid]
    assert by_reference.cluster_revision > 0  # the shard waits until the bucket holds the claim

    scheduling.shards[0] = fresh = Shard(nats, index=0, prefix=scheduling.prefix, lease_seconds=30.0)
    await fresh.start()
    await fresh.wait_ready()
    for name in ("small", "large"):
        bound = await scheduling.bound_pod(namespace, name)
        assert bound.spec.node_name == node

"""A pod deleted while its PendingPod waits in a shard's queue is never placed (issue 23, item 7).

Before, the shard placed it all the same: it took devices under a lease and published a Placement
that the binder then abandoned. Now the binder deletes the waiting message from the stream.
"""

from __future__ import annotations

import uuid

import pytest

from draplane.simulation import scenario
from draplane_allocator.shard import Shard
from conftest import ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration


async def test_a_pod_deleted_while_its_pending_pod_waits_is_never_placed(scheduling, kube, nats, namespace):
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"withdraw-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 2, "80Gi")])
    await scheduling.start()
    shard = scheduling.shards[0]
    await shard.stop()  # the queue now waits for a shard: the PendingPod stays in it
    binder = scheduling.binder

    await kube.create(scenario.claim(namespace, "gone", class_name))
    pod = await kube.create(scheduling.pod(namespace, "gone", claim_name="gone"))
    uid = pod.metadata.uid

    async def published():
        sent = binder.pending.in_flight.get(uid)
        return sent is not None and sent.sequence is not None

    await scheduling.wait_for(published, what="the pod's PendingPod to be published")
    withdrawn_before = binder.counters["pending_withdrawn"]
    await kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/gone", query={"gracePeriodSeconds": 0})

    async def deletion_handled():
        # the binder saw it go, and what it started then has finished
        return uid not in binder.pending.in_flight and not binder._one_offs

    await scheduling.wait_for(deletion_handled, what="the binder to see the pod deleted")

    # a shard that starts now sees only the pod that still exists
    await kube.create(scenario.claim(namespace, "kept", class_name))
    await kube.create(scheduling.pod(namespace, "kept", claim_name="kept"))
    scheduling.shards[0] = fresh = Shard(nats, index=0, prefix=scheduling.prefix, lease_seconds=30.0)
    placed_before = fresh.counters["placed"]
    await fresh.start()
    await fresh.wait_ready()
    await scheduling.bound_pod(namespace, "kept")
    assert fresh.counters["placed"] - placed_before == 1  # "kept" only: "gone" was never placed
    assert binder.counters["pending_withdrawn"] - withdrawn_before == 1


async def test_a_pending_pod_its_shard_took_already_is_left_to_the_shard_quietly(scheduling, kube, nats, namespace,
                                                                                  caplog):
    """JetStream answers 'no message found' (10057) for a message acknowledged already: the pod's
    placement, if any, is abandoned by the binder; nothing to warn about."""
    from draplane.scheduling.messages import Subjects
    from draplane_binder import in_flight as inf

    await scheduling.start()
    js = nats.jetstream()
    subjects = Subjects(prefix=scheduling.prefix)
    sequence = (await js.publish(subjects.pending(0), b"not a PendingPod")).seq  # the shard drops it at once

    async def taken():
        return (await js.stream_info(subjects.pending_stream)).state.messages == 0

    await scheduling.wait_for(taken, what="the shard to take the message")
    pod = scheduling.pod(namespace, "late")
    binder = scheduling.binder
    before = binder.counters["pending_withdrawn"]
    await binder.pending.withdraw_pending(pod, inf.InFlight(since=0.0, shard=0, sequence=sequence))
    assert binder.counters["pending_withdrawn"] == before
    assert not [r for r in caplog.records if r.name.startswith("draplane_binder") and r.levelname == "WARNING"
                and "late" in r.getMessage()]

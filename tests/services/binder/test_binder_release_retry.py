"""A pod waiting for a device is tried again when a claim's devices are released, and its shard
places it from a view that no longer holds the released claim.

The claim's change reaches the shards through the cluster bucket, which the binder writes in
rounds; the retry comes retry_flush_seconds after the release. A retry placed before the change
arrived found the device taken still and backed off again, longer, while a pod created after the
release took the device (tests/cli/test_demo.py, under CI's load). Here the rounds gather for 2 s,
so that without the wait the retry always comes first.
"""

from __future__ import annotations

import time
import uuid

import pytest

from draplane.api.core import Pod
from draplane.api.resource import ResourceClaim
from draplane.kube import KubeApiError
from draplane.simulation import scenario
from conftest import ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration


async def test_a_pod_retried_after_a_release_sees_the_device_free(scheduling, kube, namespace):
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"release-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 1, "80Gi")])
    await scheduling.start()
    binder, shard = scheduling.binder, scheduling.shards[0]

    await kube.create(scenario.claim(namespace, "first", class_name))
    await kube.create(scheduling.pod(namespace, "first", claim_name="first"))
    await scheduling.bound_pod(namespace, "first")

    # after its first failure the waiting pod is tried again only when something wakes it
    binder.pending.backoff.initial = binder.pending.backoff.maximum = 120.0
    await kube.create(scenario.claim(namespace, "second", class_name))
    second = await kube.create(scheduling.pod(namespace, "second", claim_name="second"))

    async def told_unschedulable():
        return second.metadata.uid in binder.pending.backoff and shard.counters["unschedulable"] >= 1

    await scheduling.wait_for(told_unschedulable, what="the second pod to be found unschedulable")
    failures = shard.counters["unschedulable"]

    binder.publisher.coalesce_seconds = 2.0  # the released claim's change lands well after the retry is due
    released_before = binder.counters["claims_released"]
    await kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/first", query={"gracePeriodSeconds": 0})
    await kube.delete(ResourceClaim, "first", namespace)
    started = time.monotonic()

    async def released():
        return binder.counters["claims_released"] > released_before

    await scheduling.wait_for(released, what="the first claim's devices to be released")
    bound = await scheduling.bound_pod(namespace, "second", timeout=30)
    assert bound.spec.node_name == node
    assert time.monotonic() - started < 30  # its own backoff (120 s) never came
    assert shard.counters["unschedulable"] == failures  # the retry was placed at its first try
    assert binder.pending.released_through > 0

    try:
        await kube.get(Pod, "first", namespace)
        raise AssertionError("the first pod is still there")
    except KubeApiError as exc:
        assert exc.is_not_found

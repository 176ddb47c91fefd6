"""A pod waiting out a backoff is woken when what it waits for changes (a claim's devices released,
its node's taint lifted), and its shard places it from a view that holds that change.

The change reaches the shards through the cluster bucket, which the binder writes in rounds; the
retry comes retry_flush_seconds after the binder saw it. A retry placed before the change arrived
found the device taken (or the node tainted) still and backed off again, longer, while a pod
created after took the device (tests/cli/test_demo.py, under CI's load). Here the rounds gather
for 2 s, so that without the wait the retry always comes first.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

import pytest

from draplane.api.core import Node
from draplane.api.resource import ResourceClaim
from draplane.simulation import scenario
from conftest import ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration

SLOW_ROUNDS_SECONDS = 2.0
NEVER_SECONDS = 120.0  # a backoff the test never waits out


async def _one_gpu_node(scheduling, kube, namespace: str) -> tuple[str, str]:
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"woken-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 1, "80Gi")])
    await scheduling.start()
    return class_name, node


async def _bound_at_its_first_retry(scheduling, kube, namespace: str, class_name: str, node: str,
                                    wake: Callable[[], Awaitable[None]]) -> None:
    """Pod `waiting` is found unschedulable once; `wake` changes what it waits for while the bucket's
    rounds gather slowly; it is then bound at its first retry, long before its own backoff."""
    binder, shard = scheduling.binder, scheduling.shards[0]
    binder.pending.backoff.initial = binder.pending.backoff.maximum = NEVER_SECONDS
    await kube.create(scenario.claim(namespace, "waiting", class_name))
    waiting = await kube.create(scheduling.pod(namespace, "waiting", claim_name="waiting"))

    async def told_unschedulable():
        return waiting.metadata.uid in binder.pending.backoff and shard.counters["unschedulable"] >= 1

    await scheduling.wait_for(told_unschedulable, what="the waiting pod to be found unschedulable")
    failures = shard.counters["unschedulable"]

    binder.publisher.coalesce_seconds = SLOW_ROUNDS_SECONDS
    started = time.monotonic()
    await wake()
    bound = await scheduling.bound_pod(namespace, "waiting", timeout=30)
    assert bound.spec.node_name == node
    assert time.monotonic() - started < NEVER_SECONDS
    assert shard.counters["unschedulable"] == failures  # placed at its first retry
    assert binder.pending.woken_through > 0


async def test_a_pod_retried_after_a_release_sees_the_device_free(scheduling, kube, namespace):
    class_name, node = await _one_gpu_node(scheduling, kube, namespace)
    await kube.create(scenario.claim(namespace, "first", class_name))
    await kube.create(scheduling.pod(namespace, "first", claim_name="first"))
    await scheduling.bound_pod(namespace, "first")

    async def release() -> None:
        released_before = scheduling.binder.counters["claims_released"]
        await kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/first", query={"gracePeriodSeconds": 0})
        await kube.delete(ResourceClaim, "first", namespace)

        async def released():
            return scheduling.binder.counters["claims_released"] > released_before

        await scheduling.wait_for(released, what="the first claim's devices to be released")

    await _bound_at_its_first_retry(scheduling, kube, namespace, class_name, node, release)


async def test_a_pod_retried_after_its_nodes_taint_went_sees_the_node_untainted(scheduling, kube, namespace):
    class_name, node = await _one_gpu_node(scheduling, kube, namespace)
    await kube.patch(Node, node, {"spec": {"taints": [{"key": "example.com/maintenance", "effect": "NoSchedule"}]}})

    async def shard_sees_the_taint():
        seen = scheduling.shards[0].state.nodes.get(node)
        return seen is not None and seen.spec is not None and bool(seen.spec.taints)

    await scheduling.wait_for(shard_sees_the_taint, what="the shard to see the node's taint")

    async def lift_the_taint() -> None:
        await kube.patch(Node, node, {"spec": {"taints": None}})

    await _bound_at_its_first_retry(scheduling, kube, namespace, class_name, node, lift_the_taint)

"""4 shards, more pods than devices: no device twice, every pod bound or explained.

The issue asks for 1,000 pods; on the shared 2-core machine the suite runs DRAPLANE_CONTENTION_PODS
(default 300) against a quarter as many devices; the full 1,000 was run
by hand (see the commit message for the figures).
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from draplane.simulation import scenario
from conftest import audit, create_many, ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration

PODS = int(os.environ.get("DRAPLANE_CONTENTION_PODS", "300"))
NODES = 10
GPUS_PER_NODE = max(1, PODS // 40)  # 10 nodes x (pods/40) = a quarter as many devices as pods


@pytest.mark.parametrize("following", ["one connection", "paced"])
async def test_four_shards_never_give_a_device_twice(scheduling, kube, namespace, follow_nats, following):
    if following == "paced":  # each shard's view of the others' reservations up to a pace behind
        scheduling.follow_nats = follow_nats
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    suffix = namespace[-6:]
    for i in range(NODES):
        name = f"cont-{i}-{suffix}"
        await scheduling.put_node(scenario.gpu_node(name), [scenario.gpu_slice(name, GPUS_PER_NODE, "80Gi")])
    devices = NODES * GPUS_PER_NODE
    await scheduling.start(shards=4)
    await kube.create(scenario.claim_template(namespace, "one-gpu", class_name))

    started = time.monotonic()
    await create_many(kube, [scheduling.pod(namespace, f"p-{i:04d}", template_name="one-gpu") for i in range(PODS)])

    async def settled():
        result = await audit(kube, namespace)
        done = len(result["bound"]) == devices and len(result["explained"]) == PODS - devices
        return result if done else None

    # a full audit lists every pod and claim: poll less often for big runs
    result = await scheduling.wait_for(settled, timeout=60 + PODS * 0.5, what="every pod bound or explained",
                                       interval=max(0.1, PODS / 500))
    elapsed = time.monotonic() - started
    print(f"\ncontention: {PODS} pods, {devices} devices, 4 shards: settled in {elapsed:.1f}s; "
          f"{scheduling.diagnostics()}")
    assert result["duplicates"] == []
    assert len(result["bound"]) == devices
    assert len(result["devices"]) == devices
    assert result["bound_without_claim"] == []
    for pod in result["explained"]:
        condition = next(c for c in pod.status.conditions if c.type == "PodScheduled")
        assert condition.reason == "Unschedulable"
        assert "capacity exhausted" in condition.message, condition.message
    # every shard did part of the work
    assert all(s.counters["placed"] + s.counters["unschedulable"] > 0 for s in scheduling.shards)

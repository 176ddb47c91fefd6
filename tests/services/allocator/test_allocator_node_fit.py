"""Node fit across shards: 4 shards, plenty of devices, too little CPU. No node is over-committed.

Each shard keeps its own view of the pods on a node; without the pod reservations in the node's
bucket entry, two shards could each see room for one more pod on the same node and both place it.
"""

from __future__ import annotations

import uuid

import pytest

from draplane.component_helpers.resource import pod_requests
from draplane.simulation import scenario
from conftest import audit, create_many, ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration

NODES = 5
CPUS_PER_NODE = 4
PODS = 60  # one CPU each: 20 fit, 40 must be explained


async def test_four_shards_never_overcommit_a_node_cpu(scheduling, kube, namespace):
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    suffix = namespace[-6:]
    for i in range(NODES):
        name = f"fit-{i}-{suffix}"
        await scheduling.put_node(scenario.gpu_node(name, cpu=str(CPUS_PER_NODE)),
                                  [scenario.gpu_slice(name, 16, "80Gi")])
    await scheduling.start(shards=4)
    await kube.create(scenario.claim_template(namespace, "one-gpu", class_name))
    await create_many(kube, [scheduling.pod(namespace, f"p-{i:03d}", template_name="one-gpu", cpu="1")
                             for i in range(PODS)])
    fitting = NODES * CPUS_PER_NODE

    async def settled():
        result = await audit(kube, namespace)
        done = len(result["bound"]) == fitting and len(result["explained"]) == PODS - fitting
        return result if done else None

    result = await scheduling.wait_for(settled, timeout=120, what="every pod bound or explained", interval=0.3)
    cpu_by_node: dict[str, int] = {}
    for pod in result["bound"]:
        cpu_by_node[pod.spec.node_name] = cpu_by_node.get(pod.spec.node_name, 0) + pod_requests(pod)["cpu"]
    assert all(used <= CPUS_PER_NODE * 1000 for used in cpu_by_node.values()), cpu_by_node
    assert result["duplicates"] == [] and result["bound_without_claim"] == []
    for pod in result["explained"]:
        condition = next(c for c in pod.status.conditions if c.type == "PodScheduled")
        assert "Insufficient cpu" in condition.message, condition.message
    assert all(s.counters["placed"] + s.counters["unschedulable"] > 0 for s in scheduling.shards)

"""A reservation whose placement never reached Kubernetes is released when its lease runs out."""

from __future__ import annotations

import time
import uuid

import pytest

from draplane.api.meta import NodeSelector, NodeSelectorRequirement, NodeSelectorTerm
from draplane.api.resource import AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult
from draplane.scheduling import reservations as rv
from draplane.scheduling import scenario, streams
from draplane.scheduling.messages import Subjects
from conftest import ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration


async def test_an_orphaned_reservation_is_released_after_its_lease(scheduling, kube, nats, namespace):
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"lease-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 1, "80Gi")])

    # what a shard that died right after its commit leaves: the only GPU reserved for a claim that
    # will never be written, with a lease that has just run out
    kv = await streams.reservation_bucket(nats.jetstream(), Subjects(prefix=scheduling.prefix))
    allocation = AllocationResult(
        devices=DeviceAllocationResult(results=[DeviceRequestAllocationResult(
            request="gpu", driver=scenario.GPU_DRIVER, pool=node, device="gpu-0")]),
        node_selector=NodeSelector(node_selector_terms=[NodeSelectorTerm(match_fields=[
            NodeSelectorRequirement(key="metadata.name", operator="In", values=[node])])]),
    )
    orphan = rv.Reservation(
        claim_uid="never-written", claim_namespace=namespace, claim_name="ghost", pod_uid="ghost-pod",
        devices=rv.devices_of(allocation), allocation=allocation,
        reserved_at=time.time() - 60, expires_at=time.time() - 1,
    )
    await kv.put(rv.node_key(node), rv.encode_entry(rv.add(rv.NodeReservations(node=node), [orphan])))

    await scheduling.start()
    await kube.create(scenario.claim(namespace, "mine", class_name))
    await kube.create(scheduling.pod(namespace, "mine", claim_name="mine"))
    bound = await scheduling.bound_pod(namespace, "mine", timeout=30)
    assert bound.spec.node_name == node
    entry = rv.decode_entry((await kv.get(rv.node_key(node))).value, node)
    assert "never-written" not in entry.claims

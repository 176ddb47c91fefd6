"""A reservation whose placement never reached Kubernetes is released when its lease runs out."""

from __future__ import annotations

import uuid

import pytest

from draplane.scheduling import reservations as rv
from draplane.jetstream import streams
from draplane.simulation import scenario
from draplane.scheduling.messages import Subjects
from conftest import ensure_class, lapsed_reservation  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration


async def test_an_orphaned_reservation_is_released_after_its_lease(scheduling, kube, nats, namespace):
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"lease-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 1, "80Gi")])

    kv = await streams.reservation_bucket(nats.jetstream(), Subjects(prefix=scheduling.prefix))
    await kv.put(rv.node_key(node), rv.encode_entry(lapsed_reservation(node, namespace, "never-written")))

    await scheduling.start()
    await kube.create(scenario.claim(namespace, "mine", class_name))
    await kube.create(scheduling.pod(namespace, "mine", claim_name="mine"))
    bound = await scheduling.bound_pod(namespace, "mine", timeout=30)
    assert bound.spec.node_name == node
    entry = rv.decode_entry((await kv.get(rv.node_key(node))).value, node)
    assert "never-written" not in entry.claims

"""A claim deleted while no binder runs: its confirmed reservation is released when the binder starts.

Before reconcile_reservations the devices stayed reserved for ever: nobody but the binder releases a
confirmed reservation, and it only did so on the watch event of the claim's deletion, which a binder
that is down never sees (found by the protocol model, tests/shared/scheduling/test_reservation_protocol.py).
"""

from __future__ import annotations

import uuid

import pytest

from draplane.api.resource import ResourceClaim
from draplane.kube import KubeApiError
from draplane.scheduling import reservations as rv
from draplane.jetstream import streams
from draplane.simulation import scenario
from draplane.scheduling.messages import Subjects
from draplane_binder.service import Binder
from conftest import ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration


async def test_a_claim_deleted_while_the_binder_is_down_frees_its_devices_when_it_starts(scheduling, kube, nats,
                                                                                          namespace):
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"reconcile-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 1, "80Gi")])
    await scheduling.start()
    kv = await streams.reservation_bucket(nats.jetstream(), Subjects(prefix=scheduling.prefix))

    async def entry() -> rv.NodeReservations:
        try:
            return rv.decode_entry((await kv.get(rv.node_key(node))).value, node)
        except Exception:  # noqa: BLE001 - not written yet
            return rv.NodeReservations(node=node)

    claim = await kube.create(scenario.claim(namespace, "first", class_name))
    await kube.create(scheduling.pod(namespace, "first", claim_name="first"))
    await scheduling.bound_pod(namespace, "first")
    uid = claim.metadata.uid

    async def confirmed():
        reservation = (await entry()).claims.get(uid)
        return reservation is not None and reservation.confirmed

    await scheduling.wait_for(confirmed, what="the claim's reservation to be confirmed")

    settings = scheduling.binder.settings
    await scheduling.binder.stop()
    # no kubelet runs here to finish a graceful deletion; kube-controller-manager then takes the
    # pod out of the claim's reservedFor and deallocates it, and the claim's deletion completes
    await kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/first", query={"gracePeriodSeconds": 0})
    await kube.delete(ResourceClaim, "first", namespace)

    async def claim_gone():
        try:
            await kube.get(ResourceClaim, "first", namespace)
            return False
        except KubeApiError as exc:
            return exc.is_not_found

    await scheduling.wait_for(claim_gone, timeout=60, what="the claim to be deleted")
    # nobody else releases a confirmed reservation: the shard's lease pruning leaves it alone
    assert (await entry()).claims[uid].confirmed

    # a pod waiting for the only GPU
    await kube.create(scenario.claim(namespace, "second", class_name))
    await kube.create(scheduling.pod(namespace, "second", claim_name="second"))

    scheduling.binder = Binder(settings, kube, nats)
    await scheduling.binder.start()
    await scheduling.binder.wait_ready()

    async def released():
        return uid not in (await entry()).claims

    await scheduling.wait_for(released, what="the deleted claim's reservation to be released")
    second = await scheduling.bound_pod(namespace, "second", timeout=60)
    assert second.spec.node_name == node
    assert scheduling.binder.counters["claims_released"] >= 1

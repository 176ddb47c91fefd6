"""A placement that cannot complete is undone: reservedFor entries taken back, reservations released."""

from __future__ import annotations

import time
import uuid

import pytest

from draplane.api.core import Pod
from draplane.api.resource import ResourceClaim
from draplane.scheduling import reservations as rv
from draplane.scheduling.messages import ClaimPlacement, ClaimRef, Placement, PodRef
from draplane.scheduling.placing import SchedulingState
from draplane.simulation import scenario
from conftest import ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration


async def test_failed_placement_undoes_reserved_for_and_releases(scheduling, kube, namespace):
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"undo-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 2, "80Gi")])
    await scheduling.start()
    # "taken" is placed by draplane on one GPU
    await kube.create(scenario.claim(namespace, "taken", class_name))
    await kube.create(scheduling.pod(namespace, "first", claim_name="taken"))
    await scheduling.bound_pod(namespace, "first")
    taken = await kube.get(ResourceClaim, "taken", namespace)

    # a pod nobody schedules, and a placement for it that asks for "free" on the other GPU and for
    # "taken" with other devices: the second claim fails after the first was written
    free = await kube.create(scenario.claim(namespace, "free", class_name))
    pod = await kube.create(scenario.pod(namespace, "second", claim_name="free", scheduler_name="nobody"))
    other_gpu = "gpu-1" if taken.status.allocation.devices.results[0].device == "gpu-0" else "gpu-0"
    state = SchedulingState()
    state.set_class(scenario.device_class(class_name))
    state.set_node(scenario.gpu_node(node))
    state.set_feed_entry(node, [scenario.gpu_slice(node, 2, "80Gi")])
    state.set_claim(taken)
    placed = state.place_pod(pod, [free])
    assert placed.allocations[free.metadata.uid].devices.results[0].device == other_gpu
    wrong_for_taken = placed.allocations[free.metadata.uid]
    store = scheduling.binder.reservations.store
    revision, entry = await store.refresh(node)
    reservation = rv.Reservation(
        claim_uid=free.metadata.uid, claim_namespace=namespace, claim_name="free", pod_uid=pod.metadata.uid,
        devices=rv.devices_of(wrong_for_taken), allocation=wrong_for_taken,
        reserved_at=time.time(), expires_at=time.time() + 30,
    )
    await store.write(node, rv.add(entry, [reservation]), revision)
    placement = Placement(
        pod=PodRef(namespace=namespace, name="second", uid=pod.metadata.uid),
        node=node,
        claims=[
            ClaimPlacement(claim=ClaimRef(namespace=namespace, name="free", uid=free.metadata.uid), allocation=wrong_for_taken),
            ClaimPlacement(claim=ClaimRef(namespace=namespace, name="taken", uid=taken.metadata.uid), allocation=wrong_for_taken),
        ],
        shard=0, first_seen=time.time(), expires_at=time.time() + 30,
    )
    assert await scheduling.binder.writer.write_placement(placement) is False

    free_now = await kube.get(ResourceClaim, "free", namespace)
    assert free_now.status is None or (free_now.status.allocation is None and not free_now.status.reserved_for)
    taken_now = await kube.get(ResourceClaim, "taken", namespace)
    assert taken_now.status.allocation == taken.status.allocation  # untouched
    assert not (await kube.get(Pod, "second", namespace)).spec.node_name
    _, entry = await store.refresh(node)
    assert free.metadata.uid not in entry.claims


async def test_a_placement_delivered_again_for_a_bound_pod_binds_nothing_and_says_so(scheduling, kube, namespace,
                                                                                   caplog):
    """A restarted shard republishes what its reservations hold: the binder checks and renews, and
    neither binds again nor logs a second "bound to node" (issue 27: six such doubled lines)."""
    import logging

    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"again-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 1, "80Gi")])
    await scheduling.start()
    await kube.create(scenario.claim(namespace, "mine", class_name))
    pod = await kube.create(scheduling.pod(namespace, "once", claim_name="mine"))
    await scheduling.bound_pod(namespace, "once")
    claim = await kube.get(ResourceClaim, "mine", namespace)
    bound_before = scheduling.binder.counters["pods_bound"]
    placement = Placement(
        pod=PodRef(namespace=namespace, name="once", uid=pod.metadata.uid), node=node,
        claims=[ClaimPlacement(claim=ClaimRef(namespace=namespace, name="mine", uid=claim.metadata.uid),
                               allocation=claim.status.allocation)],
        shard=0, first_seen=time.time(), expires_at=time.time() + 30,
    )
    with caplog.at_level(logging.INFO, logger="draplane_binder"):
        assert await scheduling.binder.writer.write_placement(placement) is True
    lines = [r.getMessage() for r in caplog.records if f"{namespace}/once" in r.getMessage()]
    assert any("was already bound to node" in line and "nothing rebound" in line for line in lines), lines
    assert not any(" bound to node " in line and "already" not in line for line in lines), lines
    assert scheduling.binder.counters["pods_bound"] == bound_before
    assert (await kube.get(Pod, "once", namespace)).spec.node_name == node

"""What the inventory adds for readers of NATS alone: DeviceClasses in the feed, and audit events
for a node whose agent stops heartbeating (tainted, withdrawn, back)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import nats as nats_py
import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import KeyNotFoundError

from draplane.api.core import Node
from draplane.api.meta import ObjectMeta
from draplane.api.resource import DeviceClass
from draplane.messages import audit
from draplane.messages.inventory import InventoryNames, decode_feed_entry
from draplane.simulation import scenario
from draplane_inventory.service import InventoryService, InventorySettings
from draplane.nodes.slices import STALE_TAINT_KEY
from draplane_node_agent.agent import AgentFleet, SimulatedAgent
from draplane.nodes.hardware import driver_devices
from draplane.nodes.profile import load_profile, profile_hardware

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@contextlib.asynccontextmanager
async def running_inventory(kube, url: str, prefix: str, **settings):
    connection = await nats_py.connect(url, name="inventory-under-test", max_reconnect_attempts=-1)
    service = InventoryService(kube, connection, InventorySettings(prefix=prefix, instance=f"inv-{uuid.uuid4().hex[:6]}",
                                                                   **settings))
    await service.start()
    try:
        yield service
    finally:
        await service.stop()
        await asyncio.wait_for(connection.close(), 10)


async def eventually(check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (result := await check()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.2)
    return result


async def test_device_classes_are_in_the_feed(kube, control_plane, subject_prefix):
    name = f"feed-class-{uuid.uuid4().hex[:6]}"
    async with running_inventory(kube, control_plane.nats_url, subject_prefix) as service:
        await kube.create(scenario.device_class(name))
        key = InventoryNames.class_key(name)

        async def published():
            try:
                return decode_feed_entry((await service.kv.get(key)).value)
            except KeyNotFoundError:
                return None

        entry = await eventually(published)
        assert entry.device_class.metadata.name == name and entry.slices == []
        assert entry.device_class.spec == scenario.device_class(name).spec
        await kube.delete(DeviceClass, name)

        async def gone():
            return await published() is None

        await eventually(gone)


async def test_a_silent_node_is_tainted_withdrawn_and_back_in_the_audit_stream(kube, nats, control_plane, subject_prefix):
    node = f"audited-{uuid.uuid4().hex[:6]}"
    await kube.create(Node(metadata=ObjectMeta(name=node)))
    devices = driver_devices(profile_hardware(load_profile("l4"), node))
    names = audit.AuditNames(prefix=subject_prefix)

    def fleet():
        return AgentFleet(control_plane.nats_url, [SimulatedAgent(node, lambda: devices)],
                          names=InventoryNames(subject_prefix), heartbeat_interval=0.3)

    async with running_inventory(kube, control_plane.nats_url, subject_prefix,
                                 taint_after=1.5, remove_after=4.0, check_interval=0.2):
        agents = fleet()
        await agents.start()
        await asyncio.sleep(1.0)
        await agents.stop()  # silent from here on

        sub = await nats.jetstream().subscribe(names.wildcard, stream=names.stream, ordered_consumer=True)
        events = []

        async def seen(*kinds):
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except NatsTimeout:
                    break
                events.append(audit.decode_event(msg.data))
            return [e.kind for e in events] == list(kinds)

        await eventually(lambda: seen("tainted", "removed"))
        agents = fleet()
        await agents.start()
        try:
            await eventually(lambda: seen("tainted", "removed", "untainted"))
        finally:
            await agents.stop()
        await sub.unsubscribe()
    tainted, removed, back = events
    gpus = sorted(d.name for d in devices[0].devices)
    assert sorted(d.device for d in tainted.devices) == gpus and tainted.device_count == len(gpus)
    assert {d.pool for d in tainted.devices} == {node} and tainted.node == node
    assert f"{STALE_TAINT_KEY}=true:NoSchedule" in tainted.reason
    assert "deleted" in removed.reason and "heartbeating again" in back.reason
    assert len({tainted.id, removed.id, back.id}) == 3

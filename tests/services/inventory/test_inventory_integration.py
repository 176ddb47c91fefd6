"""The inventory data path on real servers: node agents -> NATS JetStream -> inventory -> kube-apiserver."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import msgspec
import nats as nats_py
import pytest

from draplane.api.core import Node
from draplane.api.meta import ObjectMeta
from draplane.api.resource import ResourceSlice
from draplane.messages.inventory import (
    SCHEMA_VERSION,
    Heartbeat,
    InventoryNames,
    MAX_MESSAGE_BYTES,
    NodeSnapshot,
    decode_feed_entry,
    encode,
)
from draplane.metrics import sample_value
from draplane_inventory.service import InventoryService, InventorySettings
from draplane.nodes.slices import STALE_TAINT_KEY, NodeRef, is_managed, plan_pool
from draplane_node_agent.agent import AgentFleet, SimulatedAgent
from draplane.nodes.hardware import driver_devices
from draplane.nodes.profile import load_profile

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def count(service: InventoryService, name: str, **labels: str) -> float:
    """One of the service's metrics (draplane_inventory_<name>), summed over other labels."""
    return sample_value(service.metrics.registry, f"draplane_inventory_{name}", **labels)


async def create_nodes(kube, names: list[str]) -> dict[str, str]:
    uids = {}
    for name in names:
        node = await kube.create(Node(metadata=ObjectMeta(name=name)))
        uids[name] = node.metadata.uid
    return uids


def profile_agent(profile: str, node: str) -> SimulatedAgent:
    devices = driver_devices(load_profile(profile).hardware(node))
    return SimulatedAgent(node, lambda: devices)


async def node_slices(kube, node: str) -> list[ResourceSlice]:
    items, _ = await kube.list(ResourceSlice, field_selector=f"spec.nodeName={node}")
    return sorted(items, key=lambda s: s.metadata.name)


async def eventually(check, timeout: float = 30.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = await check()
            if result:
                return result
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def running_inventory(kube, url: str, prefix: str, instance: str, **settings):
    connection = await nats_py.connect(url, name="inventory-under-test", max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    service = InventoryService(kube, connection, InventorySettings(prefix=prefix, instance=instance, **settings))
    await service.start()
    try:
        yield service
    finally:
        await service.stop()
        await asyncio.wait_for(connection.close(), 10)


@contextlib.asynccontextmanager
async def running_fleet(url: str, prefix: str, agents: list[SimulatedAgent], **kw):
    fleet = AgentFleet(url, agents, names=InventoryNames(prefix), **kw)
    await fleet.start()
    try:
        yield fleet
    finally:
        await fleet.stop()


def _devices_by_driver(slices: list[ResourceSlice]) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in slices:
        out.setdefault(s.spec.driver, []).extend(s.spec.devices or [])
    return out


async def test_three_profile_agents_become_valid_slices(kube, control_plane, subject_prefix):
    suffix = uuid.uuid4().hex[:6]
    nodes = {f"dgx-{suffix}": "dgx-h100", f"mig-{suffix}": "a100-mig", f"l4-{suffix}": "l4"}
    uids = await create_nodes(kube, list(nodes))
    instance = f"inv-{suffix}"
    async with running_inventory(kube, control_plane.nats_url, subject_prefix, instance) as service, \
            running_fleet(control_plane.nats_url, subject_prefix, [profile_agent(p, n) for n, p in nodes.items()]) as fleet:
        await fleet.wait_all_sent()

        async def all_written():
            for node in nodes:
                if not await node_slices(kube, node):
                    return False
            return True

        await eventually(all_written)
        await service.wait_idle()
        for node, profile in nodes.items():
            slices = await node_slices(kube, node)
            expected = {d.driver: d for d in driver_devices(load_profile(profile).hardware(node))}
            got = _devices_by_driver(slices)
            assert set(got) == set(expected)
            for driver, entry in expected.items():
                assert {d.name: d for d in got[driver]} == {d.name: d for d in entry.devices}
                pool = [s for s in slices if s.spec.driver == driver]
                assert {s.spec.pool.resource_slice_count for s in pool} == {len(pool)}
                assert {s.spec.pool.generation for s in pool} == {1}
                counters = [cs for s in pool for cs in (s.spec.shared_counters or [])]
                assert counters == entry.counter_sets
                for s in pool:
                    assert not (s.spec.shared_counters and s.spec.devices)
                    assert s.metadata.owner_references[0].uid == uids[node]
                    assert s.spec.node_name == node and s.spec.pool.name == node
        mig = await node_slices(kube, f"mig-{suffix}")
        assert [len(s.spec.devices or []) for s in mig] == [0, 64, 56]
        # The feed carries the same slices, keyed by node.
        entry = decode_feed_entry((await service.kv.get(InventoryNames.node_key(f"dgx-{suffix}"))).value)
        assert entry.schema_version == SCHEMA_VERSION and len(entry.slices) == 2 and not entry.stale
        assert all(s.metadata.managed_fields is None and s.metadata.resource_version for s in entry.slices)
        # Nothing changes, nothing is written: heartbeats alone make no apiserver writes.
        writes = count(service, "slice_writes_total")
        assert writes == sum([len(await node_slices(kube, n)) for n in nodes])  # one write per slice
        await fleet.rescan()
        await asyncio.sleep(1.0)
        await service.wait_idle()
        assert count(service, "slice_writes_total") == writes


async def test_profile_change_bumps_generation(kube, control_plane, subject_prefix, tmp_path):
    node = f"change-{uuid.uuid4().hex[:6]}"
    await create_nodes(kube, [node])
    hardware = {"profile": "dgx-h100"}
    agent = SimulatedAgent(node, lambda: driver_devices(load_profile(hardware["profile"]).hardware(node)))
    async with running_inventory(kube, control_plane.nats_url, subject_prefix, f"inv-{node}") as service, \
            running_fleet(control_plane.nats_url, subject_prefix, [agent]) as fleet:
        await eventually(lambda: _has_generation(kube, node, "gpu.nvidia.com", 1, 8))
        hardware["profile"] = "mixed"
        assert await fleet.rescan() == 1
        await eventually(lambda: _has_generation(kube, node, "gpu.nvidia.com", 2, 26))
        slices = await node_slices(kube, node)
        gpu = [s for s in slices if s.spec.driver == "gpu.nvidia.com"]
        assert {s.spec.pool.generation for s in gpu} == {2}
        assert {s.spec.pool.resource_slice_count for s in gpu} == {len(gpu)}
        net = [s for s in slices if s.spec.driver == "dra.net"]
        assert len(net[0].spec.devices) == 2 and net[0].spec.pool.generation == 2
        await service.wait_idle()


async def _has_generation(kube, node, driver, generation, devices):
    pool = [s for s in await node_slices(kube, node) if s.spec.driver == driver]
    return (
        pool
        and {s.spec.pool.generation for s in pool} == {generation}
        and sum(len(s.spec.devices or []) for s in pool) == devices
        and len(pool) == pool[0].spec.pool.resource_slice_count
    )


async def test_killed_agent_is_tainted_then_removed(kube, control_plane, subject_prefix):
    node = f"dies-{uuid.uuid4().hex[:6]}"
    await create_nodes(kube, [node])
    async with running_inventory(kube, control_plane.nats_url, subject_prefix, f"inv-{node}",
                                 taint_after=1.5, remove_after=4.0, check_interval=0.2) as service:
        async with running_fleet(control_plane.nats_url, subject_prefix, [profile_agent("l4", node)],
                                 heartbeat_interval=0.3) as fleet:
            await eventually(lambda: node_slices(kube, node))
            await asyncio.sleep(2.0)  # heartbeats keep it fresh past the taint period
            (s,) = await node_slices(kube, node)
            assert not any(d.taints for d in s.spec.devices)
        # The fleet is gone: no more heartbeats.

        async def tainted():
            slices = await node_slices(kube, node)
            return slices and all(
                any(t.key == STALE_TAINT_KEY and t.effect == "NoSchedule" for t in d.taints or [])
                for s in slices for d in s.spec.devices
            )

        await eventually(tainted, timeout=10)
        (s,) = await node_slices(kube, node)
        assert s.spec.pool.generation == 2
        await eventually(lambda: _feed_stale(service, node))

        async def removed():
            return not await node_slices(kube, node)

        await eventually(removed, timeout=10)
        assert count(service, "stale_transitions_total", to="tainted") == 1
        assert count(service, "stale_transitions_total", to="removed") == 1

        # The agent comes back: its devices come back, untainted, with a generation never used before.
        async with running_fleet(control_plane.nats_url, subject_prefix, [profile_agent("l4", node)],
                                 heartbeat_interval=0.3):
            await eventually(lambda: node_slices(kube, node))
            (s,) = await node_slices(kube, node)
            assert not any(d.taints for d in s.spec.devices)
            assert s.spec.pool.generation == 3


async def _feed_stale(service, node):
    entry = decode_feed_entry((await service.kv.get(InventoryNames.node_key(node))).value)
    return entry.stale


@pytest.mark.parametrize(
    "case",
    ["malformed", "oversized", "wrong-version", "wrong-node-snapshot", "wrong-node-heartbeat", "invalid-devices"],
)
async def test_bad_messages_are_rejected_logged_and_counted(kube, control_plane, subject_prefix, nats, caplog, case):
    node = f"bad-{uuid.uuid4().hex[:6]}"
    await create_nodes(kube, [node])
    names = InventoryNames(subject_prefix)
    good = NodeSnapshot(schema_version=SCHEMA_VERSION, node=node, agent_id="a", sequence=1, sent_at=time.time(),
                        drivers=driver_devices(load_profile("l4").hardware(node)))
    js = nats.jetstream()
    reason = {"malformed": "malformed", "oversized": "oversized", "wrong-version": "version",
              "invalid-devices": "invalid"}.get(case, "node-mismatch")
    async with running_inventory(kube, control_plane.nats_url, subject_prefix, f"inv-{node}") as service:
        caplog.set_level(logging.WARNING, logger="draplane_inventory.service")
        if case == "malformed":
            await js.publish(names.snapshot_subject(node), b"\x93not-a-snapshot")
        elif case == "oversized":
            await js.publish(names.snapshot_subject(node), b"\x00" * (MAX_MESSAGE_BYTES + 10))
        elif case == "wrong-version":
            await js.publish(names.snapshot_subject(node), encode(msgspec.structs.replace(good, schema_version=SCHEMA_VERSION + 1)))
        elif case == "invalid-devices":  # slices the apiserver would refuse: once retried for ever
            bad = msgspec.structs.replace(good.drivers[0], devices=[msgspec.structs.replace(good.drivers[0].devices[0],
                                                                                            name="GPU_0")])
            await js.publish(names.snapshot_subject(node), encode(msgspec.structs.replace(good, drivers=[bad])))
        elif case == "wrong-node-snapshot":
            await js.publish(names.snapshot_subject(node), encode(msgspec.structs.replace(good, node="someone-else")))
        else:
            hb = Heartbeat(schema_version=SCHEMA_VERSION, node="someone-else", agent_id="a", sequence=2, sent_at=time.time(),
                           snapshot_sequence=1, snapshot_digest="x")
            # Heartbeats are core NATS, at most once, as agents send them (one every few seconds):
            # sent again until one is counted. A single one once never arrived in a full CI run.
            for _ in range(6):
                await nats.publish(names.heartbeat_subject(node), encode(hb))
                await nats.flush(timeout=5)
                try:
                    await eventually(lambda: _async(count(service, "messages_rejected_total", reason=reason) >= 1),
                                     timeout=5)
                    break
                except AssertionError:
                    continue

        async def counted():
            rejected = count(service, "messages_rejected_total", reason=reason)
            # each of the JetStream cases sent one message, counted once however often redelivered
            return rejected >= 1 if case == "wrong-node-heartbeat" else rejected == 1

        await eventually(counted, timeout=30)
        assert any(reason in r.getMessage() and "rejected" in r.getMessage() for r in caplog.records)
        assert not await node_slices(kube, node)
        # Still running: a good snapshot after the bad one is written.
        await js.publish(names.snapshot_subject(node), encode(good))
        await eventually(lambda: node_slices(kube, node), timeout=30)


async def test_inventory_restart_mid_stream_leaves_no_duplicates_or_gaps(kube, control_plane, subject_prefix):
    suffix = uuid.uuid4().hex[:6]
    nodes = [f"rs-{suffix}-{i:03d}" for i in range(150)]
    await create_nodes(kube, nodes + [f"gone-{suffix}"])
    instance = f"inv-{suffix}"
    # A slice of ours left behind for a node whose agent no longer exists: reconcile must delete it.
    leftover_plan = plan_pool(
        NodeRef(f"gone-{suffix}", "uid-x"),
        driver_devices(load_profile("l4").hardware(f"gone-{suffix}"))[0], [], managed_by=instance,
    )
    await kube.create(leftover_plan.creates[0])
    agents = [profile_agent("mixed" if i % 3 == 0 else "l4", n) for i, n in enumerate(nodes)]
    async with running_inventory(kube, control_plane.nats_url, subject_prefix, instance, workers=4) as first:
        async with running_fleet(control_plane.nats_url, subject_prefix, agents) as fleet:
            await eventually(lambda: _async(count(first, "slice_writes_total") >= 40), timeout=60, interval=0.05)
            await first.stop()  # mid-stream: snapshots still queued, others not yet fetched
            first_writes = count(first, "slice_writes_total")
            await fleet.wait_all_sent()
            async with running_inventory(kube, control_plane.nats_url, subject_prefix, instance) as second:
                await eventually(lambda: _complete(kube, nodes, instance), timeout=120, interval=1.0)
                await second.wait_idle()
                assert not await node_slices(kube, f"gone-{suffix}")
    expected_slices = sum(3 if i % 3 == 0 else 1 for i in range(len(nodes)))  # mixed: counters + gpus + nics
    assert first_writes < expected_slices
    # Every slice written once in all (plus the leftover's delete); a write in flight when the first
    # run was stopped reached the apiserver without being counted, hence the range: about one per
    # worker (4); the full suite once saw 5 uncounted (not pinned down further: any write the stop
    # cancels after the apiserver took it). The slices listed below show no gaps and no duplicates.
    total = first_writes + count(second, "slice_writes_total")
    assert expected_slices + 1 - 5 <= total <= expected_slices + 1
    items, _ = await kube.list(ResourceSlice, label_selector=f"app.kubernetes.io/managed-by={instance}")
    assert len(items) == expected_slices
    assert {s.spec.pool.generation for s in items} == {1}  # nothing was ever rewritten


async def _async(value):
    return value


async def _complete(kube, nodes, instance):
    items, _ = await kube.list(ResourceSlice, label_selector=f"app.kubernetes.io/managed-by={instance}")
    by_node: dict[str, list[ResourceSlice]] = {}
    for s in items:
        by_node.setdefault(s.spec.node_name, []).append(s)
    for node in nodes:
        slices = by_node.get(node, [])
        pools: dict[str, list[ResourceSlice]] = {}
        for s in slices:
            pools.setdefault(s.spec.driver, []).append(s)
        if not pools:
            return False
        for pool in pools.values():
            if len(pool) != pool[0].spec.pool.resource_slice_count or len({s.metadata.name for s in pool}) != len(pool):
                return False
    return len(items) == sum(len(v) for k, v in by_node.items() if k in set(nodes)) and set(by_node) <= set(nodes)


async def test_feed_includes_other_drivers_slices_and_announces_changes(kube, control_plane, subject_prefix, nats):
    from draplane.api.resource import Device, ResourcePool, ResourceSliceSpec
    from draplane.messages.inventory import decode_feed_change

    suffix = uuid.uuid4().hex[:6]
    node = f"feed-{suffix}"
    await create_nodes(kube, [node])
    names = InventoryNames(subject_prefix)
    changes = []
    async def collect(msg):
        changes.append(decode_feed_change(msg.data))

    sub = await nats.subscribe(names.change_wildcard, cb=collect)
    try:
        async with running_inventory(kube, control_plane.nats_url, subject_prefix, f"inv-{suffix}") as service, \
                running_fleet(control_plane.nats_url, subject_prefix, [profile_agent("l4", node)]):
            # A slice on the same node from some other DRA driver, and a network-attached pool.
            await kube.create(ResourceSlice(
                metadata=ObjectMeta(name=f"{node}-fpga"),
                spec=ResourceSliceSpec(driver="fpga.example.com", pool=ResourcePool(name=node, generation=1, resource_slice_count=1),
                                       node_name=node, devices=[Device(name="fpga-0")]),
            ))
            await kube.create(ResourceSlice(
                metadata=ObjectMeta(name=f"shared-{suffix}"),
                spec=ResourceSliceSpec(driver="storage.example.com", pool=ResourcePool(name=f"san-{suffix}", generation=1, resource_slice_count=1),
                                       all_nodes=True, devices=[Device(name="lun-0")]),
            ))

            async def node_entry_has_both():
                entry = await service.kv.get(InventoryNames.node_key(node))
                drivers = {s.spec.driver for s in decode_feed_entry(entry.value).slices}
                return drivers == {"gpu.nvidia.com", "fpga.example.com"}

            await eventually(_tolerant(node_entry_has_both), timeout=20)
            pool_key = InventoryNames.pool_key("storage.example.com", f"san-{suffix}")
            pool_entry = decode_feed_entry((await eventually(_tolerant(lambda: service.kv.get(pool_key)), timeout=20)).value)
            assert pool_entry.node is None and pool_entry.slices[0].spec.all_nodes
            # Deleting the other driver's pool removes its key and announces it.
            await kube.delete(ResourceSlice, f"shared-{suffix}")
            await eventually(lambda: _async(any(c.key == pool_key and c.kind == "delete" for c in changes)), timeout=20)
            assert any(c.key == InventoryNames.node_key(node) and c.kind == "put" and c.revision > 0 for c in changes)
            assert all(c.schema_version == SCHEMA_VERSION for c in changes)
    finally:
        await sub.unsubscribe()
        await kube.delete(ResourceSlice, f"{node}-fpga")


def _tolerant(check):
    async def run():
        try:
            return await check()
        except Exception:  # the key does not exist yet
            return False

    return run


async def test_slices_follow_the_node_object(kube, control_plane, subject_prefix):
    node = f"late-{uuid.uuid4().hex[:6]}"
    async with running_inventory(kube, control_plane.nats_url, subject_prefix, f"inv-{node}") as service, \
            running_fleet(control_plane.nats_url, subject_prefix, [profile_agent("l4", node)]) as fleet:
        await fleet.wait_all_sent()
        await eventually(lambda: _async(count(service, "nodes_without_node_object_total") >= 1), timeout=10)
        assert not await node_slices(kube, node)  # nothing could own them yet
        uids = await create_nodes(kube, [node])
        await eventually(lambda: node_slices(kube, node), timeout=20)
        (s,) = await node_slices(kube, node)
        assert s.metadata.owner_references[0].uid == uids[node]
        # The node leaves the cluster (no garbage collector runs here): its slices go with it.
        await kube.delete(Node, node)

        async def gone():
            return not await node_slices(kube, node)

        await eventually(gone, timeout=20)


async def test_a_driver_another_publisher_uses_on_a_node_is_not_published_there(kube, control_plane, subject_prefix):
    """NVIDIA's DRA driver publishes gpu.nvidia.com on one node: draplane's inventory publishes its
    other drivers there, not that one, logs why and counts it; once the other publisher's slice is
    gone, it publishes the driver again. A node without the other publisher is not affected."""
    from draplane.api.resource import Device, ResourcePool, ResourceSliceSpec

    suffix = uuid.uuid4().hex[:6]
    shared, alone = f"beside-{suffix}", f"alone-{suffix}"
    await create_nodes(kube, [shared, alone])
    foreign = f"{shared}-gpu.nvidia.com-x7k2p"
    await kube.create(ResourceSlice(
        metadata=ObjectMeta(name=foreign),
        spec=ResourceSliceSpec(driver="gpu.nvidia.com", pool=ResourcePool(name=shared, generation=1, resource_slice_count=1),
                               node_name=shared, devices=[Device(name="gpu-0")]),
    ))
    instance = f"inv-{suffix}"
    try:
        async with running_inventory(kube, control_plane.nats_url, subject_prefix, instance) as service, \
                running_fleet(control_plane.nats_url, subject_prefix,
                              [profile_agent("dgx-h100", shared), profile_agent("dgx-h100", alone)]):
            async def ours(node):
                return {s.spec.driver for s in await node_slices(kube, node) if is_managed(s, instance)}

            assert await eventually(lambda: _eq(ours(alone), {"gpu.nvidia.com", "dra.net"}), timeout=30)
            assert await eventually(lambda: _eq(ours(shared), {"dra.net"}), timeout=30)
            await asyncio.sleep(1)  # and it stays so
            assert await ours(shared) == {"dra.net"}
            assert count(service, "drivers_refused") == 1
            assert service.refused == {(shared, "gpu.nvidia.com"): f"ResourceSlice {foreign}"}

            await kube.delete(ResourceSlice, foreign)
            assert await eventually(lambda: _eq(ours(shared), {"gpu.nvidia.com", "dra.net"}), timeout=30)
            assert count(service, "drivers_refused") == 0
    finally:
        await kube.delete(ResourceSlice, foreign, missing_ok=True)


async def _eq(awaitable, expected):
    return (await awaitable) == expected

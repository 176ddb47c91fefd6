"""NATS permissions per agent, and NATS restarting under load, on a nats-server of the test's own."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid

import nats as nats_py
import nats.errors
import pytest

from draplane import natsauth
from draplane.localenv import binaries
from draplane.localenv.processes import ServerProcess, free_port
from draplane.messages.inventory import SCHEMA_VERSION, InventoryNames, NodeSnapshot, encode
from draplane.nats_roles import node_agent_permissions
from draplane_inventory.service import InventoryService, InventorySettings
from draplane_node_agent.agent import AgentFleet, SimulatedAgent
from draplane.nodes.hardware import driver_devices
from draplane.nodes.profile import load_profile

from draplane.messages.inventory import decode_feed_entry
from test_inventory_integration import _tolerant, count, create_nodes, eventually, node_slices

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PREFIX = "draplane."
SERVICE_KEY = natsauth.new_user_key()


class AuthNats:
    """A nats-server with JetStream on disk and nkey users (the service, and one per agent with the
    inventory contract's permissions); restartable on the same port and store."""

    def __init__(self, workdir, agent_keys: dict[str, natsauth.UserKey]):
        self.port, self.monitor = free_port(), free_port()
        self.workdir = workdir
        self.config = workdir / "nats.conf"
        self.agent_keys = agent_keys
        self.write_config("js")

    def write_config(self, store: str) -> None:
        workdir, agent_keys = self.workdir, self.agent_keys
        self.config.write_text(
            "\n".join([
                f"listen: 127.0.0.1:{self.port}",
                f"http: 127.0.0.1:{self.monitor}",
                "jetstream { store_dir: " + json.dumps(str(workdir / store)) + " }",
                "authorization " + json.dumps({"users": [{"nkey": SERVICE_KEY.public_key}] + [
                    {"nkey": key.public_key,
                     "permissions": node_agent_permissions([node], InventoryNames(PREFIX)).config()}
                    for node, key in agent_keys.items()
                ]}),
            ])
        )
        self.process: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = ServerProcess("nats-server", [str(binaries.require(binaries.NATS_SERVER)), "-c", str(self.config)],
                                     self.workdir / "nats.log")
        self.process.start()
        self.process.wait_ready(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{self.monitor}/healthz?js-enabled-only=true", timeout=1).status == 200,
            30,
        )

    def stop(self) -> None:
        if self.process:
            self.process.stop()


def _agent(profile: str, node: str, box: dict | None = None) -> SimulatedAgent:
    if box is None:
        devices = driver_devices(load_profile(profile).hardware(node))
        return SimulatedAgent(node, lambda: devices)
    return SimulatedAgent(node, lambda: driver_devices(load_profile(box["profile"]).hardware(node)))


def _seed_file(tmp_path, name: str, key: natsauth.UserKey) -> str:
    path = tmp_path / f"{name}.seed"
    path.write_bytes(key.seed)
    return str(path)


async def _service(kube, url: str, instance: str, seed_file: str) -> tuple[InventoryService, nats_py.NATS]:
    connection = await nats_py.connect(url, nkeys_seed=seed_file, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    service = InventoryService(kube, connection, InventorySettings(prefix=PREFIX, instance=instance))
    await service.start()
    return service, connection


async def test_agent_can_publish_only_for_its_own_node(kube, tmp_path):
    suffix = uuid.uuid4().hex[:6]
    mine, other = f"own-{suffix}", f"other-{suffix}"
    keys = {mine: natsauth.new_user_key(), other: natsauth.new_user_key()}
    server = AuthNats(tmp_path, keys)
    server.start()
    await create_nodes(kube, [mine, other])
    names = InventoryNames(PREFIX)
    service, service_conn = await _service(kube, server.url, f"inv-{suffix}", _seed_file(tmp_path, "inventory", SERVICE_KEY))
    mine_seed = _seed_file(tmp_path, mine, keys[mine])
    errors: list[Exception] = []

    async def on_error(exc):
        errors.append(exc)

    agent_conn = await nats_py.connect(server.url, nkeys_seed=mine_seed,
                                       inbox_prefix=names.agent_inbox_prefix(mine), error_cb=on_error, allow_reconnect=False)
    try:
        js = agent_conn.jetstream()
        snapshot = NodeSnapshot(schema_version=SCHEMA_VERSION, node=mine, agent_id="a", sequence=1, sent_at=1.0,
                                drivers=driver_devices(load_profile("l4").hardware(mine)))
        ack = await js.publish(names.snapshot_subject(mine), encode(snapshot), timeout=5)
        assert ack.stream == names.stream
        await eventually(lambda: node_slices(kube, mine))

        forged = NodeSnapshot(schema_version=SCHEMA_VERSION, node=other, agent_id="a", sequence=2, sent_at=1.0,
                              drivers=driver_devices(load_profile("dgx-h100").hardware(other)))
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await js.publish(names.snapshot_subject(other), encode(forged), timeout=2)
        # The server refuses it as a permissions violation (nats-py then drops the connection).
        await eventually(lambda: _async_true("permissions violation" in str(agent_conn.last_error).lower()), timeout=5)
        await asyncio.sleep(0.5)
        assert not await node_slices(kube, other)
        assert count(service, "messages_rejected_total") == 0  # it never even reached the service
        # Nor may an agent read other nodes' snapshots.
        await agent_conn.close()
        agent_conn = await nats_py.connect(server.url, nkeys_seed=mine_seed,
                                           inbox_prefix=names.agent_inbox_prefix(mine), error_cb=on_error,
                                           allow_reconnect=False)
        await agent_conn.subscribe(names.snapshot_wildcard)
        await eventually(lambda: _async_true("permissions violation" in str(agent_conn.last_error).lower()), timeout=5)
    finally:
        await asyncio.wait_for(agent_conn.close(), 10)
        await service.stop()
        await asyncio.wait_for(service_conn.close(), 10)
        server.stop()


async def _async_true(value):
    return value


@pytest.mark.parametrize("store", ["kept", "lost"])
async def test_nats_restart_under_load_loses_nothing(kube, tmp_path, store):
    """NATS restarts while every agent is sending a changed snapshot; with its store kept, or with
    a blank one (the stream, the consumer and the feed bucket are gone and must be made again)."""
    suffix = uuid.uuid4().hex[:6]
    nodes = [f"load-{suffix}-{i:03d}" for i in range(120)]
    server = AuthNats(tmp_path, {})
    server.start()
    await create_nodes(kube, nodes)
    box = {"profile": "l4"}
    seed = _seed_file(tmp_path, "inventory", SERVICE_KEY)
    service, service_conn = await _service(kube, server.url, f"inv-{suffix}", seed)
    fleet = AgentFleet(server.url, [_agent("", n, box) for n in nodes], names=InventoryNames(PREFIX),
                       heartbeat_interval=2.0, rescan_interval=3600,
                       connect_options={"nkeys_seed": seed})
    await fleet.start()
    try:
        await fleet.wait_all_sent(60)
        # Change every node's hardware and pull the server out from under the storm of snapshots.
        box["profile"] = "dgx-h100"
        assert await fleet.rescan() == len(nodes)
        await asyncio.sleep(0.3)
        server.stop()
        await asyncio.sleep(2.0)
        if store == "lost":
            server.write_config("js-blank")
        server.start()
        await eventually(lambda: _async_true(fleet.reconnects >= 1), timeout=30)
        await fleet.wait_all_sent(90)

        async def all_dgx():
            for node in nodes:
                slices = await node_slices(kube, node)
                drivers = {s.spec.driver: s for s in slices}
                if set(drivers) != {"gpu.nvidia.com", "dra.net"} or len(drivers["gpu.nvidia.com"].spec.devices) != 8:
                    return False
                if len(slices) != 2:
                    return False
            return True

        await eventually(all_dgx, timeout=120, interval=1.0)
        await service.wait_idle(60)
        # The feed is whole again too, in the bucket as it now exists.
        for node in nodes[:5]:
            entry = await eventually(_tolerant(lambda node=node: service.kv.get(InventoryNames.node_key(node))), timeout=30)
            assert len(decode_feed_entry(entry.value).slices) == 2
    finally:
        await fleet.stop()
        await service.stop()
        await asyncio.wait_for(service_conn.close(), 10)
        server.stop()

"""The whole pipeline on a 3-server NATS cluster, one server SIGKILLed mid-run: nothing is lost.

The services run as real processes, started as `draplane up` starts them (environment.py), but
with every NATS URL of a local 3-server JetStream cluster and R3 streams and buckets. Pods arrive
in waves; once about a third are bound, the server leading the most streams (or the meta leader)
is killed. Every pod must still end bound, with its claim allocated once and no device shared.

NATS is as deployed: TLS, and each process its own key with its role's permissions
(draplane.nats_roles); the servers refuse them nothing (no "Violation" in their logs).

The node agents get one URL only, of a server that is never killed: they connect without
reconnecting to a pool (AgentFleet retries its one URL), and the agents' own failover is not
what this test is about.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from draplane.api.core import Node
from draplane.api.resource import ResourceSlice
from draplane.localenv import binaries, natssecurity
from draplane.localenv.environment import _apply, _ready, _register_node, standard_device_classes
from draplane.localenv.natscluster import NatsCluster
from draplane.localenv.processes import ServerProcess, free_port
from draplane.nats_roles import fleet_inbox_prefix
from draplane.simulation import scenario
from conftest import audit, create_many  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration

NODES = 4  # dgx-h100: 8 GPUs each, 32 in all
PODS = 24  # fewer than the GPUs, so every pod must end bound
WAVE = 4
SHARDS = 2


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.load(response)


def _meta_leader(cluster: NatsCluster) -> str:
    for member in cluster.members:
        try:
            leader = (_get_json(f"{member.monitor_url}/jsz").get("meta_cluster") or {}).get("leader")
        except OSError:
            continue
        if leader:
            return leader
    raise AssertionError("no server of the NATS cluster reports a JetStream meta leader")


def _streams(cluster: NatsCluster, alive: list[int]) -> dict[str, tuple[str | None, int]]:
    """stream name -> (the server leading it, its configured replicas), as the given members report it."""
    streams: dict[str, tuple[str | None, int]] = {}
    for index in alive:
        jsz = _get_json(f"{cluster.members[index].monitor_url}/jsz?streams=true&config=true")
        for account in jsz.get("account_details") or []:
            for detail in account.get("stream_detail") or []:
                leader = (detail.get("cluster") or {}).get("leader")
                replicas = (detail.get("config") or {}).get("num_replicas", 0)
                if leader or detail["name"] not in streams:
                    streams[detail["name"]] = (leader, replicas)
    return streams


@pytest.mark.timeout(180)
async def test_pipeline_loses_nothing_when_a_nats_server_is_killed(kube, control_plane, namespace, subject_prefix,
                                                                   tmp_path: Path):
    binaries.require(binaries.NATS_SERVER)
    token = uuid.uuid4().hex[:6]
    node_prefix = f"natsha-{token}"
    # Our own scheduler name: pods other tests leave pending must not take this test's GPUs, and
    # other tests' binders must not take these pods.
    scheduler_name = f"draplane-{token}"
    node_names = [f"{node_prefix}-{i:04d}" for i in range(NODES)]
    security = natssecurity.create(tmp_path / "nats-auth", prefix=subject_prefix,
                                   agents=[natssecurity.NodeAgentIdentity("node-agent", tuple(node_names),
                                                                          fleet_inbox_prefix(node_prefix))])
    cluster = NatsCluster(tmp_path / "nats", extra_config=security.server_config())
    services: list[ServerProcess] = []
    started = time.monotonic()
    try:
        await asyncio.to_thread(cluster.start)
        urls = ",".join(cluster.urls)
        # The agents' server is not the meta leader; it is never the one killed.
        meta_leader = await asyncio.to_thread(_meta_leader, cluster)
        agents_index = next(i for i, m in enumerate(cluster.members) if m.name != meta_leader)

        for name in node_names:
            await _register_node(kube, name, "dgx-h100")
        for device_class in standard_device_classes():
            await _apply(kube, device_class)

        env = dict(os.environ, KUBECONFIG=str(control_plane.kubeconfig), PYTHONUNBUFFERED="1")
        env.pop("DRAPLANE_NATS_URL", None)
        logs = tmp_path / "logs"

        def service(name: str, identity: str, module: str, *args: str) -> ServerProcess:
            process = ServerProcess(name, [sys.executable, "-m", module, f"--prefix={subject_prefix}", *args],
                                    logs / f"{name}.log", env={**env, **security.environment(identity)})
            process.start()
            services.append(process)
            return process

        probes: list[tuple[ServerProcess, str]] = []
        port = free_port()
        probes.append((service("inventory", "inventory", "draplane_inventory", f"--nats={urls}", "--stream-replicas=3",
                               f"--listen=127.0.0.1:{port}"), f"http://127.0.0.1:{port}/readyz"))
        for shard in range(SHARDS):
            port = free_port()
            probes.append((service(f"allocator-{shard}", "allocator", "draplane_allocator", f"--nats={urls}", "--stream-replicas=3",
                                   f"--shards={SHARDS}", f"--shard-index={shard}", f"--port={port}"),
                           f"http://127.0.0.1:{port}/readyz"))
        port = free_port()
        probes.append((service("binder", "binder", "draplane_binder", f"--nats={urls}", "--stream-replicas=3",
                               f"--shards={SHARDS}", f"--scheduler-name={scheduler_name}", f"--port={port}"),
                       f"http://127.0.0.1:{port}/readyz"))
        service("node-agent", "node-agent", "draplane_node_agent", f"--nats={cluster.members[agents_index].client_url}",
                "--profile=dgx-h100", f"--nodes={NODES}", f"--node-prefix={node_prefix}", "--listen=")

        deadline = time.monotonic() + 60
        for process, url in probes:
            await asyncio.to_thread(process.wait_ready, lambda url=url: _ready(url), max(1.0, deadline - time.monotonic()))
        while True:
            slices, _ = await kube.list(ResourceSlice)
            if set(node_names) <= {s.spec.node_name for s in slices}:
                break
            assert time.monotonic() < deadline, (
                f"no ResourceSlices for {node_names}; inventory log:\n{services[0].log_tail()}\n"
                f"node-agent log:\n{services[-1].log_tail()}")
            await asyncio.sleep(0.5)
        up_s = time.monotonic() - started

        await kube.create(scenario.claim_template(namespace, "one-gpu", "gpu.nvidia.com"))
        pods = [scenario.pod(namespace, f"p-{i:03d}", template_name="one-gpu", scheduler_name=scheduler_name)
                for i in range(PODS)]

        async def bound_count() -> int:
            return len((await audit(kube, namespace))["bound"])

        # Pods in waves, so that some are created only after the kill and must go through the
        # re-elected stream leaders.
        killed: dict = {}

        async def kill_after_a_third() -> None:
            while await bound_count() < PODS // 3:
                await asyncio.sleep(0.1)
            alive = [i for i in range(len(cluster.members)) if i != agents_index]
            streams = await asyncio.to_thread(_streams, cluster, alive)
            # Every stream and bucket the services made must be R3, or losing a server loses it.
            assert streams and all(r == 3 for _, r in streams.values()), f"streams not R3: {streams}"
            leaders = {name: leader for name, (leader, _) in streams.items()}
            led = {i: sum(1 for leader in leaders.values() if leader == cluster.members[i].name) for i in alive}
            victim = max(alive, key=lambda i: (led[i], cluster.members[i].name == meta_leader))
            killed.update(name=cluster.members[victim].name, bound=await bound_count(), streams_led=led[victim],
                          streams=len(leaders), was_meta_leader=cluster.members[victim].name == meta_leader,
                          at=time.monotonic())
            cluster.kill(victim)
            killed["created_before"] = created[0]

        created = [0]
        killer = asyncio.create_task(kill_after_a_third())
        pods_started = time.monotonic()
        for i in range(0, PODS, WAVE):
            if i >= PODS // 2:
                # The second half waits for the kill: a pipeline quicker than the killer's look at
                # the streams had bound every pod before it landed (24 of 24, a fresh-clone run).
                await asyncio.wait_for(asyncio.shield(killer), 60)
            await create_many(kube, pods[i : i + WAVE])
            created[0] += len(pods[i : i + WAVE])
            if not killer.done():
                await asyncio.sleep(0.5)
        await asyncio.wait_for(killer, 60)

        # Pods bound 5-20 s after the kill on 2 loaded cores (new stream leaders, then the shards'
        # redeliveries). 50 s is still short of the binder's 60 s in-flight backstop, so a pod
        # stranded by a failed publish fails here instead of passing late.
        result = None
        deadline = killed["at"] + 50
        while True:
            result = await audit(kube, namespace)
            if len(result["bound"]) == PODS and len(result["devices"]) >= PODS:
                break
            dead = [p.name for p in services if not p.alive()]
            assert not dead, f"services died after the NATS server was killed: {dead}; " + "; ".join(
                f"{p.name}:\n{p.log_tail()}" for p in services if not p.alive())
            assert time.monotonic() < deadline, (
                f"only {len(result['bound'])}/{PODS} pods bound 50s after killing {killed}; binder log:\n"
                f"{next(p for p in services if p.name == 'binder').log_tail(30)}")
            await asyncio.sleep(0.5)
        settled_s = time.monotonic() - pods_started

        assert killed["bound"] < PODS, f"the kill must land mid-run, not after every pod was bound: {killed}"
        assert result["duplicates"] == [], f"devices given to two claims: {result['duplicates']}"
        assert result["bound_without_claim"] == []
        assert len(result["claims"]) == PODS, sorted(c.metadata.name for c in result["claims"])
        for claim in result["claims"]:
            results = claim.status.allocation.devices.results
            assert len(results) == 1, f"claim {claim.metadata.name}: {len(results)} devices in status.allocation"
            assert len(claim.status.reserved_for or ()) == 1, f"claim {claim.metadata.name}: reservedFor"
        nodes_of_pods = {p.spec.node_name for p in result["pods"]}
        assert nodes_of_pods <= set(node_names)
        assert all(p.alive() for p in services), [p.name for p in services if not p.alive()]
        print(f"\nNATS cluster pipeline: up in {up_s:.1f}s; {PODS} pods on {NODES}x8 GPUs settled in {settled_s:.1f}s; "
              f"killed {killed['name']} (led {killed['streams_led']}/{killed['streams']} streams, "
              f"meta leader: {killed['was_meta_leader']}) with {killed['bound']} bound and "
              f"{PODS - killed['created_before']} pods not yet created, "
              f"{time.monotonic() - killed['at']:.1f}s from the kill to all bound")
    finally:
        for process in services:
            process.terminate()
        for process in services:
            await asyncio.to_thread(process.stop)
        await asyncio.to_thread(cluster.stop)
        for name in node_names:
            await kube.delete(Node, name)
        slices, _ = await kube.list(ResourceSlice)
        for s in slices:
            if s.spec.node_name in node_names:
                await kube.delete(ResourceSlice, s.metadata.name)
    orphans = [p.name for p in services if p.alive()] + [
        cluster.members[i].name for i, p in enumerate(cluster.processes) if p is not None and p.alive()]
    assert orphans == [], f"processes still running after stop: {orphans}"
    # Every service did its whole job, through the kill, within its role's permissions.
    refused = [line for member in cluster.members
               for line in (tmp_path / "nats" / "logs" / f"{member.name}.log").read_text().splitlines() if "Violation" in line]
    assert refused == []

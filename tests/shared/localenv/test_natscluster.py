"""The local 3-server NATS cluster: config rendering, and an R3 stream that loses a server mid-run."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import StorageType, StreamConfig

from draplane.localenv import binaries
from draplane.localenv.natscluster import ClusterMember, NatsCluster, plan_members, render_server_config


def test_config_routes_to_every_other_member_and_never_itself(tmp_path: Path):
    members = [ClusterMember(f"nats-{i}", 4000 + i, 5000 + i, 6000 + i) for i in range(3)]
    config = render_server_config(members[1], members, tmp_path / "js")
    assert "server_name: nats-1" in config
    assert "listen: 127.0.0.1:4001" in config
    assert "listen: 127.0.0.1:5001" in config
    assert "nats-route://127.0.0.1:5000" in config
    assert "nats-route://127.0.0.1:5002" in config
    assert "nats-route://127.0.0.1:5001" not in config
    assert json.dumps(str(tmp_path / "js")) in config


def test_fewer_than_three_servers_is_refused():
    with pytest.raises(ValueError, match="at least 3 servers"):
        plan_members(2)


def test_duplicate_member_names_are_refused(tmp_path: Path):
    members = [ClusterMember("nats-0", 1, 2, 3), ClusterMember("nats-0", 4, 5, 6), ClusterMember("nats-2", 7, 8, 9)]
    with pytest.raises(ValueError, match="unique"):
        render_server_config(members[0], members, tmp_path)


def test_member_outside_the_cluster_is_refused(tmp_path: Path):
    members = [ClusterMember(f"nats-{i}", i, 10 + i, 20 + i) for i in range(3)]
    with pytest.raises(ValueError, match="not one of the cluster's members"):
        render_server_config(ClusterMember("stranger", 1, 2, 3), members, tmp_path)


def _jsz_stream_messages(monitor_url: str, stream: str) -> int | None:
    """Messages in this server's own replica of `stream`, from its monitoring endpoint."""
    with urllib.request.urlopen(f"{monitor_url}/jsz?streams=true", timeout=2) as response:
        jsz = json.load(response)
    for account in jsz.get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            if detail["name"] == stream:
                return detail["state"]["messages"]
    return None


RETRYABLE = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)


async def _retrying(request, deadline: float):
    """Retry a JetStream request while the cluster elects new leaders after a server died."""
    while True:
        try:
            return await request()
        except RETRYABLE:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def _publish_until_acked(js, subject: str, payload: bytes, msg_id: str, deadline: float) -> int:
    """Publish with a message id and retry until acknowledged: the id makes retries idempotent."""
    ack = await _retrying(
        lambda: js.publish(subject, payload, timeout=1.0, headers={"Nats-Msg-Id": msg_id}), deadline
    )
    return ack.seq


@pytest.mark.integration
@pytest.mark.timeout(180)
async def test_r3_stream_loses_nothing_when_its_leader_is_killed_mid_run(tmp_path: Path):
    binaries.require(binaries.NATS_SERVER)
    total, kill_after = 600, 200
    with NatsCluster(tmp_path) as cluster:
        nc = await nats.connect(
            servers=cluster.urls, max_reconnect_attempts=-1, reconnect_time_wait=0.1, connect_timeout=2
        )
        try:
            js = nc.jetstream(timeout=5)
            await js.add_stream(
                StreamConfig(name="FAILOVER", subjects=["failover.>"], num_replicas=3, storage=StorageType.FILE)
            )
            info = await js.stream_info("FAILOVER")
            assert info.cluster is not None and info.cluster.leader
            assert len(info.cluster.replicas or []) == 2
            leader = cluster.index_of(info.cluster.leader)

            acked: list[int] = []
            acked_at: list[float] = []
            enough_before_kill = asyncio.Event()

            async def publish_all() -> None:
                deadline = time.monotonic() + 90
                for i in range(total):
                    seq = await _publish_until_acked(js, f"failover.m{i}", b"%d" % i, f"m{i}", deadline)
                    acked.append(seq)
                    acked_at.append(time.monotonic())
                    if len(acked) == kill_after:
                        enough_before_kill.set()

            publisher = asyncio.create_task(publish_all())
            await asyncio.wait_for(enough_before_kill.wait(), 30)
            killed_at = len(acked)
            killed_started = time.monotonic()
            cluster.kill(leader)  # the stream leader: the harder case, a new leader must be elected
            await asyncio.wait_for(publisher, 120)
            recovered_s = time.monotonic() - killed_started
            assert killed_at < total, "the kill must land while publishing is still going on"

            info = await _retrying(lambda: js.stream_info("FAILOVER"), time.monotonic() + 30)
            assert info.cluster.leader != cluster.members[leader].name
            # Every message exactly once: dedup by message id absorbed the retried publishes.
            assert info.state.messages == total
            assert sorted(acked) == list(range(1, total + 1))

            # Read every message back from the surviving pair, by sequence, while the third is down.
            # Direct reads from the stream leader need no consumer, so no consumer leader election.
            deadline = time.monotonic() + 30
            seen = [int((await _retrying(lambda s=seq: js.get_msg("FAILOVER", s), deadline)).data)
                    for seq in range(1, total + 1)]
            assert sorted(seen) == list(range(total))

            # The killed server comes back on its own store and catches up to the full stream.
            cluster.restart(leader)
            member = cluster.members[leader]
            deadline = time.monotonic() + 30
            while _jsz_stream_messages(member.monitor_url, "FAILOVER") != total:
                assert time.monotonic() < deadline, f"{member.name} never caught up to {total} messages"
                await asyncio.sleep(0.2)
            stall = max(b - a for a, b in zip(acked_at, acked_at[1:]))
            print(f"published {total}, leader killed after {killed_at} acks, longest wait for one ack "
                  f"{stall:.2f}s (the failover), rest acked in {recovered_s:.2f}s")
        finally:
            await nc.close()

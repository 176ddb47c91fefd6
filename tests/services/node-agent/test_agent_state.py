from __future__ import annotations

import random

import pytest

from draplane.api.resource import Device
from draplane.messages.inventory import DriverDevices
from draplane_node_agent.__main__ import parse_args, simulated_node_names
from draplane_node_agent.state import AgentState, backoff_delay


def devices(*names):
    return [DriverDevices(driver="gpu.nvidia.com", devices=[Device(name=n) for n in names])]


def test_snapshot_at_start_on_change_and_after_reconnect():
    s = AgentState("n1", agent_id="a")
    assert s.observe(devices("gpu-0")) and s.snapshot_due
    first = s.snapshot(1.0)
    s.snapshot_acked(first.sequence)
    assert not s.snapshot_due
    assert not s.observe(devices("gpu-0"))
    assert not s.snapshot_due
    hb = s.heartbeat(2.0)
    assert hb.sequence == first.sequence + 1 and hb.snapshot_sequence == first.sequence and hb.snapshot_digest == first.digest()
    s.reconnected()
    assert s.snapshot_due
    second = s.snapshot(3.0)
    assert second.sequence > hb.sequence
    s.snapshot_acked(second.sequence)
    assert s.observe(devices("gpu-0", "gpu-1")) and s.snapshot_due


def test_an_ack_for_an_older_snapshot_keeps_the_newer_one_due():
    s = AgentState("n1")
    s.observe(devices("gpu-0"))
    old = s.snapshot(1.0)
    s.observe(devices("gpu-1"))
    s.snapshot(2.0)
    s.snapshot_acked(old.sequence)
    assert s.snapshot_due


def test_snapshot_before_discovery_is_an_error():
    with pytest.raises(RuntimeError, match="node agent n1"):
        AgentState("n1").snapshot(0.0)


def test_backoff_grows_is_capped_and_jittered():
    rng = random.Random(7)
    delays = [backoff_delay(a, base=0.1, cap=2.0, rng=rng) for a in range(12)]
    assert 0.05 <= delays[0] <= 0.1
    assert all(1.0 <= d <= 2.0 for d in delays[6:])
    assert len({round(d, 6) for d in delays[6:]}) > 1  # jitter: not all the same


def test_cli_arguments():
    args = parse_args(["--profile", "dgx-h100", "--nodes", "1000"])
    assert args.backend == "profile" and args.nodes == 1000
    assert simulated_node_names("sim", 1000)[-1] == "sim-0999"
    with pytest.raises(SystemExit):
        parse_args(["--nodes", "5"])  # simulation needs a profile
    with pytest.raises(SystemExit):
        parse_args(["--profile", "l4"])  # no node named

from __future__ import annotations

import pytest

from draplane.api.resource import Device
from draplane.messages.inventory import SCHEMA_VERSION, DriverDevices, Heartbeat, MessageError, NodeSnapshot
from draplane_inventory.liveness import Liveness, NodeLivenessTable
from draplane.nodes.slices import STALE_TAINT_KEY


def snap(node="n1", agent="a", seq=1, sent=100.0, devices=("gpu-0",)):
    return NodeSnapshot(schema_version=SCHEMA_VERSION, node=node, agent_id=agent, sequence=seq, sent_at=sent,
                        drivers=[DriverDevices(driver="gpu.nvidia.com", devices=[Device(name=d) for d in devices])])


def beat(node="n1", agent="a", seq=2):
    return Heartbeat(schema_version=SCHEMA_VERSION, node=node, agent_id=agent, sequence=seq, sent_at=0.0,
                     snapshot_sequence=1, snapshot_digest="")


def table():
    return NodeLivenessTable(taint_after=10, remove_after=30)


def test_snapshot_changes_only_when_devices_change():
    t = table()
    assert t.apply_snapshot(snap(seq=1), now=0)
    assert not t.apply_snapshot(snap(seq=2), now=1)  # same devices, after a reconnect
    assert t.apply_snapshot(snap(seq=3, devices=("gpu-0", "gpu-1")), now=2)


def test_redelivered_and_superseded_snapshots_are_ignored():
    t = table()
    t.apply_snapshot(snap(seq=5, devices=("new",)), now=0)
    assert not t.apply_snapshot(snap(seq=4, devices=("old",)), now=1)  # redelivery of an older one
    assert not t.apply_snapshot(snap(agent="previous-process", seq=99, sent=50.0, devices=("old",)), now=1)
    assert t.desired("n1").drivers[0].devices[0].name == "new"
    assert t.apply_snapshot(snap(agent="restarted", seq=1, sent=200.0, devices=("newer",)), now=2)


def test_taint_then_remove_then_come_back():
    t = table()
    t.apply_snapshot(snap(), now=0)
    assert t.expire(now=9, wall_now=1000) == []
    assert t.expire(now=11, wall_now=1000) == ["n1"]
    assert t.liveness("n1") is Liveness.TAINTED
    taint = t.desired("n1").taint
    assert taint.key == STALE_TAINT_KEY and taint.effect == "NoSchedule" and taint.time_added == "1970-01-01T00:16:40Z"
    assert t.expire(now=20, wall_now=2000) == []  # no change: the taint keeps its time
    assert t.desired("n1").taint.time_added == "1970-01-01T00:16:40Z"
    assert t.expire(now=31, wall_now=3000) == ["n1"]
    assert t.liveness("n1") is Liveness.REMOVED and t.desired("n1").drivers == []
    assert t.apply_heartbeat(beat(), now=32)  # back: rewrite without the taint
    assert t.liveness("n1") is Liveness.FRESH and t.desired("n1").taint is None
    assert t.desired("n1").drivers


def test_heartbeat_keeps_a_node_fresh():
    t = table()
    t.apply_snapshot(snap(), now=0)
    for now in range(5, 100, 5):
        assert not t.apply_heartbeat(beat(), now=now)
        assert t.expire(now=now + 1, wall_now=0) == []


def test_heartbeat_before_any_snapshot_changes_nothing():
    t = table()
    assert not t.apply_heartbeat(beat(), now=0)
    assert t.liveness("n1") is None


def test_subject_node_must_match_body():
    NodeLivenessTable.check_subject("n1", snap())
    with pytest.raises(MessageError, match="subject of node 'n2' names node 'n1'") as info:
        NodeLivenessTable.check_subject("n2", snap())
    assert info.value.reason == "node-mismatch"


def test_periods_are_checked():
    with pytest.raises(ValueError, match="taint_after"):
        NodeLivenessTable(taint_after=30, remove_after=10)

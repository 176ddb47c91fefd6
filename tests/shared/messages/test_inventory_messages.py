from __future__ import annotations

import msgspec
import pytest

from draplane.messages.inventory import (
    SCHEMA_VERSION,
    DriverDevices,
    Heartbeat,
    InventoryNames,
    MAX_MESSAGE_BYTES,
    MessageError,
    NodeSnapshot,
    decode_agent_message,
    encode,
)
from draplane.api.resource import Device


def _snapshot(**kw):
    base = dict(schema_version=SCHEMA_VERSION, node="n1", agent_id="a", sequence=3, sent_at=1.0,
                drivers=[DriverDevices(driver="gpu.nvidia.com", devices=[Device(name="gpu-0")])])
    base.update(kw)
    return NodeSnapshot(**base)


def test_round_trip_both_kinds():
    snap = _snapshot()
    assert decode_agent_message(encode(snap)) == snap
    hb = Heartbeat(schema_version=SCHEMA_VERSION, node="n1", agent_id="a", sequence=4, sent_at=2.0,
                   snapshot_sequence=3, snapshot_digest=snap.digest())
    assert decode_agent_message(encode(hb)) == hb


def test_digest_changes_with_devices():
    assert _snapshot().digest() == _snapshot(sequence=9).digest()
    other = _snapshot(drivers=[DriverDevices(driver="gpu.nvidia.com", devices=[Device(name="gpu-1")])])
    assert other.digest() != _snapshot().digest()


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"\xc1garbage", "malformed"),
        (msgspec.msgpack.encode({"type": "snapshot", "schemaVersion": SCHEMA_VERSION, "node": "n1"}), "malformed"),
        (msgspec.msgpack.encode({"type": "snapshot", "schemaVersion": 99, "node": "n1"}), "version"),
        (msgspec.msgpack.encode([1, 2, 3]), "malformed"),
        (b"\x00" * (MAX_MESSAGE_BYTES + 1), "oversized"),
    ],
)
def test_rejections_carry_a_reason(data, reason):
    with pytest.raises(MessageError) as info:
        decode_agent_message(data)
    assert info.value.reason == reason


def test_wrong_version_message_names_node_and_versions():
    data = msgspec.msgpack.encode({"type": "heartbeat", "schemaVersion": 2, "node": "gpu-7"})
    with pytest.raises(MessageError, match=r"'gpu-7'.*schemaVersion 2.*version 1"):
        decode_agent_message(data)


def test_names_for_a_prefix():
    names = InventoryNames("t.case-1.")
    assert names.snapshot_subject("node.a.example") == "t.case-1.inventory.snapshot.node.a.example"
    assert names.node_from_subject("t.case-1.inventory.snapshot.node.a.example") == ("snapshot", "node.a.example")
    assert names.node_from_subject("t.case-1.inventory.heartbeat.n2") == ("heartbeat", "n2")
    assert names.stream == "T_CASE-1_INVENTORY"
    assert "." not in names.feed_bucket and "." not in names.consumer
    with pytest.raises(MessageError):
        names.node_from_subject("t.case-1.inventory.other.n2")
    with pytest.raises(ValueError, match="prefix"):
        InventoryNames("no-dot")
    assert names.agent_inbox_prefix("n1.rack-2") == "_INBOX_n1_rack-2"

"""Fuzzing the inventory messages at their trust boundary: what node agents publish (snapshots,
heartbeats) and what the inventory feed holds (entries, changes).

Property: each decoder returns a message or raises MessageError with a reason and a text; nothing
else, and no hang. An accepted agent message must also go through what the inventory service does
with it next (the subject check, the liveness table, the slice plans) without an exception: one
that passed decoding and then failed there was retried for ever, never acknowledged. Counts: see
tests/fuzzing.py.
"""

from __future__ import annotations

import msgspec
from hypothesis import example, given, reject
from hypothesis import strategies as st

from draplane.api.resource import Device, DeviceCapacity
from draplane.messages.inventory import (
    SCHEMA_VERSION,
    FeedChange,
    FeedEntry,
    Heartbeat,
    MessageError,
    NodeSnapshot,
    decode_agent_message,
    decode_feed_change,
    decode_feed_entry,
    encode,
)
from draplane_inventory.liveness import NodeLivenessTable
from draplane.validation import validate_typed
from draplane.nodes.slices import NodeRef, check_snapshot, plan_node
from fuzzing import bounded, fuzz, mutated, profile_drivers

NODE = "gpu-node-1"
AGENT_REASONS = {"oversized", "malformed", "version"}


def snapshot() -> NodeSnapshot:
    return NodeSnapshot(schema_version=SCHEMA_VERSION, node=NODE, agent_id="agent-1", sequence=3, sent_at=1.7e9,
                        drivers=list(profile_drivers("a100-mig", NODE)))


def heartbeat() -> Heartbeat:
    return Heartbeat(schema_version=SCHEMA_VERSION, node=NODE, agent_id="agent-1", sequence=4, sent_at=1.7e9 + 5,
                     snapshot_sequence=3, snapshot_digest=snapshot().digest())


def feed_entry() -> FeedEntry:
    plans = plan_node(NodeRef(NODE, "uid-1"), snapshot().drivers, [])
    return FeedEntry(schema_version=SCHEMA_VERSION, key=f"node.{NODE}", node=NODE,
                     slices=[s for plan in plans for s in plan.creates])


def feed_change() -> FeedChange:
    return FeedChange(schema_version=SCHEMA_VERSION, key=f"node.{NODE}", kind="put", revision=7, device_count=12)


@st.composite
def near_valid(draw, message) -> bytes:
    """The message's msgpack with a few fields wrong: types, sizes, versions, nesting."""
    tree = draw(mutated(msgspec.to_builtins(message)))
    try:
        return msgspec.msgpack.encode(tree)
    except RecursionError:  # nested past what the encoder writes: nobody can send it
        reject()


def random_bytes() -> st.SearchStrategy[bytes]:
    """Bytes, and msgpack of random values (so the decoders see maps and arrays, not only junk)."""
    from fuzzing import awkward_values

    return st.binary(max_size=200) | awkward_values().map(msgspec.msgpack.encode)


def inventory_takes(message: NodeSnapshot | Heartbeat, subject_node: str = NODE) -> None:
    """What the inventory service does with an accepted agent message (its checks as in
    InventoryService._decode, then the liveness table and the slice plans), up to its writes: an
    accepted snapshot's slices must be ones the apiserver takes."""
    table = NodeLivenessTable(taint_after=30, remove_after=120)
    try:
        table.check_subject(subject_node, message)
        if isinstance(message, NodeSnapshot):
            check_snapshot(message)
    except MessageError as exc:
        assert exc.reason in ("node-mismatch", "invalid") and str(exc)
        return
    if isinstance(message, Heartbeat):
        table.apply_heartbeat(message, 0.0)
        return
    table.apply_snapshot(message, 0.0)
    table.expire(60.0, 1.7e9)  # tainted: the plans then carry the stale taint too
    desired = table.desired(message.node)
    for plan in plan_node(NodeRef(message.node, "uid-1"), desired.drivers, [], taint=desired.taint):
        for slice_ in plan.creates:
            assert validate_typed(slice_) == [], slice_.metadata.name


def decode_agent(data: bytes) -> None:
    with bounded():
        try:
            message = decode_agent_message(data)
        except MessageError as exc:
            assert exc.reason in AGENT_REASONS and str(exc)
            return
        inventory_takes(message)


def decode_feed(decode, data: bytes) -> None:
    with bounded():
        try:
            decode(data)
        except MessageError as exc:
            assert exc.reason in {"malformed", "version"} and str(exc)


@fuzz(300)
@given(random_bytes())
@example(b"")
@example(b"\xc1")
@example(msgspec.msgpack.encode({"type": "snapshot", "schemaVersion": SCHEMA_VERSION}))
def test_random_bytes_as_agent_messages(data):
    decode_agent(data)


@fuzz(120)
@given(st.sampled_from([snapshot(), heartbeat()]).flatmap(near_valid))
@example(encode(msgspec.structs.replace(snapshot(), drivers=snapshot().drivers * 2)))  # one driver twice: ValueError
@example(encode(msgspec.structs.replace(snapshot(), drivers=[msgspec.structs.replace(  # refused by the apiserver:
    snapshot().drivers[0], devices=[Device(name="GPU_0")])])))  # the writes failed and were retried for ever
@example(encode(msgspec.structs.replace(snapshot(), drivers=[msgspec.structs.replace(  # found by a long run: a
    snapshot().drivers[0], devices=[Device(name="gpu-0", capacity={"memory": DeviceCapacity(value="3" * 12_000)})])])))
def test_near_valid_agent_messages(data):  # quantity of 12,000 digits, ValueError from int() in validation
    decode_agent(data)


@fuzz(200)
@given(random_bytes())
def test_random_bytes_as_feed_entries_and_changes(data):
    decode_feed(decode_feed_entry, data)
    decode_feed(decode_feed_change, data)


@fuzz(80)
@given(near_valid(feed_entry()))
def test_near_valid_feed_entries(data):
    decode_feed(decode_feed_entry, data)


@fuzz(60)
@given(near_valid(feed_change()))
def test_near_valid_feed_changes(data):
    decode_feed(decode_feed_change, data)


def test_feed_entries_of_another_version_are_rejected_by_name():
    newer = msgspec.structs.replace(feed_entry(), schema_version=SCHEMA_VERSION + 1)
    try:
        decode_feed_entry(encode(newer))
    except MessageError as exc:
        assert exc.reason == "version" and f"schemaVersion {SCHEMA_VERSION + 1}" in str(exc)
    else:
        raise AssertionError("a feed entry of another schema version was taken")


def test_a_snapshot_the_apiserver_would_refuse_is_rejected_by_name():
    bad = msgspec.structs.replace(snapshot(), drivers=[msgspec.structs.replace(
        snapshot().drivers[0], devices=[Device(name="GPU_0")])])
    try:
        check_snapshot(decode_agent_message(encode(bad)))
    except MessageError as exc:
        assert exc.reason == "invalid" and "GPU_0" in str(exc) and "gpu.nvidia.com" in str(exc)
    else:
        raise AssertionError("a snapshot with an invalid device name was taken")


def test_the_valid_messages_are_taken():
    for message in (snapshot(), heartbeat()):
        assert decode_agent_message(encode(message)) == message
        inventory_takes(message)
    assert decode_feed_entry(encode(feed_entry())) == feed_entry()
    assert decode_feed_change(encode(feed_change())) == feed_change()

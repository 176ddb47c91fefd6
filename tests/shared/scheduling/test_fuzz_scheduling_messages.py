"""Fuzzing the scheduling messages (pending pods, placements, unschedulable answers, released claims)
and the reservation bucket's node entries at their trust boundary.

Property: decode_message returns a message or raises MessageError; decode_entry returns an entry or
raises ValueError naming the node; nothing else, no hang. What the shard and the binder do first with
an accepted message (partition it, read the devices of its allocations) and every step of the
reservation protocol on an accepted entry must not raise either. Counts: see tests/fuzzing.py.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import example, given, reject
from hypothesis import strategies as st

from draplane.component_helpers.errors import SpecError
from draplane.component_helpers.resource import pod_requests
from draplane.api.core import Pod, PodSpec
from draplane.api.meta import ObjectMeta
from draplane.api.resource import AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult
from draplane.scheduling import reservations as rv
from draplane.scheduling.messages import (
    SCHEMA_VERSION,
    ClaimPlacement,
    ClaimRef,
    ClaimReleased,
    MessageError,
    NodeFailure,
    PendingPod,
    Placement,
    PodRef,
    Unschedulable,
    decode_message,
    encode_message,
    partition_key,
    shard_for,
)
from fuzzing import awkward_values, bounded, fuzz, mutated

POD = PodRef(namespace="default", name="vllm", uid="pod-uid-1")
CLAIM = ClaimRef(namespace="default", name="vllm-gpu", uid="claim-uid-1")
NODE = "gpu-node-1"


def allocation() -> AllocationResult:
    return AllocationResult(devices=DeviceAllocationResult(results=[
        DeviceRequestAllocationResult(request="gpu", driver="gpu.nvidia.com", pool=NODE, device="gpu-0"),
        DeviceRequestAllocationResult(request="nic", driver="dra.net", pool=NODE, device="nic-0", share_id="s-1"),
        DeviceRequestAllocationResult(request="mon", driver="gpu.nvidia.com", pool=NODE, device="gpu-1",
                                      admin_access=True),
    ]))


MESSAGES = [
    PendingPod(pod=POD, claims=[CLAIM, ClaimRef(namespace="default", name="b", uid="claim-uid-2")], first_seen=1.7e9,
               attempt=2, spec=msgspec.convert({"containers": [{"name": "c", "resources": {"requests": {"cpu": "2"}}}],
                                                "nodeSelector": {"zone": "a"}}, PodSpec)),
    Placement(pod=POD, node=NODE, claims=[ClaimPlacement(claim=CLAIM, allocation=allocation())], shard=1,
              first_seen=1.7e9, expires_at=1.7e9 + 30),
    Unschedulable(pod=POD, shard=0, message="0/2 nodes are available: 2 Insufficient cpu.",
                  failures=[NodeFailure(node=NODE, reason="node-fit", reasons=["Insufficient cpu"])],
                  claim_error=""),
    ClaimReleased(claim=CLAIM, node=NODE),
]


def entry() -> rv.NodeReservations:
    reservation = rv.Reservation(claim_uid=CLAIM.uid, claim_namespace=CLAIM.namespace, claim_name=CLAIM.name,
                                 pod_uid=POD.uid, devices=rv.devices_of(allocation()), allocation=allocation(),
                                 reserved_at=1.7e9, expires_at=1.7e9 + 30, shard=1)
    confirmed = msgspec.structs.replace(reservation, claim_uid="claim-uid-2", expires_at=None,
                                        devices=[rv.ReservedDevice("gpu.nvidia.com", NODE, "gpu-2")])
    pod = rv.PodReservation(pod_uid=POD.uid, pod_namespace=POD.namespace, pod_name=POD.name,
                            requests={"cpu": 2000, "memory": 2**34}, reserved_at=1.7e9, expires_at=1.7e9 + 30)
    return rv.NodeReservations(node=NODE, claims={reservation.claim_uid: reservation, "claim-uid-2": confirmed},
                               pods={POD.uid: pod})


@st.composite
def near_valid(draw, message, encode) -> bytes:
    tree = draw(mutated(msgspec.to_builtins(message)))
    try:
        return encode(tree)
    except (RecursionError, TypeError, ValueError, OverflowError):  # nothing anyone could send
        reject()


def random_bytes() -> st.SearchStrategy[bytes]:
    return st.binary(max_size=200) | awkward_values().map(msgspec.msgpack.encode)


def first_uses(message) -> None:
    """What the shard and the binder do first with an accepted message."""
    if isinstance(message, PendingPod):
        shard_for(partition_key(message), 3)
        message.pod.key()
        if message.spec is not None:  # the shard's node fit reads the requests the spec carries
            pod = Pod(metadata=ObjectMeta(name=message.pod.name, namespace=message.pod.namespace), spec=message.spec)
            try:
                pod_requests(pod)
            except SpecError as exc:
                assert message.pod.name in str(exc)
    elif isinstance(message, Placement):
        for placed in message.claims:
            rv.devices_of(placed.allocation)
            placed.claim.key()
    elif isinstance(message, ClaimReleased):
        message.claim.key()


def decode_scheduling(data: bytes) -> None:
    with bounded():
        try:
            message = decode_message(data)
        except MessageError as exc:
            assert str(exc)
            return
        first_uses(message)


def protocol_steps(decoded: rv.NodeReservations) -> None:
    """Every step of the reservation protocol on an entry read from the bucket."""
    now = 1.7e9 + 10
    rv.has_lapsed_claims(decoded, now)
    pruned, _ = rv.prune(decoded, now + 100, lambda uid: uid.endswith("2"))
    rv.exclusive_devices(decoded)
    for uid in list(decoded.claims):
        rv.confirm(decoded, uid)
        rv.extend(decoded, uid, now + 30)
        rv.same_devices(decoded.claims[uid].devices, decoded.claims[uid].devices)
    rv.release(decoded, list(decoded.claims), list(decoded.pods))
    fresh = rv.Reservation(claim_uid="new", claim_namespace="d", claim_name="n", pod_uid="p",
                           devices=[rv.ReservedDevice("gpu.nvidia.com", NODE, "gpu-7")], allocation=AllocationResult(),
                           reserved_at=now, expires_at=now + 30)
    try:
        rv.add(pruned, [fresh])
    except rv.ReservationConflict:
        pass
    rv.decode_entry(rv.encode_entry(pruned), NODE)


def decode_reservations(data: bytes) -> None:
    with bounded():
        try:
            decoded = rv.decode_entry(data, NODE)
        except ValueError as exc:
            assert f"node {NODE}" in str(exc) or f"key {NODE}" in str(exc)
            with pytest.raises(ValueError, match=f"node {NODE}|key {NODE}"):
                rv.EntryDecoder().decode(data, NODE)  # the watch's decoder refuses it as well
            return
        # the watch's decoder reads it the same, first alone and then after what it read before
        assert rv.EntryDecoder().decode(data, NODE) == decoded
        decoder = rv.EntryDecoder()
        decoder.decode(rv.encode_entry(decoded), NODE)
        assert decoder.decode(data, NODE) == decoded
        protocol_steps(decoded)


@fuzz(300)
@given(random_bytes())
@example(b"")
@example(msgspec.msgpack.encode({"type": "placement", "version": SCHEMA_VERSION + 1}))
def test_random_bytes_as_scheduling_messages(data):
    decode_scheduling(data)


@fuzz(150)
@given(st.sampled_from(MESSAGES).flatmap(lambda m: near_valid(m, msgspec.msgpack.encode)))
def test_near_valid_scheduling_messages(data):
    decode_scheduling(data)


@fuzz(200)
@given(st.binary(max_size=200) | awkward_values(binary=False).map(msgspec.json.encode))
@example(b"null")
@example(b'{"node": "gpu-node-1", "version": 2}')
def test_random_bytes_as_reservation_entries(data):
    decode_reservations(data)


@fuzz(100)
@given(near_valid(entry(), msgspec.json.encode))
def test_near_valid_reservation_entries(data):
    decode_reservations(data)


def test_another_version_is_rejected_by_name_even_in_another_shape():
    """A newer binder's message may have other fields: the version is what to report."""
    newer = msgspec.to_builtins(MESSAGES[1])
    newer["version"] = SCHEMA_VERSION + 1
    newer["claims"] = {"moved": True}
    try:
        decode_message(msgspec.msgpack.encode(newer))
    except MessageError as exc:
        assert f"version is {SCHEMA_VERSION + 1}" in str(exc) and "Placement" in str(exc)
    else:
        raise AssertionError("a message of another version was taken")


def test_the_valid_messages_are_taken():
    for message in MESSAGES:
        assert decode_message(encode_message(message)) == message
        first_uses(message)
    protocol_steps(rv.decode_entry(rv.encode_entry(entry()), NODE))

"""draplane.messages.audit: the audit events' wire form, and the ids that make one fact one event."""

from __future__ import annotations

import msgspec
import pytest

from draplane.api.resource import AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult
from draplane.messages import audit


def event(**fields) -> audit.AuditEvent:
    base = dict(id=audit.placed_id("pod-1"), kind="placed", at=1.5, by=["shard-0", "binder-x"], node="n1",
                pod=audit.PodName(namespace="ns", name="p", uid="pod-1"))
    return audit.AuditEvent(**{**base, **fields})


def test_an_event_round_trips_and_omits_what_it_does_not_say():
    e = event(score=12.5, policy="draplane")
    data = audit.encode_event(e)
    assert audit.decode_event(data) == e
    assert b"device_count" not in data and b'"reason"' not in data


def test_devices_of_an_allocation_keep_request_share_and_consumed_capacity():
    allocation = AllocationResult(devices=DeviceAllocationResult(results=[
        DeviceRequestAllocationResult(request="gpu", driver="gpu.nvidia.com", pool="n1", device="gpu-0"),
        DeviceRequestAllocationResult(request="mem", driver="gpu.nvidia.com", pool="n1", device="gpu-1",
                                      share_id="s-1", consumed_capacity={"memory": "8Gi"}, admin_access=True),
    ]))
    first, second = audit.devices_of(allocation)
    assert (first.request, first.device, first.share_id) == ("gpu", "gpu-0", None)
    assert (second.share_id, second.consumed, second.admin_access) == ("s-1", {"memory": "8Gi"}, True)
    assert second.text() == "n1/gpu-1 (share s-1)"
    assert audit.devices_of(None) == []


@pytest.mark.parametrize("data, words", [
    (b"not json", "not an audit event"),
    (msgspec.json.encode({"id": "x", "kind": "exploded", "at": 1, "by": []}), "not an audit event"),
    (msgspec.json.encode({"version": 2, "id": "x", "kind": "placed", "at": 1, "by": []}), "has version 2"),
    (b"{" + b" " * audit.MAX_EVENT_BYTES + b"}", "exceeds the limit"),
])
def test_what_is_not_an_event_is_refused_with_why(data, words):
    with pytest.raises(audit.MessageError, match=words):
        audit.decode_event(data)


def test_the_same_fact_gets_the_same_id_and_other_facts_other_ids():
    assert audit.placed_id("u") == audit.placed_id("u")
    # A shard's answer is named by its stream sequence; the binder's own verdict by its words.
    assert audit.rejected_id("u", "no GPU", "17") != audit.rejected_id("u", "no GPU", "18")
    assert audit.rejected_id("u", "claim missing") == audit.rejected_id("u", "claim missing")
    assert audit.rejected_id("u", "claim missing") != audit.rejected_id("u", "template missing")
    assert audit.released_id("c", "100") != audit.released_id("c", "250")  # allocated again, released again
    assert audit.taint_rule_id("tainted", "r", "5") != audit.taint_rule_id("untainted", "r", "5")


def test_names_derive_from_the_prefix():
    names = audit.AuditNames(prefix="t.test-1.")
    assert names.subject("placed") == "t.test-1.audit.placed"
    assert names.wildcard == "t.test-1.audit.>"
    assert names.stream == "T_TEST-1_AUDIT"
    assert audit.AuditNames().stream == "DRAPLANE_AUDIT"

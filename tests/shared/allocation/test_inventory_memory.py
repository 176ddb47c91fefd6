"""What alike devices share in the inventory (a shard holds every device of the cluster), and that
sharing never makes two devices read alike that are not."""

from __future__ import annotations

from draplane.allocation import inventory as inv
from draplane.allocation.inventory import DeviceRecord

from allocation_builders import DRIVER_A, Version, capacity_policy, device, slice_


def _records(*devices) -> list[DeviceRecord]:
    s = slice_("s", "node-1", "pool", DRIVER_A, *devices)
    return [DeviceRecord(s, d) for d in s.spec.devices]


def test_alike_devices_share_their_attributes_capacities_and_physical_content():
    a, b = _records(device("gpu-0", {"model": "h100", "index": 0}, {"memory": "80Gi"}),
                    device("gpu-1", {"model": "h100", "index": 1}, {"memory": "80Gi"}))
    assert a.device.attributes["model"] is b.device.attributes["model"]
    assert a.attribute("model") is b.attribute(f"{DRIVER_A}/model")
    assert a.device.capacity["memory"] is b.device.capacity["memory"]
    assert a.capacity["memory"] is b.capacity["memory"]
    assert a.physical is b.physical  # same model, attributes aside
    assert a.content != b.content and len(a.content) == 16  # a digest, not the encoding
    assert a.attribute("index") == ("int", 0) and b.attribute("index") == ("int", 1)


def test_sharing_keeps_kinds_texts_and_policies_apart():
    one, true, text, version, binary, decimal, policy = _records(
        device("d-int", {"x": 1}), device("d-bool", {"x": True}), device("d-str", {"x": "1"}),
        device("d-version", {"x": Version("1.0.0")}, {"memory": "80Gi"}),
        device("d-binary", capacity={"memory": "80Gi"}), device("d-decimal", capacity={"memory": "85899345920"}),
        device("d-policy", capacity={"memory": "80Gi"}, policies={"memory": capacity_policy(default="1Gi")}))
    assert [r.attribute("x") for r in (one, true, text, version)] == [
        ("int", 1), ("bool", True), ("string", "1"), ("version", "1.0.0")]
    assert one.device.attributes["x"] is not true.device.attributes["x"]  # 1 == True in Python
    assert binary.capacity["memory"].value == decimal.capacity["memory"].value
    # equal values, written differently: each device keeps its own text
    assert binary.device.capacity["memory"].value == "80Gi"
    assert decimal.device.capacity["memory"].value == "85899345920"
    assert binary.capacity["memory"] is version.capacity["memory"]
    assert policy.capacity["memory"] is not binary.capacity["memory"] and policy.capacity["memory"].has_policy
    assert policy.capacity["memory"].default.value == 1 << 30
    assert binary.physical != decimal.physical and binary.physical != policy.physical


def test_the_shared_values_are_bounded(monkeypatch):
    monkeypatch.setattr(inv.SHARED_VALUES, "limit", 8)
    records = _records(*(device(f"gpu-{i}", {"serial": f"s-{i}", "model": "h100"}) for i in range(50)))
    assert len(inv.SHARED_VALUES) <= 8
    assert [r.attribute("serial") for r in records] == [("string", f"s-{i}") for i in range(50)]
    assert all(r.attribute("model") == ("string", "h100") for r in records)

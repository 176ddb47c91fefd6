"""The CEL view of ResourceSlice devices: names, values, identity."""

from __future__ import annotations

import pytest

from draplane.api.quantity import parse_quantity
from draplane.api.resource import Device, DeviceAttribute, DeviceCapacity
from draplane.cel import CELDevice, CELRuntimeError, Semver, compile_selector, device_for_cel, parse_semver


def slice_device(**attributes) -> Device:
    return Device(name="gpu-0", attributes={k: DeviceAttribute(**v) for k, v in attributes.items()})


def test_unqualified_names_take_the_driver_domain_and_qualified_keep_theirs():
    device = Device(
        name="gpu-0",
        attributes={
            "model": DeviceAttribute(string_value="A100"),
            "resource.kubernetes.io/pcieRoot": DeviceAttribute(string_value="pci0"),
            "example.com/index": DeviceAttribute(int_value=2),
        },
        capacity={"memory": DeviceCapacity(value="80Gi"), "example.com/slots": DeviceCapacity(value="4")},
    )
    cel_device = device_for_cel("gpu.nvidia.com", device)
    assert cel_device.driver == "gpu.nvidia.com"
    assert dict(cel_device.attributes["gpu.nvidia.com"]) == {"model": "A100"}
    assert dict(cel_device.attributes["resource.kubernetes.io"]) == {"pcieRoot": "pci0"}
    assert dict(cel_device.attributes["example.com"]) == {"index": 2}
    assert cel_device.capacity["gpu.nvidia.com"]["memory"] == parse_quantity("80Gi")
    assert cel_device.capacity["example.com"]["slots"] == parse_quantity("4")
    assert compile_selector('device.attributes["resource.kubernetes.io"].pcieRoot == "pci0"').matches(cel_device)
    assert compile_selector('device.capacity["example.com"].slots.asInteger() == 4').matches(cel_device)


def test_values_keep_their_types():
    cel_device = device_for_cel(
        "d.example.com",
        slice_device(
            i={"int_value": 7}, b={"bool_value": True}, s={"string_value": "x"}, v={"version_value": "1.2.3-rc.1"}
        ),
    )
    values = cel_device.attributes["d.example.com"]
    assert values["i"] == 7 and type(values["i"]) is int
    assert values["b"] is True
    assert values["s"] == "x"
    assert values["v"] == parse_semver("1.2.3-rc.1") and isinstance(values["v"], Semver)
    assert compile_selector('device.attributes["d.example.com"].v.isLessThan(semver("1.2.3"))').matches(cel_device)
    assert compile_selector('device.attributes["d.example.com"].b').matches(cel_device)


def test_allow_multiple_allocations():
    shared = device_for_cel("nic.example.com", Device(name="nic", allow_multiple_allocations=True))
    exclusive = device_for_cel("nic.example.com", Device(name="nic"))
    assert compile_selector("device.allowMultipleAllocations").matches(shared)
    assert not compile_selector("device.allowMultipleAllocations").matches(exclusive)


def test_invalid_version_makes_every_selector_fail_at_evaluation():
    cel_device = device_for_cel("d.example.com", slice_device(v={"version_value": "1.2"}))
    assert cel_device.invalid == "attribute v: parse semantic version: No Major.Minor.Patch elements found"
    with pytest.raises(CELRuntimeError, match="attribute v: parse semantic version"):
        compile_selector("true").matches(cel_device)


def test_invalid_capacity_is_reported():
    cel_device = device_for_cel("d.example.com", Device(name="d", capacity={"memory": DeviceCapacity(value="lots")}))
    assert cel_device.invalid.startswith("capacity memory: ")


def test_attribute_without_value_is_reported():
    cel_device = device_for_cel("d.example.com", slice_device(empty={}))
    assert cel_device.invalid == "attribute empty: unsupported attribute value"


def test_equal_content_is_equal_and_hashes_alike():
    first = device_for_cel("d.example.com", slice_device(a={"int_value": 1}, v={"version_value": "1.0.0+x"}))
    second = device_for_cel("d.example.com", slice_device(a={"int_value": 1}, v={"version_value": "1.0.0+y"}))
    assert first == second and hash(first) == hash(second)  # build metadata is invisible to CEL
    built = CELDevice("d.example.com", {"d.example.com": {"a": 1, "v": parse_semver("1.0.0")}})
    assert built == first and hash(built) == hash(first)


def test_bool_and_int_are_different_content():
    as_bool = CELDevice("d.example.com", {"d.example.com": {"a": True}})
    as_int = CELDevice("d.example.com", {"d.example.com": {"a": 1}})
    assert as_bool != as_int
    assert compile_selector('device.attributes["d.example.com"].a == true').matches(as_bool)
    assert not compile_selector('device.attributes["d.example.com"].a == true').matches(as_int)


def test_equal_quantities_in_other_units_are_equal_content():
    first = CELDevice("d", capacity={"d": {"memory": parse_quantity("1Gi")}})
    second = CELDevice("d", capacity={"d": {"memory": parse_quantity("1024Mi")}})
    assert first == second and hash(first) == hash(second)


def test_different_content_differs():
    base = CELDevice("d", {"d": {"a": 1}})
    assert base != CELDevice("e", {"d": {"a": 1}})
    assert base != CELDevice("d", {"d": {"a": 2}})
    assert base != CELDevice("d", {"d": {"a": 1}}, allow_multiple_allocations=True)
    assert base != CELDevice("d", {"d": {"a": 1}}, capacity={"d": {"m": parse_quantity("1")}})


def test_snapshot_is_immutable():
    cel_device = CELDevice("d", {"d": {"a": 1}})
    with pytest.raises(AttributeError):
        cel_device.driver = "other"
    with pytest.raises(TypeError):
        cel_device.attributes["d"]["a"] = 2
    with pytest.raises(TypeError):
        cel_device.attributes["e"] = {}


def test_constructor_rejects_values_cel_cannot_hold():
    with pytest.raises(TypeError, match="attribute d/a: expected int, bool, str or Semver, got float"):
        CELDevice("d", {"d": {"a": 1.5}})
    with pytest.raises(TypeError, match="capacity d/m: expected a Quantity, got str"):
        CELDevice("d", capacity={"d": {"m": "1Gi"}})

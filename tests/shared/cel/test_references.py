"""Which device entries a selector reads, and that sharing results by them never changes an answer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draplane.api.quantity import parse_quantity
from draplane.api.resource import Device, DeviceAttribute, DeviceCapacity
from draplane.cel import (
    CELDevice,
    CELRuntimeError,
    compile_selector,
    device_for_cel,
    projection,
    referenced_entries,
    slice_projection,
)

D = "gpu.nvidia.com"


@pytest.mark.parametrize("expression, entries", [
    (f'device.driver == "{D}"', ()),
    (f'device.attributes["{D}"].productName == "H100" && device.capacity["{D}"].memory.compareTo(quantity("40Gi")) > 0',
     (("attributes", D, "productName"), ("capacity", D, "memory"))),
    (f'has(device.attributes["{D}"].uuid)', (("attributes", D, "uuid"),)),
    (f'device.attributes["{D}"].model.startsWith("A") || device.allowMultipleAllocations', (("attributes", D, "model"),)),
    ('"device.driver" == device.driver', ()),  # a literal that reads like a field only adds an entry
    # single quotes, as the classes of NVIDIA's DRA driver write them
    (f"device.driver == '{D}' && device.attributes['{D}'].type == 'gpu'", (("attributes", D, "type"),)),
])
def test_entries_a_selector_reads(expression, entries):
    assert referenced_entries(expression) == entries


@pytest.mark.parametrize("expression", [
    f'device.attributes["{D}"].exists(k, k == "x")',  # a macro over the whole map
    f'"model" in device.attributes["{D}"]',  # the map itself
    f'device.attributes["{D}"].size() > 1',
    f'device.attributes["{D}"]["model"] == "x"',  # index syntax
    f'device.attributes["{D}"].?model.orValue("") == "x"',  # optional syntax
    f"device.attributes[r'{D}'].model == 'x'",  # a raw string
    f"""device.attributes['{D}"].model == 'x'""",  # quotes that do not pair
    'cel.bind(a, device.attributes["d"], a.x == 1)',
    '[1].exists(device, device > 0)',  # a variable named device
    'device . driver == "x"',
])
def test_uses_it_does_not_recognise_give_up(expression):
    assert referenced_entries(expression) is None


def gpu(uuid: str, model, memory: str = "80Gi", extra=None) -> CELDevice:
    attributes = {D: {"uuid": uuid, **({"model": model} if model is not None else {}), **(extra or {})}}
    return CELDevice(D, attributes, {D: {"memory": parse_quantity(memory)}})


def answer(expression: str, device: CELDevice):
    try:
        return compile_selector(expression).matches(device)
    except CELRuntimeError as exc:
        return str(exc)


EXPRESSIONS = [
    f'device.attributes["{D}"].model == "H100"',
    f'device.attributes["{D}"].model == 1',
    f'device.capacity["{D}"].memory.compareTo(quantity("40Gi")) >= 0',
    f'has(device.attributes["{D}"].model) && device.attributes["{D}"].model != true',
    f'device.attributes["other.example.com"].model == "H100"',
    f"device.attributes['{D}'].model == 'H100' && device.capacity['{D}'].memory.isGreaterThan(quantity('40Gi'))",
]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.sampled_from(EXPRESSIONS), st.lists(st.tuples(st.sampled_from([None, "H100", "A100", 1, True]),
                                                        st.sampled_from(["24Gi", "40Gi", "80Gi", "81920Mi"])),
                                              min_size=2, max_size=6))
def test_devices_with_one_projection_get_one_answer(expression, shapes):
    entries = referenced_entries(expression)
    assert entries is not None
    devices = [gpu(f"GPU-{i}", model, memory) for i, (model, memory) in enumerate(shapes)]
    by_key: dict = {}
    for device in devices:
        by_key.setdefault(projection(device, entries), set()).add(repr(answer(expression, device)))
    assert all(len(answers) == 1 for answers in by_key.values()), by_key


# Slice devices built to reach every corner of device_for_cel: a name both plain and qualified
# (the later one wins), another domain, versions that parse and that do not, an attribute with no
# value, True next to 1, capacities that parse and that do not.
ATTRIBUTE_NAMES = ["model", f"{D}/model", "uuid", "other.example.com/model", "resource.kubernetes.io/pcieRoot"]
ATTRIBUTE_VALUES = [
    DeviceAttribute(string_value="H100"), DeviceAttribute(string_value="A100"), DeviceAttribute(int_value=1),
    DeviceAttribute(bool_value=True), DeviceAttribute(version_value="1.2.3"), DeviceAttribute(version_value="x.y"),
    DeviceAttribute(),
]
SLICE_EXPRESSIONS = EXPRESSIONS + [
    f'device.driver == "{D}"',
    f'device.attributes["resource.kubernetes.io"].pcieRoot == "H100"',
    f'has(device.attributes["other.example.com"].model)',
    f'device.attributes["{D}"].uuid == "A100" || device.allowMultipleAllocations',
]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.sampled_from(SLICE_EXPRESSIONS), st.lists(
    st.tuples(st.lists(st.tuples(st.sampled_from(ATTRIBUTE_NAMES), st.sampled_from(ATTRIBUTE_VALUES)), max_size=4),
              st.sampled_from([None, "40Gi", "80Gi", "lots"]), st.sampled_from([None, True])),
    min_size=2, max_size=8))
def test_slice_devices_with_one_slice_projection_get_one_projection_and_one_answer(expression, shapes):
    entries = referenced_entries(expression)
    assert entries is not None
    by_key: dict = {}
    for i, (attributes, memory, multi) in enumerate(shapes):
        device = Device(name=f"gpu-{i}", attributes=dict(attributes) or None,
                        capacity={"memory": DeviceCapacity(value=memory)} if memory else None,
                        allow_multiple_allocations=multi)
        seen = device_for_cel(D, device)
        by_key.setdefault(slice_projection(D, device, entries), set()).add(
            (projection(seen, entries), repr(answer(expression, seen))))
    assert all(len(seen) == 1 for seen in by_key.values()), by_key


def test_slice_projection_ignores_what_the_selector_cannot_see_and_keeps_what_it_can():
    entries = referenced_entries(f'device.attributes["{D}"].model == "H100"')

    def key(uuid: str, model: str, version: str = "1.0.0"):
        return slice_projection(D, Device(name=uuid, attributes={
            "uuid": DeviceAttribute(string_value=uuid), "model": DeviceAttribute(string_value=model),
            "driverVersion": DeviceAttribute(version_value=version)}), entries)

    assert key("GPU-1", "H100") == key("GPU-2", "H100")  # one evaluation for a model's GPUs
    assert key("GPU-1", "H100") != key("GPU-1", "A100")
    assert key("GPU-1", "H100") != key("GPU-1", "H100", version="bad")  # the device's error differs
    as_int, as_bool = (slice_projection(D, Device(name="gpu", attributes={"model": value}), entries)
                       for value in (DeviceAttribute(int_value=1), DeviceAttribute(bool_value=True)))
    assert as_int != as_bool  # CEL keeps 1 and true apart; Python's 1 == True must not merge them

"""Which device entries a selector reads, and that sharing results by them never changes an answer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draplane.api.quantity import parse_quantity
from draplane.cel import CELDevice, CELRuntimeError, compile_selector, projection, referenced_entries

D = "gpu.nvidia.com"


@pytest.mark.parametrize("expression, entries", [
    (f'device.driver == "{D}"', ()),
    (f'device.attributes["{D}"].productName == "H100" && device.capacity["{D}"].memory.compareTo(quantity("40Gi")) > 0',
     (("attributes", D, "productName"), ("capacity", D, "memory"))),
    (f'has(device.attributes["{D}"].uuid)', (("attributes", D, "uuid"),)),
    (f'device.attributes["{D}"].model.startsWith("A") || device.allowMultipleAllocations', (("attributes", D, "model"),)),
    ('"device.driver" == device.driver', ()),  # a literal that reads like a field only adds an entry
])
def test_entries_a_selector_reads(expression, entries):
    assert referenced_entries(expression) == entries


@pytest.mark.parametrize("expression", [
    f'device.attributes["{D}"].exists(k, k == "x")',  # a macro over the whole map
    f'"model" in device.attributes["{D}"]',  # the map itself
    f'device.attributes["{D}"].size() > 1',
    f'device.attributes["{D}"]["model"] == "x"',  # index syntax
    f'device.attributes["{D}"].?model.orValue("") == "x"',  # optional syntax
    f"device.attributes['{D}'].model == 'x'",  # single quotes
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

"""The AST round trip and the rewrite that gives device maps Kubernetes' empty-map default."""

from __future__ import annotations

import pytest

from draplane.api.quantity import parse_quantity
from draplane.cel import CELCompileError, CELDevice, CELRuntimeError, compile_selector
from draplane.cel.ast import decode_serialized, encode_parsed
from draplane.cel.library import new_runtime_env

DEVICE = CELDevice(
    "gpu.nvidia.com",
    {"gpu.nvidia.com": {"model": "A100"}},
    {"gpu.nvidia.com": {"memory": parse_quantity("80Gi")}},
)


@pytest.mark.parametrize(
    "expression",
    [
        '[1, 2].all(x, x > 0) && {"a": 1}[?"a"].orValue(2) == 1',
        'b"ab" != b"" && 2u > 1u && null == null && -1.5 < 0.0 && "x" + "y" == "xy"',
        "cel.bind(x, [1, 2, 3].filter(i, i > 1), x.size() == 2) && [?optional.of(1)] == [1]",
        '"a,b".split(",").all(i, v, v.size() == 1) && {"k": [1]}.k[0] == 1',
        "9223372036854775807 > -9223372036854775807 - 1 && 18446744073709551615u > 0u",
    ],
)
def test_ast_round_trip_evaluates_the_same(expression):
    env = new_runtime_env()
    original = env.compile(expression, disable_check=True)
    again = env.deserialize(encode_parsed(decode_serialized(original.serialize())))
    assert original.eval(data={}).value() is True
    assert again.eval(data={}).value() is True


def matches(expression: str) -> bool:
    return compile_selector(expression).matches(DEVICE)


def test_missing_domain_is_an_empty_map():
    assert matches('device.attributes["other.example.com"].size() == 0')
    assert not matches('has(device.attributes["other.example.com"].model)')
    assert matches('device.attributes["other.example.com"].?model.orValue("none") == "none"')
    assert matches('device.capacity["other.example.com"][?"memory"].orValue(quantity("0")) == quantity("0")')
    with pytest.raises(CELRuntimeError, match="^no such key: model"):
        matches('device.attributes["other.example.com"].model == "A100"')


def test_presence_and_optional_lookups_of_a_domain_are_always_true():
    assert matches("has(device.attributes.anything)")
    assert matches('device.attributes[?"anything"].hasValue()')
    assert matches("device.capacity.?anything.hasValue()")


def test_membership_size_and_iteration_see_only_real_domains():
    assert not matches('"other.example.com" in device.attributes')
    assert matches('"gpu.nvidia.com" in device.capacity')
    assert matches("device.attributes.size() == 1")
    assert matches('device.attributes.all(d, d == "gpu.nvidia.com")')


def test_rewrite_follows_bind():
    assert matches('cel.bind(a, device.attributes, a["other.example.com"].size() == 0)')
    assert matches('cel.bind(d, device, d.capacity["other"].size() == 0 && d.driver == "gpu.nvidia.com")')
    assert matches('cel.bind(g, device.attributes["gpu.nvidia.com"], g.model == "A100")')


def test_a_local_named_device_is_not_the_device():
    # Inside the comprehension, `device` is a map from the list, not the device variable.
    assert matches('[{"attributes": {"x": {}}}].all(device, !has(device.attributes.y))')
    with pytest.raises(CELRuntimeError, match="no such key: y"):
        matches('[{"attributes": {"x": {}}}].all(device, device.attributes.y.size() == 0)')


def test_device_fields_are_checked_through_bind():
    with pytest.raises(CELCompileError, match="undefined field 'nosuch'") as caught:
        compile_selector("cel.bind(d, device, d.nosuch == 1)")
    assert caught.value.reason == "type"
    with pytest.raises(CELCompileError, match=r"found no matching overload for '_\[_\]' applied to '\(kubernetes.DRADevice, string\)'"):
        compile_selector('device["driver"] == "x"')


def test_homogeneous_literals():
    with pytest.raises(CELCompileError, match="expected type 'int' but found 'string'"):
        compile_selector("[1, 'a'].size() == 2")
    with pytest.raises(CELCompileError, match="expected type 'list\\(int\\)' but found 'list\\(string\\)'"):
        compile_selector("[[1], ['a']].size() == 2")
    with pytest.raises(CELCompileError, match="expected type 'string' but found 'int'"):
        compile_selector("{'a': 1, 2: 1}.size() == 2")
    # string.format takes mixed lists.
    assert matches("'%s %d'.format(['a', 1]) == 'a 1'")


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("1 +", "syntax"),
        ("device.nosuch", "type"),
        ("device.driver", "result"),
        ("device.attributes.all(a, device.attributes.all(b, device.attributes.all(c, device.attributes.all(d, a != d))))", "cost"),
        ("true" + " " * 10241, "length"),
    ],
)
def test_compile_errors_say_why(expression, reason):
    with pytest.raises(CELCompileError) as caught:
        compile_selector(expression)
    assert caught.value.reason == reason

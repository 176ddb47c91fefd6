"""Fuzzing draplane.cel: compile_selector on random and near-valid text, and evaluation of what
compiles against devices, some of them odd.

Property: compiling raises CELCompileError or gives a program; evaluating gives a bool or raises
CELRuntimeError; nothing else comes out, nothing runs without bound (the cost limit bounds CEL's own
work; the Python functions behind the Kubernetes libraries must be as bounded). Counts: see
tests/fuzzing.py.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from draplane.api.resource import Device, DeviceAttribute, DeviceCapacity
from draplane.cel import CELCompileError, CELRuntimeError, compile_selector, device_for_cel
from fuzzing import bounded, fuzz, profile_drivers

from kubernetes_cases import CASES, DEVICES
from test_cel_kubernetes_parity import CEL_DEVICES

ODD = Device(
    name="odd",
    attributes={
        "s": DeviceAttribute(string_value="a" * 63 + "!"),  # the longest string attribute there is
        "empty": DeviceAttribute(string_value=""),
        "unicode": DeviceAttribute(string_value="é💥\u2028"),
        "big": DeviceAttribute(int_value=2**63 - 1),
        "small": DeviceAttribute(int_value=-(2**63)),
        "v": DeviceAttribute(version_value="0.0.0-0+0"),
        "t": DeviceAttribute(bool_value=True),
        "other.example.com/x": DeviceAttribute(string_value="x"),
    },
    capacity={"huge": DeviceCapacity(value="9223372036854775807"), "milli": DeviceCapacity(value="1m"),
              "exp": DeviceCapacity(value="1e3"), "zero": DeviceCapacity(value="0")},
)
DEVICES_TO_TRY = [*CEL_DEVICES.values(), device_for_cel("gpu.nvidia.com", ODD)] + [
    device_for_cel(d.driver, device) for d in profile_drivers("a100-mig") for device in d.devices[:2]]

SEEDS = sorted({expression for expression, _ in CASES})

# Pieces of CEL, so random text gets past the lexer and into the checker, the rewrites and the runtime.
TOKENS = [
    "device", ".", "attributes", "capacity", "driver", "allowMultipleAllocations", '["gpu.nvidia.com"]',
    '["resource.kubernetes.io"]', "[", "]", "(", ")", "{", "}", ",", ":", "?", "!", "-", "+", "*", "/", "%",
    "==", "!=", "<", "<=", ">", ">=", "&&", "||", " in ", "true", "false", "null", "0", "1", "-1", "1u", "1.5",
    "9223372036854775807", "18446744073709551615u", "1e308", '""', '"a"', "'x'", 'b"\\xff"', "r'\\d'",
    "quantity", "semver", "isGreaterThan", "isLessThan", "compareTo", "add", "sub", "asInteger", "isInteger",
    "asApproximateFloat", "sign", "major", "matches", "find", "findAll", "'(a+)+$'", "'(a|a)*b'", "'['",
    "size", "string", "int", "uint", "double", "bytes", "type", "dyn", "has", "all", "exists", "exists_one",
    "map", "filter", "x", "cel.bind", "optional.of", "orValue", "?.", "[?", "ip", "cidr", "isSorted", "sum",
    "min", "max", "indexOf", "lastIndexOf", "split", "substring", "charAt", "replace", "format", "join",
    "lowerAscii", "transformMap", "sets.contains", "lists.range", "timestamp", "duration",
    "memory", "productName", "type", "index", "driverVersion", '"40Gi"', '"1.0.0"', "' '",
]


def check(expression: str) -> None:
    with bounded():
        try:
            program = compile_selector(expression)
        except CELCompileError as exc:
            assert exc.message and exc.reason in ("length", "syntax", "type", "result", "cost", "internal")
            assert exc.reason != "internal", exc.message  # the checker accepted it and draplane failed
            return
        for device in DEVICES_TO_TRY:
            try:
                assert program.matches(device) in (True, False)
            except CELRuntimeError as exc:
                assert exc.message


@fuzz(300)
@given(st.text(max_size=80) | st.lists(st.sampled_from(TOKENS), max_size=25).map("".join))
@example('"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!".find("(a+)+$") == ""')  # backtracking: ran for minutes
@example('device.attributes["gpu.nvidia.com"].s.findAll("(a|a)*b").size() == 0')
@example("x" * 10 * 1024 + "x")  # past the length limit
@example("[" * 200 + "]" * 200)
@example("1" + " + 1" * 3000)
def test_random_selectors_compile_or_fail_cleanly(expression):
    check(expression)


_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|\b\d+(?:\.\d+)?u?\b')
LITERALS = {
    "string": ['""', '"a"', '"' + "a" * 64 + '"', '"(a+)+$"', '"["', '"\\u0000"', '"💥"', '"1.0.0"', '"1.0.0-rc.1+b"',
               '"40Gi"', '"1e3"', '"-1"', '"0.000001m"', '"9223372036854775807"', '"x.example.com"', '"10.0.0.1"',
               '"::1"', '"10.0.0.0/8"'],
    "number": ["0", "1", "-1", "2", "9223372036854775807", "18446744073709551615u", "1.5", "1e308", "0u", "64"],
}


@st.composite
def edited_selectors(draw):
    """A selector Kubernetes' own tests use, with a few tokens inserted, deleted or swapped."""
    text = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace", "repeat", "literal", "literal"]))
        token = draw(st.sampled_from(TOKENS))
        literals = list(_LITERAL.finditer(text))
        if op == "literal" and literals:  # another literal of the same kind: still compiles, mostly
            found = draw(st.sampled_from(literals))
            kind = "string" if found.group(0)[0] in "\"'" else "number"
            text = text[:found.start()] + draw(st.sampled_from(LITERALS[kind])) + text[found.end():]
        elif op == "insert":
            text = text[:at] + token + text[at:]
        elif op == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 8)):]
        elif op == "replace":
            text = text[:at] + token + text[at + len(token):]
        else:  # a part of it again and again: long chains, deep nesting
            piece = text[at:at + draw(st.integers(1, 12))]
            text = text[:at] + piece * draw(st.sampled_from([2, 10, 100])) + text[at:]
    return text


@fuzz(300)
@given(edited_selectors())
def test_edited_selectors_compile_or_fail_cleanly(expression):
    check(expression)


@pytest.mark.parametrize("expression", [
    '"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!".find("(a+)+$") == ""',
    'device.attributes["gpu.nvidia.com"].s.find("(a+)+$") == ""',
    'device.attributes["gpu.nvidia.com"].s.findAll("(a|aa)+$").size() == 0',
])
def test_catastrophic_regexes_match_in_linear_time(expression):
    """Python's re backtracks: each `a` more doubled the time (24 of them took 4 s). RE2 does not."""
    with bounded(5):
        assert compile_selector(expression).matches(device_for_cel("gpu.nvidia.com", ODD)) is True


@pytest.mark.parametrize("expression, expected", [
    ("'abc'.find('[bc]+') == 'bc'", True),
    (r"'x1 y22'.findAll('\\d+') == ['1', '22']", True),
    (r"'é1'.find('\\w') == '1'", True),  # \w is ASCII, as in Go
    ("'aaa'.findAll('a', 2) == ['a', 'a']", True),
    ("'baaab'.findAll('a*') == ['', 'aaa', '']", True),  # Go drops the empty match right after "aaa"
])
def test_find_still_answers_as_kubernetes(expression, expected):
    assert compile_selector(expression).matches(CEL_DEVICES["bare"]) is expected


def test_seeds_are_the_oracle_cases():
    assert len(SEEDS) > 300 and set(DEVICES) <= set(CEL_DEVICES)

"""draplane.cel against Kubernetes' own DRA CEL compiler, case by case.

kubernetes_results.json was produced by k8s.io/dynamic-resource-allocation v0.37.2 (the Go program
in kubernetes_oracle/) from the cases in kubernetes_cases.py. Every case must have the same
outcome here — compile error, runtime error, or the same bool — and the same message, except the
differences listed below with their reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draplane.api.resource import Device, DeviceAttribute, DeviceCapacity
from draplane.cel import CELCompileError, CELRuntimeError, compile_selector, device_for_cel

from kubernetes_cases import CASES, DEVICES

RESULTS = json.loads((Path(__file__).parent / "kubernetes_results.json").read_text())

_G = 'device.attributes["gpu.nvidia.com"]'

# Outcome differs from Kubernetes. Each is a limit of the engine, documented in README.md.
OUTCOME_DIFFERENCES = {
    # A cel-go panic ("hash of unhashable type cel.Semver"): its `in` over a constant list hashes.
    f"{_G}.driverVersion in ['550.54.15']": "false here; an internal error (a cel-go bug) in Kubernetes",
    # cel-go checks string.format's arguments against the format string at compile time.
    "'%s'.format([1, 'a']) != ''": "format argument count is checked at evaluation, not compile time",
    # Kubernetes libraries cel-cpp does not provide.
    "url('https://x.io').getHost() == 'x.io'": "url library not provided",
}

# Same outcome, different message text.
MESSAGE_DIFFERENCES = {
    'quantity("1").sign() == 1': "cel-cpp: undeclared reference to 'sign' (cel-go names the receiver type)",
    "[1, 'a'] == [1, 'a']": "cel-cpp words heterogeneous list literals differently",
}


def _slice_device(spec: dict) -> Device:
    attributes = {}
    for name, value in spec["attributes"].items():
        kind, raw = next(iter(value.items()))
        field = {"int": "int_value", "bool": "bool_value", "string": "string_value", "version": "version_value"}[kind]
        attributes[name] = DeviceAttribute(**{field: raw})
    capacity = {name: DeviceCapacity(value=q) for name, q in spec["capacity"].items()}
    return Device(
        name="d", attributes=attributes, capacity=capacity,
        allow_multiple_allocations=spec.get("allowMultipleAllocations"),
    )


CEL_DEVICES = {name: device_for_cel(spec["driver"], _slice_device(spec)) for name, spec in DEVICES.items()}


def _ours(expression: str, device: str) -> tuple[str, object]:
    try:
        program = compile_selector(expression)
    except CELCompileError as err:
        return "compile", err.message
    try:
        return "result", program.matches(CEL_DEVICES[device])
    except CELRuntimeError as err:
        return "runtime", err.message


def _theirs(record: dict) -> tuple[str, object]:
    if "compileError" in record:
        return "compile", record["compileError"]
    if "runtimeError" in record:
        return "runtime", record["runtimeError"]
    return "result", record["result"]


def test_recorded_results_match_the_cases():
    recorded = [(r["expression"], r["device"]) for r in RESULTS]
    assert recorded == list(CASES), "kubernetes_results.json is stale: regenerate it (see kubernetes_cases.py)"


@pytest.mark.parametrize("record", RESULTS, ids=[f"{i}" for i in range(len(RESULTS))])
def test_same_outcome_as_kubernetes(record):
    expression = record["expression"]
    if expression in OUTCOME_DIFFERENCES:
        pytest.skip(OUTCOME_DIFFERENCES[expression])
    ours_kind, ours_value = _ours(expression, record["device"])
    theirs_kind, theirs_value = _theirs(record)
    if theirs_kind == "runtime" and "actual cost limit exceeded" in theirs_value:
        # Kubernetes' estimate already exceeds the limit: the apiserver rejects these at creation.
        assert record["maxCost"] > 1_000_000
        assert ours_kind == "compile" and "too complex, exceeds cost limit" in ours_value
        return
    if theirs_kind != "compile" and record["maxCost"] > 1_000_000:
        assert ours_kind == "compile" and "too complex, exceeds cost limit" in ours_value, (expression, ours_value)
        return
    assert ours_kind == theirs_kind, (expression, ours_value, theirs_value)
    if ours_kind != "compile":
        assert compile_selector(expression).max_cost == record["maxCost"], expression
    if ours_kind == "result":
        assert ours_value == theirs_value, expression
    elif expression not in MESSAGE_DIFFERENCES:
        assert ours_value == theirs_value, expression

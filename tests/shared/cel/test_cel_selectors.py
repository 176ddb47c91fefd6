"""Device selectors compiled and evaluated as the apiserver and kube-scheduler do it."""

from __future__ import annotations

import pytest

from draplane.api.quantity import parse_quantity
from draplane.cel import (
    MAX_EXPRESSION_LENGTH,
    CELCompileError,
    CELDevice,
    CELRuntimeError,
    compile_selector,
    parse_semver,
)

GPU = "gpu.nvidia.com"


@pytest.fixture(scope="module")
def gpu() -> CELDevice:
    return CELDevice(
        GPU,
        attributes={
            GPU: {
                "type": "gpu",
                "productName": "NVIDIA A100-SXM4-80GB",
                "index": 3,
                "mig": False,
                "driverVersion": parse_semver("550.54.15"),
                "cudaComputeCapability": parse_semver("8.0.0"),
            },
            "resource.kubernetes.io": {"pcieRoot": "pci0000:00", "numaNode": 1},
        },
        capacity={GPU: {"memory": parse_quantity("80Gi")}},
    )


def matches(expression: str, device: CELDevice) -> bool:
    return compile_selector(expression).matches(device)


# --- compile-time type checking ------------------------------------------------------------------


def test_seed_expression_fails_type_check_at_compile_time():
    with pytest.raises(CELCompileError) as caught:
        compile_selector('device.capacity["memory"].isGreaterThan(quantity("40Gi"))')
    message = caught.value.message
    assert message.startswith("compilation failed: ERROR: <input>:1:40: ")
    assert (
        "found no matching overload for 'isGreaterThan' applied to "
        "'map(string, kubernetes.Quantity).(kubernetes.Quantity)'" in message
    )
    assert caught.value.expression == 'device.capacity["memory"].isGreaterThan(quantity("40Gi"))'


def test_corrected_seed_expressions_compile_and_match(gpu):
    assert matches('device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))', gpu)
    driver_neutral = (
        '"memory" in device.capacity[device.driver] && '
        'device.capacity[device.driver].memory.isGreaterThan(quantity("40Gi"))'
    )
    assert matches(driver_neutral, gpu)
    assert not matches('device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("80Gi"))', gpu)


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("device.driver", "must evaluate to bool or the unknown type, not string"),
        ("1 + 2", "must evaluate to bool or the unknown type, not int"),
        ('quantity("1")', "must evaluate to bool or the unknown type, not kubernetes.Quantity"),
        ("device.capacity", "not map(string, map(string, kubernetes.Quantity))"),
    ],
)
def test_non_bool_result_is_a_compile_error(expression, expected):
    with pytest.raises(CELCompileError) as caught:
        compile_selector(expression)
    assert expected in caught.value.message


def test_syntax_error_is_a_compile_error():
    with pytest.raises(CELCompileError) as caught:
        compile_selector('device.driver == "a" &&')
    assert "Syntax error" in caught.value.message
    assert caught.value.message.startswith("compilation failed: ERROR: <input>:1:")


def test_unknown_device_field_is_a_compile_error():
    with pytest.raises(CELCompileError) as caught:
        compile_selector("device.model == 1")
    assert "undefined field 'model'" in caught.value.message


def test_undeclared_function_is_a_compile_error():
    with pytest.raises(CELCompileError) as caught:
        compile_selector('nosuchfunction("x")')
    assert "undeclared reference to 'nosuchfunction'" in caught.value.message


def test_wrong_argument_types_are_compile_errors():
    for expression in (
        'quantity(1) == quantity("1")',
        'device.driver.isGreaterThan("a")',
        'semver("1.0.0").isGreaterThan(quantity("1"))',
        "device.allowMultipleAllocations == 1",
    ):
        with pytest.raises(CELCompileError, match="found no matching overload"):
            compile_selector(expression)
    # sign is a global function in Kubernetes, not a member.
    with pytest.raises(CELCompileError, match="'sign'"):
        compile_selector('quantity("1").sign() == 1')


def test_has_on_device_fields_type_checks_as_bool(gpu):
    assert matches('has(device.driver) && has(device.attributes) && has(device.capacity)', gpu)
    assert matches("has(device.allowMultipleAllocations)", gpu)


# --- runtime errors and guards -------------------------------------------------------------------


def test_missing_attribute_is_a_runtime_error_with_kubernetes_hint(gpu):
    with pytest.raises(CELRuntimeError) as caught:
        matches('device.attributes["gpu.nvidia.com"].nosuch == "x"', gpu)
    assert caught.value.message.startswith("no such key: nosuch")
    assert "consider using CEL optional chaining" in caught.value.message


def test_has_and_in_and_optional_guard_missing_attributes(gpu):
    assert not matches('has(device.attributes["gpu.nvidia.com"].nosuch)', gpu)
    assert matches('!has(device.attributes["gpu.nvidia.com"].nosuch) || device.attributes["gpu.nvidia.com"].nosuch', gpu)
    assert not matches('"nosuch" in device.attributes["gpu.nvidia.com"]', gpu)
    assert matches('device.attributes["gpu.nvidia.com"][?"nosuch"].orValue(7) == 7', gpu)
    assert matches('device.attributes["gpu.nvidia.com"].?nosuch.orValue("none") == "none"', gpu)
    assert matches('device.attributes["gpu.nvidia.com"].?type.orValue("none") == "gpu"', gpu)


def test_non_bool_attribute_result_fails_at_evaluation(gpu):
    program = compile_selector('device.attributes["gpu.nvidia.com"].type')
    with pytest.raises(CELRuntimeError, match="CEL result of type string could not be converted to bool"):
        program.matches(gpu)
    assert compile_selector('device.attributes["gpu.nvidia.com"].mig').matches(gpu) is False


def test_bad_quantity_literal_is_a_runtime_error(gpu):
    with pytest.raises(CELRuntimeError, match="quantities must match the regular expression"):
        matches('device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("forty"))', gpu)


def test_runtime_overload_mismatch_through_dyn(gpu):
    # Attribute values are typed dyn; a string has no isGreaterThan, as in Kubernetes.
    with pytest.raises(CELRuntimeError, match="no such overload"):
        matches('device.attributes["gpu.nvidia.com"].type.isGreaterThan(semver("1.0.0"))', gpu)


def test_invalid_device_fails_every_selector():
    device = CELDevice(GPU, invalid="attribute driverVersion: parse semantic version: Version string empty")
    with pytest.raises(CELRuntimeError, match="parse semantic version"):
        matches("true", device)


# --- names ----------------------------------------------------------------------------------------


def test_qualified_and_unqualified_attributes(gpu):
    assert matches('device.attributes["resource.kubernetes.io"].pcieRoot == "pci0000:00"', gpu)
    assert matches('device.attributes["gpu.nvidia.com"].index == 3', gpu)
    assert matches('device.attributes[device.driver].type == "gpu"', gpu)
    assert matches('device.driver == "gpu.nvidia.com"', gpu)
    assert matches("!device.allowMultipleAllocations", gpu)


# --- extension libraries ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression",
    [
        # quantity library
        'quantity("1Gi") == quantity("1024Mi")',
        'quantity("1Gi").isGreaterThan(quantity("1000Mi"))',
        'quantity("1G").isLessThan(quantity("1Gi"))',
        'quantity("1k").compareTo(quantity("1000")) == 0',
        'quantity("500m").compareTo(quantity("1")) == -1',
        'quantity("2").compareTo(quantity("1500m")) == 1',
        'isQuantity("10Mi") && !isQuantity("ten")',
        'sign(quantity("-1")) == -1 && sign(quantity("0")) == 0 && sign(quantity("3Ki")) == 1',
        'quantity("1Ki").isInteger() && !quantity("500m").isInteger()',
        'quantity("1Ki").asInteger() == 1024',
        'quantity("1.5").asApproximateFloat() == 1.5',
        'quantity("1Gi").add(quantity("1Gi")) == quantity("2Gi")',
        'quantity("1Gi").add(1) == quantity("1073741825")',
        'quantity("1Gi").sub(quantity("512Mi")) == quantity("512Mi")',
        'quantity("10").sub(3) == quantity("7")',
        'quantity("1e3") == quantity("1k")',
        # semver library
        'semver("1.2.3").major() == 1 && semver("1.2.3").minor() == 2 && semver("1.2.3").patch() == 3',
        'semver("1.10.0").isGreaterThan(semver("1.9.9"))',
        'semver("1.0.0-alpha").isLessThan(semver("1.0.0"))',
        'semver("1.0.0-alpha.1").isLessThan(semver("1.0.0-alpha.beta"))',
        'semver("1.0.0-2").isLessThan(semver("1.0.0-10"))',
        'semver("1.0.0+build1") == semver("1.0.0+build2")',
        'semver("1.0.0").compareTo(semver("1.0.0+meta")) == 0',
        'isSemver("1.2.3") && !isSemver("1.2") && !isSemver("01.2.3")',
        'isSemver("v1.2", true) && semver("v01.2", true) == semver("1.2.0")',
        # strings (v2)
        '"a,b".split(",") == ["a", "b"]',
        '"Hello".lowerAscii() == "hello" && "x".upperAscii() == "X"',
        '"abc".charAt(1) == "b" && "abcabc".lastIndexOf("c") == 5 && "abc".indexOf("c") == 2',
        '"  x ".trim() == "x" && "aXa".replace("X", "b") == "aba" && "abc".substring(1, 2) == "b"',
        '"%s-%d".format(["a", 1]) == "a-1"',
        'strings.quote("a") == "\\"a\\""',
        '"abc".startsWith("a") && "abc".endsWith("c") && "abc".contains("b") && "abc".matches("^a.c$")',
        # lists (v3)
        "[3, 1, 2].sort() == [1, 2, 3]",
        "[1, 2, 3].slice(1, 2) == [2]",
        "lists.range(3) == [0, 1, 2]",
        "[1, 1, 2].distinct() == [1, 2]",
        "[[1], [2]].flatten() == [1, 2]",
        "[1, 2].reverse() == [2, 1]",
        "[2, 1].sortBy(x, x) == [1, 2]",
        "[1, 2].first().value() == 1 && [1, 2].last().value() == 2",
        # sets
        "sets.contains([1, 2, 3], [1, 2])",
        "sets.equivalent([1, 2], [2, 1, 1])",
        "sets.intersects([1, 2], [2, 3])",
        # comprehensions, two-variable comprehensions, bind, optional
        "[1, 2, 3].exists(x, x == 2) && [1, 2].all(x, x > 0) && [1, 2].exists_one(x, x == 1)",
        "[1, 2].map(x, x * 2) == [2, 4] && [1, 2, 3].filter(x, x > 1) == [2, 3]",
        "[1, 2].all(i, v, v > i)",
        "{'a': 1}.exists(k, v, k == 'a' && v == 1)",
        "[1, 2].transformList(i, v, v + i) == [1, 3]",
        "cel.bind(x, 2, x * x == 4)",
        "optional.of(1).hasValue() && !optional.none().hasValue()",
        "{'a': 1}[?'b'].orValue(5) == 5",
        # cross-type numeric comparisons
        "1 < 2.5 && 2u > 1 && 3.0 >= 3",
    ],
)
def test_extension_functions(gpu, expression):
    assert matches(expression, gpu), expression


def test_semver_attribute_comparisons(gpu):
    assert matches('device.attributes["gpu.nvidia.com"].driverVersion.isGreaterThan(semver("550.0.0"))', gpu)
    assert matches('device.attributes["gpu.nvidia.com"].driverVersion == semver("550.54.15+anything")', gpu)
    assert matches('device.attributes["gpu.nvidia.com"].cudaComputeCapability.compareTo(semver("8.0.0")) == 0', gpu)
    assert matches('device.attributes["gpu.nvidia.com"].driverVersion.major() >= 550', gpu)
    # A version attribute is not a string: cel-go's Semver.Equal fails, its != says true.
    with pytest.raises(CELRuntimeError, match="^no such overload$"):
        matches('device.attributes["gpu.nvidia.com"].driverVersion == "550.54.15"', gpu)
    assert matches('device.attributes["gpu.nvidia.com"].driverVersion != "550.54.15"', gpu)
    assert not matches('"550.54.15" == device.attributes["gpu.nvidia.com"].driverVersion', gpu)


def test_quantity_capacity_comparisons_across_suffixes(gpu):
    memory = 'device.capacity["gpu.nvidia.com"].memory'
    assert matches(f'{memory} == quantity("81920Mi")', gpu)
    assert matches(f'{memory}.isGreaterThan(quantity("80G"))', gpu)  # 80Gi > 80G
    assert matches(f'{memory}.isLessThan(quantity("0.1Ti"))', gpu)
    assert matches(f'{memory}.compareTo(quantity("85899345920")) == 0', gpu)
    assert matches(f'{memory}.sub(quantity("40Gi")).isGreaterThan(quantity("39Gi"))', gpu)


# --- limits and caching -------------------------------------------------------------------------------


def test_cost_limit_rejects_what_the_apiserver_rejects():
    # Three nested loops over the 32 x 32 attribute maps: about 68 million by Kubernetes' estimate.
    nested = (
        "device.attributes.all(a, device.attributes.all(b, device.attributes.all(c, "
        "device.attributes.all(d, a + b + c + d != ''))))"
    )
    with pytest.raises(CELCompileError, match="too complex, exceeds cost limit"):
        compile_selector(nested)
    # join() has no size bound for list literals in cel-go's model, so Kubernetes rejects it too.
    with pytest.raises(CELCompileError, match="too complex, exceeds cost limit"):
        compile_selector('["a", "b"].join("-") == "a-b"')
    # Two levels are fine, and the estimate is the apiserver's.
    program = compile_selector("device.attributes.all(k, device.attributes[k].all(i, device.attributes[k][i] != 'zz'))")
    assert program.max_cost == 10499


def test_cost_estimate_matches_kubernetes_for_simple_selectors():
    assert compile_selector('device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))').max_cost == 6
    assert compile_selector('has(device.driver) && true').max_cost == 1
    assert compile_selector('device.attributes["gpu.nvidia.com"].type.matches("^g.*")').max_cost == 11


def test_expression_length_limit():
    long_true = "true" + " " * (MAX_EXPRESSION_LENGTH - 4)
    assert compile_selector(long_true).expression == long_true
    too_long = long_true + " "
    with pytest.raises(CELCompileError, match="may not be more than 10240 bytes"):
        compile_selector(too_long)
    # Bytes, not characters, as Go's len() counts them.
    multibyte = 'device.driver == "' + "é" * 5200 + '"'
    assert len(multibyte) < MAX_EXPRESSION_LENGTH < len(multibyte.encode())
    with pytest.raises(CELCompileError, match="may not be more than 10240 bytes"):
        compile_selector(multibyte)


def test_compilation_is_cached_per_expression():
    first = compile_selector('device.driver == "cached.example.com"')
    assert compile_selector('device.driver == "cached.example.com"') is first
    assert compile_selector('device.driver == "other.example.com"') is not first


def test_an_expression_that_is_not_a_string_is_a_compile_error():
    for bad in (None, 42, ["device.driver == 'x'"]):
        with pytest.raises(CELCompileError, match="expression must be a string"):
            compile_selector(bad)


def test_failed_compilations_raise_every_time():
    for _ in range(2):
        with pytest.raises(CELCompileError):
            compile_selector("device.nosuch")

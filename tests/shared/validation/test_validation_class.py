"""DeviceClass rules, including CEL compile and type errors through draplane.cel."""

from draplane.validation import validate_object
from draplane.validation.problem import INVALID, REQUIRED, TOO_LONG, TOO_MANY


def test_valid_class_has_no_problems(build):
    assert validate_object(build.device_class(
        'device.driver == "gpu.nvidia.com"',
        'device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))',
        config=[{"opaque": {"driver": "gpu.nvidia.com", "parameters": {"kind": "GpuConfig"}}}],
        extendedResourceName="example.com/gpu",
    )) == []


def test_class_name_is_a_dns_subdomain(build):
    problems = validate_object(build.device_class(name="High_Memory_GPU"))
    assert [(p.field, p.reason) for p in problems] == [("metadata.name", INVALID)]
    assert problems[0].fix == "name: high-memory-gpu"


def test_a_namespace_on_a_class_is_ignored_like_the_apiserver_does(build):
    obj = build.device_class()
    obj["metadata"]["namespace"] = "Not_A_Namespace"
    assert validate_object(obj) == []


def test_selector_needs_cel(build):
    obj = build.device_class()
    obj["spec"]["selectors"] = [{}]
    problems = validate_object(obj)
    assert [(p.field, p.reason) for p in problems] == [("spec.selectors[0].cel", REQUIRED)]


def test_cel_syntax_error(build):
    problems = validate_object(build.device_class('device.driver == "gpu.nvidia.com" &&'))
    assert [(p.field, p.reason) for p in problems] == [("spec.selectors[0].cel.expression", INVALID)]
    assert "does not compile" in problems[0].message


def test_cel_type_error(build):
    problems = validate_object(build.device_class('device.driver > 3'))
    assert [(p.field, p.reason) for p in problems] == [("spec.selectors[0].cel.expression", INVALID)]


def test_cel_non_bool_result_is_an_error(build):
    problems = validate_object(build.device_class("device.driver"))
    assert [p.field for p in problems] == ["spec.selectors[0].cel.expression"]


def test_bare_capacity_name_gets_both_corrected_expressions(build):
    problems = validate_object(build.device_class('device.capacity["memory"].isGreaterThan(quantity("40Gi"))'))
    assert [(p.field, p.reason) for p in problems] == [("spec.selectors[0].cel.expression", INVALID)]
    assert 'device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))' in problems[0].fix
    assert ('"memory" in device.capacity[device.driver] && '
            'device.capacity[device.driver].memory.isGreaterThan(quantity("40Gi"))') in problems[0].fix
    assert "keyed by domain first" in problems[0].message


def test_bare_attribute_name_uses_the_domain_of_known_slices(build):
    from draplane.validation import validate_objects

    slice_ = build.slice([{"name": "nic-0", "attributes": {"speed": {"int": 100}}}], driver="nic.example.com")
    cls = build.device_class("device.attributes['speed'] > 10")
    problems = validate_objects([("a.yaml", slice_), ("b.yaml", cls)])
    assert [p.field for p in problems] == ["spec.selectors[0].cel.expression"]
    assert 'device.attributes["nic.example.com"].speed > 10' in problems[0].fix
    assert problems[0].source == "b.yaml"


def test_expression_length_limit(build):
    long_expression = " || ".join(['device.driver == "gpu.nvidia.com"'] * 400)
    assert len(long_expression) > 10 * 1024
    problems = validate_object(build.device_class(long_expression))
    assert [(p.field, p.reason) for p in problems] == [("spec.selectors[0].cel.expression", TOO_LONG)]


def test_selector_count_limit(build):
    problems = validate_object(build.device_class(*['device.driver == "a.b"'] * 33))
    assert [(p.field, p.reason) for p in problems] == [("spec.selectors", TOO_MANY)]


def test_config_and_extended_resource_name(build):
    obj = build.device_class(config=[{}], extendedResourceName="gpu")
    problems = validate_object(obj)
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.config[0].opaque", REQUIRED), ("spec.extendedResourceName", INVALID)]


def test_claim_selectors_are_compiled_too(build):
    request = build.exact("gpu", selectors=[{"cel": {"expression": 'device.capacity["memory"] > 1'}}])
    problems = validate_object(build.claim([request]))
    assert [p.field for p in problems] == ["spec.devices.requests[0].exactly.selectors[0].cel.expression"]

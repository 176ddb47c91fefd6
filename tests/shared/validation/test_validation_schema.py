"""The decoder's view: unknown fields and wrong types, reported with the field path, on raw input."""

import datetime

import msgspec

from draplane.api.codec import decode_object
from draplane.validation import validate_object, validate_typed
from draplane.validation.problem import UNKNOWN_FIELD, WRONG_TYPE


def test_unknown_field_with_a_close_name_suggests_it(build):
    claim = build.claim([{"name": "gpu", "exactly": {"deviceClassName": "c", "cuont": 1}}])
    problems = validate_object(claim)
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests[0].exactly.cuont", UNKNOWN_FIELD)]
    assert "'count'" in problems[0].fix


def test_unknown_field_without_a_close_name_lists_the_fields(build):
    obj = build.device_class()
    obj["spec"]["suitableNodes"] = {}
    problems = validate_object(obj)
    assert [(p.field, p.reason) for p in problems] == [("spec.suitableNodes", UNKNOWN_FIELD)]
    assert "selectors" in problems[0].fix


def test_field_names_are_case_sensitive(build):
    claim = build.claim([{"name": "gpu", "exactly": {"DeviceClassName": "c"}}])
    problems = validate_object(claim)
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.devices.requests[0].exactly.DeviceClassName", UNKNOWN_FIELD),
        ("spec.devices.requests[0].exactly.deviceClassName", "Required value"),
    ]
    assert "'deviceClassName'" in problems[0].fix


def test_v1beta1_request_shape_is_one_problem_with_the_exactly_snippet(build):
    claim = build.claim([{"name": "gpu", "deviceClassName": "c", "count": 2, "selectors": []}])
    problems = validate_object(claim)
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests[0]", UNKNOWN_FIELD)]
    problem = problems[0]
    for moved in ("deviceClassName", "count", "selectors"):
        assert f"spec.devices.requests[0].{moved}" in problem.message
    assert "exactly:\n    deviceClassName: c\n    count: 2\n    selectors: []" in problem.fix


def test_wrong_types(build):
    claim = build.claim([{"name": "gpu", "exactly": {"deviceClassName": "c", "count": "2", "adminAccess": "true"}}])
    problems = validate_object(claim)
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.devices.requests[0].exactly.count", WRONG_TYPE),
        ("spec.devices.requests[0].exactly.adminAccess", WRONG_TYPE),
    ]
    assert problems[0].fix == "remove the quotes: 2"
    assert problems[1].fix == "remove the quotes: true"


def test_list_where_a_mapping_belongs_and_back(build):
    obj = build.device_class()
    obj["spec"]["selectors"] = {"cel": {"expression": "true"}}
    problems = validate_object(obj)
    assert [(p.field, p.reason) for p in problems] == [("spec.selectors", WRONG_TYPE)]
    claim = build.claim()
    claim["spec"]["devices"] = ["gpu"]
    assert [(p.field, p.reason) for p in validate_object(claim)] == [("spec.devices", WRONG_TYPE)]


def test_bad_quantity(build):
    device = build.device("gpu-0")
    device["capacity"]["memory"] = {"value": "80 GB"}
    problems = validate_object(build.slice([device]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices[0].capacity[memory].value", WRONG_TYPE)]
    assert problems[0].fix == "value: 80Gi (binary, 1024-based, as memory is usually meant) or 80G (decimal)"


def test_numbers_are_accepted_as_quantities(build):
    device = build.device("gpu-0")
    device["capacity"]["cores"] = {"value": 132}
    assert validate_object(build.slice([device])) == []


def test_null_means_unset_and_yaml_timestamps_are_times(build):
    claim = build.claim(constraints=None)
    claim["metadata"]["creationTimestamp"] = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    assert validate_object(claim) == []


def test_string_field_given_a_number(build):
    obj = build.device_class()
    obj["metadata"]["name"] = 42
    problems = validate_object(obj)
    # An object that cannot be decoded is not validated further, as in the apiserver.
    assert [(p.field, p.reason) for p in problems] == [("metadata.name", WRONG_TYPE)]
    assert problems[0].fix == 'quote it: "42"'


def test_validate_typed_checks_decoded_models(build):
    bad = build.slice([build.device("gpu-0"), build.device("gpu-0")])
    obj = decode_object(bad)
    problems = validate_typed(obj)
    assert [(p.field, p.reason) for p in problems] == [("spec.devices[1]", "Duplicate value")]
    assert validate_typed(decode_object(build.slice())) == []
    assert isinstance(obj, msgspec.Struct)


def test_v1beta1_fields_next_to_exactly_are_merged_into_the_snippet(build):
    claim = build.claim([{"name": "gpu", "exactly": {"deviceClassName": "c"}, "count": 2}])
    problems = validate_object(claim)
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests[0]", UNKNOWN_FIELD)]
    assert "neither" not in problems[0].message
    assert problems[0].fix == "move it under exactly:\nrequests:\n- name: gpu\n  exactly:\n    deviceClassName: c\n    count: 2"


def test_v1beta1_shape_is_reported_even_in_an_oversized_request_list(build):
    requests = [build.exact(f"r{i}") for i in range(33)]
    requests[20] = {"name": "r20", "deviceClassName": "c"}
    problems = validate_object(build.claim(requests))
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.devices.requests[20]", UNKNOWN_FIELD), ("spec.devices.requests", "Too many")]

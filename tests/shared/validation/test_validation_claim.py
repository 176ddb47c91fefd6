"""ResourceClaim and ResourceClaimTemplate rules (validateDeviceClaim and friends)."""

from draplane.validation import validate_object
from draplane.validation.problem import DUPLICATE, FORBIDDEN, INVALID, REQUIRED, TOO_MANY, UNSUPPORTED


def test_valid_claim_has_no_problems(build):
    claim = build.claim([
        build.exact("gpu", count=2, selectors=[{"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}]),
        {"name": "nic", "firstAvailable": [
            {"name": "fast", "deviceClassName": "nic-class", "count": 1},
            {"name": "slow", "deviceClassName": "nic-class", "allocationMode": "All"},
        ]},
    ], constraints=[{"requests": ["gpu", "nic/fast"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}],
        config=[{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {"kind": "GpuConfig"}}}])
    assert validate_object(claim) == []


def test_32_requests_are_allowed_and_33_are_too_many(build):
    assert validate_object(build.claim([build.exact(f"r{i}") for i in range(32)])) == []
    problems = validate_object(build.claim([build.exact(f"r{i}") for i in range(33)]))
    # Like the apiserver, the oversized list is reported once, without looking at its entries.
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests", TOO_MANY)]
    assert "33" in problems[0].message and "32" in problems[0].message
    assert problems[0].fix


def test_duplicate_request_names(build):
    problems = validate_object(build.claim([build.exact("gpu"), build.exact("gpu")]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests[1]", DUPLICATE)]
    assert "requests[0]" in problems[0].message


def test_request_needs_exactly_or_first_available(build):
    problems = validate_object(build.claim([{"name": "gpu"}]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests[0]", REQUIRED)]
    assert "exactly" in problems[0].fix


def test_request_with_both_exactly_and_first_available(build):
    request = build.exact("gpu")
    request["firstAvailable"] = [{"name": "a", "deviceClassName": "x"}]
    problems = validate_object(build.claim([request]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests[0]", INVALID)]


def test_request_name_must_be_a_dns_label(build):
    problems = validate_object(build.claim([build.exact("GPU_0")]))
    assert build.fields(problems) == ["spec.devices.requests[0].name"]
    assert problems[0].fix == "name: gpu-0"


def test_device_class_name_required_and_formatted(build):
    problems = validate_object(build.claim([{"name": "gpu", "exactly": {"count": 1}}]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests[0].exactly.deviceClassName", REQUIRED)]
    problems = validate_object(build.claim([build.exact("gpu", class_name="High_Memory")]))
    assert build.fields(problems) == ["spec.devices.requests[0].exactly.deviceClassName"]


def test_allocation_mode_enum(build):
    problems = validate_object(build.claim([build.exact("gpu", allocationMode="Some")]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests[0].exactly.allocationMode", UNSUPPORTED)]
    assert '"All"' in problems[0].message and '"ExactCount"' in problems[0].message


def test_count_rules_after_defaulting(build):
    # count 0 / unset defaults to 1 for ExactCount, as SetDefaults_ExactDeviceRequest does.
    assert validate_object(build.claim([build.exact("gpu", count=0)])) == []
    assert validate_object(build.claim([build.exact("gpu", allocationMode="All")])) == []
    problems = validate_object(build.claim([build.exact("gpu", count=-1)]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests[0].exactly.count", INVALID)]
    assert "greater than zero" in problems[0].message
    problems = validate_object(build.claim([build.exact("gpu", allocationMode="All", count=2)]))
    assert build.fields(problems) == ["spec.devices.requests[0].exactly.count"]


def test_first_available_limits_and_duplicates(build):
    subs = [{"name": f"s{i}", "deviceClassName": "c"} for i in range(9)]
    problems = validate_object(build.claim([{"name": "gpu", "firstAvailable": subs}]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests[0].firstAvailable", TOO_MANY)]
    subs = [{"name": "s", "deviceClassName": "c"}, {"name": "s", "deviceClassName": "c"}]
    problems = validate_object(build.claim([{"name": "gpu", "firstAvailable": subs}]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests[0].firstAvailable[1]", DUPLICATE)]


def test_admin_access_is_forbidden_in_a_subrequest(build):
    subs = [{"name": "s", "deviceClassName": "c", "adminAccess": True}]
    problems = validate_object(build.claim([{"name": "gpu", "firstAvailable": subs}]))
    # adminAccess is not a DeviceSubRequest field at all: the schema reports it.
    assert build.fields(problems) == ["spec.devices.requests[0].firstAvailable[0].adminAccess"]


def test_tolerations(build):
    tolerations = [
        {"key": "example.com/unhealthy", "operator": "Exists", "effect": "NoExecute"},
        {"key": "k", "value": "v"},  # operator defaults to Equal
        {"operator": "Exists", "value": "v"},
        {"key": "k", "operator": "In"},
        {"key": "k", "operator": "Exists", "effect": "PreferNoSchedule"},
    ]
    problems = validate_object(build.claim([build.exact("gpu", tolerations=tolerations)]))
    base = "spec.devices.requests[0].exactly.tolerations"
    assert [(p.field, p.reason) for p in problems] == [
        (f"{base}[2].value", INVALID), (f"{base}[3].operator", UNSUPPORTED), (f"{base}[4].effect", UNSUPPORTED),
    ]
    assert "NoSchedule" in problems[2].fix
    # Documented as at most 16, but the v1.37 apiserver accepts more (see test_validation_apiserver.py).
    assert validate_object(build.claim([build.exact("gpu", tolerations=[{"operator": "Exists"}] * 17)])) == []


def test_constraints(build):
    requests = [build.exact("gpu"), build.exact("nic")]
    constraints = [
        {"requests": ["gpu", "nope"], "matchAttribute": "resource.kubernetes.io/pcieRoot"},
        {"matchAttribute": "pcieRoot"},
        {"requests": ["gpu"]},
        {"requests": ["gpu/a/b"], "distinctAttribute": "gpu.nvidia.com/uuid"},
        {"matchAttribute": "x.io/a", "distinctAttribute": "x.io/b"},  # accepted by the apiserver
    ]
    problems = validate_object(build.claim(requests, constraints=constraints))
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.devices.constraints[0].requests[1]", INVALID),
        ("spec.devices.constraints[1].matchAttribute", INVALID),
        ("spec.devices.constraints[2]", REQUIRED),
        ("spec.devices.constraints[3].requests[0]", INVALID),
    ]
    assert "gpu, nic" in problems[0].message
    assert problems[1].fix == "matchAttribute: resource.kubernetes.io/pcieRoot"  # a well-known attribute
    problems = validate_object(build.claim(requests, constraints=[{"matchAttribute": "x.io/a"}] * 33))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.constraints", TOO_MANY)]


def test_constraint_may_reference_subrequests(build):
    requests = [{"name": "gpu", "firstAvailable": [{"name": "big", "deviceClassName": "c"}]}]
    ok = validate_object(build.claim(requests, constraints=[{"requests": ["gpu/big"], "matchAttribute": "x.io/a"}]))
    assert ok == []
    bad = validate_object(build.claim(requests, constraints=[{"requests": ["gpu/small"], "matchAttribute": "x.io/a"}]))
    assert build.fields(bad) == ["spec.devices.constraints[0].requests[0]"]
    assert "gpu/big" in bad[0].fix


def test_config(build):
    config = [
        {"requests": ["gpu"]},
        {"opaque": {"driver": "gpu.nvidia.com"}},
        {"opaque": {"driver": "gpu.nvidia.com", "parameters": ["not", "an", "object"]}},
        {"opaque": {"driver": "Bad_Driver", "parameters": {"a": 1}}},
        {"opaque": {"driver": "gpu.nvidia.com", "parameters": {"blob": "x" * 11000}}},
    ]
    problems = validate_object(build.claim(config=config))
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.devices.config[0].opaque", REQUIRED),
        ("spec.devices.config[1].opaque.parameters", REQUIRED),
        ("spec.devices.config[2].opaque.parameters", INVALID),
        ("spec.devices.config[3].opaque.driver", INVALID),
        ("spec.devices.config[4].opaque.parameters", "Too long"),
    ]


def test_claim_name_and_metadata(build):
    claim = build.claim()
    claim["metadata"] = {"namespace": "Bad_NS", "labels": {"-bad": "ok"}}
    problems = validate_object(claim)
    assert build.fields(problems) == ["metadata.name", "metadata.namespace", "metadata.labels"]
    assert problems[0].reason == REQUIRED


def test_template_metadata_may_only_carry_labels_and_annotations(build):
    template = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "t"},
        "spec": {"metadata": {"name": "x", "labels": {"app": "vllm"}}, "spec": build.claim()["spec"]},
    }
    problems = validate_object(template)
    assert [(p.field, p.reason) for p in problems] == [("spec.metadata.name", FORBIDDEN)]
    template["spec"]["metadata"] = {"labels": {"app": "vllm"}}
    template["spec"]["spec"]["devices"]["requests"].append(build.exact("gpu"))
    problems = validate_object(template)
    assert [(p.field, p.reason) for p in problems] == [("spec.spec.devices.requests[1]", DUPLICATE)]


def test_allocated_status_is_checked(build):
    claim = build.claim()
    result = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0"}
    claim["status"] = {"allocation": {"devices": {"results": [result]}}}
    assert validate_object(claim) == []
    claim["status"]["allocation"]["devices"]["results"] = [dict(result, device=f"gpu-{i}") for i in range(33)]
    problems = validate_object(claim)
    assert [(p.field, p.reason) for p in problems] == [("status.allocation.devices.results", TOO_MANY)]
    claim["status"] = {"allocation": {"devices": {
        "results": [dict(result, request="tpu", shareID="NOT-A-UUID")],
        "config": [{"source": "FromSomewhere", "opaque": {"driver": "gpu.nvidia.com", "parameters": {}}}],
    }}, "reservedFor": [{"resource": "pods", "name": "p"}]}
    problems = validate_object(claim)
    assert [(p.field, p.reason) for p in problems] == [
        ("status.reservedFor[0].uid", REQUIRED),
        ("status.allocation.devices.results[0].request", INVALID),
        ("status.allocation.devices.results[0].shareID", INVALID),
        ("status.allocation.devices.config[0].source", UNSUPPORTED),
    ]


def test_capacity_request_names(build):
    ok = build.exact("gpu", capacity={"requests": {"memory": "10Gi", "gpu.nvidia.com/cores": 4}})
    assert validate_object(build.claim([ok])) == []
    # Not checked by the v1.37 apiserver either: such a request simply matches no device.
    odd = build.exact("gpu", capacity={"requests": {"bad-name": "10Gi"}})
    assert validate_object(build.claim([odd])) == []
    bad = build.exact("gpu", capacity={"requests": {"memory": "ten"}})
    assert build.fields(validate_object(build.claim([bad]))) == ["spec.devices.requests[0].exactly.capacity.requests[memory]"]


def test_fixes_for_common_slips(build):
    problems = validate_object(build.claim([build.exact("gpu", allocationMode="exactCount")]))
    assert problems[0].fix == "allocationMode: ExactCount (values are case-sensitive)"
    problems = validate_object(build.claim([build.exact("gpu"), build.exact("nic")],
                                           constraints=[{"requests": ["nics"], "matchAttribute": "x.io/numa"}]))
    assert problems[0].fix == "did you mean 'nic'?"
    problems = validate_object(build.claim(constraints=[{"matchAttribute": "numa"}]))
    assert problems[0].fix.startswith("matchAttribute: <driver domain>/numa")


def test_admin_access_needs_the_namespace_label(build):
    claim = build.claim([build.exact("gpu", adminAccess=True)])
    problems = validate_object(claim)
    # Reported where the apiserver reports it: on the request, not under exactly.
    assert [(p.field, p.reason) for p in problems] == [("spec.devices.requests[0].adminAccess", FORBIDDEN)]
    assert "resource.kubernetes.io/admin-access" in problems[0].fix
    assert validate_object(claim, admin_access=True) == []
    assert validate_object(build.claim([build.exact("gpu", adminAccess=False)])) == []


def test_both_exactly_and_first_available_still_get_the_declarative_checks(build):
    request = build.exact("gpu", allocationMode="Some", count=-1)
    request["firstAvailable"] = [{"name": "a", "deviceClassName": "Bad_Class"}, {"name": "a", "deviceClassName": ""}]
    problems = validate_object(build.claim([request]))
    assert [p.field for p in problems] == [
        "spec.devices.requests[0]", "spec.devices.requests[0].exactly.allocationMode",
        "spec.devices.requests[0].firstAvailable[0].deviceClassName",
        "spec.devices.requests[0].firstAvailable[1].deviceClassName", "spec.devices.requests[0].firstAvailable[1]"]


def test_template_metadata_fields_are_forbidden_unless_empty(build):
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "t"},
                "spec": {"metadata": {"uid": "x", "generation": 0, "finalizers": []}, "spec": build.claim()["spec"]}}
    # "uID" is how the apiserver spells this path; draplane uses the same so the two can be compared.
    assert [(p.field, p.reason) for p in validate_object(template)] == [("spec.metadata.uID", FORBIDDEN)]


def test_status_admin_access_results_and_device_condition_types(build):
    claim = build.claim()
    result = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0", "adminAccess": True}
    ready = {"type": "Ready", "status": "True", "reason": "Prepared", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    claim["status"] = {"allocation": {"devices": {"results": [result]}}, "devices": [
        {"driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0", "shareID": "", "conditions": [ready, ready]}]}
    problems = validate_object(claim)
    assert [(p.field, p.reason) for p in problems] == [
        ("status.devices[0].shareID", INVALID), ("status.devices[0].conditions[1]", DUPLICATE),
        ("status.allocation.devices.results[0].adminAccess", FORBIDDEN)]
    assert [p.field for p in validate_object(claim, admin_access=True)] == [
        "status.devices[0].shareID", "status.devices[0].conditions[1]"]

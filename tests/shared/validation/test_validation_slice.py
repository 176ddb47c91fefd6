"""ResourceSlice rules: node selection, device limits, names, attributes, capacity, counters, taints."""

from draplane.validation import validate_object
from draplane.validation.problem import DUPLICATE, FORBIDDEN, INVALID, REQUIRED, TOO_LONG, TOO_MANY, UNSUPPORTED


def test_valid_slice_has_no_problems(build):
    assert validate_object(build.slice()) == []


def test_128_devices_are_allowed_and_129_are_too_many(build):
    assert validate_object(build.slice([build.device(f"gpu-{i}") for i in range(128)])) == []
    problems = validate_object(build.slice([build.device(f"gpu-{i}") for i in range(129)]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices", TOO_MANY)]
    assert "129" in problems[0].message and "128" in problems[0].message
    assert "resourceSliceCount" in problems[0].fix


def test_limit_is_64_when_taints_or_counters_are_used(build):
    taint = {"key": "example.com/unhealthy", "effect": "NoSchedule"}
    devices = [build.device(f"gpu-{i}") for i in range(65)]
    devices[3]["taints"] = [taint]
    problems = validate_object(build.slice(devices))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices", TOO_MANY)]
    assert "64" in problems[0].message and "taints" in problems[0].message
    assert validate_object(build.slice(devices[:64])) == []
    counters = [build.device(f"mig-{i}", consumesCounters=[{"counterSet": "gpu-0", "counters": {"sm": {"value": "1"}}}])
                for i in range(65)]
    assert [p.field for p in validate_object(build.slice(counters))] == ["spec.devices"]


def test_duplicate_device_names(build):
    problems = validate_object(build.slice([build.device("gpu-0"), build.device("gpu-1"), build.device("gpu-0")]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices[2]", DUPLICATE)]


def test_device_name_must_be_a_dns_label(build):
    problems = validate_object(build.slice([build.device("GPU_0")]))
    assert [p.field for p in problems] == ["spec.devices[0].name"]
    assert problems[0].fix == "name: gpu-0"


def test_exactly_one_node_selection(build):
    problems = validate_object(build.slice(nodeName=None))
    assert [(p.field, p.reason) for p in problems] == [("spec", REQUIRED)]
    problems = validate_object(build.slice(allNodes=True))
    assert [(p.field, p.reason) for p in problems] == [("spec", INVALID)]
    problems = validate_object(build.slice(nodeName=None, allNodes=False))
    assert [p.field for p in problems] == ["spec.allNodes", "spec"]
    two_terms = {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
    ]}
    problems = validate_object(build.slice(nodeName=None, nodeSelector=two_terms))
    assert [p.field for p in problems] == ["spec.nodeSelector.nodeSelectorTerms"]
    bad_requirement = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In"}]}]}
    problems = validate_object(build.slice(nodeName=None, nodeSelector=bad_requirement))
    assert [p.field for p in problems] == ["spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].values"]


def test_per_device_node_selection(build):
    devices = [build.device("gpu-0", nodeName="node-1"), build.device("gpu-1")]
    problems = validate_object(build.slice(devices, nodeName=None, perDeviceNodeSelection=True))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices[1]", REQUIRED)]
    problems = validate_object(build.slice([build.device("gpu-0", allNodes=True)]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices[0]", INVALID)]
    assert "perDeviceNodeSelection" in problems[0].fix


def test_pool(build):
    spec = build.slice()
    spec["spec"]["pool"] = {"name": "Node_1", "generation": -1, "resourceSliceCount": 0}
    problems = validate_object(spec)
    assert [p.field for p in problems] == ["spec.pool.name", "spec.pool.resourceSliceCount", "spec.pool.generation"]
    del spec["spec"]["pool"]  # reported like the apiserver does: as an empty pool
    assert [(p.field, p.reason) for p in validate_object(spec)] == [
        ("spec.pool.name", REQUIRED), ("spec.pool.resourceSliceCount", INVALID)]


def test_driver_name(build):
    problems = validate_object(build.slice(driver="GPU_driver"))
    assert [p.field for p in problems] == ["spec.driver"]
    problems = validate_object(build.slice(driver=None))
    assert [(p.field, p.reason) for p in problems] == [("spec.driver", REQUIRED)]


def test_attribute_and_capacity_limits(build):
    attributes = {f"a{i}": {"int": i} for i in range(30)}
    capacity = {f"c{i}": {"value": "1"} for i in range(3)}
    problems = validate_object(build.slice([{"name": "gpu-0", "attributes": attributes, "capacity": capacity}]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices[0]", INVALID)]
    assert "32" in problems[0].message


def test_attribute_values(build):
    attributes = {
        "both": {"int": 1, "string": "x"},
        "none": {},
        "long": {"string": "x" * 65},
        "ver": {"version": "v12.4"},
        "0bad": {"bool": True},
        "empty": {"strings": []},
    }
    problems = validate_object(build.slice([{"name": "gpu-0", "attributes": attributes}]))
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.devices[0].attributes[both]", INVALID),
        ("spec.devices[0].attributes[none]", INVALID),
        ("spec.devices[0].attributes[long].string", TOO_LONG),
        ("spec.devices[0].attributes[ver].version", INVALID),
        ("spec.devices[0].attributes", INVALID),
        ("spec.devices[0].attributes[empty]", INVALID),
        ("spec.devices[0].attributes[empty].strings", INVALID),
    ]
    assert problems[3].fix == "version: 12.4.0"


def test_request_policy_needs_multiple_allocations(build):
    capacity = {"memory": {"value": "80Gi", "requestPolicy": {"default": "10Gi", "validValues": ["10Gi", "20Gi"]}}}
    problems = validate_object(build.slice([{"name": "gpu-0", "capacity": capacity}]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices[0].capacity[memory].requestPolicy", FORBIDDEN)]
    assert validate_object(build.slice([{"name": "gpu-0", "capacity": capacity, "allowMultipleAllocations": True}])) == []


def test_request_policy_values_and_range(build):
    def policy_problems(policy):
        capacity = {"memory": {"value": "80Gi", "requestPolicy": policy}}
        return [p.field for p in validate_object(build.slice([{"name": "g", "capacity": capacity,
                                                                "allowMultipleAllocations": True}]))]

    base = "spec.devices[0].capacity[memory].requestPolicy"
    assert policy_problems({"validValues": ["1Gi"]}) == [f"{base}.default"]
    assert policy_problems({"default": "3Gi", "validValues": ["2Gi", "1Gi", "100Gi"]}) == [
        f"{base}.validValues[1]", f"{base}.validValues[2]", f"{base}.validValues"]
    assert policy_problems({"default": "1Gi", "validValues": ["1Gi"], "validRange": {"min": "1Gi"}}) == [base]
    assert policy_problems({"default": "8Gi", "validRange": {"min": "4Gi", "max": "64Gi", "step": "4Gi"}}) == []
    assert policy_problems({"default": "6Gi", "validRange": {"min": "4Gi", "max": "64Gi", "step": "4Gi"}}) == [
        f"{base}.validRange.step"]
    assert policy_problems({"default": "1Gi", "validRange": {"min": "4Gi", "max": "100Gi"}}) == [
        f"{base}.validRange.default", f"{base}.validRange.max"]


def test_shared_counters(build):
    sets = [{"name": f"gpu-{i}", "counters": {"memory": {"value": "80Gi"}}} for i in range(8)]
    assert validate_object(build.slice(devices=None, sharedCounters=sets)) == []
    problems = validate_object(build.slice(devices=None, sharedCounters=sets + [sets[0]]))
    assert [(p.field, p.reason) for p in problems] == [("spec.sharedCounters", TOO_MANY)]
    problems = validate_object(build.slice(devices=None, sharedCounters=[sets[0], sets[0], {"name": "x"}]))
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.sharedCounters[2].counters", REQUIRED), ("spec.sharedCounters[1]", DUPLICATE)]
    problems = validate_object(build.slice(sharedCounters=sets[:1]))
    assert [(p.field, p.reason) for p in problems] == [("spec", INVALID)]


def test_consumes_counters(build):
    consumption = {"counterSet": "gpu-0", "counters": {"memory": {"value": "10Gi"}}}
    device = build.device("mig-0", consumesCounters=[consumption, consumption, dict(consumption, counterSet="x")])
    problems = validate_object(build.slice([device]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices[0].consumesCounters", TOO_MANY)]
    device = build.device("mig-0", consumesCounters=[consumption, consumption])
    problems = validate_object(build.slice([device]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices[0].consumesCounters[1]", DUPLICATE)]


def test_taints(build):
    taints = [{"key": "k", "effect": "NoExecute"}, {"key": "k"}, {"key": "k", "effect": "PreferNoSchedule"},
              {"effect": "None"}]
    problems = validate_object(build.slice([build.device("gpu-0", taints=taints)]))
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.devices[0].taints[1].effect", REQUIRED),
        ("spec.devices[0].taints[2].effect", UNSUPPORTED),
        ("spec.devices[0].taints[3].key", REQUIRED),
    ]
    problems = validate_object(build.slice([build.device("gpu-0", taints=[taints[0]] * 17)]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices[0].taints", TOO_MANY)]
    # Effects are checked declaratively in the apiserver, so even when there are too many taints.
    problems = validate_object(build.slice([build.device("gpu-0", taints=[taints[0]] * 16 + [{"key": "-bad"}])]))
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.devices[0].taints", TOO_MANY), ("spec.devices[0].taints[16].effect", REQUIRED)]


def test_binding_conditions(build):
    device = build.device("gpu-0", bindingConditions=["Ready"], bindingFailureConditions=["Ready"])
    problems = validate_object(build.slice([device]))
    assert [p.field for p in problems] == ["spec.devices[0].bindingFailureConditions[0]"]
    device = build.device("gpu-0", bindingConditions=["Ready"])
    assert [p.field for p in validate_object(build.slice([device]))] == ["spec.devices[0].bindingFailureConditions"]


def test_v1beta1_basic_device_shape(build):
    device = {"name": "gpu-0", "basic": {"attributes": {"productName": {"string": "H100"}}}}
    problems = validate_object(build.slice([device]))
    assert [(p.field, p.reason) for p in problems] == [("spec.devices[0].basic", "Unknown field")]
    assert "move the contents of basic" in problems[0].fix


def test_oversized_slice_still_gets_the_declarative_device_checks(build):
    consumption = {"counterSet": "gpu-0", "counters": {"memory": {"value": "10Gi"}}}
    devices = [build.device(f"mig-{i}", consumesCounters=[consumption]) for i in range(65)]
    devices[5]["consumesCounters"] = [consumption, consumption]
    devices[7]["name"] = "Bad_Name"  # a handwritten check: not run on an oversized list, as in the apiserver
    problems = validate_object(build.slice(devices))
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.devices", TOO_MANY), ("spec.devices[5].consumesCounters[1]", DUPLICATE)]


def test_skip_node_operations(build):
    assert validate_object(build.slice(skipNodeOperations=["NodePrepareResources", "NodeUnprepareResources"])) == []
    problems = validate_object(build.slice(skipNodeOperations=["Everything", "*", "*"]))
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.skipNodeOperations[0]", UNSUPPORTED), ("spec.skipNodeOperations[2]", DUPLICATE)]
    problems = validate_object(build.slice(skipNodeOperations=["NodePrepareResources"]))
    assert [p.field for p in problems] == ["spec.skipNodeOperations"]


def test_compatibility_groups(build):
    consumption = {"counterSet": "gpu-0", "counters": {"memory": {"value": "10Gi"}},
                   "compatibilityGroups": ["Half_A", "b"]}
    problems = validate_object(build.slice([build.device("mig-0", consumesCounters=[consumption])]))
    assert [p.field for p in problems] == ["spec.devices[0].consumesCounters[0].compatibilityGroups[0]"]


def test_node_allocatable_resources(build):
    ok = build.device("cpu-0", nodeAllocatableResources={
        "cpu": {"mapping": {"capacityKey": "memory", "capacityMultiplier": "2"}},
        "memory": {"overhead": {"perPod": "1Gi"}}})
    assert validate_object(build.slice([ok])) == []
    bad = build.device("cpu-0", nodeAllocatableResources={
        "example.com/gpu": {}, "cpu": {"mapping": {"capacityKey": "cores", "deviceMultiplier": "-1"}},
        "memory": {"overhead": {}}})
    problems = validate_object(build.slice([bad]))
    base = "spec.devices[0].nodeAllocatableResources"
    assert [(p.field, p.reason) for p in problems] == [
        (f"{base}[example.com/gpu]", INVALID), (f"{base}[example.com/gpu]", REQUIRED),
        (f"{base}[cpu].mapping.capacityKey", "Not found"), (f"{base}[cpu].mapping.capacityMultiplier", REQUIRED),
        (f"{base}[cpu].mapping.deviceMultiplier", INVALID), (f"{base}[memory].overhead", INVALID)]


def test_partition_type_attribute(build):
    consumption = [{"counterSet": "gpu-0", "counters": {"memory": {"value": "10Gi"}}}]
    devices = [build.device("mig-0", consumesCounters=consumption),
               build.device("mig-1", consumesCounters=consumption, attributes={"profile": {"string": "1g.10gb"}}),
               build.device("mig-2", consumesCounters=consumption, attributes={"gpu.nvidia.com/profile": {"int": 1}}),
               build.device("gpu-3")]
    problems = validate_object(build.slice(devices, partitionTypeAttribute="gpu.nvidia.com/profile"))
    assert [(p.field, p.reason) for p in problems] == [
        ("spec.devices[0].attributes[gpu.nvidia.com/profile]", REQUIRED),
        ("spec.devices[2].attributes[gpu.nvidia.com/profile]", INVALID)]
    problems = validate_object(build.slice(partitionTypeAttribute="gpu.nvidia.com/profile"))
    assert [p.field for p in problems] == ["spec.partitionTypeAttribute"]

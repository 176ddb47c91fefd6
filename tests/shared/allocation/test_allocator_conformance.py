"""Conformance with Kubernetes' structured allocator.

Each case names the case of k8s.io/dynamic-resource-allocation/structured allocator tests
(`internal/allocatortesting/allocator_testing.go`, run by allocator_test.go) it mirrors. Where
Kubernetes' answer depends on its first-fit order, the case runs with the `first-fit` policy, which
keeps that order; cases that only need a valid answer say so.
"""

from __future__ import annotations

import pytest

from allocation_builders import (
    CLASS_A,
    CLASS_B,
    DRIVER_A,
    DRIVER_B,
    NODE_1,
    NODE_2,
    Version,
    allocate,
    allocated,
    capacity_policy,
    claim,
    claim_config,
    device,
    device_class,
    distinct,
    failed,
    first_available,
    label_selector,
    local_selector,
    match,
    node,
    one_device_slice,
    request,
    results,
    slice_,
    sub,
)
from draplane.allocation import AllocationError, NodeFailure, Reason
from draplane.api.resource import DeviceTaint, DeviceToleration

A = DRIVER_A
CLASSES = [device_class(CLASS_A, DRIVER_A), device_class(CLASS_B, DRIVER_B)]


def test_empty():
    # mirrors allocator_test.go "empty"
    assert results(allocate(CLASSES, [], [])) == []


def test_simple():
    # mirrors allocator_test.go "simple"
    out = allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)], [claim("claim-0", request("req-0", CLASS_A))])
    assert results(out) == [[("req-0", A, "pool-1", "device-1")]]
    assert out.allocations[0].node_selector == local_selector(NODE_1)


def test_other_node():
    # mirrors allocator_test.go "other-node"
    slices = [one_device_slice("slice-1", NODE_2, "pool-1", A), one_device_slice("slice-2", NODE_1, "pool-2", A)]
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A))])
    assert results(out) == [[("req-0", A, "pool-2", "device-1")]]


def test_small_and_large():
    # mirrors allocator_test.go "small-and-large"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("small", {"size": 1}), device("large", {"size": 2}))
    c = claim("claim-0",
              request("small", CLASS_A, sel=(f'device.attributes["{A}"].size >= 1',)),
              request("large", CLASS_A, sel=(f'device.attributes["{A}"].size >= 2',)))
    assert results(allocate(CLASSES, [s], [c])) == [[("small", A, "pool-1", "small"), ("large", A, "pool-1", "large")]]


def test_small_and_large_backtrack_requests():
    # mirrors allocator_test.go "small-and-large-backtrack-requests": the first request first takes
    # the large device, the second cannot be satisfied, the search backtracks.
    s = slice_("slice-1", NODE_1, "pool-1", A, device("large", {"size": 2}), device("small", {"size": 1}))
    c = claim("claim-0",
              request("small", CLASS_A, sel=(f'device.attributes["{A}"].size >= 1',)),
              request("large", CLASS_A, sel=(f'device.attributes["{A}"].size >= 2',)))
    assert results(allocate(CLASSES, [s], [c])) == [[("small", A, "pool-1", "small"), ("large", A, "pool-1", "large")]]


def test_small_and_large_backtrack_claims():
    # mirrors allocator_test.go "small-and-large-backtrack-claims"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("large", {"size": 2}), device("small", {"size": 1}))
    c0 = claim("claim-0", request("small", CLASS_A, sel=(f'device.attributes["{A}"].size >= 1',)))
    c1 = claim("claim-1", request("large", CLASS_A, sel=(f'device.attributes["{A}"].size >= 2',)))
    assert results(allocate(CLASSES, [s], [c0, c1])) == [[("small", A, "pool-1", "small")], [("large", A, "pool-1", "large")]]


def test_devices_split_across_different_slices():
    # mirrors allocator_test.go "devices-split-across-different-slices"
    slices = [slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), count=2),
              slice_("slice-2", NODE_1, "pool-1", A, device("device-2"), count=2)]
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A, 2))])
    assert results(out) == [[("req-0", A, "pool-1", "device-1"), ("req-0", A, "pool-1", "device-2")]]


def test_obsolete_slice():
    # mirrors allocator_test.go "obsolete-slice": the highest generation wins
    slices = [slice_("slice-old", NODE_1, "pool-1", A, device("old-device"), generation=1),
              slice_("slice-new", NODE_1, "pool-1", A, device("new-device"), generation=2)]
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A))])
    assert results(out) == [[("req-0", A, "pool-1", "new-device")]]


def test_duplicate_slice():
    # mirrors allocator_test.go "duplicate-slice": duplicate device names make the pool invalid
    slices = [slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), count=2),
              slice_("slice-2", NODE_1, "pool-1", A, device("device-1"), count=2)]
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A))])
    assert isinstance(out, NodeFailure) and out.reason is Reason.POOL_INVALID
    assert "duplicate device name device-1" in out.message


def test_invalid_pool_does_not_block_valid_pools():
    # mirrors allocator_test.go "duplicate-slice" (second half: other pools stay usable)
    slices = [slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), count=2),
              slice_("slice-2", NODE_1, "pool-1", A, device("device-1"), count=2),
              one_device_slice("slice-3", NODE_1, "pool-2", A)]
    assert results(allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A))])) == [[("req-0", A, "pool-2", "device-1")]]


def test_no_slices():
    # mirrors allocator_test.go "no-slices"
    out = allocate(CLASSES, [], [claim("claim-0", request("req-0", CLASS_A))])
    assert failed(out) and out.reason is Reason.NO_DEVICES


def test_not_enough_suitable_devices():
    # mirrors allocator_test.go "not-enough-suitable-devices"
    out = allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)],
                   [claim("claim-0", request("req-0", CLASS_A)), claim("claim-1", request("req-0", CLASS_A))])
    assert failed(out) and out.reason is Reason.NOT_ENOUGH_DEVICES


def test_no_classes():
    # mirrors allocator_test.go "no-classes"
    with pytest.raises(AllocationError) as err:
        allocate([], [one_device_slice("slice-1", NODE_1, "pool-1", A)], [claim("claim-0", request("req-0", CLASS_A))])
    assert err.value.reason is Reason.UNKNOWN_CLASS and "class-a" in str(err.value)


def test_unknown_class():
    # mirrors allocator_test.go "unknown-class"
    with pytest.raises(AllocationError) as err:
        allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)], [claim("claim-0", request("req-0", "unknown-class"))])
    assert "spec.devices.requests[0].exactly.deviceClassName" in str(err.value)
    assert "'unknown-class' not found" in str(err.value)


def test_empty_class():
    # mirrors allocator_test.go "empty-class"
    with pytest.raises(AllocationError, match="missing device class name"):
        allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)], [claim("claim-0", request("req-0", ""))])


def test_no_claims_to_allocate():
    # mirrors allocator_test.go "no-claims-to-allocate"
    assert results(allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)], [])) == []


def test_all_devices_single():
    # mirrors allocator_test.go "all-devices-single"
    out = allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)], [claim("claim-0", request("req-0", CLASS_A, mode="All"))])
    assert results(out) == [[("req-0", A, "pool-1", "device-1")]]


def test_all_devices_many():
    # mirrors allocator_test.go "all-devices-many"
    slices = [one_device_slice("slice-1", NODE_1, "pool-1", A), one_device_slice("slice-2", NODE_1, "pool-2", A)]
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A, mode="All"))])
    assert results(out) == [[("req-0", A, "pool-1", "device-1"), ("req-0", A, "pool-2", "device-1")]]


def test_all_devices_of_the_incomplete_pool():
    # mirrors allocator_test.go "all-devices-of-the-incomplete-pool"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), count=2)
    with pytest.raises(AllocationError) as err:
        allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, mode="All"))])
    assert err.value.reason is Reason.POOL_INCOMPLETE
    assert "asks for all devices, but resource pool driver-a.example.com/pool-1 is currently being updated" in str(err.value)
    assert not err.value.fatal


def test_incomplete_pool_is_skipped():
    # mirrors allocator_test.go "incomplete-pool" behaviour for ExactCount: devices of an incomplete
    # pool are not used
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), count=2)
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))])
    assert failed(out) and out.reason is Reason.POOL_INCOMPLETE


def test_all_devices_plus_another():
    # mirrors allocator_test.go "all-devices-plus-another"
    slices = [one_device_slice("slice-1", NODE_1, "pool-1", A), one_device_slice("slice-1b", NODE_1, "pool-1", DRIVER_B)]
    claims = [claim("claim-0", request("req-0", CLASS_A, mode="All")), claim("claim-1", request("req-0", CLASS_B))]
    assert results(allocate(CLASSES, slices, claims)) == [[("req-0", A, "pool-1", "device-1")], [("req-0", DRIVER_B, "pool-1", "device-1")]]


def test_all_devices_plus_another_reversed():
    # mirrors allocator_test.go "all-devices-plus-another-reversed"
    slices = [one_device_slice("slice-1", NODE_1, "pool-1", A), one_device_slice("slice-1b", NODE_1, "pool-1", DRIVER_B)]
    claims = [claim("claim-1", request("req-0", CLASS_B)), claim("claim-0", request("req-0", CLASS_A, mode="All"))]
    assert results(allocate(CLASSES, slices, claims)) == [[("req-0", DRIVER_B, "pool-1", "device-1")], [("req-0", A, "pool-1", "device-1")]]


def test_all_devices_many_plus_another():
    # mirrors allocator_test.go "all-devices-many-plus-another"
    slices = [slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), device("device-2")),
              one_device_slice("slice-1b", NODE_1, "pool-1", DRIVER_B)]
    claims = [claim("claim-0", request("req-0", CLASS_A, mode="All")), claim("claim-1", request("req-0", CLASS_B))]
    assert results(allocate(CLASSES, slices, claims)) == [
        [("req-0", A, "pool-1", "device-1"), ("req-0", A, "pool-1", "device-2")],
        [("req-0", DRIVER_B, "pool-1", "device-1")],
    ]


def test_all_devices_no_solution():
    # mirrors allocator_test.go "all-devices-no-solution"
    claims = [claim("claim-1", request("req-0", CLASS_A)), claim("claim-0", request("req-0", CLASS_A, mode="All"))]
    assert failed(allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)], claims))


def test_all_devices_no_solution_reversed():
    # mirrors allocator_test.go "all-devices-no-solution-reversed"
    claims = [claim("claim-0", request("req-0", CLASS_A, mode="All")), claim("claim-1", request("req-0", CLASS_A))]
    assert failed(allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)], claims))


def test_all_devices_slice_without_devices():
    # mirrors allocator_test.go "all-devices-slice-without-devices"
    assert failed(allocate(CLASSES, [slice_("slice-1", NODE_1, "pool-1", A)], [claim("claim-0", request("req-0", CLASS_A, mode="All"))]))


def test_all_devices_no_slices():
    # mirrors allocator_test.go "all-devices-no-slices"
    assert failed(allocate(CLASSES, [], [claim("claim-0", request("req-0", CLASS_A, mode="All"))]))


def test_all_devices_some_allocated():
    # mirrors allocator_test.go "all-devices-some-allocated"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), device("device-2"))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, mode="All"))],
                   in_use=[allocated("other", (A, "pool-1", "device-1"))])
    assert failed(out)


def test_all_devices_some_allocated_admin_access():
    # mirrors allocator_test.go "all-devices-some-allocated-admin-access"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), device("device-2"))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, mode="All", admin=True))],
                   in_use=[allocated("other", (A, "pool-1", "device-1"))])
    assert results(out) == [[("req-0", A, "pool-1", "device-1", "admin"), ("req-0", A, "pool-1", "device-2", "admin")]]


def test_all_devices_some_allocating_admin_access():
    # mirrors allocator_test.go "all-devices-some-allocating-admin-access"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), device("device-2"))
    c = claim("claim-0", request("req-0", CLASS_A, admin=True), request("req-1", CLASS_A, mode="All", admin=True))
    assert failed(allocate(CLASSES, [s], [c]))


def test_count_devices_some_allocated_admin_access():
    # mirrors allocator_test.go "count-devices-some-allocated-admin-access"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), device("device-2"))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, 2, admin=True))],
                   in_use=[allocated("other", (A, "pool-1", "device-1"))])
    assert results(out) == [[("req-0", A, "pool-1", "device-1", "admin"), ("req-0", A, "pool-1", "device-2", "admin")]]


def test_separate_claims_share_device_admin_access():
    # mirrors allocator_test.go "separate-claims-share-device-admin-access"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), device("device-2"))
    claims = [claim("claim-0", request("req-0", CLASS_A, admin=True)), claim("claim-1", request("req-0", CLASS_A, admin=True))]
    assert results(allocate(CLASSES, [s], claims)) == [[("req-0", A, "pool-1", "device-1", "admin")]] * 2


def test_admin_access_allocation_does_not_occupy_device():
    # mirrors allocator_test.go "admin-access-claims-device-allocating-for-non-admin-access" (an
    # admin-access allocation in the cluster leaves the device available)
    s = one_device_slice("slice-1", NODE_1, "pool-1", A)
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))],
                   in_use=[allocated("admin", (A, "pool-1", "device-1", None, None, True))])
    assert results(out) == [[("req-0", A, "pool-1", "device-1")]]


def test_already_allocated_devices():
    # mirrors allocator_test.go "already-allocated-devices"
    s = one_device_slice("slice-1", NODE_1, "pool-1", A)
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))], in_use=[allocated("other", (A, "pool-1", "device-1"))])
    assert failed(out) and out.reason is Reason.IN_USE


def test_network_attached_device():
    # mirrors allocator_test.go "network-attached-device": the slice's node selector is copied
    sel = label_selector("region", "region-1")
    s = slice_("slice-1", None, "pool-1", A, device("device-1"), node_selector=sel)
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))])
    assert results(out) == [[("req-0", A, "pool-1", "device-1")]]
    assert out.allocations[0].node_selector == sel


def test_network_attached_device_other_region():
    # mirrors allocator_test.go "unsuccessful-allocation-network-attached-device"
    s = slice_("slice-1", None, "pool-1", A, device("device-1"), node_selector=label_selector("region", "region-2"))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))]))


def test_all_nodes_device_has_no_node_selector():
    # mirrors allocator_test.go "several-different-drivers" (allNodes slice): no node selector at all
    s = slice_("slice-1", None, "pool-1", A, device("device-1"), all_nodes=True)
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))])
    assert out.allocations[0].node_selector is None


def test_mixed_node_local_and_network_device_selector():
    # mirrors allocator_test.go "local-and-network-attached-devices": one local device pins the node
    slices = [one_device_slice("slice-1", NODE_1, "pool-1", A),
              slice_("slice-2", None, "pool-2", A, device("device-2"), all_nodes=True)]
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A, 2))])
    assert out.allocations[0].node_selector == local_selector(NODE_1)


def test_per_device_node_selection():
    # mirrors allocator_test.go "partitionable-devices-per-device-node-selection"
    s = slice_("slice-1", None, "pool-1", A, device("device-1", node_name=NODE_2), device("device-2", node_name=NODE_1),
               per_device=True)
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))])
    assert results(out) == [[("req-0", A, "pool-1", "device-2")]]
    assert out.allocations[0].node_selector == local_selector(NODE_1)


def test_invalid_cel_one_device():
    # mirrors allocator_test.go "invalid-CEL-one-device"
    s = one_device_slice("slice-1", NODE_1, "pool-1", A)
    with pytest.raises(AllocationError) as err:
        allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, sel=(f'device.attributes["{A}"].missing == 1',)))])
    assert err.value.reason is Reason.CEL_RUNTIME
    assert "spec.devices.requests[0].exactly.selectors[0].cel.expression" in str(err.value)
    assert "driver-a.example.com/pool-1/device-1" in str(err.value)


def test_invalid_cel_one_device_class():
    # mirrors allocator_test.go "invalid-CEL-one-device-class"
    cls = [device_class(CLASS_A, A, f'device.attributes["{A}"].missing == 1')]
    with pytest.raises(AllocationError) as err:
        allocate(cls, [one_device_slice("slice-1", NODE_1, "pool-1", A)], [claim("claim-0", request("req-0", CLASS_A))])
    assert "DeviceClass class-a: spec.selectors[0].cel.expression" in str(err.value)


def test_invalid_cel_all_devices():
    # mirrors allocator_test.go "invalid-CEL-all-devices"
    with pytest.raises(AllocationError, match="CEL runtime error"):
        allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)],
                 [claim("claim-0", request("req-0", CLASS_A, mode="All", sel=(f'device.attributes["{A}"].missing == 1',)))])


def test_cel_runtime_error_skipped_on_device_in_use():
    # mirrors allocator_test.go "invalid-CEL-one-device" order: in-use devices are skipped before
    # their selectors are evaluated, so their errors are never met
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), device("device-2", {"ok": True}))
    c = claim("claim-0", request("req-0", CLASS_A, sel=(f'device.attributes["{A}"].ok',)))
    out = allocate(CLASSES, [s], [c], in_use=[allocated("other", (A, "pool-1", "device-1"))])
    assert results(out) == [[("req-0", A, "pool-1", "device-2")]]


def test_cel_guarded_by_has():
    # mirrors allocator_test.go "invalid-CEL-one-device" (the fixed expression)
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"other": 1}), device("device-2", {"ok": True}))
    c = claim("claim-0", request("req-0", CLASS_A, sel=(f'has(device.attributes["{A}"].ok) && device.attributes["{A}"].ok',)))
    assert results(allocate(CLASSES, [s], [c])) == [[("req-0", A, "pool-1", "device-2")]]


def test_cel_compile_error():
    # mirrors allocator_test.go "invalid-CEL" compile case
    with pytest.raises(AllocationError) as err:
        allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)],
                 [claim("claim-0", request("req-0", CLASS_A, sel=("device.driver ==",)))])
    assert err.value.reason is Reason.CEL_COMPILE


def test_too_many_devices_single_request():
    # mirrors allocator_test.go "too-many-devices-single-request"
    with pytest.raises(AllocationError, match="exceeds the claim limit of 32"):
        allocate(CLASSES, [], [claim("claim-0", request("req-0", CLASS_A, 33))])


def test_many_devices_okay():
    # mirrors allocator_test.go "many-devices-okay"
    s = slice_("slice-1", NODE_1, "pool-1", A, *[device(f"device-{i:02d}") for i in range(32)])
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, 32))])
    assert len(results(out)[0]) == 32


def test_too_many_devices_total():
    # mirrors allocator_test.go "too-many-devices-total"
    with pytest.raises(AllocationError, match="number of requested devices 33"):
        allocate(CLASSES, [], [claim("claim-0", request("req-0", CLASS_A, 16), request("req-1", CLASS_A, 17))])


def test_all_devices_too_many():
    # mirrors allocator_test.go "too-many-devices-total" for allocationMode All: matching more than
    # 32 devices is an error, as Kubernetes counts All's devices before searching
    s = slice_("slice-1", NODE_1, "pool-1", A, *[device(f"device-{i:02d}") for i in range(33)])
    with pytest.raises(AllocationError, match="number of requested devices 33 exceeds the claim limit of 32"):
        allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, mode="All"))])


def test_too_many_requests():
    # mirrors validation "spec.devices.requests: Too many" (32 requests at most)
    with pytest.raises(AllocationError, match="at most 32"):
        allocate(CLASSES, [], [claim("claim-0", *[request(f"req-{i}", CLASS_A) for i in range(33)])])


def test_with_constraint():
    # mirrors allocator_test.go "with-constraint"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"model": "x"}), device("device-2", {"model": "y"}),
               device("device-3", {"model": "y"}))
    c = claim("claim-0", request("req-0", CLASS_A), request("req-1", CLASS_A), constraints=[match(f"{A}/model")])
    assert results(allocate(CLASSES, [s], [c])) == [[("req-0", A, "pool-1", "device-2"), ("req-1", A, "pool-1", "device-3")]]


def test_with_constraint_non_existent_attribute():
    # mirrors allocator_test.go "with-constraint-non-existent-attribute"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), device("device-2"))
    c = claim("claim-0", request("req-0", CLASS_A, 2), constraints=[match(f"{A}/missing")])
    out = allocate(CLASSES, [s], [c])
    assert failed(out) and out.reason is Reason.CONSTRAINT


def test_with_constraint_not_matching_int_attribute():
    # mirrors allocator_test.go "with-constraint-not-matching-int-attribute"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"n": 1}), device("device-2", {"n": 2}))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, 2), constraints=[match(f"{A}/n")])]))


def test_with_constraint_not_matching_version_attribute():
    # mirrors allocator_test.go "with-constraint-not-matching-version-attribute"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"v": Version("1.0.0")}), device("device-2", {"v": Version("2.0.0")}))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, 2), constraints=[match(f"{A}/v")])]))


def test_with_constraint_type_mismatch():
    # mirrors allocator_test.go "with-constraint-not-matching-int-attribute" (string "1" != int 1)
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"n": 1}), device("device-2", {"n": "1"}))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, 2), constraints=[match(f"{A}/n")])]))


def test_with_constraint_for_request():
    # mirrors allocator_test.go "with-constraint-for-request"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"n": 1}), device("device-2", {"n": 2}),
               device("device-3", {"n": 2}))
    c = claim("claim-0", request("req-0", CLASS_A), request("req-1", CLASS_A, 2), constraints=[match(f"{A}/n", "req-1")])
    assert results(allocate(CLASSES, [s], [c])) == [[("req-0", A, "pool-1", "device-1"), ("req-1", A, "pool-1", "device-2"),
                                                      ("req-1", A, "pool-1", "device-3")]]


def test_with_constraint_for_request_retry():
    # mirrors allocator_test.go "with-constraint-for-request-retry"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"n": 1}), device("device-2", {"n": 2}),
               device("device-3", {"n": 1}))
    c = claim("claim-0", request("req-0", CLASS_A, 2), request("req-1", CLASS_A), constraints=[match(f"{A}/n", "req-0")])
    assert results(allocate(CLASSES, [s], [c])) == [[("req-0", A, "pool-1", "device-1"), ("req-0", A, "pool-1", "device-3"),
                                                      ("req-1", A, "pool-1", "device-2")]]


def test_unqualified_attribute_in_constraint_matches_driver_domain():
    # mirrors allocator_test.go "with-constraint" (attributes published without a domain)
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"model": "x"}), device("device-2", {f"{A}/model": "x"}))
    c = claim("claim-0", request("req-0", CLASS_A, 2), constraints=[match(f"{A}/model")])
    assert len(results(allocate(CLASSES, [s], [c]))[0]) == 2


def test_distinct_attribute():
    # mirrors allocator_test.go "distinct-attribute-constraint"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"numa": 0}), device("device-2", {"numa": 0}),
               device("device-3", {"numa": 1}))
    c = claim("claim-0", request("req-0", CLASS_A, 2), constraints=[distinct(f"{A}/numa")])
    assert results(allocate(CLASSES, [s], [c])) == [[("req-0", A, "pool-1", "device-1"), ("req-0", A, "pool-1", "device-3")]]


def test_distinct_attribute_unsatisfiable():
    # mirrors allocator_test.go "distinct-attribute-constraint-not-satisfied"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"numa": 0}), device("device-2", {"numa": 0}))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, 2), constraints=[distinct(f"{A}/numa")])]))


def test_with_class_device_config():
    # mirrors allocator_test.go "with-class-device-config"
    cls = [device_class(CLASS_A, A, config=[{"from": "class"}])]
    out = allocate(cls, [one_device_slice("slice-1", NODE_1, "pool-1", A)], [claim("claim-0", request("req-0", CLASS_A))])
    config = out.allocations[0].devices.config
    assert [(c.source, c.requests, c.opaque.parameters) for c in config] == [("FromClass", None, {"from": "class"})]


def test_claim_with_device_config():
    # mirrors allocator_test.go "claim-with-device-config"
    c = claim("claim-0", request("req-0", CLASS_A), config=[claim_config(A, {"from": "claim"})])
    out = allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)], [c])
    assert [(x.source, x.requests) for x in out.allocations[0].devices.config] == [("FromClaim", None)]


def test_config_from_class_before_claim_and_requests_cleared_for_all():
    # mirrors allocator_test.go "with-class-device-config" + "claim-with-device-config": class config
    # first, and a config naming every request has its list cleared
    cls = [device_class(CLASS_A, A, config=[{"c": 1}]), device_class(CLASS_B, DRIVER_B, config=[{"c": 2}])]
    slices = [one_device_slice("slice-1", NODE_1, "pool-1", A), one_device_slice("slice-2", NODE_1, "pool-2", DRIVER_B)]
    c = claim("claim-0", request("req-0", CLASS_A), request("req-1", CLASS_B),
              config=[claim_config(A, {"c": 3}, "req-0", "req-1"), claim_config(A, {"c": 4}, "req-1")])
    config = allocate(cls, slices, [c]).allocations[0].devices.config
    assert [(x.source, x.requests, x.opaque.parameters) for x in config] == [
        ("FromClass", ["req-0"], {"c": 1}),
        ("FromClass", ["req-1"], {"c": 2}),
        ("FromClaim", None, {"c": 3}),  # named both requests: added once (Kubernetes 1.37 stops at the first match)
        ("FromClaim", ["req-1"], {"c": 4}),
    ]


def test_class_config_added_once_per_class():
    # mirrors allocator_test.go "with-class-device-config" (two requests of one class)
    cls = [device_class(CLASS_A, A, config=[{"c": 1}])]
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), device("device-2"))
    c = claim("claim-0", request("req-0", CLASS_A), request("req-1", CLASS_A))
    config = allocate(cls, [s], [c]).allocations[0].devices.config
    assert [(x.source, x.requests) for x in config] == [("FromClass", None)]


def test_prioritized_list_first_unavailable():
    # mirrors allocator_test.go "prioritized-list-first-unavailable"
    s = one_device_slice("slice-1b", NODE_1, "pool-1", DRIVER_B)
    c = claim("claim-0", first_available("req-0", sub("sub-0", CLASS_A), sub("sub-1", CLASS_B)))
    assert results(allocate(CLASSES, [s], [c])) == [[("req-0/sub-1", DRIVER_B, "pool-1", "device-1")]]


def test_prioritized_list_first_available():
    # mirrors allocator_test.go "prioritized-list-subrequests-with-expressions"
    slices = [one_device_slice("slice-1", NODE_1, "pool-1", A), one_device_slice("slice-1b", NODE_1, "pool-1", DRIVER_B)]
    c = claim("claim-0", first_available("req-0", sub("sub-0", CLASS_A), sub("sub-1", CLASS_B)))
    assert results(allocate(CLASSES, slices, [c])) == [[("req-0/sub-0", A, "pool-1", "device-1")]]


def test_prioritized_list_multiple_requests_backtrack():
    # mirrors allocator_test.go "prioritized-list-multiple-requests": the second request needs the
    # device the first subrequest took, so the first request falls back to its second subrequest
    slices = [one_device_slice("slice-1", NODE_1, "pool-1", A), one_device_slice("slice-1b", NODE_1, "pool-1", DRIVER_B)]
    c = claim("claim-0", first_available("req-0", sub("sub-0", CLASS_A), sub("sub-1", CLASS_B)), request("req-1", CLASS_A))
    assert results(allocate(CLASSES, slices, [c])) == [[("req-0/sub-1", DRIVER_B, "pool-1", "device-1"),
                                                         ("req-1", A, "pool-1", "device-1")]]


def test_prioritized_list_config_for_subrequest():
    # mirrors allocator_test.go "prioritized-list-with-config": config naming req/sub applies when
    # that subrequest is chosen; class config names the subrequest
    cls = [device_class(CLASS_A, A), device_class(CLASS_B, DRIVER_B, config=[{"c": "b"}])]
    s = one_device_slice("slice-1b", NODE_1, "pool-1", DRIVER_B)
    c = claim("claim-0", first_available("req-0", sub("sub-0", CLASS_A), sub("sub-1", CLASS_B)), request("req-1", CLASS_B, mode="All"),
              config=[claim_config(DRIVER_B, {"c": "sub-1"}, "req-0/sub-1"), claim_config(A, {"c": "sub-0"}, "req-0/sub-0")])
    # req-1 takes all devices of class B too, so only the firstAvailable's result is checked here
    out = allocate(cls, [s], [c])
    assert failed(out)  # both want the single device
    c2 = claim("claim-0", first_available("req-0", sub("sub-0", CLASS_A), sub("sub-1", CLASS_B)),
               config=[claim_config(DRIVER_B, {"c": "sub-1"}, "req-0/sub-1"), claim_config(A, {"c": "sub-0"}, "req-0/sub-0")])
    config = allocate(cls, [s], [c2]).allocations[0].devices.config
    assert [(x.source, x.requests, x.opaque.parameters) for x in config] == [
        ("FromClass", None, {"c": "b"}),
        ("FromClaim", None, {"c": "sub-1"}),
    ]


def test_prioritized_list_constraint_on_subrequest():
    # mirrors allocator_test.go "prioritized-list-constraints"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"n": 1}), device("device-2", {"n": 2}),
               device("device-3", {"n": 2}))
    c = claim("claim-0", first_available("req-0", sub("sub-0", CLASS_A, 2)), request("req-1", CLASS_A),
              constraints=[match(f"{A}/n", "req-0/sub-0")])
    assert results(allocate(CLASSES, [s], [c])) == [[("req-0/sub-0", A, "pool-1", "device-2"), ("req-0/sub-0", A, "pool-1", "device-3"),
                                                      ("req-1", A, "pool-1", "device-1")]]


def test_prioritized_list_max_results_falls_back():
    # mirrors allocator_test.go "prioritized-list-allocation-result-limit": a subrequest that would
    # exceed 32 results is skipped in favour of a smaller one
    s = slice_("slice-1", NODE_1, "pool-1", A, *[device(f"device-{i:02d}") for i in range(40)])
    c = claim("claim-0", request("req-0", CLASS_A, 30), first_available("req-1", sub("big", CLASS_A, 4), sub("small", CLASS_A, 2)))
    out = allocate(CLASSES, [s], [c])
    assert [r[0] for r in results(out)[0]].count("req-1/small") == 2


def test_tainted_device_no_schedule():
    # mirrors allocator_test.go "tainted-devices"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", taints=[DeviceTaint(key="k", value="v", effect="NoSchedule")]))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))])
    assert failed(out) and out.reason is Reason.TAINTED


def test_tainted_device_no_execute():
    # mirrors allocator_test.go "tainted-devices-no-execute"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", taints=[DeviceTaint(key="k", effect="NoExecute")]))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))]))


def test_tainted_device_tolerated():
    # mirrors allocator_test.go "tolerated-tainted-devices": tolerations are copied into the result
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", taints=[DeviceTaint(key="k", value="v", effect="NoSchedule")]))
    tol = [DeviceToleration(key="k", operator="Equal", value="v", effect="NoSchedule")]
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, tolerations=tol))])
    assert out.allocations[0].devices.results[0].tolerations == tol


def test_tainted_device_exists_toleration():
    # mirrors allocator_test.go "tolerated-tainted-devices" with operator Exists and no key
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", taints=[DeviceTaint(key="k", effect="NoExecute")]))
    tol = [DeviceToleration(operator="Exists")]
    assert results(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, tolerations=tol))]))


def test_tainted_device_wrong_toleration_value():
    # mirrors allocator_test.go "tainted-devices" (toleration value differs)
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", taints=[DeviceTaint(key="k", value="v", effect="NoSchedule")]))
    tol = [DeviceToleration(key="k", value="other", effect="NoSchedule")]
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, tolerations=tol))]))


def test_taint_effect_none_does_not_block():
    # mirrors allocator_test.go "tainted-devices-effect-none"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", taints=[DeviceTaint(key="k", effect="None")]))
    assert results(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))]))


def test_tainted_all_devices():
    # mirrors allocator_test.go "tainted-all-devices-single"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", taints=[DeviceTaint(key="k", effect="NoSchedule")]))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, mode="All"))]))


def test_tainted_prioritized_list_falls_back():
    # mirrors allocator_test.go "tainted-devices-prioritized-list"
    slices = [slice_("slice-1", NODE_1, "pool-1", A, device("device-1", taints=[DeviceTaint(key="k", effect="NoSchedule")])),
              one_device_slice("slice-1b", NODE_1, "pool-1", DRIVER_B)]
    c = claim("claim-0", first_available("req-0", sub("sub-0", CLASS_A), sub("sub-1", CLASS_B)))
    assert results(allocate(CLASSES, slices, [c])) == [[("req-0/sub-1", DRIVER_B, "pool-1", "device-1")]]


def _partitioned(*devices, counters=None):
    return [slice_("counters", NODE_1, "pool-1", A, count=2, counters=counters or {"gpu-0": {"memory": "8Gi"}}),
            slice_("devices", NODE_1, "pool-1", A, *devices, count=2)]


def test_partitionable_devices_single():
    # mirrors allocator_test.go "partitionable-devices-single-device"
    slices = _partitioned(device("mig-1", consumes={"gpu-0": {"memory": "4Gi"}}))
    assert results(allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A))])) == [[("req-0", A, "pool-1", "mig-1")]]


def test_partitionable_devices_counters_exhausted_within_claim():
    # mirrors allocator_test.go "partitionable-devices-multiple-devices-insufficient-counters"
    slices = _partitioned(device("whole", consumes={"gpu-0": {"memory": "8Gi"}}), device("half", consumes={"gpu-0": {"memory": "4Gi"}}))
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A, 2))])
    assert failed(out)


def test_partitionable_devices_two_halves():
    # mirrors allocator_test.go "partitionable-devices-multiple-devices"
    slices = _partitioned(device("whole", consumes={"gpu-0": {"memory": "8Gi"}}), device("half-1", consumes={"gpu-0": {"memory": "4Gi"}}),
                          device("half-2", consumes={"gpu-0": {"memory": "4Gi"}}))
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A, 2))])
    assert results(out) == [[("req-0", A, "pool-1", "half-1"), ("req-0", A, "pool-1", "half-2")]]


def test_partitionable_devices_counters_used_by_allocated_device():
    # mirrors allocator_test.go "partitionable-devices-with-allocated-device"
    slices = _partitioned(device("whole", consumes={"gpu-0": {"memory": "8Gi"}}), device("half-1", consumes={"gpu-0": {"memory": "4Gi"}}),
                          device("half-2", consumes={"gpu-0": {"memory": "4Gi"}}))
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A))], in_use=[allocated("other", (A, "pool-1", "half-1"))])
    assert results(out) == [[("req-0", A, "pool-1", "half-2")]]
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A, 2))], in_use=[allocated("other", (A, "pool-1", "half-1"))])
    assert failed(out) and out.reason is Reason.COUNTERS or failed(out)


def test_partitionable_devices_missing_counter_set_invalid_pool():
    # mirrors allocator_test.go "partitionable-devices-invalid-counter-set"
    slices = _partitioned(device("mig-1", consumes={"gpu-9": {"memory": "4Gi"}}))
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A))])
    assert failed(out) and out.reason is Reason.POOL_INVALID and "counter set gpu-9 not found" in out.message


def test_partitionable_devices_missing_counter_invalid_pool():
    # mirrors allocator_test.go "partitionable-devices-invalid-counter"
    slices = _partitioned(device("mig-1", consumes={"gpu-0": {"cores": "4"}}))
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A))])
    assert failed(out) and "counter cores not found in counter set gpu-0" in out.message


def test_partitionable_devices_counter_slice_on_other_node_still_counts():
    # mirrors allocator_test.go "partitionable-devices-counters-in-separate-slice": the slice with
    # the counter sets is part of the pool whatever its node
    slices = [slice_("counters", None, "pool-1", A, count=2, all_nodes=True, counters={"gpu-0": {"memory": "8Gi"}}),
              slice_("devices", NODE_1, "pool-1", A, device("mig-1", consumes={"gpu-0": {"memory": "4Gi"}}), count=2)]
    assert results(allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A))]))


def test_consumable_capacity_shared_device():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"memory": "8Gi"}, multi=True))
    claims = [claim("claim-0", request("req-0", CLASS_A, capacity={"memory": "4Gi"})),
              claim("claim-1", request("req-0", CLASS_A, capacity={"memory": "4Gi"}))]
    out = allocate(CLASSES, [s], claims)
    for allocation in out.allocations:
        r = allocation.devices.results[0]
        assert r.device == "device-1" and r.share_id and r.consumed_capacity == {"memory": "4Gi"}
    assert out.allocations[0].devices.results[0].share_id != out.allocations[1].devices.results[0].share_id


def test_consumable_capacity_exhausted():
    # mirrors allocator_test.go "consumable-capacity-insufficient"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"memory": "8Gi"}, multi=True))
    c = claim("claim-0", request("req-0", CLASS_A, capacity={"memory": "6Gi"}))
    out = allocate(CLASSES, [s], [c], in_use=[allocated("other", (A, "pool-1", "device-1", "6f1c2a4e-0b7d-4c1e-9a3f-2d5e8b7c1a90", {"memory": "4Gi"}))])
    assert failed(out) and out.reason is Reason.CAPACITY


def test_consumable_capacity_default_consumes_whole_capacity():
    # mirrors allocator_test.go "consumable-capacity-no-request": no request consumes the default
    # (or everything), so a second share does not fit
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"memory": "8Gi"}, multi=True))
    claims = [claim("claim-0", request("req-0", CLASS_A)), claim("claim-1", request("req-0", CLASS_A))]
    assert failed(allocate(CLASSES, [s], claims))


def test_consumable_capacity_request_policy_default():
    # mirrors allocator_test.go "consumable-capacity-with-default-request-policy"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"memory": "8Gi"}, multi=True,
                                                      policies={"memory": capacity_policy(default="2Gi", min="1Gi", step="1Gi")}))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))])
    assert out.allocations[0].devices.results[0].consumed_capacity == {"memory": "2Gi"}


def test_consumable_capacity_request_policy_range_rounds_up():
    # mirrors consumable_capacity_test.go "round up to step"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"memory": "8Gi"}, multi=True,
                                                      policies={"memory": capacity_policy(default="1Gi", min="1Gi", step="1Gi")}))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, capacity={"memory": "1500Mi"}))])
    assert out.allocations[0].devices.results[0].consumed_capacity == {"memory": "2Gi"}


def test_consumable_capacity_rounded_up_is_written_in_the_steps_format():
    # kube-scheduler 1.37 writes the rounded value with the step's format: a 10G request with a
    # 1M step is "10G" (decimal), which binary suffixes would write "9765625Ki"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"bandwidth": "100G"}, multi=True,
                                                      policies={"bandwidth": capacity_policy(default="1M", min="1M", step="1M")}))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, capacity={"bandwidth": "10G"}))])
    assert out.allocations[0].devices.results[0].consumed_capacity == {"bandwidth": "10G"}
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, capacity={"bandwidth": "1500k"}))])
    assert out.allocations[0].devices.results[0].consumed_capacity == {"bandwidth": "2M"}


def test_consumable_capacity_request_policy_range_max():
    # mirrors consumable_capacity_test.go "exceeds max"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"memory": "8Gi"}, multi=True,
                                                      policies={"memory": capacity_policy(default="1Gi", min="1Gi", max="4Gi")}))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, capacity={"memory": "5Gi"}))]))


def test_consumable_capacity_request_policy_valid_values():
    # mirrors consumable_capacity_test.go "round up to valid value"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"bw": "100"}, multi=True,
                                                      policies={"bw": capacity_policy(default="10", valid_values=["10", "50", "100"])}))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, capacity={"bw": "20"}))])
    assert out.allocations[0].devices.results[0].consumed_capacity == {"bw": "50"}


def test_consumable_capacity_unknown_capacity_name():
    # mirrors consumable_capacity_test.go "request non-existent capacity"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"memory": "8Gi"}, multi=True))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, capacity={"cores": "1"}))]))


def test_capacity_request_on_exclusive_device():
    # mirrors allocator_test.go "consumable-capacity-not-multi-allocatable": the request must fit,
    # no share ID and no consumedCapacity are written
    s = slice_("slice-1", NODE_1, "pool-1", A, device("small", capacity={"memory": "4Gi"}), device("big", capacity={"memory": "16Gi"}))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, capacity={"memory": "8Gi"}))])
    r = out.allocations[0].devices.results[0]
    assert (r.device, r.share_id, r.consumed_capacity) == ("big", None, None)


def test_binding_conditions_copied():
    # mirrors allocator_test.go "device-binding-conditions"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", binding=["attached"], binding_failure=["failed"]))
    r = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))]).allocations[0].devices.results[0]
    assert (r.binding_conditions, r.binding_failure_conditions) == (["attached"], ["failed"])


def test_binds_to_node_pins_node_selector():
    # mirrors allocator_test.go "device-binds-to-node"
    s = slice_("slice-1", None, "pool-1", A, device("device-1", binds_to_node=True), all_nodes=True)
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))])
    assert out.allocations[0].node_selector == local_selector(NODE_1)


def test_node_selector_slice_other_labels():
    # mirrors allocator_test.go "network-attached-device" (node without the label)
    s = slice_("slice-1", None, "pool-1", A, device("device-1"), node_selector=label_selector("zone", "a"))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))], on=node(NODE_1, zone="b")))
    assert results(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A))], on=node(NODE_1, zone="a")))


def test_claim_without_requests():
    # mirrors allocator_test.go "empty" for a claim with no requests: allocated, with nothing in it
    out = allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)], [claim("claim-0")])
    assert results(out) == [[]]
    assert out.allocations[0].node_selector is None


def test_many_network_attached_devices():
    # mirrors allocator_test.go "many-network-attached-devices": the result's selector is the union
    planet = label_selector("planet", "earth")
    slices = [slice_("slice-1", None, "pool-1", A, device("device-1"), node_selector=label_selector("region", "region-1")),
              slice_("slice-2", None, "pool-2", A, device("device-1"), all_nodes=True),
              slice_("slice-3", None, "pool-3", A, device("device-1"), node_selector=planet),
              slice_("slice-4", None, "pool-4", A, device("device-1"), node_selector=local_selector(NODE_1))]
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A, 4))], on=node(NODE_1, region="region-1", planet="earth"))
    assert [r[2] for r in results(out)[0]] == ["pool-1", "pool-2", "pool-3", "pool-4"]
    term = out.allocations[0].node_selector.node_selector_terms[0]
    assert [(e.key, e.values) for e in term.match_expressions] == [("region", ["region-1"]), ("planet", ["earth"])]
    assert [(f.key, f.values) for f in term.match_fields] == [("metadata.name", [NODE_1])]


def test_local_and_network_attached_devices():
    # mirrors allocator_test.go "local-and-network-attached-devices"
    slices = [slice_("slice-1", None, "pool-1", A, device("device-1"), node_selector=label_selector("region", "region-1")),
              one_device_slice("slice-2", NODE_1, "pool-2", A)]
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A, 2))])
    assert out.allocations[0].node_selector == local_selector(NODE_1)


def test_several_different_drivers():
    # mirrors allocator_test.go "several-different-drivers"
    slices = [slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), device("device-2")),
              one_device_slice("slice-1b", NODE_1, "pool-1", DRIVER_B)]
    claims = [claim("claim-0", request("req-0", CLASS_A)), claim("claim-0b", request("req-0", CLASS_B))]
    assert results(allocate(CLASSES, slices, claims)) == [[("req-0", A, "pool-1", "device-1")], [("req-0", DRIVER_B, "pool-1", "device-1")]]


def test_admin_access_enabled():
    # mirrors allocator_test.go "admin-access-enabled": in-use devices are available to admin access
    out = allocate(CLASSES, [one_device_slice("slice-1", NODE_1, "pool-1", A)], [claim("claim-0", request("req-0", CLASS_A, admin=True))],
                   in_use=[allocated("other", (A, "pool-1", "device-1"))])
    assert results(out) == [[("req-0", A, "pool-1", "device-1", "admin")]]


def test_admin_access_and_normal_claim_share_device():
    # mirrors allocator_test.go "admin-access-claims-device-allocating-for-non-admin-access"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), device("device-2"))
    claims = [claim("claim-0", request("req-0", CLASS_A)), claim("claim-1", request("req-0", CLASS_A, admin=True))]
    assert results(allocate(CLASSES, [s], claims)) == [[("req-0", A, "pool-1", "device-1")], [("req-0", A, "pool-1", "device-1", "admin")]]


def test_with_constraint_all_types():
    # mirrors allocator_test.go "with-constraint" (int, version, string and bool attributes)
    values = {"driverVersion": Version("1.0.0"), "numa": 1, "stringAttribute": "v", "boolAttribute": True}
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", values), device("device-2", values))
    c = claim("claim-0", request("req-0", CLASS_A), request("req-1", CLASS_A),
              constraints=[match(f"{A}/{k}") for k in values])
    assert results(allocate(CLASSES, [s], [c])) == [[("req-0", A, "pool-1", "device-1"), ("req-1", A, "pool-1", "device-2")]]


@pytest.mark.parametrize("first, second", [("s1", "s2"), (True, False)])
def test_with_constraint_not_matching_string_or_bool(first, second):
    # mirrors allocator_test.go "with-constraint-not-matching-string-attribute" and "...-bool-attribute"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"x": first}), device("device-2", {"x": second}))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, 2), constraints=[match(f"{A}/x")])]))


def test_with_constraint_not_matching_int_attribute_all_devices():
    # mirrors allocator_test.go "with-constraint-not-matching-int-attribute-all-devices"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", {"numa": 1}), device("device-2", {"numa": 2}))
    with pytest.raises(AllocationError) as err:
        allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, mode="All"), constraints=[match(f"{A}/numa")])])
    assert "cannot add device driver-a.example.com/pool-1/device-2 because a claim constraint would not be satisfied" in str(err.value)


def test_all_devices_some_allocated_prioritized_list():
    # mirrors allocator_test.go "all-devices-some-allocated-prioritized-list"
    slices = [slice_("slice-1", NODE_1, "pool-1", A, device("device-1"), device("device-2")),
              one_device_slice("slice-2", NODE_1, "pool-2", DRIVER_B)]
    c = claim("claim-0", first_available("req-0", sub("sub-0", CLASS_A, mode="All"), sub("sub-1", CLASS_B)))
    out = allocate(CLASSES, slices, [c], in_use=[allocated("other", (A, "pool-1", "device-1"))])
    assert results(out) == [[("req-0/sub-1", DRIVER_B, "pool-2", "device-1")]]


def test_all_devices_slice_without_devices_prioritized_list():
    # mirrors allocator_test.go "all-devices-slice-without-devices-prioritized-list"
    slices = [slice_("slice-1", NODE_1, "pool-1", A), one_device_slice("slice-2", NODE_1, "pool-2", DRIVER_B)]
    c = claim("claim-0", first_available("req-0", sub("sub-0", CLASS_A, mode="All"), sub("sub-1", CLASS_B)))
    assert results(allocate(CLASSES, slices, [c])) == [[("req-0/sub-1", DRIVER_B, "pool-2", "device-1")]]


def test_partitionable_devices_with_binding_conditions_multi_slices():
    # mirrors allocator_test.go "partitionable-devices-with-binding-conditions-multi-slices": slices
    # are searched in name order, binding conditions are copied per device
    counters = {"set-1": {"memory": "8Gi"}}
    slices = [
        slice_("slice-4", NODE_1, "pool-1", A, device("device-1", consumes={"set-1": {"memory": "4Gi"}},
                                                      binding=["IsPrepare"], binding_failure=["BindingFailed"]), count=4),
        slice_("slice-3", NODE_1, "pool-1", A, count=4, counters=counters),
        slice_("slice-2", NODE_1, "pool-1", A, device("device-2", consumes={"set-2": {"memory": "4Gi"}}), count=4),
        slice_("slice-1", NODE_1, "pool-1", A, count=4, counters={"set-2": {"memory": "8Gi"}}),
    ]
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A, 2))])
    rs = out.allocations[0].devices.results
    assert [(r.device, r.binding_conditions) for r in rs] == [("device-2", None), ("device-1", ["IsPrepare"])]


def test_binding_conditions_and_taints():
    # mirrors allocator_test.go "partitionable-devices-with-binding-conditions-and-taints" and
    # "...-tolerated": the toleration is copied into every result of the request
    taint = DeviceTaint(key="key1", value="value1", effect="NoSchedule")
    slices = _partitioned(device("device-1", consumes={"gpu-0": {"memory": "4Gi"}}, binding=["IsPrepare"],
                                 binding_failure=["PrepareFailed"], taints=[taint]),
                          device("device-2", consumes={"gpu-0": {"memory": "4Gi"}}))
    assert failed(allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A, 2))]))
    tol = [DeviceToleration(key="key1", operator="Exists", effect="NoSchedule")]
    rs = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A, 2, tolerations=tol))]).allocations[0].devices.results
    assert [(r.device, r.binding_conditions, r.tolerations) for r in rs] == [("device-1", ["IsPrepare"], tol), ("device-2", None, tol)]


def test_consumable_capacity_missing_capacity_request():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-with-missing-capacity-request"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"capacity1": "1"}, multi=True))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, capacity={"capacity0": "1"}))]))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, mode="All", capacity={"capacity0": "1"}))]))


def test_consumable_capacity_without_capacity_without_request():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-without-capacity-without-capacity-request"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", multi=True))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A)), claim("claim-1", request("req-0", CLASS_A))])
    rs = [a.devices.results[0] for a in out.allocations]
    assert [(r.device, bool(r.share_id), r.consumed_capacity) for r in rs] == [("device-1", True, None)] * 2


def test_consumable_capacity_without_policy_without_request():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-without-policy-without-capacity-request"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"capacity0": "1"}, multi=True),
               device("device-2", capacity={"capacity0": "1"}, multi=True))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A)), claim("claim-1", request("req-0", CLASS_A))])
    rs = [a.devices.results[0] for a in out.allocations]
    assert [(r.device, r.consumed_capacity) for r in rs] == [("device-1", {"capacity0": "1"}), ("device-2", {"capacity0": "1"})]


def test_consumable_capacity_without_policy_without_request_block():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-without-policy-without-capacity-request-block"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"capacity0": "2"}, multi=True))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A)), claim("claim-1", request("req-0", CLASS_A))]))


def test_consumable_capacity_without_policy_with_request():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-without-policy-with-capacity-request"
    s = slice_("slice-1", NODE_1, "pool-1", A, device("device-1", capacity={"capacity0": "2"}, multi=True))
    claims = [claim("claim-0", request("req-0", CLASS_A, capacity={"capacity0": "1"})),
              claim("claim-1", request("req-0", CLASS_A, capacity={"capacity0": "1"}))]
    rs = [a.devices.results[0] for a in allocate(CLASSES, [s], claims).allocations]
    assert [(r.device, r.consumed_capacity) for r in rs] == [("device-1", {"capacity0": "1"})] * 2


def _range_device(name: str, value: str, attributes=None):
    # Kubernetes' withCapacityRequestPolicyRange: default 2, valid range 2..4 in steps of 2. The
    # apiserver refuses a range or a step beyond the capacity, so a device of capacity 2 gets the
    # range 2..2, which admits the same requests.
    if int(value) < 4:
        return device(name, attributes, capacity={"capacity0": value}, multi=True,
                      policies={"capacity0": capacity_policy(default="2", min="2", max=value)})
    return device(name, attributes, capacity={"capacity0": value}, multi=True,
                  policies={"capacity0": capacity_policy(default="2", min="2", max="4", step="2")})


def test_consumable_capacity_with_policy_without_request():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-with-policy-without-capacity-request"
    s = slice_("slice-1", NODE_1, "pool-1", A, _range_device("device-1", "4"))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A)), claim("claim-1", request("req-0", CLASS_A))])
    assert [a.devices.results[0].consumed_capacity for a in out.allocations] == [{"capacity0": "2"}] * 2


def test_consumable_capacity_range_policy_rounds_to_minimum():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-with-range-policy-with-capacity-request"
    s = slice_("slice-1", NODE_1, "pool-1", A, _range_device("device-1", "4"))
    claims = [claim(f"claim-{i}", request("req-0", CLASS_A, capacity={"capacity0": "1"})) for i in range(2)]
    out = allocate(CLASSES, [s], claims)
    assert [a.devices.results[0].consumed_capacity for a in out.allocations] == [{"capacity0": "2"}] * 2


def test_consumable_capacity_range_policy_step():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-with-range-policy-step"
    s = slice_("slice-1", NODE_1, "pool-1", A, _range_device("device-1", "4"))
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, capacity={"capacity0": "3"}))])
    assert out.allocations[0].devices.results[0].consumed_capacity == {"capacity0": "4"}


def test_consumable_capacity_request_over_policy_max():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-with-request-over-max-sharing-policy"
    s = slice_("slice-1", NODE_1, "pool-1", A, _range_device("device-1", "10"))
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, capacity={"capacity0": "6"}))]))


def test_consumable_capacity_zero_default_valid_values():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-with-zero-request-policy"
    # and "...-violates-zero-request-policy"
    d = device("device-1", capacity={"capacity0": "1"}, multi=True,
               policies={"capacity0": capacity_policy(default="0", valid_values=["0"])})
    s = slice_("slice-1", NODE_1, "pool-1", A, d)
    out = allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A)), claim("claim-1", request("req-0", CLASS_A))])
    assert [a.devices.results[0].consumed_capacity for a in out.allocations] == [{"capacity0": "0"}] * 2
    assert failed(allocate(CLASSES, [s], [claim("claim-0", request("req-0", CLASS_A, capacity={"capacity0": "1"}))]))


def test_consumable_capacity_valid_values_round_up_to_capacity():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-with-valid-values-policy-round-up"
    d = device("device-1", capacity={"capacity0": "3"}, multi=True,
               policies={"capacity0": capacity_policy(default="1", valid_values=["1", "3"])})
    out = allocate(CLASSES, [slice_("slice-1", NODE_1, "pool-1", A, d)],
                   [claim("claim-0", request("req-0", CLASS_A, capacity={"capacity0": "2"}))])
    assert out.allocations[0].devices.results[0].consumed_capacity == {"capacity0": "3"}


def test_consumable_capacity_allocated_use_remaining_and_next_device():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-with-allocated-capacity-use-remaining",
    # "...-next-device" and "...-with-no-available-consumable-capacity"
    used = [allocated("other", (A, "pool-1", "device-1", "00000000-0000-4000-8000-00000000000a", {"capacity0": "2"}))]
    c = claim("claim-0", request("req-0", CLASS_A, capacity={"capacity0": "2"}))
    s = slice_("slice-1", NODE_1, "pool-1", A, _range_device("device-1", "4"))
    assert results(allocate(CLASSES, [s], [c], in_use=used)) == [[("req-0", A, "pool-1", "device-1")]]
    s = slice_("slice-1", NODE_1, "pool-1", A, _range_device("device-1", "2"), _range_device("device-2", "2"))
    assert results(allocate(CLASSES, [s], [c], in_use=used)) == [[("req-0", A, "pool-1", "device-2")]]
    s = slice_("slice-1", NODE_1, "pool-1", A, _range_device("device-1", "2"))
    assert failed(allocate(CLASSES, [s], [c], in_use=used))


def test_consumable_capacity_backtrack():
    # mirrors allocator_test.go "consumable-capacity-with-multi-allocatable-device-backtrack"
    s = slice_("slice-1", NODE_1, "pool-1", A, _range_device("device-2", "2", {"s": "v1"}), _range_device("device-1", "4", {"s": "v2"}))
    c0 = claim("claim-0", request("req-0", CLASS_A, capacity={"capacity0": "2"}), request("req-1", CLASS_A, capacity={"capacity0": "2"}),
               constraints=[match(f"{A}/s")])
    c1 = claim("claim-1", request("req-0", CLASS_A, capacity={"capacity0": "2"}))
    assert results(allocate(CLASSES, [s], [c0, c1])) == [
        [("req-0", A, "pool-1", "device-1"), ("req-1", A, "pool-1", "device-1")],
        [("req-0", A, "pool-1", "device-2")],
    ]


def test_consumable_capacity_with_subrequest():
    # mirrors allocator_test.go "consumable-capacity-multi-allocatable-device-with-subrequest"
    s = slice_("slice-1", NODE_1, "pool-1", A, _range_device("device-1", "2"))
    c = claim("claim-0", first_available("req-0", sub("sub-0", CLASS_A, capacity={"capacity0": "4"}),
                                         sub("sub-1", CLASS_A, capacity={"capacity0": "2"})))
    out = allocate(CLASSES, [s], [c])
    assert results(out) == [[("req-0/sub-1", A, "pool-1", "device-1")]]
    assert out.allocations[0].devices.results[0].consumed_capacity == {"capacity0": "2"}


def _counter_pool(pool: str, slice_names: tuple[str, str], devices, counters):
    return [slice_(slice_names[0], NODE_1, pool, A, *devices, count=2),
            slice_(slice_names[1], NODE_1, pool, A, count=2, counters=counters)]


def test_partitionable_devices_multiple_counters():
    # mirrors allocator_test.go "partitionable-devices-multiple-counters"
    devices = [
        device("device-1", consumes={"set-1": {"memory": "4Gi", "cpus": "6"}, "set-2": {"cpus": "4", "memory": "2Gi"}}),
        device("device-2", consumes={"set-1": {"memory": "6Gi", "cpus": "4"}, "set-2": {"cpus": "6", "memory": "6Gi"}}),
        device("device-3", consumes={"set-1": {"memory": "4Gi", "cpus": "4"}, "set-2": {"cpus": "4", "memory": "4Gi"}}),
    ]
    slices = _counter_pool("pool-1", ("slice-1", "slice-2"), devices,
                           {"set-1": {"cpus": "8", "memory": "18Gi"}, "set-2": {"cpus": "12", "memory": "18Gi"}})
    c = claim("claim-0", request("req-0", CLASS_A), request("req-1", CLASS_A))
    assert results(allocate(CLASSES, slices, [c])) == [[("req-0", A, "pool-1", "device-2"), ("req-1", A, "pool-1", "device-3")]]


def test_partitionable_devices_multiple_pools():
    # mirrors allocator_test.go "partitionable-devices-multiple-pools"
    counters = {"set-1": {"cpus": "8", "memory": "18Gi"}}
    pool1 = _counter_pool("pool-1", ("slice-1", "slice-2"), [
        device("device-1", consumes={"set-1": {"cpus": "6", "memory": "4Gi"}}),
        device("device-2", consumes={"set-1": {"cpus": "4", "memory": "6Gi"}}),
        device("device-3", consumes={"set-1": {"cpus": "4", "memory": "4Gi"}})], counters)
    pool2 = _counter_pool("pool-2", ("slice-3", "slice-4"), [
        device("device-1", consumes={"set-1": {"cpus": "6", "memory": "4Gi"}}),
        device("device-2", consumes={"set-1": {"cpus": "1", "memory": "7Gi"}}),
        device("device-3", consumes={"set-1": {"cpus": "1", "memory": "7Gi"}})], counters)
    in_use = [allocated("other", (A, "pool-1", "device-2"), (A, "pool-1", "device-3"), (A, "pool-2", "device-1"))]
    c = claim("claim-0", request("req-0", CLASS_A), request("req-1", CLASS_A))
    assert results(allocate(CLASSES, pool1 + pool2, [c], in_use=in_use)) == [
        [("req-0", A, "pool-2", "device-2"), ("req-1", A, "pool-2", "device-3")]]


def test_partitionable_devices_unused_counters_in_counter_set():
    # mirrors allocator_test.go "partitionable-devices-unused-counters-in-counter-set"
    slices = _counter_pool("pool-1", ("slice-1", "slice-2"), [
        device("device-1", consumes={"set-1": {"memory": "5Gi"}}),
        device("device-2", consumes={"set-1": {"memory": "4Gi"}}),
        device("device-3", consumes={"set-1": {"memory": "4Gi"}})], {"set-1": {"memory": "8Gi", "unused": "1Gi"}})
    assert results(allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A, 2))])) == [
        [("req-0", A, "pool-1", "device-2"), ("req-0", A, "pool-1", "device-3")]]


@pytest.mark.parametrize("taken", ["16Gi", "20Gi"])
def test_partitionable_devices_no_capacity_or_overallocated(taken):
    # mirrors allocator_test.go "partitionable-devices-no-capacity-available" and
    # "partitionable-devices-overallocated-capacity-pool"
    slices = _counter_pool("pool-1", ("slice-1", "slice-2"), [
        device("device-1", consumes={"set-1": {"memory": "4Gi"}}),
        device("device-2", consumes={"set-1": {"memory": taken}})], {"set-1": {"memory": "18Gi"}})
    out = allocate(CLASSES, slices, [claim("claim-0", request("req-0", CLASS_A))], in_use=[allocated("other", (A, "pool-1", "device-2"))])
    assert failed(out) and out.reason is Reason.COUNTERS

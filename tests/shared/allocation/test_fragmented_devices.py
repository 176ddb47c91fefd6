"""The fragmentation gauge's definition, on the shard's own core (SchedulingState) with real CEL."""

from __future__ import annotations

from fractions import Fraction

from allocation_builders import (
    DRIVER_A, NODE_1, capacity_policy, claim, device, device_class, first_available, node, request, slice_, sub,
)
from draplane.api.quantity import parse_quantity
from draplane.api.resource import AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaimStatus
from draplane.allocation.fragmented_devices import claim_demands, fits
from draplane.scheduling.placing import SchedulingState

SHARED = "shared-gpu"
MIG = "mig"
WHOLE = "whole-gpu"
OTHER = "other"
GI = 2**30


def gi(n) -> Fraction:
    return Fraction(n * GI)


def allocated(name: str, cls: str, *results: tuple, uid: str, capacity: dict | None = None):
    """A claim of one request of `cls` holding (device[, consumed memory]) results on NODE_1."""
    c = claim(name, request("req", cls, capacity=capacity))
    c.metadata.uid = uid
    c.status = ResourceClaimStatus(allocation=AllocationResult(devices=DeviceAllocationResult(results=[
        DeviceRequestAllocationResult(request="req", driver=DRIVER_A, pool=NODE_1, device=r[0],
                                      share_id=f"00000000-0000-4000-8000-{uid[-1]:0>12}" if len(r) > 1 else None,
                                      consumed_capacity={"memory": r[1]} if len(r) > 1 else None)
        for r in results])))
    return c


def pending(name: str, cls: str, uid: str, capacity: dict | None = None):
    c = claim(name, request("req", cls, capacity=capacity))
    c.metadata.uid = uid
    return c


def shared_state(*claims) -> SchedulingState:
    """Two 80Gi GPUs that allow multiple allocations, selected by the shared class."""
    state = SchedulingState()
    state.set_class(device_class(SHARED, DRIVER_A, 'device.attributes["driver-a.example.com"].kind == "shared"'))
    state.set_node(node(NODE_1))
    policy = {"memory": capacity_policy(default="10Gi", min="1Gi")}
    state.set_feed_entry("node." + NODE_1, [slice_("s1", NODE_1, NODE_1, DRIVER_A, *(
        device(f"gpu-{i}", {"kind": "shared"}, {"memory": "80Gi"}, policies=policy, multi=True) for i in range(2)))])
    for c in claims:
        state.set_claim(c)
    return state


def test_a_sliver_smaller_than_every_share_seen_is_fragmented():
    ten_gi_wanted = pending("c", SHARED, "u3", capacity={"memory": "10Gi"})
    # gpu-0: 75Gi used, 5Gi left, the smallest demand 10Gi: fragmented; gpu-1, untouched, is not
    state = shared_state(allocated("a", SHARED, ("gpu-0", "75Gi"), uid="u1"), ten_gi_wanted)
    assert state.fragmented_devices() == {SHARED: 1}
    # a 5Gi share seen too (typical, allocated): the 5Gi left can take one
    state.set_claim(allocated("b", SHARED, ("gpu-1", "5Gi"), uid="u2"))
    assert state.fragmented_devices() == {SHARED: 0}
    # 70Gi used, 10Gi left: the 10Gi demand fits exactly
    state = shared_state(allocated("a", SHARED, ("gpu-0", "70Gi"), uid="u1"), ten_gi_wanted)
    assert state.fragmented_devices() == {SHARED: 0}


def test_the_shares_allocated_are_demands_too_and_a_used_up_device_is_not_fragmented():
    # the 75Gi share is the only claim: 5Gi left is too little for another like it
    assert shared_state(allocated("a", SHARED, ("gpu-0", "75Gi"), uid="u1")).fragmented_devices() == {SHARED: 1}
    # no claim names an amount (a pending claim without one says no size): nothing to compare with
    assert shared_state(pending("c", SHARED, "u3")).fragmented_devices() == {SHARED: 0}
    full = shared_state(allocated("a", SHARED, ("gpu-0", "80Gi"), uid="u1"),
                        pending("c", SHARED, "u3", capacity={"memory": "1Gi"}))
    assert full.fragmented_devices() == {SHARED: 0}  # nothing left on it to waste


def test_a_claim_going_away_changes_the_answer():
    small = pending("c", SHARED, "u3", capacity={"memory": "4Gi"})
    state = shared_state(allocated("a", SHARED, ("gpu-0", "75Gi"), uid="u1"), small)
    assert state.fragmented_devices() == {SHARED: 0}  # 5Gi left fits the 4Gi one
    state.set_claim(small, deleted=True)
    assert state.fragmented_devices() == {SHARED: 1}


def mig_state(*claims) -> SchedulingState:
    """One partitionable GPU: a counter set of 4 memory slices and 40Gi, a whole-GPU device and
    four 1-slice (10Gi) and two 2-slice (20Gi) placements."""
    state = SchedulingState()
    state.set_class(device_class(MIG, DRIVER_A, 'device.attributes["driver-a.example.com"].kind == "mig"'))
    state.set_class(device_class(WHOLE, DRIVER_A, 'device.attributes["driver-a.example.com"].kind == "whole"'))
    state.set_class(device_class(OTHER, DRIVER_A, 'device.attributes["driver-a.example.com"].kind == "none"'))
    state.set_node(node(NODE_1))
    everything = {f"slice{i}": "1" for i in range(4)} | {"memory": "40Gi"}
    devices = [device("gpu-0", {"kind": "whole"}, {"memory": "40Gi"}, consumes={"gpu-0-counters": everything})]
    for i in range(4):
        devices.append(device(f"gpu-0-1g-{i}", {"kind": "mig"}, {"memory": "10Gi"},
                              consumes={"gpu-0-counters": {f"slice{i}": "1", "memory": "10Gi"}}))
    for start in (0, 2):
        devices.append(device(f"gpu-0-2g-{start}", {"kind": "mig"}, {"memory": "20Gi"},
                              consumes={"gpu-0-counters": {f"slice{start}": "1", f"slice{start + 1}": "1",
                                                           "memory": "20Gi"}}))
    # as the v1 API wants them: the counter set in a slice of its own
    state.set_feed_entry("node." + NODE_1, [slice_("s0", NODE_1, NODE_1, DRIVER_A, count=2,
                                                   counters={"gpu-0-counters": everything}),
                                            slice_("s1", NODE_1, NODE_1, DRIVER_A, *devices, count=2)])
    for c in claims:
        state.set_claim(c)
    return state


def test_a_partitioned_gpu_is_fragmented_for_a_class_none_of_whose_devices_fits_what_is_left():
    one_slice = allocated("a", MIG, ("gpu-0-1g-1",), uid="u1")  # a 10Gi MIG device: the MIG demand is 10Gi
    whole_wanted = pending("w", WHOLE, "u2", capacity={"memory": "40Gi"})
    # nobody split the GPU: nothing is fragmented, whatever is asked
    assert mig_state(whole_wanted).fragmented_devices() == {MIG: 0, WHOLE: 0, OTHER: 0}
    # slice 1 taken: a 1g can still be had there (slices 0, 2, 3), the whole GPU no longer can
    assert mig_state(one_slice, whole_wanted).fragmented_devices() == {MIG: 0, WHOLE: 1, OTHER: 0}
    # a pending whole-GPU claim that names no amount says no size: no demand for its class
    assert mig_state(one_slice, pending("w", WHOLE, "u2")).fragmented_devices() == {MIG: 0, WHOLE: 0, OTHER: 0}


def test_single_slices_left_where_only_two_slice_claims_are_seen_are_fragmented():
    # slices 0 and 3 held by claims of another class; a MIG claim asks 20Gi. Left: slices 1 and
    # 2 and 20Gi, but both 2g placements overlap a taken slice and a 1g holds only 10Gi.
    holders = [allocated(name, OTHER, (dev,), uid=uid) for name, dev, uid in (("a", "gpu-0-1g-0", "u1"),
                                                                                ("b", "gpu-0-1g-3", "u2"))]
    state = mig_state(*holders, pending("big", MIG, "u3", capacity={"memory": "20Gi"}))
    assert state.fragmented_devices() == {MIG: 1, WHOLE: 0, OTHER: 0}
    # a 1g claim seen as well (10Gi): the free single slices are of use, so nothing counts
    state.set_claim(allocated("small", MIG, ("gpu-0-1g-1",), uid="u4"))
    assert state.fragmented_devices() == {MIG: 0, WHOLE: 0, OTHER: 0}
    # and with slices 1 and 2 gone too, nothing is left to fragment
    state.set_claim(allocated("small2", MIG, ("gpu-0-1g-2",), uid="u5"))
    assert state.fragmented_devices()[MIG] == 0


def test_claim_demands_reads_subrequests_consumed_capacity_and_keeps_the_least():
    capacity = {(DRIVER_A, NODE_1, "gpu-0"): {"memory": gi(80)}}
    with_subs = claim("s", first_available("r", sub("big", WHOLE, capacity={"memory": "40Gi"}),
                                           sub("small", SHARED, capacity={"memory": "8Gi"})))
    holding = allocated("h", WHOLE, ("gpu-0",), uid="u1")
    holding.spec.devices.requests[0].name = "r"
    holding.spec.devices.requests[0] = first_available("r", sub("big", WHOLE))
    holding.status.allocation.devices.results[0].request = "r/big"
    share = allocated("x", SHARED, ("gpu-0", "16Gi"), uid="u2")
    smaller = pending("y", SHARED, "u3", capacity={"memory": "8Gi"})
    demands = claim_demands([(with_subs, None), (holding, holding.status.allocation),
                             (share, share.status.allocation), (smaller, None)], capacity.get)
    # WHOLE: 40Gi pending, 80Gi held: 80Gi is larger than 40Gi, so only 40Gi stays
    assert demands[WHOLE] == [{"memory": gi(40)}]
    assert demands[SHARED] == [{"memory": gi(8)}]


def test_fits_treats_a_missing_name_as_nothing():
    assert fits({"memory": gi(1)}, {"memory": gi(1)})
    assert not fits({"memory": gi(1)}, {})
    assert fits({}, {})
    assert not fits({"memory": gi(1), "cores": Fraction(1)}, {"memory": gi(2)})
    assert parse_quantity("1Gi").value == gi(1)

"""draplane.allocation.free_capacity: what a new claim could still get, by class and node.

The nodes are the shipped hardware profiles, turned into slices the way the node agent and the
inventory service do, and the classes are the ones `draplane up` installs.
"""

from __future__ import annotations

from fractions import Fraction

import msgspec

from draplane.allocation.free_capacity import ALLOCATED, FREE, SHARED, TAINTED, BLOCKED, free_capacity
from draplane.api.resource import (
    AllocationResult,
    DeviceAllocationResult,
    DeviceClass,
    DeviceRequestAllocationResult,
    DeviceTaint,
    ResourceSlice,
)
from draplane.localenv.environment import standard_device_classes
from draplane.nodes.slices import NodeRef, plan_node
from draplane.nodes.hardware import driver_devices
from draplane.nodes.profile import load_profile, profile_hardware
from allocation_builders import device, device_class, slice_

CLASSES = [msgspec.convert(c, DeviceClass) for c in standard_device_classes()]
GPU = "gpu.nvidia.com"


def profile_slices(profile: str, node: str) -> list[ResourceSlice]:
    drivers = driver_devices(profile_hardware(load_profile(profile), node))
    return [s for plan in plan_node(NodeRef(node, f"uid-{node}"), drivers, []) for s in plan.creates]


def allocation(node: str, *devices: str, share: str | None = None, consumed: dict | None = None) -> AllocationResult:
    return AllocationResult(devices=DeviceAllocationResult(results=[
        DeviceRequestAllocationResult(request="r", driver=GPU, pool=node, device=d, share_id=share,
                                      consumed_capacity=consumed)
        for d in devices
    ]))


def row(free, node, device_class):
    (found,) = [r for r in free.nodes if r.node == node and r.device_class == device_class]
    return found


def test_an_empty_a100_node_offers_every_gpu_whole_and_every_mig_profile_to_its_limit():
    free = free_capacity(profile_slices("a100-mig", "a100-0"), CLASSES, {})
    gpus = row(free, "a100-0", "gpu.nvidia.com")
    assert (gpus.devices, gpus.whole_free, gpus.states[FREE]) == (8, 8, 8)
    mig = row(free, "a100-0", "mig.nvidia.com")
    # 7 + 3 + 2 + 1 + 1 placements per GPU are devices; at once, each GPU holds 7 x 1g.5gb, or
    # 3 x 2g.10gb (memory slices 0-1, 2-3, 4-5), 2 x 3g.20gb, 1 x 4g.20gb, 1 x 7g.40gb.
    assert mig.devices == 8 * 14
    assert mig.partitions == {"1g.5gb": 56, "2g.10gb": 24, "3g.20gb": 16, "4g.20gb": 8, "7g.40gb": 8}
    assert mig.whole_free == 56  # as many MIG devices as fit at once: all 1g.5gb
    # No A100 has more than 40Gi: the high-memory class finds nothing on this node.
    assert not [r for r in free.nodes if r.device_class == "high-memory-gpu"]


def test_one_mig_slice_in_use_takes_its_gpu_out_of_whole_and_blocks_the_overlapping_placements():
    slices = profile_slices("a100-mig", "a100-0")
    free = free_capacity(slices, CLASSES, {"claim-1": allocation("a100-0", "gpu-0-mig-1g-5gb-0")})
    gpus = row(free, "a100-0", "gpu.nvidia.com")
    assert gpus.whole_free == 7
    assert gpus.states[BLOCKED] == 1 and gpus.states[FREE] == 7  # gpu-0: its counters are taken
    mig = row(free, "a100-0", "mig.nvidia.com")
    assert mig.partitions == {"1g.5gb": 55, "2g.10gb": 23, "3g.20gb": 15, "4g.20gb": 7, "7g.40gb": 7}
    assert mig.states[ALLOCATED] == 1
    # On gpu-0 the placements over memory slice 0 (2g@0, 3g@0, 4g@0, 7g@0) cannot be had now.
    assert mig.states[BLOCKED] == 4
    assert mig.states[FREE] == 8 * 14 - 5


def test_totals_by_class_add_up_the_nodes():
    slices = profile_slices("a100-mig", "a100-0") + profile_slices("dgx-h100", "h100-0")
    free = free_capacity(slices, CLASSES, {"c": allocation("h100-0", "gpu-3")})
    totals = {t.device_class: t for t in free.classes}
    assert totals["gpu.nvidia.com"].nodes == 2
    assert totals["gpu.nvidia.com"].whole_free == 8 + 7
    assert totals["gpu.nvidia.com"].states[ALLOCATED] == 1
    assert totals["high-memory-gpu"].devices == 8 and totals["high-memory-gpu"].whole_free == 7
    assert totals["mig.nvidia.com"].partitions["1g.5gb"] == 56


def test_alike_nodes_get_the_same_counts_each_from_its_own_allocations():
    slices = profile_slices("a100-mig", "a100-0") + profile_slices("a100-mig", "a100-1")
    free = free_capacity(slices, CLASSES, {"c": allocation("a100-1", "gpu-0-mig-7g-40gb-0")})
    assert row(free, "a100-0", "mig.nvidia.com").partitions["7g.40gb"] == 8
    assert row(free, "a100-1", "mig.nvidia.com").partitions["7g.40gb"] == 7
    assert row(free, "a100-1", "mig.nvidia.com").partitions["1g.5gb"] == 49


SHARED_CLASS = device_class("shared", GPU)


def shared_slice(*, taints=None) -> ResourceSlice:
    return slice_("n1-shared", "n1", "n1", GPU,
                  device("gpu-0", capacity={"memory": "24Gi"}, multi=True),
                  device("gpu-1", capacity={"memory": "24Gi"}, multi=True, taints=taints))


def test_shared_capacity_left_is_what_the_shares_do_not_consume():
    share = allocation("n1", "gpu-0", share="6b0d1c7e-0000-4000-8000-000000000001", consumed={"memory": "8Gi"})
    free = free_capacity([shared_slice()], [SHARED_CLASS], {"s": share})
    shared = row(free, "n1", "shared")
    (memory,) = shared.shared
    assert (memory.capacity, memory.devices) == ("memory", 2)
    assert memory.total == Fraction(48 * 2**30) and memory.left == Fraction(40 * 2**30)
    assert memory.text(memory.left) == "40Gi"
    assert shared.states[SHARED] == 1 and shared.states[FREE] == 1
    # A claim asking for no capacity takes a shared device whole: only the untouched one fits.
    assert shared.whole_free == 1


def test_a_tainted_device_is_not_free_for_a_claim_without_a_toleration():
    taint = DeviceTaint(key="example.com/broken", value="true", effect="NoSchedule")
    free = free_capacity([shared_slice(taints=[taint])], [SHARED_CLASS], {})
    shared = row(free, "n1", "shared")
    assert shared.states[TAINTED] == 1 and shared.whole_free == 1

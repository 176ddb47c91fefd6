from __future__ import annotations

import msgspec
import pytest

from draplane.api.resource import Counter, CounterSet, Device, DeviceCounterConsumption
from draplane.messages.inventory import DriverDevices
from draplane.nodes.slices import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    NodeRef,
    plan_node,
    plan_pool,
    slice_name_base,
    stale_taint,
)
from draplane.nodes.hardware import driver_devices
from draplane.nodes.profile import load_profile

NODE = NodeRef("node-1", "uid-1")


def _apply(existing, plans):
    """What the apiserver would hold after the plans' writes."""
    by_name = {s.metadata.name: s for s in existing}
    rv = 100
    for plan in plans:
        for s in plan.creates + plan.updates:
            rv += 1
            by_name[s.metadata.name] = msgspec.structs.replace(
                s, metadata=msgspec.structs.replace(s.metadata, resource_version=str(rv))
            )
        for name in plan.deletes:
            by_name.pop(name)
    return list(by_name.values())


def _devices(n, counters=False):
    return DriverDevices(
        driver="gpu.nvidia.com",
        devices=[
            Device(name=f"d-{i}", consumes_counters=[DeviceCounterConsumption(counter_set="cs", counters={"c": Counter(value="1")})] if counters else None)
            for i in range(n)
        ],
        counter_sets=[CounterSet(name="cs", counters={"c": Counter(value=str(n))})] if counters else [],
    )


def test_first_write_creates_every_slice_with_owner_and_count():
    plans = plan_node(NODE, driver_devices(load_profile("dgx-h100").hardware("node-1")), [])
    assert [p.driver for p in plans] == ["gpu.nvidia.com", "dra.net"]
    for plan in plans:
        assert plan.generation == 1 and len(plan.creates) == 1 and not plan.updates and not plan.deletes
        s = plan.creates[0]
        assert s.spec.node_name == "node-1" and s.spec.pool.name == "node-1"
        assert s.spec.pool.resource_slice_count == 1 and s.spec.pool.generation == 1
        assert s.metadata.owner_references[0].kind == "Node" and s.metadata.owner_references[0].uid == "uid-1"
        assert s.metadata.labels[MANAGED_BY_LABEL] == MANAGED_BY
        assert len(s.spec.devices) == 8


@pytest.mark.parametrize("count, counters, sizes", [
    (128, False, [128]),
    (129, False, [128, 1]),
    (300, False, [128, 128, 44]),
    (64, True, [0, 64]),
    (65, True, [0, 64, 1]),
])
def test_split_at_128_or_64(count, counters, sizes):
    plan = plan_pool(NODE, _devices(count, counters), [])
    assert [len(s.spec.devices or []) for s in plan.creates] == sizes
    assert all(s.spec.pool.resource_slice_count == len(sizes) for s in plan.creates)
    if counters:
        first = plan.creates[0].spec
        assert first.shared_counters and first.devices is None  # counter sets alone in their slice


def test_taints_lower_the_limit_to_64():
    plan = plan_pool(NODE, _devices(100), [], taint=stale_taint("2026-01-01T00:00:00Z"))
    assert [len(s.spec.devices) for s in plan.creates] == [64, 36]
    assert all(d.taints[0].effect == "NoSchedule" for s in plan.creates for d in s.spec.devices)


def test_more_than_eight_counter_sets_take_more_slices():
    entry = _devices(4, counters=True)
    entry.counter_sets = [CounterSet(name=f"cs-{i}", counters={"c": Counter(value="1")}) for i in range(9)]
    plan = plan_pool(NODE, entry, [])
    assert [len(s.spec.shared_counters or []) for s in plan.creates] == [8, 1, 0]


def test_nothing_changed_means_no_write():
    drivers = driver_devices(load_profile("mixed").hardware("node-1"))
    existing = _apply([], plan_node(NODE, drivers, []))
    again = plan_node(NODE, driver_devices(load_profile("mixed").hardware("node-1")), existing)
    assert all(p.empty for p in again)
    assert {p.generation for p in again} == {1}


def test_change_bumps_generation_and_rewrites_the_whole_pool():
    existing = _apply([], [plan_pool(NODE, _devices(200), [])])
    plan = plan_pool(NODE, _devices(201), existing)
    assert plan.generation == 2
    assert len(plan.updates) == 2 and len(plan.creates) == 0
    assert all(s.spec.pool.generation == 2 for s in plan.updates)
    assert all(s.metadata.resource_version for s in plan.updates)  # optimistic concurrency
    shrunk = plan_pool(NODE, _devices(10), _apply(existing, [plan]))
    assert shrunk.generation == 3 and len(shrunk.updates) == 1 and shrunk.deletes == [f"{slice_name_base('node-1', 'gpu.nvidia.com')}-1"]
    assert shrunk.updates[0].spec.pool.resource_slice_count == 1


def test_mixed_generations_are_repaired():
    existing = _apply([], [plan_pool(NODE, _devices(200), [])])
    existing[1].spec.pool.generation = 7  # e.g. a crash between two updates
    plan = plan_pool(NODE, _devices(200), existing)
    assert plan.generation == 8 and len(plan.updates) == 2


def test_remembered_generation_is_never_reused():
    plan = plan_pool(NODE, _devices(3), [], last_generation=5)
    assert plan.generation == 6


def test_dropped_driver_pool_is_deleted():
    existing = _apply([], plan_node(NODE, driver_devices(load_profile("dgx-h100").hardware("node-1")), []))
    plans = plan_node(NODE, driver_devices(load_profile("l4").hardware("node-1")), existing)
    net = next(p for p in plans if p.driver == "dra.net")
    assert net.deletes and not net.creates
    gpu = next(p for p in plans if p.driver == "gpu.nvidia.com")
    assert gpu.generation == 2 and len(gpu.updates) == 1


def test_node_recreated_with_new_uid_rewrites_owner():
    existing = _apply([], [plan_pool(NODE, _devices(3), [])])
    plan = plan_pool(NodeRef("node-1", "uid-2"), _devices(3), existing)
    assert plan.generation == 2 and plan.updates[0].metadata.owner_references[0].uid == "uid-2"


def test_duplicate_driver_in_snapshot_is_an_error():
    with pytest.raises(ValueError, match="node-1: driver gpu.nvidia.com appears twice"):
        plan_node(NODE, [_devices(1), _devices(2)], [])


def test_long_names_stay_valid():
    base = slice_name_base("n" * 250, "gpu.nvidia.com")
    assert len(base) + 4 <= 253


def test_interrupted_first_write_is_completed_without_a_new_generation():
    full = plan_pool(NODE, _devices(200), [])
    partial = _apply([], [full])[:1]  # the second create never happened
    plan = plan_pool(NODE, _devices(200), partial)
    assert plan.generation == 1 and not plan.updates and not plan.deletes
    assert [s.metadata.name for s in plan.creates] == [full.creates[1].metadata.name]
    assert plan.creates[0].spec.pool.generation == 1


def test_interrupted_update_is_rewritten_at_a_new_generation():
    existing = _apply([], [plan_pool(NODE, _devices(200), [])])
    changed = plan_pool(NODE, _devices(201), existing)
    half = _apply(existing, [PoolPlanLike(changed.updates[:1])])
    plan = plan_pool(NODE, _devices(201), half)
    assert plan.generation == 3 and len(plan.updates) == 2


class PoolPlanLike:
    def __init__(self, updates):
        self.creates, self.updates, self.deletes = [], updates, []


@pytest.mark.parametrize("profile", ["dgx-h100", "a100-mig", "l4", "mixed"])
@pytest.mark.parametrize("tainted", [False, True])
def test_every_planned_slice_passes_the_apiservers_rules(profile, tainted):
    """The shipped profiles, as slices, checked offline by draplane.validation (the v1 rules)."""
    from draplane.validation import validate_typed

    node = NodeRef("gpu-node-1.example.com", "uid-1")
    taint = stale_taint("2026-01-01T00:00:00Z") if tainted else None
    plans = plan_node(node, driver_devices(load_profile(profile).hardware(node.name)), [], taint=taint)
    for plan in plans:
        for s in plan.creates:
            assert validate_typed(s) == [], s.metadata.name


def _slice(name: str, driver: str, manager: str | None):
    from draplane.api.meta import ObjectMeta
    from draplane.api.resource import ResourcePool, ResourceSlice, ResourceSliceSpec

    labels = {"app.kubernetes.io/managed-by": manager} if manager else None
    return ResourceSlice(metadata=ObjectMeta(name=name, labels=labels),
                         spec=ResourceSliceSpec(driver=driver, node_name="n1", pool=ResourcePool(name="n1", generation=1,
                                                                                                resource_slice_count=1)))


def test_a_driver_another_publisher_uses_on_the_node_is_refused_unless_ours_came_first():
    from draplane.nodes.slices import drivers_of_other_publishers, refused_drivers

    nvidia = _slice("n1-gpu.nvidia.com-x7k2p", "gpu.nvidia.com", None)  # NVIDIA's plugin sets no managed-by
    other_inventory = _slice("n1-dra-net-0", "dra.net", "draplane-inventory-b")
    ours = _slice("n1-fpga-0", "fpga.example.com", "draplane-inventory")
    others = drivers_of_other_publishers([nvidia, other_inventory, ours], "draplane-inventory")
    assert others == {"gpu.nvidia.com": "ResourceSlice n1-gpu.nvidia.com-x7k2p",
                      "dra.net": "ResourceSlice n1-dra-net-0 (managed-by draplane-inventory-b)"}
    wanted = ["gpu.nvidia.com", "dra.net", "fpga.example.com"]
    assert refused_drivers(wanted, [ours], others) == {"gpu.nvidia.com": others["gpu.nvidia.com"],
                                                       "dra.net": others["dra.net"]}
    # ours were there first: they stay (the newcomer is the one to fix)
    ours_too = _slice("n1-gpu-nvidia-com-0", "gpu.nvidia.com", "draplane-inventory")
    assert refused_drivers(wanted, [ours, ours_too], others) == {"dra.net": others["dra.net"]}
    assert refused_drivers(wanted, [], {}) == {}

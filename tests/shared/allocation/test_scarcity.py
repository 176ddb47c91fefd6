"""draplane.allocation.scarcity, and the shipped policy keeping scarce GPUs for the classes that need
them (issue 27, items 13 and 14), on the nodes `draplane up --nodes 6` runs."""

from __future__ import annotations

import random

import msgspec
import pytest

from draplane.allocation.device_allocator import DeviceAllocator
from draplane.allocation.fragmentation import FragmentationAwareDraplane
from draplane.allocation.scarcity import DeviceScarcity, unit_of
from draplane.api.resource import DeviceClass, ResourceClaimStatus
from draplane.localenv.environment import DEFAULT_PROFILES, node_names, standard_device_classes
from draplane.simulation import scenario
from draplane.scheduling.placing import SchedulingState, Placed
from draplane.nodes.slices import NodeRef, plan_node
from draplane.nodes.hardware import driver_devices
from draplane.nodes.profile import load_profile, profile_hardware


def profile_slices(profile: str, node: str) -> list:
    drivers = driver_devices(profile_hardware(load_profile(profile), node))
    return [s for plan in plan_node(NodeRef(node, "uid"), drivers, []) for s in plan.creates]


def standard_classes() -> list[DeviceClass]:
    return [msgspec.convert(c, DeviceClass) for c in standard_device_classes()]


def up_cluster(nodes: int = 6, classes: list[DeviceClass] | None = None) -> SchedulingState:
    """The nodes and classes of `draplane up --nodes N`, in the shard's core with the shipped policy,
    fresh: the registered one learns from every pod any test places."""
    state = SchedulingState(policy=FragmentationAwareDraplane())
    for c in standard_classes() if classes is None else classes:
        state.set_class(c)
    for profile, names in node_names(DEFAULT_PROFILES, nodes).items():
        for name in names:
            state.set_node(scenario.gpu_node(name))
            state.set_feed_entry(f"node.{name}", profile_slices(profile, name))
    return state


def place(state: SchedulingState, name: str, class_name: str, count: int = 1, node: str | None = None, **kw):
    """Place and keep a claim (as if bound): its node and (device, productName) pairs."""
    claim = scenario.claim("ns", name, class_name, count=count, **kw)
    claim.metadata.uid = name
    if node is None:
        pod = scenario.pod("ns", f"pod-{name}", claim_name=name)
        pod.metadata.uid = f"pod-{name}"
        placed = state.place_pod(pod, [claim])
        assert isinstance(placed, Placed), placed
        where, allocation = placed.node, placed.allocations[name]
        chosen = state.devices.allocate_on_node([claim], where).chosen  # the same search, for the records
    else:
        placement = state.devices.allocate_on_node([claim], node)
        where, allocation, chosen = node, placement.allocations[0], placement.chosen
    claim.status = ResourceClaimStatus(allocation=allocation)
    state.set_claim(claim)
    return where, [(c.record.name, c.record.attributes["productName"][1]) for group in chosen for c in group]


def test_the_shares_of_the_standard_classes_on_the_up_cluster_and_each_gpus_scarcity():
    state = up_cluster()
    scarcity = state.devices.scarcity
    # 38 GPUs: 10 L4, 18 A100 that MIG can split, 10 H100 over 40Gi; shares in 1/32 of the GPUs.
    # The dranet class reaches the NICs of the DGX and mixed nodes, all of them.
    assert scarcity.describe() == {"gpu.nvidia.com": 1.0, "high-memory-gpu": 8 / 32, "mig.nvidia.com": 15 / 32,
                                   "dranet": 1.0}
    by_product = {}
    for slice_ in state.devices.inventory.slice_entries().values():
        for record in slice_.devices:
            product = record.attributes.get("productName")
            if product is not None:
                by_product.setdefault(product[1], set()).add(scarcity.of(record))
    assert by_product["NVIDIA L4"] == {0.0}
    assert by_product["NVIDIA A100-SXM4-40GB"] == {1 - 15 / 32}  # the whole GPU and its partitions: one unit
    assert by_product["NVIDIA H100 80GB HBM3"] == {1 - 8 / 32}


def test_a_class_for_another_kind_of_device_changes_no_gpus_scarcity():
    """The NICs and their class are no competitor of the GPU classes: the GPUs' shares and
    scarcities are those of the GPU classes alone, and one NIC class makes no NIC scarce."""
    gpu_classes = [c for c in standard_classes() if c.metadata.name != "dranet"]
    with_nics, without = up_cluster(), up_cluster(classes=gpu_classes)
    shares = with_nics.devices.scarcity.describe()
    assert shares.pop("dranet") == 1.0
    assert shares == without.devices.scarcity.describe()
    nics = 0
    for name, entry in with_nics.devices.inventory.slice_entries().items():
        for record in entry.devices:
            alone = without.devices.inventory.slice_entries()[name]
            if record.driver == "dra.net":
                nics += 1
                assert with_nics.devices.scarcity.of(record) == 0.0
            else:
                assert with_nics.devices.scarcity.of(record) == without.devices.scarcity.of(
                    next(r for r in alone.devices if r.id == record.id))
    assert nics > 0
    # a second NIC class that reaches the NICs of one NUMA node makes those scarce, and no GPU
    numa_zero = msgspec.convert({"metadata": {"name": "nic-numa-0"}, "spec": {"selectors": [{"cel": {
        "expression": "device.driver == 'dra.net' && device.attributes['resource.kubernetes.io'].numaNode == 0"}}]}},
        DeviceClass)
    with_nics.set_class(numa_zero)
    shares = with_nics.devices.scarcity.describe()
    assert 0 < shares["nic-numa-0"] < 1 and shares["dranet"] == 1.0
    assert {k: v for k, v in shares.items() if k not in ("dranet", "nic-numa-0")} == without.devices.scarcity.describe()


def test_one_class_that_every_gpu_meets_makes_nothing_scarce():
    only_generic = [c for c in standard_classes() if c.metadata.name == "gpu.nvidia.com"]
    state = up_cluster(classes=only_generic)
    records = [r for s in state.devices.inventory.slice_entries().values() for r in s.devices]
    assert {state.devices.scarcity.of(r) for r in records} == {0.0}


def test_counts_kept_across_slice_changes_equal_a_fresh_count():
    state = up_cluster(8)
    cluster = state.devices
    rng = random.Random(3)
    names = [n for names in node_names(DEFAULT_PROFILES, 8).values() for n in names]
    profiles = {n: p for p, ns in node_names(DEFAULT_PROFILES, 8).items() for n in ns}
    for _ in range(12):
        name = rng.choice(names)
        if rng.random() < 0.5:
            state.set_feed_entry(f"node.{name}", [])  # the node's slices withdrawn
        else:
            state.set_feed_entry(f"node.{name}", profile_slices(profiles[name], name))
        cluster.scarcity.refresh()
        fresh = DeviceScarcity(cluster.inventory, cluster.allocator.matcher)
        fresh.set_classes(cluster.classes.values())
        assert fresh.describe() == cluster.scarcity.describe()
        for entry in cluster.inventory.slice_entries().values():
            for record in entry.devices:
                assert fresh.of(record) == cluster.scarcity.of(record), record


def test_the_version_moves_only_when_a_rounded_share_moves():
    state = up_cluster(8)
    scarcity = state.devices.scarcity
    scarcity.refresh()
    version = scarcity.version
    # a node's slices published again, unchanged
    state.set_feed_entry("node.l4-0000", profile_slices("l4", "l4-0000"))
    scarcity.refresh()
    assert scarcity.version == version
    # every A100 node gone: the MIG class reaches only the mixed nodes' A100s
    for name in ("a100-mig-0000", "a100-mig-0001"):
        state.set_feed_entry(f"node.{name}", [])
    scarcity.refresh()
    assert scarcity.version == version + 1
    assert scarcity.describe()["mig.nvidia.com"] < 15 / 32


def test_a_class_whose_selector_does_not_compile_counts_for_no_device():
    broken = msgspec.convert({"metadata": {"name": "broken"}, "spec": {"selectors": [{"cel": {"expression": "device.("}}]}},
                             DeviceClass)
    state = up_cluster(classes=[*standard_classes(), broken])
    assert state.devices.scarcity.describe()["broken"] == 0.0
    where, devices = place(state, "one", "gpu.nvidia.com")
    assert devices[0][1] == "NVIDIA L4", (where, devices)


def test_an_8_gpu_generic_claim_takes_an_a100_node_and_leaves_the_dgx_h100_to_high_memory():
    """Item 13: the only 8 x H100 node stays whole for high-memory-gpu."""
    state = up_cluster()
    where, devices = place(state, "eight", "gpu.nvidia.com", count=8)
    assert where.startswith("a100-mig-") and {p for _, p in devices} == {"NVIDIA A100-SXM4-40GB"}
    where, devices = place(state, "eight-big", "high-memory-gpu", count=8)
    assert where == "dgx-h100-0000"


def test_a_generic_gpu_on_the_mixed_node_is_an_l4_not_an_h100():
    """Item 14: one A100 partitioned makes its PCIe root the tightest, where the H100s sit; the L4
    on the other root is still the one to take, and the A100s before the H100s after the L4s."""
    state = up_cluster()
    place(state, "slice", "mig.nvidia.com", node="mixed-0000",
          selector='device.attributes["gpu.nvidia.com"].profile == "1g.5gb"')
    products = [place(state, f"one-{i}", "gpu.nvidia.com", node="mixed-0000")[1][0][1] for i in range(5)]
    assert products == ["NVIDIA L4", "NVIDIA L4", "NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3",
                        "NVIDIA H100 80GB HBM3"]


def test_a_generic_gpu_goes_to_an_l4_node_before_a_busy_node_of_scarce_gpus():
    state = up_cluster()
    place(state, "busy", "gpu.nvidia.com", node="dgx-h100-0000")
    where, devices = place(state, "one", "gpu.nvidia.com")
    assert devices[0][1] == "NVIDIA L4" and where != "dgx-h100-0000", (where, devices)


def test_the_unit_of_a_mig_partition_is_its_gpu():
    state = up_cluster(3)
    records = {r.name: r for s in state.devices.inventory.slice_entries().values() for r in s.devices
               if r.pool == "a100-mig-0000"}
    assert unit_of(records["gpu-0"]) == unit_of(records["gpu-0-mig-1g-5gb-0"]) != unit_of(records["gpu-1"])
    assert unit_of(records["gpu-0"])[:2] == ("gpu.nvidia.com", "a100-mig-0000")


def test_first_fit_reads_no_scarcity():
    cluster = DeviceAllocator(policy="first-fit")
    assert not cluster.policy.reads_scarcity

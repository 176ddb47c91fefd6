from __future__ import annotations

import msgspec
import pytest

from draplane.api.quantity import parse_quantity
from draplane.nodes.hardware import GPU_DRIVER, HardwareError, as_semver, driver_devices
from draplane.nodes.profile import ProfileError, load_profile, parse_profile, shipped_profiles

STD = "resource.kubernetes.io"


def _attr(device, name):
    return device.attributes[name].value()


def test_shipped_profiles_are_the_four_of_the_issue():
    assert set(shipped_profiles()) == {"dgx-h100", "a100-mig", "l4", "mixed"}
    for name in shipped_profiles():
        driver_devices(load_profile(name).hardware("node-a"))


def test_dgx_h100_topology_and_attribute_names():
    gpus, nics = driver_devices(load_profile("dgx-h100").hardware("dgx-1"))
    assert gpus.driver == GPU_DRIVER and nics.driver == "dra.net"
    assert len(gpus.devices) == 8 and len(nics.devices) == 8 and not gpus.counter_sets
    gpu = gpus.devices[0]
    assert gpu.name == "gpu-0"
    assert _attr(gpu, "type") == "gpu"
    assert _attr(gpu, "productName") == "NVIDIA H100 80GB HBM3"
    assert _attr(gpu, "architecture") == "Hopper"
    assert gpu.attributes["cudaComputeCapability"].version_value == "9.0.0"
    assert gpu.attributes["driverVersion"].version_value == "550.54.15"
    assert _attr(gpu, "uuid").startswith("GPU-")
    assert parse_quantity(gpu.capacity["memory"].value) == parse_quantity("81559Mi")
    roots = {_attr(d, f"{STD}/pcieRoot") for d in gpus.devices}
    numas = {_attr(d, f"{STD}/numaNode") for d in gpus.devices}
    assert len(roots) == 4 and numas == {0, 1}
    # Every PCIe root has two GPUs and two NICs, and each root lies on one NUMA node.
    for root in roots:
        on_root = [d for d in gpus.devices + nics.devices if _attr(d, f"{STD}/pcieRoot") == root]
        assert len(on_root) == 4
        assert len({_attr(d, f"{STD}/numaNode") for d in on_root}) == 1
    bus_ids = [_attr(d, f"{STD}/pciBusID") for d in gpus.devices + nics.devices]
    assert len(set(bus_ids)) == 16


def test_uuids_are_stable_per_node_and_differ_between_nodes():
    profile = load_profile("l4")
    a1 = driver_devices(profile.hardware("a"))[0].devices
    a2 = driver_devices(profile.hardware("a"))[0].devices
    b = driver_devices(profile.hardware("b"))[0].devices
    assert [_attr(d, "uuid") for d in a1] == [_attr(d, "uuid") for d in a2]
    assert not {_attr(d, "uuid") for d in a1} & {_attr(d, "uuid") for d in b}


def test_a100_mig_is_partitionable():
    (gpus,) = driver_devices(load_profile("a100-mig").hardware("n"))
    assert len(gpus.counter_sets) == 8
    per_gpu = [d for d in gpus.devices if d.name == "gpu-0" or d.name.startswith("gpu-0-")]
    # whole GPU + 7 x 1g.5gb + 3 x 2g.10gb + 2 x 3g.20gb + 4g.20gb + 7g.40gb
    assert len(per_gpu) == 15
    whole = per_gpu[0]
    counter_set = gpus.counter_sets[0]
    assert counter_set.name == "gpu-0-counter-set"
    assert whole.consumes_counters[0].counters == counter_set.counters
    mig = next(d for d in per_gpu if d.name == "gpu-0-mig-3g-20gb-4")
    assert _attr(mig, "type") == "mig" and _attr(mig, "profile") == "3g.20gb"
    used = mig.consumes_counters[0].counters
    assert {k for k in used if k.startswith("memory-slice-")} == {f"memory-slice-{i}" for i in range(4, 8)}
    assert len(counter_set.counters) <= 32
    # Counter names are DNS labels, as the apiserver requires.
    assert all(k.replace("-", "").isalnum() and k == k.lower() for k in counter_set.counters)


def test_semver_normalisation():
    assert as_semver("9.0", what="x") == "9.0.0"
    assert as_semver("550.90.07", what="x") == "550.90.7"
    with pytest.raises(HardwareError, match="driverVersion"):
        as_semver("550.x", what="GPU 0 driverVersion")


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: x\ndriverVersion: '1.2.3'\ngpus: [{count: 1, productName: p, architecture: a, cudaComputeCapability: '9.0', memory: lots}]", "gpus\\[0\\].memory"),
        ("name: x\ndriverVersion: '1.2.3'\ngpuz: []", "gpuz"),
        ("name: x\ndriverVersion: '1.2.3'\nnumaNodes: 2\npcieRoots: 1", "pcieRoots"),
        ("name: x\ndriverVersion: '1.2.3'\ngpus: [{count: 0, productName: p, architecture: a, cudaComputeCapability: '9.0', memory: 1Gi}]", "count"),
        ("name: [", "not valid YAML"),
        ("name: x\ndriverVersion: 'abc'\ngpus: [{count: 1, productName: p, architecture: a, cudaComputeCapability: '9.0', memory: 1Gi}]", "driverVersion"),
    ],
)
def test_bad_profiles_are_reported_by_field(text, message):
    with pytest.raises(ProfileError, match=message):
        parse_profile(text, source="bad.yaml")


def test_mig_placement_outside_the_gpu_is_rejected():
    text = """
name: x
driverVersion: '1.2.3'
gpus:
  - count: 1
    productName: p
    architecture: Ampere
    cudaComputeCapability: '8.0'
    memory: 40Gi
    mig:
      memorySlices: 8
      multiprocessors: 108
      profiles: [{name: 7g.40gb, memory: 40Gi, multiprocessors: 98, placements: [{start: 4, size: 8}]}]
"""
    with pytest.raises(ProfileError, match="7g.40gb.*start=4 size=8"):
        parse_profile(text)


def test_unknown_profile_name():
    with pytest.raises(ProfileError, match="not a shipped profile"):
        load_profile("no-such-profile")


SHARED = """
name: shared
driverVersion: '1.2.3'
gpus:
  - {count: 2, productName: NVIDIA L4, architecture: Ada Lovelace, cudaComputeCapability: '8.9', memory: 23034Mi,
     shared: {memoryStep: 4Gi}}
"""


def test_shared_gpus_are_consumable_capacity_devices_the_apiserver_accepts():
    from draplane.validation import validate_object

    (gpus,) = driver_devices(parse_profile(SHARED).hardware("node-a"))
    for device in gpus.devices:
        assert device.allow_multiple_allocations is True
        policy = device.capacity["memory"].request_policy
        assert (policy.default, policy.valid_range.min, policy.valid_range.step) == ("4Gi", "4Gi", "4Gi")
        assert device.capacity["memory"].value == "23034Mi"
    slice_ = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "node-a-gpu"},
              "spec": {"driver": GPU_DRIVER, "nodeName": "node-a", "pool": {"name": "node-a", "generation": 1,
                                                                             "resourceSliceCount": 1},
                       "devices": [msgspec.to_builtins(d) for d in gpus.devices]}}
    assert validate_object(slice_) == []


@pytest.mark.parametrize("extra, message", [
    ("shared: {memoryStep: 0}", "shared.memoryStep"),
    ("shared: {memoryStep: 4Gi}\n    mig: {memorySlices: 8, multiprocessors: 98, profiles: []}", "either partitioned"),
])
def test_bad_shared_gpus_are_reported_by_field(extra, message):
    text = ("name: x\ndriverVersion: '1.2.3'\ngpus:\n  - count: 1\n    productName: p\n    architecture: a\n"
            f"    cudaComputeCapability: '9.0'\n    memory: 40Gi\n    {extra}\n")
    with pytest.raises(ProfileError, match=message):
        parse_profile(text, source="bad.yaml")

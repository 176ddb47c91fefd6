"""Preparing a claim on a node, decided without I/O: refusals that name the field, claim config,
CDI content, request names and conflicts between claims."""

from __future__ import annotations

import pytest

from draplane.api.codec import convert
from draplane.api.resource import Device, ResourceClaim
from draplane_node_agent.preparation import (
    CDI_KIND,
    ClaimRef,
    PrepareRefused,
    cdi_spec,
    cdi_spec_file_name,
    conflicting_claim,
    plan_claim,
)

DRIVER = "gpu.nvidia.com"
NODE = "node-a"


def published(*names: str, shared: bool = False, mig_without_uuid: str | None = None) -> dict[str, Device]:
    devices = {}
    for i, name in enumerate(names):
        attributes = {"type": {"string": "gpu"}, "uuid": {"string": f"GPU-{i:04d}"}}
        devices[name] = convert({"name": name, "attributes": attributes, "allowMultipleAllocations": shared or None},
                                Device)
    if mig_without_uuid:
        devices[mig_without_uuid] = convert({"name": mig_without_uuid, "attributes": {"type": {"string": "mig"}}}, Device)
    return devices


def claim(results: list[dict], *, uid: str = "uid-1", config: list[dict] | None = None,
          allocated: bool = True) -> ResourceClaim:
    raw = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
           "metadata": {"name": "c1", "namespace": "ns", "uid": uid}, "spec": {"devices": {"requests": []}}}
    if allocated:
        raw["status"] = {"allocation": {"devices": {"results": results, "config": config}}}
    return convert(raw, ResourceClaim)


def result(device: str, *, request: str = "gpu", driver: str = DRIVER, pool: str = NODE, **extra) -> dict:
    return {"request": request, "driver": driver, "pool": pool, "device": device, **extra}


REF = ClaimRef(namespace="ns", name="c1", uid="uid-1")


def test_two_devices_get_their_cdi_ids_env_and_files():
    plan = plan_claim(claim([result("gpu-0"), result("gpu-1")]), REF, driver=DRIVER, node=NODE,
                      published=published("gpu-0", "gpu-1", "gpu-2"))
    assert [d.device for d in plan.devices] == ["gpu-0", "gpu-1"]
    assert plan.devices[0].cdi_device_ids == [f"{CDI_KIND}=uid-1_{DRIVER}_gpu-0"]
    assert plan.devices[0].env["DRAPLANE_DEVICE_GPU_NVIDIA_COM_GPU_0_UUID"] == "GPU-0000"
    assert plan.devices[1].env["DRAPLANE_DEVICE_GPU_NVIDIA_COM_GPU_1_NAME"] == f"{DRIVER}/{NODE}/gpu-1"
    assert "uuid: GPU-0001" in plan.devices[1].file_text
    spec = cdi_spec(plan, "/host/claims/uid-1")
    assert spec["kind"] == CDI_KIND
    assert [d["name"] for d in spec["devices"]] == [f"uid-1_{DRIVER}_gpu-0", f"uid-1_{DRIVER}_gpu-1"]
    mount = spec["devices"][0]["containerEdits"]["mounts"][0]
    assert mount["hostPath"] == f"/host/claims/uid-1/{DRIVER}_gpu-0"
    assert mount["containerPath"] == f"/var/run/draplane/devices/{DRIVER}_gpu-0" and "ro" in mount["options"]
    assert cdi_spec_file_name("uid-1", DRIVER) == f"k8s.draplane.io-claim_uid-1_{DRIVER}.json"


def test_real_gpus_also_get_the_nvidia_toolkit_device_by_uuid():
    plan = plan_claim(claim([result("gpu-1")]), REF, driver=DRIVER, node=NODE, published=published("gpu-0", "gpu-1"),
                      real_gpus=True)
    assert plan.devices[0].cdi_device_ids[1] == "nvidia.com/gpu=GPU-0001"


def test_a_mig_placement_without_an_instance_is_refused_on_a_real_node():
    with pytest.raises(PrepareRefused, match=r"results\[0\]\.device: gpu-0-mig-1g.5gb-0 is a MIG placement"):
        plan_claim(claim([result("gpu-0-mig-1g.5gb-0")]), REF, driver=DRIVER, node=NODE,
                   published=published(mig_without_uuid="gpu-0-mig-1g.5gb-0"), real_gpus=True)


def test_the_kubelet_gets_base_request_names_for_subrequests():
    plan = plan_claim(claim([result("gpu-0", request="gpu/large")]), REF, driver=DRIVER, node=NODE,
                      published=published("gpu-0"))
    assert plan.devices[0].request_names == ["gpu"]


def test_only_this_drivers_devices_are_prepared():
    plan = plan_claim(claim([result("nic-0", driver="net.example.com"), result("gpu-0")]), REF, driver=DRIVER,
                      node=NODE, published=published("gpu-0"))
    assert [d.device for d in plan.devices] == ["gpu-0"]
    with pytest.raises(PrepareRefused, match="has no device of driver gpu.nvidia.com"):
        plan_claim(claim([result("nic-0", driver="net.example.com")]), REF, driver=DRIVER, node=NODE,
                   published=published("gpu-0"))


@pytest.mark.parametrize("case, match", [
    ("uid", r"ResourceClaim ns/c1: metadata.uid is other, but the kubelet asked for UID uid-1"),
    ("unallocated", r"ResourceClaim ns/c1: status.allocation is not set"),
    ("other-node", r"results\[0\]\.pool: 'node-b' is not this node's pool \('node-a'\)"),
    ("unknown-device", r"results\[0\]\.device: gpu.nvidia.com/node-a/gpu-9 is not a device this node publishes"),
])
def test_refusals_name_the_claim_and_the_field(case, match):
    if case == "uid":
        c = claim([result("gpu-0")], uid="other")
    elif case == "unallocated":
        c = claim([], allocated=False)
    elif case == "other-node":
        c = claim([result("gpu-0", pool="node-b")])
    else:
        c = claim([result("gpu-9")])
    with pytest.raises(PrepareRefused, match=match):
        plan_claim(c, REF, driver=DRIVER, node=NODE, published=published("gpu-0"))


def opaque(parameters, *, requests=None, driver=DRIVER, source="FromClaim") -> dict:
    return {"source": source, "requests": requests, "opaque": {"driver": driver, "parameters": parameters}}


def test_claim_config_env_is_applied_per_request_class_first_claim_wins():
    config = [
        opaque({"apiVersion": "draplane.io/v1alpha1", "kind": "DeviceConfig", "env": {"MODE": "class", "A": "1"}},
               source="FromClass"),
        opaque({"apiVersion": "draplane.io/v1alpha1", "kind": "DeviceConfig", "env": {"MODE": "claim"}},
               requests=["train"]),
        opaque({"anything": "goes"}, driver="net.example.com"),  # another driver's: not ours to judge
    ]
    plan = plan_claim(claim([result("gpu-0", request="train"), result("gpu-1", request="infer")], config=config), REF,
                      driver=DRIVER, node=NODE, published=published("gpu-0", "gpu-1"))
    assert plan.devices[0].env["MODE"] == "claim" and plan.devices[0].env["A"] == "1"
    assert plan.devices[1].env["MODE"] == "class"


@pytest.mark.parametrize("parameters, match", [
    ("text", r"config\[0\]\.opaque\.parameters: must be an object"),
    ({"apiVersion": "draplane.io/v1", "kind": "DeviceConfig"}, r"parameters\.apiVersion: 'draplane.io/v1' is not supported"),
    ({"apiVersion": "draplane.io/v1alpha1", "kind": "GpuConfig"}, r"parameters\.kind: 'GpuConfig' is not supported"),
    ({"apiVersion": "draplane.io/v1alpha1", "kind": "DeviceConfig", "sharing": {}}, r"unknown field `sharing`"),
    ({"apiVersion": "draplane.io/v1alpha1", "kind": "DeviceConfig", "env": {"1BAD": "x"}},
     r"parameters\.env: '1BAD' is not a valid environment variable name"),
    ({"apiVersion": "draplane.io/v1alpha1", "kind": "DeviceConfig", "env": {"DRAPLANE_DEVICE_X": "x"}},
     r"starts with DRAPLANE_, which draplane sets itself"),
    ({"apiVersion": "draplane.io/v1alpha1", "kind": "DeviceConfig", "env": {"A": 3}}, r"Expected `str`, got `int`"),
])
def test_bad_claim_config_is_refused_naming_the_field(parameters, match):
    c = claim([result("gpu-0")], config=[opaque(parameters)])
    with pytest.raises(PrepareRefused, match=r"ResourceClaim ns/c1: status\.allocation\.devices\.config\[0\]") as info:
        plan_claim(c, REF, driver=DRIVER, node=NODE, published=published("gpu-0"))
    assert info.match(match)


def test_shared_device_share_and_admin_access_show_in_env():
    r = result("gpu-0", shareID="abc", consumedCapacity={"memory": "10Gi"})
    plan = plan_claim(claim([r]), REF, driver=DRIVER, node=NODE, published=published("gpu-0", shared=True))
    device = plan.devices[0]
    assert device.env["DRAPLANE_DEVICE_GPU_NVIDIA_COM_GPU_0_CAPACITY_MEMORY"] == "10Gi"
    assert device.cdi_device_ids == [f"{CDI_KIND}=uid-1_{DRIVER}_gpu-0_abc"] and not device.exclusive
    admin = plan_claim(claim([result("gpu-0", adminAccess=True)]), REF, driver=DRIVER, node=NODE,
                       published=published("gpu-0"))
    assert admin.devices[0].env["DRAPLANE_DEVICE_GPU_NVIDIA_COM_GPU_0_ADMIN_ACCESS"] == "true"


def _plan(uid: str, device: str, *, shared: bool = False, **extra):
    ref = ClaimRef(namespace="ns", name=f"c-{uid}", uid=uid)
    c = claim([result(device, **extra)], uid=uid)
    c.metadata.name = ref.name
    return plan_claim(c, ref, driver=DRIVER, node=NODE, published=published(device, shared=shared))


def test_an_exclusive_device_is_never_prepared_for_two_claims():
    first = _plan("u1", "gpu-0")
    message = conflicting_claim(_plan("u2", "gpu-0"), [first])
    assert message is not None and "already prepared for ResourceClaim ns/c-u1 (uid u1)" in message
    assert conflicting_claim(_plan("u2", "gpu-1"), [first]) is None
    assert conflicting_claim(first, [first]) is None  # asked again for the same claim


def test_admin_access_and_shared_devices_do_not_conflict():
    busy = _plan("u1", "gpu-0")
    assert conflicting_claim(_plan("u2", "gpu-0", adminAccess=True), [busy]) is None
    assert conflicting_claim(busy, [_plan("u2", "gpu-0", adminAccess=True)]) is None
    shares = [_plan("u1", "gpu-0", shared=True, shareID="s1"), _plan("u2", "gpu-0", shared=True, shareID="s2")]
    assert conflicting_claim(shares[1], shares[:1]) is None

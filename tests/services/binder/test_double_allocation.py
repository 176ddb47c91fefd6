"""A device in two claims beyond what adminAccess and shares allow: found once per pair, not for
what Kubernetes allows, and forgotten when a claim lets the device go."""

from __future__ import annotations

from draplane.api.meta import ObjectMeta
from draplane.api.resource import (
    AllocationResult,
    DeviceAllocationResult,
    DeviceRequestAllocationResult,
    ResourceClaim,
    ResourceClaimSpec,
    ResourceClaimStatus,
)
from draplane_binder.double_allocation import DeviceHolders


def claim(name: str, *devices: str, admin: bool = False, share: bool = False, uid: str | None = None) -> ResourceClaim:
    results = [DeviceRequestAllocationResult(request="gpu", driver="gpu.nvidia.com", pool="n1", device=d,
                                             admin_access=True if admin else None,
                                             share_id=f"{name}-{d}-share" if share else None) for d in devices]
    status = ResourceClaimStatus(allocation=AllocationResult(devices=DeviceAllocationResult(results=results))) if devices else None
    return ResourceClaim(metadata=ObjectMeta(name=name, namespace="ns", uid=uid or f"uid-{name}"),
                         spec=ResourceClaimSpec(), status=status)


def test_two_claims_on_one_device_are_one_double_allocation_told_once():
    holders = DeviceHolders()
    assert holders.update(claim("a", "gpu-0", "gpu-1")) == []
    (double,) = holders.update(claim("b", "gpu-1"))
    assert double.device == ("gpu.nvidia.com", "n1", "gpu-1")
    assert (double.first.key, double.second.key) == ("ns/a", "ns/b")
    assert "gpu.nvidia.com/n1/gpu-1 is allocated to both ResourceClaim ns/a and ResourceClaim ns/b" in double.message()
    assert holders.doubles() == 1
    # the same claims seen again (a status update, a resync, the other claim changing): not again
    assert holders.update(claim("b", "gpu-1")) == []
    assert holders.update(claim("a", "gpu-0", "gpu-1")) == []
    # a third claim on it is a new pair with each
    assert {(d.first.key, d.second.key) for d in holders.update(claim("c", "gpu-1"))} == {("ns/a", "ns/c"), ("ns/b", "ns/c")}


def test_admin_access_and_shares_are_what_kubernetes_allows():
    holders = DeviceHolders()
    assert holders.update(claim("user", "gpu-0")) == []
    assert holders.update(claim("monitor", "gpu-0", admin=True)) == []
    assert holders.update(claim("s1", "gpu-5", share=True)) == []
    assert holders.update(claim("s2", "gpu-5", share=True)) == []
    assert holders.doubles() == 0
    # a whole-device allocation of a shared device is not a share
    assert len(holders.update(claim("whole", "gpu-5"))) == 2


def test_a_deallocated_or_deleted_claim_lets_its_devices_go_and_a_new_pair_is_told_again():
    holders = DeviceHolders()
    holders.update(claim("a", "gpu-0"))
    assert len(holders.update(claim("b", "gpu-0"))) == 1
    holders.update(claim("b"))  # deallocated
    assert holders.doubles() == 0
    assert len(holders.update(claim("b", "gpu-0"))) == 1  # allocated onto it again: a new fact
    holders.forget("uid-b")
    holders.forget("uid-a")
    assert holders.doubles() == 0 and holders._by_device == {} and holders._by_claim == {} and holders._told == set()

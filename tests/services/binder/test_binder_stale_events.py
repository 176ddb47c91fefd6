"""The binder caches what it writes before its watch brings it back: an event older than that
cached state, still on its way, must not undo it (nor look like the claim was deallocated)."""

import asyncio

from draplane.api.meta import ObjectMeta
from draplane.api.resource import (
    AllocationResult,
    DeviceAllocationResult,
    DeviceRequestAllocationResult,
    ResourceClaim,
    ResourceClaimConsumerReference,
    ResourceClaimSpec,
    ResourceClaimStatus,
)
from draplane_binder.service import Binder
from draplane_binder.settings import BinderSettings


class _NoNats:
    def jetstream(self):
        return None


def _claim(resource_version: str, allocated: bool) -> ResourceClaim:
    status = ResourceClaimStatus(
        allocation=AllocationResult(devices=DeviceAllocationResult(results=[DeviceRequestAllocationResult(
            request="gpu", driver="gpu.nvidia.com", pool="n1", device="gpu-0")])),
        reserved_for=[ResourceClaimConsumerReference(resource="pods", name="web", uid="pod-uid")],
    ) if allocated else None
    return ResourceClaim(metadata=ObjectMeta(name="web-gpu", namespace="ns", uid="claim-uid",
                                             resource_version=resource_version),
                         spec=ResourceClaimSpec(), status=status)


async def test_an_event_older_than_the_binders_own_write_neither_replaces_it_nor_releases_the_claim():
    binder = Binder(BinderSettings(), kube=None, nc=_NoNats())
    released = []

    async def release(claim):
        released.append(claim.metadata.resource_version)

    binder.reservations.release = release
    binder.cache.apply_claim("MODIFIED", _claim("12", allocated=True))  # what the placement writer wrote
    binder.cache.apply_claim("ADDED", _claim("10", allocated=False))  # the watch, behind: the claim as created
    binder.cache.apply_claim("MODIFIED", _claim("12", allocated=True))  # the watch catches up
    await asyncio.sleep(0)  # a release would run now
    assert binder.cache.claims[("ns", "web-gpu")].metadata.resource_version == "12"
    assert released == []
    binder.cache.apply_claim("MODIFIED", _claim("15", allocated=False))  # a real deallocation is still one
    await asyncio.sleep(0)
    assert released == ["12"]

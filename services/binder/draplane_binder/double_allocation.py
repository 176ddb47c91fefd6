"""Devices allocated to two claims at once, beyond what Kubernetes allows. Pure: no I/O.

Two schedulers that allocate from the same ResourceSlices (draplane beside kube-scheduler, or two
draplane installations) each keep their own view of what is taken; neither sees the other's
in-flight allocations, so both can write the same device into two claims in the same second
(kubernetes#128980 describes this for any two schedulers). The apiserver accepts both writes:
nothing in ResourceClaim validation looks across claims.

The binder watches every claim, so it can see what no single scheduler can. A device may be in
several claims' allocations only where Kubernetes allows it:

- a result with `adminAccess` does not take the device (monitoring, health checks), so it shares
  with anything;
- results with a `shareID` are shares of a device that allows multiple allocations (consumable
  capacity); shares are kept apart by their IDs.

Any other pair of claims holding one device is a double allocation: two pods would be given the
same GPU. `DeviceHolders` indexes the allocations and names each such pair once.
"""

from __future__ import annotations

import dataclasses

from draplane.api.resource import ResourceClaim

DeviceKey = tuple[str, str, str]  # (driver, pool, device)


@dataclasses.dataclass(frozen=True, slots=True)
class Holder:
    """One claim's allocation result on a device."""

    uid: str
    namespace: str
    name: str
    share_id: str | None
    admin_access: bool

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclasses.dataclass(frozen=True, slots=True)
class DoubleAllocation:
    device: DeviceKey
    first: Holder  # the claims ordered by uid: the same pair is always told the same way
    second: Holder

    @property
    def pair(self) -> tuple[DeviceKey, str, str]:
        return self.device, self.first.uid, self.second.uid

    @property
    def id(self) -> str:
        driver, pool, device = self.device
        return f"{driver}/{pool}/{device}/{self.first.uid}/{self.second.uid}"

    def message(self) -> str:
        driver, pool, device = self.device
        return (f"device {driver}/{pool}/{device} is allocated to both ResourceClaim {self.first.key} and "
                f"ResourceClaim {self.second.key}; the device allows one allocation and neither claim has "
                "adminAccess, so two pods would share it. Another scheduler allocated from the same "
                "ResourceSlices: keep the schedulers' nodes apart (see deploy/README.md, \"Beside other "
                "schedulers\")")


def may_share(a: Holder, b: Holder) -> bool:
    if a.admin_access or b.admin_access:
        return True
    return a.share_id is not None and b.share_id is not None and a.share_id != b.share_id


def holders_of(claim: ResourceClaim) -> dict[DeviceKey, Holder]:
    allocation = claim.status.allocation if claim.status is not None else None
    if allocation is None or allocation.devices is None:
        return {}
    meta = claim.metadata
    found: dict[DeviceKey, Holder] = {}
    for result in allocation.devices.results or ():
        key = (result.driver, result.pool, result.device)
        holder = Holder(uid=meta.uid or "", namespace=meta.namespace or "", name=meta.name or "",
                        share_id=result.share_id, admin_access=bool(result.admin_access))
        # One claim may hold a device twice only as two shares or with adminAccess; keep the one
        # that takes the device, so that a pair with another claim is judged by it.
        if key not in found or (found[key].admin_access and not holder.admin_access):
            found[key] = holder
    return found


class DeviceHolders:
    """Which claims hold each device, updated claim by claim; memory grows with allocated devices."""

    def __init__(self) -> None:
        self._by_device: dict[DeviceKey, dict[str, Holder]] = {}
        self._by_claim: dict[str, set[DeviceKey]] = {}
        self._told: set[tuple[DeviceKey, str, str]] = set()  # (device, first uid, second uid) returned

    def update(self, claim: ResourceClaim) -> list[DoubleAllocation]:
        """Take in the claim as it is now (allocated, or not); returns the double allocations it
        makes that were not returned before."""
        uid = claim.metadata.uid or ""
        self._drop(uid)
        held = holders_of(claim)
        current: list[DoubleAllocation] = []
        for device, holder in held.items():
            others = self._by_device.setdefault(device, {})
            for other in others.values():
                if not may_share(holder, other):
                    first, second = sorted((holder, other), key=lambda h: h.uid)
                    current.append(DoubleAllocation(device=device, first=first, second=second))
            others[uid] = holder
        if held:
            self._by_claim[uid] = set(held)
        # A pair still there was told already; one that ended may be told again if it comes back.
        found = [d for d in current if d.pair not in self._told]
        self._told = {t for t in self._told if uid not in t[1:]} | {d.pair for d in current}
        return found

    def forget(self, uid: str) -> None:
        """The claim is gone."""
        self._drop(uid)
        self._told = {t for t in self._told if uid not in t[1:]}

    def _drop(self, uid: str) -> None:
        for device in self._by_claim.pop(uid, ()):
            others = self._by_device.get(device)
            if others is not None:
                others.pop(uid, None)
                if not others:
                    del self._by_device[device]

    def doubles(self) -> int:
        """Devices held now by a pair of claims that may not share them."""
        count = 0
        for holders in self._by_device.values():
            values = list(holders.values())
            if any(not may_share(a, b) for i, a in enumerate(values) for b in values[i + 1:]):
                count += 1
        return count

"""What is already allocated: devices in use, capacity consumed on shared devices, per claim.

Built from claims' `status.allocation` (ours and kube-scheduler's alike) and updated one claim at a
time. Counters of partitionable devices are not stored here: they follow from which devices are in
use, and the allocator derives them per pool (as Kubernetes does), so the state cannot disagree with
the inventory about what a device consumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from draplane.api.quantity import parse_quantity
from draplane.api.resource import AllocationResult, ResourceClaim

from draplane.allocation.inventory import DeviceID, PoolID


def claim_key(claim: ResourceClaim) -> str:
    meta = claim.metadata
    return f"{meta.namespace or ''}/{meta.name or meta.generate_name or ''}"


@dataclass(frozen=True, slots=True)
class HeldDevice:
    device: DeviceID
    share_id: str | None
    consumed: tuple[tuple[str, Fraction], ...]


class AllocatedState:
    """Devices in use. `add_claim` / `remove_claim` keep it in step with claim statuses."""

    def __init__(self) -> None:
        self._exclusive: dict[DeviceID, int] = {}
        self._shares: dict[DeviceID, int] = {}
        self._capacity: dict[DeviceID, dict[str, Fraction]] = {}
        # Per claim, a tuple of (device, share ID, consumed) tuples rather than HeldDevice objects:
        # plain tuples of strings and numbers are dropped from the garbage collector's lists, so
        # the tens of thousands a big cluster holds add nothing to its full collections.
        self._claims: dict[str, tuple[tuple, ...]] = {}
        self._pool_versions: dict[PoolID, int] = {}
        self.version = 0

    # --- updates --------------------------------------------------------------------------------

    def add_claim(self, key: str, allocation: AllocationResult | None) -> list[PoolID]:
        """Record one claim's allocation (replacing what the claim held before). Returns touched pools."""
        touched = self.remove_claim(key)
        held: list[tuple] = []
        results = allocation.devices.results if allocation and allocation.devices else None
        for r in results or []:
            if r.admin_access:
                continue  # admin access never makes a device unavailable to others
            device = (r.driver, r.pool, r.device)
            consumed = tuple(
                (name, parse_quantity(value).value) for name, value in sorted((r.consumed_capacity or {}).items())
            )
            held.append((device, r.share_id, consumed))
        if not held:
            return touched
        self._claims[key] = tuple(held)
        for h in held:
            self._hold(h, +1)
            touched.append(h[0][:2])
        self._bump(touched)
        return touched

    def remove_claim(self, key: str) -> list[PoolID]:
        held = self._claims.pop(key, None)
        if not held:
            return []
        for h in held:
            self._hold(h, -1)
        touched = [h[0][:2] for h in held]
        self._bump(touched)
        return touched

    def _hold(self, held: tuple, sign: int) -> None:
        device, share_id, consumed = held
        if share_id is None:
            count = self._exclusive.get(device, 0) + sign
            if count > 0:
                self._exclusive[device] = count
            else:
                self._exclusive.pop(device, None)
            return
        count = self._shares.get(device, 0) + sign
        if count > 0:
            self._shares[device] = count
        else:
            self._shares.pop(device, None)
        totals = self._capacity.setdefault(device, {})
        for name, value in consumed:
            totals[name] = totals.get(name, Fraction(0)) + sign * value
        if count <= 0:
            self._capacity.pop(device, None)

    def _bump(self, pools: list[PoolID]) -> None:
        self.version += 1
        for p in set(pools):
            self._pool_versions[p] = self._pool_versions.get(p, 0) + 1

    # --- queries --------------------------------------------------------------------------------

    def holds(self, key: str) -> bool:
        """The claim holds devices now."""
        return key in self._claims

    def exclusive_holders(self, device: DeviceID) -> int:
        """How many claims hold the device whole: more than one only while a preemptor's
        reservation waits for its victims' claims to let go (see SchedulingState.place_pod)."""
        return self._exclusive.get(device, 0)

    def in_use(self, device: DeviceID) -> bool:
        """Allocated exclusively to some claim."""
        return device in self._exclusive

    def shared_capacity(self, device: DeviceID) -> dict[str, Fraction] | None:
        """Capacity consumed on a multi-allocatable device, None when no share of it is allocated."""
        if device in self._shares:
            return self._capacity.get(device, {})
        return None

    def is_allocated(self, device: DeviceID) -> bool:
        """In use in any way (exclusive or shared): such a device consumes its counters."""
        return device in self._exclusive or device in self._shares

    def pool_version(self, pool: PoolID) -> int:
        return self._pool_versions.get(pool, 0)

    def claims(self) -> dict[str, list[HeldDevice]]:
        return {key: [HeldDevice(*h) for h in held] for key, held in self._claims.items()}

    def holders(self, device: DeviceID) -> list[str]:
        return [k for k, held in self._claims.items() if any(h[0] == device for h in held)]

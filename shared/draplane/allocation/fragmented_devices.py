"""Fragmented devices per DeviceClass: partly used devices whose free part no claim seen can use.

Only a device that can be split has a free *part*: a device that allows multiple allocations
(consumable capacity: shares of one GPU) and a partitionable device (MIG: the GPU's counter set,
from which the whole GPU and every MIG placement consume). A whole device is free or not, never
fragmented. Precisely, for a DeviceClass C:

- the *demands* of C are what claims of C ask per device, pending or allocated (the typical ones):
  a pending request's `capacity.requests`; an allocated result's `consumedCapacity`, or, for a
  device it holds exclusively, that device's capacity (a claim that got a 4864Mi MIG device needs
  4864Mi). A request of a pending claim without capacity amounts says no size and adds none.
- a *shared device* selected by C, with at least one share allocated, is fragmented when capacity
  is left on it (some capacity above zero) and no demand of C fits in what is left (every amount
  a demand names at most what is left of that capacity).
- a *counter set* (one partitionable GPU) is fragmented for C when a device consuming it is
  allocated, counters are left, and no free device of C consuming it can still be allocated (its
  consumption fits what is left of every counter set it draws on) with a capacity that fits a
  demand of C. It counts once per class that selects one of its devices.

A class with no demands has nothing to compare with: none of its devices counts. Devices of
pools that are incomplete or invalid do not count, and taints are not looked at.

Pure: the shard's shell gathers the pools, the allocated state and the claims, and publishes the
result as the gauge `draplane_allocator_fragmented_devices{device_class}`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction

from draplane.allocation.inventory import DeviceID, DeviceRecord, Pool
from draplane.allocation.state import AllocatedState
from draplane.api.quantity import parse_quantity
from draplane.api.resource import AllocationResult, ResourceClaim

Amounts = Mapping[str, Fraction]  # capacity or counter name -> amount


def fits(demand: Amounts, free: Amounts) -> bool:
    """Every amount the demand names is at most what is free of it (a name not there is none)."""
    return all(free.get(name, Fraction(0)) >= amount for name, amount in demand.items())


def device_capacity(record: DeviceRecord) -> dict[str, Fraction]:
    return {name: entry.value.value for name, entry in record.capacity.items()}


def claim_demands(
    claims: Iterable[tuple[ResourceClaim, AllocationResult | None]],
    capacity_of: Callable[[DeviceID], Amounts | None],
) -> dict[str, list[dict[str, Fraction]]]:
    """DeviceClass -> its demands, least first, each shape once and none larger than another
    (fitting a larger one implies fitting the smaller). `claims` pairs each claim with the
    allocation it holds (its status', or a reservation's), None when pending."""
    shapes: dict[str, set[tuple[tuple[str, Fraction], ...]]] = {}
    for claim, allocation in claims:
        requests = claim.spec.devices.requests if claim.spec and claim.spec.devices else None
        # request name ("r", or "r/sub" for a subrequest) -> (class, capacity requests)
        asked: dict[str, tuple[str, dict[str, str] | None]] = {}
        for request in requests or ():
            if request.exactly is not None:
                capacity = request.exactly.capacity.requests if request.exactly.capacity else None
                asked[request.name] = (request.exactly.device_class_name, capacity)
            for sub in request.first_available or ():
                asked[f"{request.name}/{sub.name}"] = (sub.device_class_name, sub.capacity.requests if sub.capacity else None)
        results = allocation.devices.results if allocation and allocation.devices else None
        if allocation is None:
            for class_name, capacity in asked.values():
                if capacity:
                    shapes.setdefault(class_name, set()).add(_shape(capacity))
            continue
        for result in results or ():
            if result.admin_access or result.request not in asked:
                continue
            class_name = asked[result.request][0]
            if result.consumed_capacity:
                shape = _shape(result.consumed_capacity)
            else:
                capacity = capacity_of((result.driver, result.pool, result.device))
                if capacity is None:
                    continue  # a device the inventory no longer has
                shape = tuple(sorted(capacity.items()))
            shapes.setdefault(class_name, set()).add(shape)
    return {name: _least(found) for name, found in shapes.items()}


def _shape(amounts: Mapping[str, str]) -> tuple[tuple[str, Fraction], ...]:
    return tuple(sorted((name, parse_quantity(value).value) for name, value in amounts.items()))


def _least(shapes: set[tuple[tuple[str, Fraction], ...]]) -> list[dict[str, Fraction]]:
    demands = [dict(s) for s in sorted(shapes)]
    return [d for d in demands if not any(other != d and fits(other, d) for other in demands)]


def fragmented_devices(
    pools: Iterable[Pool],
    state: AllocatedState,
    classes_of: Callable[[DeviceRecord], Iterable[str]],
    demands: Mapping[str, list[dict[str, Fraction]]],
    class_names: Iterable[str] = (),
) -> dict[str, int]:
    """DeviceClass -> how many of its devices are fragmented (module docstring), 0 for each of
    `class_names` with none. Each pool is looked at once, however many nodes see it."""
    counts = {name: 0 for name in class_names}
    seen: set = set()
    for pool in pools:
        if pool.id in seen or not pool.usable:
            continue
        seen.add(pool.id)
        for record in pool.devices:
            if record.allow_multiple and not record.consumes:
                for class_name in _fragmented_share(record, state, classes_of, demands):
                    counts[class_name] = counts.get(class_name, 0) + 1
        if pool.counter_sets:
            for class_name in _fragmented_counter_sets(pool, state, classes_of, demands):
                counts[class_name] = counts.get(class_name, 0) + 1
    return counts


def has_partly_used_devices(pools: Iterable[Pool], state: AllocatedState) -> bool:
    """Whether any device could be fragmented at all: a share of a shared device, or a device
    drawing on a counter set, is allocated. Cheap, so that a cluster of whole GPUs skips the
    demands, which read every claim."""
    for pool in pools:
        if not pool.usable:
            continue
        driver, pool_name = pool.id
        if any(state.is_allocated((driver, pool_name, name)) for name in pool.counter_consumers):
            return True
        if any(r.allow_multiple and state.shared_capacity(r.id) is not None for r in pool.devices):
            return True
    return False


def _fragmented_share(record, state, classes_of, demands) -> list[str]:
    consumed = state.shared_capacity(record.id)
    if consumed is None or state.in_use(record.id):
        return []  # no share allocated (free whole), or held whole
    free = {name: total - consumed.get(name, Fraction(0)) for name, total in device_capacity(record).items()}
    if not any(amount > 0 for amount in free.values()):
        return []  # used up: nothing left to fragment
    return [c for c in classes_of(record) if demands.get(c) and not any(fits(d, free) for d in demands[c])]


def _fragmented_counter_sets(pool: Pool, state: AllocatedState, classes_of, demands) -> list[str]:
    driver, pool_name = pool.id
    left: dict[str, dict[str, Fraction]] = {}
    used: set[str] = set()
    for device_name, consumes in pool.counter_consumers.items():
        if state.is_allocated((driver, pool_name, device_name)):
            for set_name, counters in consumes:
                if set_name not in left:
                    left[set_name] = dict(pool.counter_sets.get(set_name, {}))
                used.add(set_name)
                for counter, amount in counters.items():
                    left[set_name][counter] = left[set_name].get(counter, Fraction(0)) - amount
    if not used:
        return []
    consumers_of: dict[str, list[DeviceRecord]] = {}
    for record in pool.devices:
        for set_name, _ in record.consumes:
            consumers_of.setdefault(set_name, []).append(record)
    fragmented: list[str] = []
    for set_name in sorted(used):
        if not any(amount > 0 for amount in left[set_name].values()):
            continue  # used up
        consumers = consumers_of.get(set_name, [])
        classes = sorted({c for r in consumers for c in classes_of(r)})
        for class_name in classes:
            wanted = demands.get(class_name)
            if not wanted:
                continue
            usable = any(
                class_name in classes_of(r)
                and not state.is_allocated(r.id)
                and all(fits(counters, left[s] if s in left else pool.counter_sets.get(s, {}))
                        for s, counters in r.consumes)
                and any(fits(d, device_capacity(r)) for d in wanted)
                for r in consumers
            )
            if not usable:
                fragmented.append(class_name)
    return fragmented

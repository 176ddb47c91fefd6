"""Allocate a set of claims together on one node, with the semantics of Kubernetes' structured allocator.

Read top to bottom:
1. `plan_claim` validates a claim against the device classes and turns every request / subrequest
   into a `RequestPlan` (selectors compiled, count, mode, capacity requests parsed). Plans depend on
   the claim's spec only, so claims of one shape share them.
2. `NodeAllocator.allocate` gathers the node's pools (inventory), works out the candidate devices per
   request (selectors, cached), and runs `_Search`: one recursive function over
   claim → request → device, with the per-device checks as small named steps in a fixed order:
   in use, selector error, capacity, counters, taints, constraints.
3. The first complete solution in the policy's candidate order wins. `first-fit` keeps Kubernetes'
   order (pools by name, slices by name, devices in slice order); other policies reorder candidates,
   which changes *which* solution is found first but never *whether* one exists, because the search
   is exhaustive over combinations whatever the order.
4. The result is written as kube-scheduler writes it: `devices.results[]`, `devices.config[]`
   (FromClass first, then FromClaim), and `nodeSelector`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Callable, Sequence

import msgspec

from draplane.api.core import Node
from draplane.api.meta import NodeSelector, NodeSelectorRequirement, NodeSelectorTerm
from draplane.api.quantity import Quantity, QuantityError, parse_quantity
from draplane.api.resource import (
    AllocationResult,
    DeviceAllocationConfiguration,
    DeviceAllocationResult,
    DeviceClass,
    DeviceRequestAllocationResult,
    DeviceToleration,
    ResourceClaim,
)
from draplane.allocation.errors import AllocationError, NodeFailure, Reason
from draplane.allocation.inventory import (
    CapacityEntry,
    DeviceID,
    DeviceRecord,
    Inventory,
    Pool,
    PoolID,
    device_id_text,
    node_matches,
)
from draplane.allocation.state import AllocatedState
from draplane.component_helpers.taints import tolerates

from draplane.allocation.scoring import FIRST_FIT, ScoringPolicy

if TYPE_CHECKING:
    from draplane.allocation.scarcity import DeviceScarcity

MAX_REQUESTS = 32  # resourceapi.DeviceRequestsMaxSize
MAX_RESULTS = 32  # resourceapi.AllocationResultsMaxSize
MAX_CONSTRAINTS = 32
MAX_CONFIGS = 32
SEARCH_STEP_LIMIT = 2_000_000  # a guard for pathological claims; Kubernetes relies on a timeout


def _claim_name(claim: ResourceClaim) -> str:
    meta = claim.metadata
    name = meta.name or meta.generate_name or "<unnamed>"
    return f"{meta.namespace}/{name}" if meta.namespace else name


# --- CEL selectors -------------------------------------------------------------------------------


class SelectorMatcher:
    """Compiles each expression once and caches results per (expression, device content)."""

    def __init__(self, cel_module=None) -> None:
        # The module is injectable so tests can run the search with a stand-in evaluator.
        if cel_module is None:
            from draplane import cel as cel_module
        self._cel = cel_module
        self._programs: dict[str, object] = {}
        self._results: dict[tuple, object] = {}
        self._slice_projection = getattr(cel_module, "slice_projection", None)  # a stand-in has none

    def _entries(self, expression: str):
        referenced = getattr(self._cel, "referenced_entries", None)  # a stand-in evaluator has none
        return referenced(expression) if referenced is not None else None

    def compile(self, expression: str):
        program = self._programs.get(expression)
        if program is None:
            program = self._cel.compile_selector(expression)  # raises CELCompileError
            self._programs[expression] = program
        return program

    def evaluate(self, expression: str, record: DeviceRecord) -> object:
        """True, False, or the CELRuntimeError the expression raised on this device."""
        cached = record.match_cache.get(expression)
        if cached is not None:
            return cached
        # Keyed by what the selector can see of the device where that is known, so that alike
        # devices (one model, each with its own UUID) share one evaluation. That key is read from
        # the slice's device itself: the device's CEL view is built only for an evaluation, not
        # for each of thousands of alike devices (time, and objects the garbage collector walks).
        entries = self._entries(expression)
        if entries is not None and self._slice_projection is not None:
            key = (expression, "slice", self._slice_projection(record.driver, record.device, entries))
        else:
            key = (expression, self._cel_device(record))
        result = self._results.get(key)
        if result is None:
            if len(self._results) > 1_000_000:
                self._results.clear()  # a bound, not an LRU: results are cheap to recompute
            try:
                result = bool(self.compile(expression).matches(self._cel_device(record)))
            except self._cel.CELRuntimeError as exc:
                result = exc
            self._results[key] = result
        record.match_cache[expression] = result
        return result

    def _cel_device(self, record: DeviceRecord):
        cel_device = record._cel_device
        if cel_device is None:
            cel_device = record._cel_device = self._cel.device_for_cel(record.driver, record.device)
        return cel_device


# --- plans ---------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class RequestPlan:
    """One request without subrequests, or one subrequest. Claim-independent."""

    request_index: int
    sub_index: int
    name: str  # the request's or the subrequest's own name
    parent: str | None  # the request's name for a subrequest
    field: str  # where it is in the claim, for messages
    device_class: DeviceClass
    class_selectors: tuple[str, ...]
    request_selectors: tuple[str, ...]
    all_mode: bool
    count: int
    admin_access: bool | None
    tolerations: list[DeviceToleration] | None
    capacity: dict[str, Quantity] | None
    selector_key: tuple

    @property
    def full_name(self) -> str:
        return f"{self.parent}/{self.name}" if self.parent else self.name


@dataclass(slots=True, eq=False)
class ConstraintPlan:
    kind: str  # "match" | "distinct"
    attribute: str
    requests: frozenset[str]


@dataclass(slots=True, eq=False)
class ClaimPlan:
    claim: ResourceClaim
    requests: list[list[RequestPlan]]  # per request: [plan] or the subrequests in order
    has_subrequests: list[bool]
    constraints: list[ConstraintPlan]
    min_devices: int


def _parse_capacity(requests: dict[str, str] | None, where: str) -> dict[str, Quantity] | None:
    if not requests:
        return None
    parsed = {}
    for name, text in requests.items():
        try:
            parsed[name] = parse_quantity(text)
        except QuantityError as exc:
            raise AllocationError(Reason.INVALID_CLAIM, f"{where}.capacity.requests[{name}]: {exc}") from None
    return parsed


def plan_claim(
    claim: ResourceClaim, classes: dict[str, DeviceClass], matcher: SelectorMatcher
) -> ClaimPlan:
    """Validate one claim as the allocator needs it and compile its requests. Raises AllocationError."""
    who = f"ResourceClaim {_claim_name(claim)}"
    devices = claim.spec.devices
    requests = (devices.requests if devices else None) or []
    if len(requests) > MAX_REQUESTS:
        raise AllocationError(
            Reason.TOO_MANY_RESULTS,
            f"{who}: spec.devices.requests: {len(requests)} requests, at most {MAX_REQUESTS} are allowed",
        )
    names = set()
    plans: list[list[RequestPlan]] = []
    has_sub: list[bool] = []
    min_devices = 0
    for ri, request in enumerate(requests):
        where = f"{who}: spec.devices.requests[{ri}]"
        if request.name in names:
            raise AllocationError(Reason.INVALID_CLAIM, f"{where}.name: duplicate request name {request.name!r}")
        names.add(request.name)
        if request.exactly is not None and request.first_available:
            raise AllocationError(Reason.INVALID_CLAIM, f"{where}: exactly and firstAvailable are mutually exclusive")
        if request.exactly is not None:
            plan = _plan_request(request.exactly, ri, 0, request.name, None, f"{where}.exactly", who, classes, matcher)
            plan.admin_access = request.exactly.admin_access
            plans.append([plan])
            has_sub.append(False)
            min_devices += plan.count if not plan.all_mode else 0
        elif request.first_available:
            subs = []
            sub_names = set()
            for si, sub in enumerate(request.first_available):
                if sub.name in sub_names:
                    raise AllocationError(
                        Reason.INVALID_CLAIM, f"{where}.firstAvailable[{si}].name: duplicate subrequest name {sub.name!r}"
                    )
                sub_names.add(sub.name)
                subs.append(
                    _plan_request(sub, ri, si, sub.name, request.name, f"{where}.firstAvailable[{si}]", who, classes, matcher)
                )
            plans.append(subs)
            has_sub.append(True)
            min_devices += min((p.count if not p.all_mode else 0) for p in subs)
        else:
            raise AllocationError(
                Reason.INVALID_CLAIM,
                f"{where}: neither exactly nor firstAvailable is set (a v1 request needs one; "
                f"deviceClassName and count belong under exactly:)",
            )
    if min_devices > MAX_RESULTS:
        raise AllocationError(
            Reason.TOO_MANY_RESULTS,
            f"{who}: spec.devices.requests: number of requested devices {min_devices} exceeds the claim limit of {MAX_RESULTS}",
        )
    constraints = []
    for ci, c in enumerate((devices.constraints if devices else None) or []):
        where = f"{who}: spec.devices.constraints[{ci}]"
        if c.match_attribute and c.distinct_attribute:
            raise AllocationError(Reason.INVALID_CLAIM, f"{where}: matchAttribute and distinctAttribute are mutually exclusive")
        if c.match_attribute:
            constraints.append(ConstraintPlan("match", c.match_attribute, frozenset(c.requests or ())))
        elif c.distinct_attribute:
            constraints.append(ConstraintPlan("distinct", c.distinct_attribute, frozenset(c.requests or ())))
        else:
            raise AllocationError(Reason.INVALID_CLAIM, f"{where}: empty constraint (matchAttribute or distinctAttribute is required)")
        for name in c.requests or ():
            base = name.split("/", 1)[0]
            if base not in names:
                raise AllocationError(Reason.INVALID_CLAIM, f"{where}.requests: {name!r} is not a request of this claim")
    for ci, c in enumerate((devices.config if devices else None) or []):
        for name in c.requests or ():
            if name.split("/", 1)[0] not in names:
                raise AllocationError(
                    Reason.INVALID_CLAIM, f"{who}: spec.devices.config[{ci}].requests: {name!r} is not a request of this claim"
                )
    return ClaimPlan(claim, plans, has_sub, constraints, min_devices)


def _plan_request(request, ri, si, name, parent, where, who, classes, matcher) -> RequestPlan:
    class_name = request.device_class_name
    if not class_name:
        raise AllocationError(Reason.INVALID_CLAIM, f"{where}.deviceClassName: missing device class name")
    device_class = classes.get(class_name)
    if device_class is None:
        known = ", ".join(sorted(classes)) or "none"
        raise AllocationError(
            Reason.UNKNOWN_CLASS,
            f"{where}.deviceClassName: device class {class_name!r} not found (known: {known})",
        )
    class_selectors = []
    for i, selector in enumerate(device_class.spec.selectors or []):
        if selector.cel is None:
            raise AllocationError(
                Reason.INVALID_CLAIM, f"DeviceClass {class_name}: spec.selectors[{i}]: CEL expression empty (unsupported selector type?)"
            )
        _compile(matcher, selector.cel.expression, f"DeviceClass {class_name}: spec.selectors[{i}].cel.expression")
        class_selectors.append(selector.cel.expression)
    request_selectors = []
    for i, selector in enumerate(request.selectors or []):
        if selector.cel is None:
            raise AllocationError(Reason.INVALID_CLAIM, f"{where}.selectors[{i}]: CEL expression empty (unsupported selector type?)")
        _compile(matcher, selector.cel.expression, f"{where}.selectors[{i}].cel.expression")
        request_selectors.append(selector.cel.expression)
    mode = request.allocation_mode or "ExactCount"
    if mode not in ("ExactCount", "All"):
        raise AllocationError(Reason.INVALID_CLAIM, f"{where}.allocationMode: unsupported count mode {mode!r} (ExactCount or All)")
    count = request.count if request.count is not None else 1
    if mode == "ExactCount" and count < 1:
        raise AllocationError(Reason.INVALID_CLAIM, f"{where}.count: must be at least 1, got {count}")
    capacity = _parse_capacity(request.capacity.requests if request.capacity else None, where)
    return RequestPlan(
        request_index=ri,
        sub_index=si,
        name=name,
        parent=parent,
        field=where,
        device_class=device_class,
        class_selectors=tuple(class_selectors),
        request_selectors=tuple(request_selectors),
        all_mode=mode == "All",
        count=count if mode == "ExactCount" else 0,
        admin_access=None,
        tolerations=request.tolerations or None,
        capacity=capacity,
        selector_key=(class_name, tuple(class_selectors), tuple(request_selectors)),
    )


def _compile(matcher: SelectorMatcher, expression: str, where: str) -> None:
    try:
        matcher.compile(expression)
    except matcher._cel.CELCompileError as exc:
        text = " ".join(str(exc).split())
        raise AllocationError(Reason.CEL_COMPILE, f"{where}: CEL compile error: {text}") from None


# --- capacity (consumable capacity, Kubernetes' consumable_capacity.go) -------------------------


def _ceil(q: Quantity) -> int:
    v = q.value
    return -((-v.numerator) // v.denominator)


def _consumed_amount(requested: Quantity | None, cap: CapacityEntry) -> Quantity:
    if requested is None:
        return cap.default if cap.default is not None else cap.value
    if not cap.has_policy:
        return requested
    if cap.range_min is not None:
        if requested.value < cap.range_min.value:
            return cap.range_min
        if cap.range_step is None:
            return requested
        req, step, low = _ceil(requested), _ceil(cap.range_step), _ceil(cap.range_min)
        added = req - low
        n = added // step + (1 if added % step else 0)
        # written in the step's format, as Kubernetes does: a 10G request with a 1M step is
        # "10G", not "9765625Ki"
        return Quantity(low + step * n, cap.range_step.format)
    if cap.valid_values is not None:
        for v in cap.valid_values:
            if requested.value <= v.value:
                return v
        return requested
    return requested


def _violates_policy(amount: Quantity, cap: CapacityEntry) -> bool:
    if not cap.has_policy:
        return False
    if cap.default is not None and amount.value == cap.default.value:
        return False
    if cap.range_min is not None or cap.range_max is not None or cap.range_step is not None:
        if cap.range_max is not None and amount.value > cap.range_max.value:
            return True
        if cap.range_step is not None:
            low = _ceil(cap.range_min) if cap.range_min is not None else 0
            if (_ceil(amount) - low) % _ceil(cap.range_step) != 0:
                return True
        return False
    if cap.valid_values:
        return all(amount.value != v.value for v in cap.valid_values)
    return False


def capacity_fits(
    record: DeviceRecord,
    requested: dict[str, Quantity] | None,
    in_state: dict[str, Fraction] | None,
    allocating: dict[str, Fraction] | None,
) -> bool:
    """Kubernetes' CmpRequestOverCapacity: every capacity of the device can take this request too."""
    if requested:
        for name in requested:
            if name not in record.capacity:
                return False  # asks for a capacity the device does not have
    elif not record.allow_multiple:
        return True  # nothing requested from an exclusive device: the whole device is consumed
    for name, cap in record.capacity.items():
        amount = _consumed_amount(requested.get(name) if requested else None, cap)
        if _violates_policy(amount, cap):
            return False
        total = amount.value
        if in_state:
            total += in_state.get(name, 0)
        if allocating:
            total += allocating.get(name, 0)
        if total > cap.value.value:
            return False
    return True


def consumed_capacity(record: DeviceRecord, requested: dict[str, Quantity] | None) -> dict[str, Quantity]:
    return {
        name: _consumed_amount(requested.get(name) if requested else None, cap)
        for name, cap in record.capacity.items()
    }


# --- taints --------------------------------------------------------------------------------------


def taint_blocks(record: DeviceRecord, tolerations: list[DeviceToleration] | None) -> bool:
    for taint in record.taints or ():
        if taint.effect in ("NoSchedule", "NoExecute"):  # other effects (None, future ones) never block
            if not any(tolerates(t, taint) for t in tolerations or ()):
                return True
    return False


# --- constraints ---------------------------------------------------------------------------------


class _MatchAttribute:
    __slots__ = ("requests", "attribute", "value", "count")

    def __init__(self, plan: ConstraintPlan):
        self.requests = plan.requests
        self.attribute = plan.attribute
        self.value = None
        self.count = 0

    def applies(self, base: str, full: str) -> bool:
        return not self.requests or base in self.requests or full in self.requests

    def add(self, base: str, full: str, record: DeviceRecord) -> bool:
        if not self.applies(base, full):
            return True
        value = record.attribute(self.attribute)
        if value is None:
            return False
        if self.count == 0:
            self.value = value
        elif value != self.value:
            return False
        self.count += 1
        return True

    def remove(self, base: str, full: str, record: DeviceRecord) -> None:
        if self.applies(base, full):
            self.count -= 1


class _DistinctAttribute:
    __slots__ = ("requests", "attribute", "values")

    def __init__(self, plan: ConstraintPlan):
        self.requests = plan.requests
        self.attribute = plan.attribute
        self.values: dict[DeviceID, tuple] = {}

    def applies(self, base: str, full: str) -> bool:
        return not self.requests or base in self.requests or full in self.requests

    def add(self, base: str, full: str, record: DeviceRecord) -> bool:
        if not self.applies(base, full):
            return True
        value = record.attribute(self.attribute)
        if value is None:
            return False
        if value in self.values.values():
            return False
        self.values[record.id] = value
        return True

    def remove(self, base: str, full: str, record: DeviceRecord) -> None:
        if self.applies(base, full):
            self.values.pop(record.id, None)


# --- the search ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Candidate:
    """A device that passed the selectors of one request on this node (or whose selector failed)."""

    record: DeviceRecord
    pool: Pool
    error: object | None = None  # a CELRuntimeError met while evaluating its selectors


@dataclass(slots=True)
class ChosenDevice:
    record: DeviceRecord
    pool: Pool
    plan: RequestPlan
    share_id: str | None
    consumed: dict[str, Quantity] | None


@dataclass(slots=True)
class NodePlacement:
    """A valid placement of all claims on one node."""

    node: str
    allocations: list[AllocationResult]
    chosen: list[list[ChosenDevice]]
    score: float = 0.0


class _ResultsLimit(Exception):
    """Kubernetes' errAllocationResultMaxSizeExceeded: backtrack further, try other subrequests."""


class _StepLimit(Exception):
    pass


@dataclass(slots=True)
class NodeView:
    """What a scoring policy may look at: the node's pools, the allocated state, the Node object."""

    node: str
    pools: list[Pool]
    state: AllocatedState
    node_object: Node | None = None
    scarcity: "DeviceScarcity | None" = None  # what the cluster's classes make each device worth


class _Search:
    def __init__(self, allocator: "NodeAllocator", node: Node, pools: list[Pool], plans: list[ClaimPlan],
                 policy: "ScoringPolicy", candidates: dict[int, list[Candidate]]):
        self.allocator = allocator
        self.state = allocator.state
        self.node = node
        self.pools = pools
        self.plans = plans
        self.policy = policy
        self.candidates = candidates  # id(plan) -> ordered candidates
        self.all_devices: dict[int, list[Candidate]] = {}
        self.allocating: dict[DeviceID, set[int]] = {}
        self.allocating_capacity: dict[DeviceID, dict[str, Fraction]] = {}
        self.available_counters: dict[PoolID, dict[str, dict[str, Fraction]]] = {}
        self.consuming_counters: dict[PoolID, dict[str, dict[str, Fraction]]] = {}
        self.results: list[list[ChosenDevice]] = [[] for _ in plans]
        self.constraints = [
            [(_MatchAttribute(c) if c.kind == "match" else _DistinctAttribute(c)) for c in p.constraints] for p in plans
        ]
        self.selected_sub: dict[tuple[int, int], int] = {}
        self.steps = 0

    # One recursive step: claim ci, request ri (subrequest si when in_sub), device di of that request.
    def allocate_one(self, ci: int, ri: int, si: int, di: int, in_sub: bool, start: int) -> bool:
        self.steps += 1
        if self.steps > SEARCH_STEP_LIMIT:
            raise _StepLimit()
        if ci >= len(self.plans):
            return True
        plan = self.plans[ci]
        if ri >= len(plan.requests):
            try:
                return self.allocate_one(ci + 1, 0, 0, 0, False, 0)
            except _ResultsLimit:
                return False
        if plan.has_subrequests[ri] and not in_sub:
            all_exceeded = True
            for sub in range(len(plan.requests[ri])):
                try:
                    if self.allocate_one(ci, ri, sub, 0, True, 0):
                        self.selected_sub[(ci, ri)] = sub
                        return True
                    all_exceeded = False
                except _ResultsLimit:
                    continue
            if all_exceeded:
                raise _ResultsLimit()
            return False
        request = plan.requests[ri][si]
        if request.all_mode:
            devices = self.all_devices[id(request)]
            if not devices:
                return False
            needed = len(devices)
        else:
            needed = request.count
        if di >= needed:
            return self.allocate_one(ci, ri + 1, 0, 0, False, 0)
        if len(self.results[ci]) + needed - di > MAX_RESULTS:
            raise _ResultsLimit()

        if request.all_mode:
            candidate = self.all_devices[id(request)][di]
            undo = self.allocate_device(ci, request, candidate, must=True)
            if undo is None:
                return False
            try:
                done = self.allocate_one(ci, ri, si, di + 1, in_sub, 0)
            except BaseException:
                undo()
                raise
            if not done:
                undo()
            return done

        candidates = self.candidates[id(request)]
        for index in range(start, len(candidates)):
            candidate = candidates[index]
            record = candidate.record
            if self.device_unavailable(ci, request, record):
                continue
            if candidate.error is not None:
                raise self.allocator.runtime_error(plan, request, candidate)
            if (request.capacity or record.allow_multiple) and not self.capacity_available(request, record):
                continue
            undo = self.allocate_device(ci, request, candidate, must=False)
            if undo is None:
                continue
            try:
                done = self.allocate_one(ci, ri, si, di + 1, in_sub, index + 1)
            except BaseException:
                undo()
                raise
            if done:
                return True
            undo()
        return False

    # --- the per-device checks, in Kubernetes' order -----------------------------------------

    def device_unavailable(self, ci: int, request: RequestPlan, record: DeviceRecord) -> bool:
        """In use: by a claim already allocated, or by one of the claims being allocated now."""
        device = record.id
        if request.admin_access:
            holders = self.allocating.get(device)
            return bool(holders) and ci in holders
        if self.state.in_use(device):
            return True
        return bool(self.allocating.get(device))

    def capacity_available(self, request: RequestPlan, record: DeviceRecord) -> bool:
        return capacity_fits(
            record, request.capacity, self.state.shared_capacity(record.id), self.allocating_capacity.get(record.id)
        )

    def counters_available(self, candidate: Candidate) -> bool:
        """Consume the device's counters if the pool has enough left; False (nothing consumed) if not."""
        pool = candidate.pool
        available = self.available_counters.get(pool.id)
        if available is None:
            available = {name: dict(counters) for name, counters in pool.counter_sets.items()}
            for device_name, consumes in pool.counter_consumers.items():
                if self.state.is_allocated((pool.id[0], pool.id[1], device_name)):
                    for set_name, counters in consumes:
                        target = available.get(set_name)
                        if target is None:
                            continue
                        for counter, value in counters.items():
                            if counter in target:
                                target[counter] -= value
            self.available_counters[pool.id] = available
        consuming = self.consuming_counters.setdefault(pool.id, {})
        self._add_counters(consuming, candidate.record, +1)
        # Every counter of the pool, as Kubernetes' checkAvailableCounters does: a counter set that
        # is already overconsumed (negative) blocks the pool's devices even if they do not use it.
        for set_name, counters in available.items():
            used = consuming.get(set_name) or {}
            for counter, value in counters.items():
                if used.get(counter, 0) > value:
                    self._add_counters(consuming, candidate.record, -1)
                    return False
        return True

    @staticmethod
    def _add_counters(consuming, record: DeviceRecord, sign: int) -> None:
        for set_name, counters in record.consumes:
            target = consuming.setdefault(set_name, {})
            for counter, value in counters.items():
                target[counter] = target.get(counter, 0) + sign * value

    def allocate_device(self, ci: int, request: RequestPlan, candidate: Candidate, must: bool):
        """Take the device for the request if taints, counters and constraints allow; return an undo."""
        record = candidate.record
        device = record.id
        allow_multiple = record.allow_multiple
        if request.admin_access:
            if not allow_multiple and ci in self.allocating.get(device, ()):
                return None
        elif self.state.in_use(device) or self.allocating.get(device):
            return None
        if request.all_mode and candidate.error is not None:
            raise self.allocator.runtime_error(self.plans[ci], request, candidate)
        skip_counters = allow_multiple and (
            self.state.shared_capacity(device) is not None or device in self.allocating_capacity
        )
        counted = False
        if record.consumes and not skip_counters:
            if not self.counters_available(candidate):
                return None
            counted = True
        if record.taints and taint_blocks(record, request.tolerations):
            if counted:
                self._add_counters(self.consuming_counters[candidate.pool.id], record, -1)
            return None
        base = request.parent or request.name
        full = request.full_name
        constraints = self.constraints[ci]
        for i, constraint in enumerate(constraints):
            if not constraint.add(base, full, record):
                for previous in constraints[:i]:
                    previous.remove(base, full, record)
                if counted:
                    self._add_counters(self.consuming_counters[candidate.pool.id], record, -1)
                if must:
                    raise AllocationError(
                        Reason.CONSTRAINT,
                        f"{request.field}: cannot add device "
                        f"{device_id_text(device)} because a claim constraint would not be satisfied",
                    )
                return None
        share_id = None
        consumed = None
        if allow_multiple:
            if not self.capacity_available(request, record):
                for constraint in constraints:
                    constraint.remove(base, full, record)
                if counted:
                    self._add_counters(self.consuming_counters[candidate.pool.id], record, -1)
                return None
            consumed = consumed_capacity(record, request.capacity)
            share_id = self.allocator.new_share_id()
            totals = self.allocating_capacity.setdefault(device, {})
            for name, q in consumed.items():
                totals[name] = totals.get(name, 0) + q.value
        else:
            self.allocating.setdefault(device, set()).add(ci)
        results = self.results[ci]
        results.append(ChosenDevice(record, candidate.pool, request, share_id, consumed or None))

        def undo() -> None:
            results.pop()
            for constraint in constraints:
                constraint.remove(base, full, record)
            if allow_multiple:
                totals = self.allocating_capacity[device]
                for name, q in (consumed or {}).items():
                    totals[name] -= q.value
                if all(r.record.id != device for rs in self.results for r in rs):
                    del self.allocating_capacity[device]
            else:
                self.allocating[device].discard(ci)
            if counted:
                self._add_counters(self.consuming_counters[candidate.pool.id], record, -1)

        return undo


# --- one node ------------------------------------------------------------------------------------


ShareIDFactory = Callable[[], str]


def random_share_id() -> str:
    return str(uuid.uuid4())


class NodeAllocator:
    """Allocates claims on one node at a time against an inventory and an allocated state."""

    def __init__(
        self,
        inventory: Inventory,
        state: AllocatedState,
        classes: dict[str, DeviceClass],
        *,
        matcher: SelectorMatcher | None = None,
        share_ids: ShareIDFactory = random_share_id,
    ):
        self.inventory = inventory
        self.state = state
        self.classes = classes
        self.matcher = matcher or SelectorMatcher()
        self.new_share_id = share_ids
        self._plans: dict[tuple[int, bytes], ClaimPlan] = {}
        self._classes_version = 0
        self._candidate_cache: dict[str, tuple[list[Pool], dict[tuple, list[Candidate]]]] = {}
        self._order_cache: dict[str, tuple[list[Pool], list[Pool]]] = {}
        self.scarcity: DeviceScarcity | None = None  # set by a DeviceAllocator, which keeps it current

    def set_classes(self, classes: dict[str, DeviceClass]) -> None:
        self.classes = classes
        self._classes_version += 1
        self._plans.clear()

    def plan(self, claim: ResourceClaim) -> ClaimPlan:
        from draplane.api.codec import encode_json

        key = (self._classes_version, encode_json(claim.spec))
        cached = self._plans.get(key)
        if cached is None:
            cached = plan_claim(claim, self.classes, self.matcher)
            if len(self._plans) > 4096:
                self._plans.clear()
            self._plans[key] = cached
        if cached.claim is not claim:
            cached = ClaimPlan(claim, cached.requests, cached.has_subrequests, cached.constraints, cached.min_devices)
        return cached

    def runtime_error(self, plan: ClaimPlan, request: RequestPlan, candidate: Candidate) -> AllocationError:
        error = candidate.error
        where, expression = self._failing_selector(plan, request, candidate.record)
        text = " ".join(str(error).split())
        return AllocationError(
            Reason.CEL_RUNTIME,
            f"{where} on device {device_id_text(candidate.record.id)}: CEL runtime error: {text}",
        )

    def _failing_selector(self, plan: ClaimPlan, request: RequestPlan, record: DeviceRecord) -> tuple[str, str]:
        for i, expression in enumerate(request.class_selectors):
            if not isinstance(self.matcher.evaluate(expression, record), bool):
                return f"DeviceClass {request.device_class.metadata.name}: spec.selectors[{i}].cel.expression", expression
        for i, expression in enumerate(request.request_selectors):
            if not isinstance(self.matcher.evaluate(expression, record), bool):
                return f"{request.field}.selectors[{i}].cel.expression", expression
        return request.field, ""

    # --- candidates ------------------------------------------------------------------------------

    def candidates(self, node: Node, pools: list[Pool], request: RequestPlan) -> list[Candidate]:
        """Devices of usable pools that pass the class and request selectors, in Kubernetes' order."""
        name = node.metadata.name or ""
        cached = self._candidate_cache.get(name)
        if cached is None or cached[0] is not pools:
            cached = (pools, {})
            self._candidate_cache[name] = cached
        found = cached[1].get(request.selector_key)
        if found is not None:
            return found
        found = []
        evaluate = self.matcher.evaluate
        for pool in pools:
            if not pool.usable:
                continue
            for record in pool.devices:
                error = None
                selectable = True
                for expression in request.class_selectors:
                    result = evaluate(expression, record)
                    if result is not True:
                        if result is not False:
                            error = result
                        selectable = False
                        break
                if selectable:
                    for expression in request.request_selectors:
                        result = evaluate(expression, record)
                        if result is not True:
                            if result is not False:
                                error = result
                            selectable = False
                            break
                if selectable and record.per_device_node_selection:
                    d = record.device
                    selectable = node_matches(node, d.node_name, bool(d.all_nodes), d.node_selector)
                if selectable or error is not None:
                    found.append(Candidate(record, pool, error))
        cached[1][request.selector_key] = found
        return found

    # --- allocate --------------------------------------------------------------------------------

    def allocate(
        self, claims: Sequence[ResourceClaim], node: Node, policy: "ScoringPolicy | None" = None,
        plans: list[ClaimPlan] | None = None, diagnose: bool = True,
    ) -> NodePlacement | NodeFailure:
        """All claims on `node`, all-or-nothing. Raises AllocationError for bad input or CEL errors.

        Without `diagnose`, a failure says only that the claims do not fit (reason NOT_DIAGNOSED);
        callers that search many nodes ask for the reason only when they need to show it."""
        policy = policy or FIRST_FIT
        node_name = node.metadata.name or ""
        if plans is None:
            plans = [self.plan(c) for c in claims]
        pools = self._search_order(node_name, self.inventory.pools_for_node(node))
        view = NodeView(node_name, pools, self.state, node, self.scarcity)
        ordered: dict[int, list[Candidate]] = {}
        search = _Search(self, node, pools, plans, policy, ordered)
        in_use = self.state.in_use
        hopeless = False
        # Kubernetes has no pre-check: its search evaluates selectors device by device and fails on
        # the first CEL runtime error it meets. Where some candidate has one, only the search can
        # tell whether Kubernetes gets there, so the shortcut below is not taken.
        errors_possible = False
        for plan in plans:
            for subs in plan.requests:
                any_sub_fits = False
                for request in subs:
                    found = self.candidates(node, pools, request)
                    has_errors = any(c.error is not None for c in found)
                    errors_possible = errors_possible or has_errors
                    if request.all_mode:
                        search.all_devices[id(request)] = self._all_devices(plan, request, pools, found, node_name)
                        # Taking all of them fails with an error where one breaks a constraint.
                        errors_possible = errors_possible or bool(plan.constraints and search.all_devices[id(request)])
                        any_sub_fits = True
                        continue
                    # A cheap necessary condition first: enough devices not in use. Full nodes,
                    # the common case in a busy cluster, fail here without a search.
                    free = len(found) if request.admin_access else 0
                    for c in found if not request.admin_access else ():
                        if c.record.allow_multiple or c.error is not None or not in_use(c.record.id):
                            free += 1
                            if free >= request.count:
                                break
                    if free >= request.count:
                        any_sub_fits = True
                        ordered[id(request)] = policy.order_candidates(request, found, view)
                    elif has_errors:
                        ordered[id(request)] = policy.order_candidates(request, found, view)
                    else:
                        ordered[id(request)] = []
                hopeless = hopeless or not any_sub_fits
        for plan in plans:
            total = plan.min_devices + sum(
                len(search.all_devices[id(subs[0])]) for subs in plan.requests if subs[0].all_mode and len(subs) == 1
            )
            if total > MAX_RESULTS:
                raise AllocationError(
                    Reason.TOO_MANY_RESULTS,
                    f"ResourceClaim {_claim_name(plan.claim)}: spec.devices.requests: number of requested devices {total} "
                    f"exceeds the claim limit of {MAX_RESULTS} (allocationMode All matches too many devices on node {node_name})",
                    node=node_name,
                )
        if hopeless and not errors_possible:
            if not diagnose:
                return NodeFailure(node_name, Reason.NOT_DIAGNOSED, "the claims do not fit")
            return self.diagnose(plans, node, pools)
        try:
            done = search.allocate_one(0, 0, 0, 0, False, 0)
        except _ResultsLimit:
            done = False
        except _StepLimit:
            return NodeFailure(node_name, Reason.SEARCH_LIMIT, f"gave up after {SEARCH_STEP_LIMIT} search steps")
        if not done:
            if not diagnose:
                return NodeFailure(node_name, Reason.NOT_DIAGNOSED, "the claims do not fit")
            return self.diagnose(plans, node, pools)
        allocations = [
            self._allocation_result(plan, chosen, search, node_name) for plan, chosen in zip(plans, search.results)
        ]
        placement = NodePlacement(node_name, allocations, search.results)
        placement.score = policy.score_placement(placement, view)
        return placement

    def _all_devices(self, plan, request, pools, found, node_name) -> list[Candidate]:
        for pool in pools:
            if pool.incomplete:
                raise AllocationError(
                    Reason.POOL_INCOMPLETE,
                    f"{request.field}: asks for all devices, but resource pool "
                    f"{pool.describe()} is currently being updated",
                    node=node_name,
                )
            if pool.invalid_reason:
                raise AllocationError(
                    Reason.POOL_INVALID,
                    f"{request.field}: asks for all devices, but resource pool "
                    f"{pool.describe()} is currently invalid ({pool.invalid_reason})",
                    node=node_name,
                )
        devices = []
        for candidate in found:
            if candidate.error is not None:
                raise self.runtime_error(plan, request, candidate)
            # Kubernetes (validateDeviceRequest) checks the request against the device's capacity
            # alone, not against what other claims consume: a shared device counts as one of
            # "all" even when its capacity is in use, and the search then fails on it.
            if capacity_fits(candidate.record, request.capacity, None, None):
                devices.append(candidate)
        return devices

    def place_like(self, template: NodePlacement, positions: tuple[tuple[int, ...], ...], node: Node,
                   pools: list[Pool]) -> NodePlacement:
        """`template`, found on a node alike to `node` (see `DeviceAllocator._likeness`), as the search on
        `node` finds it: the devices at the same `positions` (indices into the devices of the
        node's pools, in order), with this node's device and pool names and node selector. The
        search on an alike node goes the same way step by step, so this is its answer without
        walking it again. Not for placements with share IDs (those must be fresh)."""
        node_name = node.metadata.name or ""
        flat = [(record, pool) for pool in pools for record in pool.devices]
        chosen_all: list[list[ChosenDevice]] = []
        allocations: list[AllocationResult] = []
        for template_chosen, template_allocation, claim_positions in zip(template.chosen, template.allocations, positions):
            chosen = []
            results = []
            template_results = template_allocation.devices.results if template_allocation.devices else None
            for i, (c, position) in enumerate(zip(template_chosen, claim_positions)):
                record, pool = flat[position]
                chosen.append(ChosenDevice(record, pool, c.plan, c.share_id, dict(c.consumed) if c.consumed else c.consumed))
                results.append(msgspec.structs.replace(
                    template_results[i], driver=record.driver, pool=record.pool, device=record.name,
                    binding_conditions=record.binding_conditions,
                    binding_failure_conditions=record.binding_failure_conditions,
                ))
            config = template_allocation.devices.config if template_allocation.devices else None
            config = [msgspec.structs.replace(e, requests=list(e.requests) if e.requests is not None else None)
                      for e in config] if config else None
            chosen_all.append(chosen)
            allocations.append(AllocationResult(
                devices=DeviceAllocationResult(results=results or None, config=config),
                node_selector=_node_selector(chosen, node_name),
            ))
        return NodePlacement(node_name, allocations, chosen_all, template.score)

    def _search_order(self, node_name: str, pools: list[Pool]) -> list[Pool]:
        """Kubernetes' GatherPools order: sorted by ID, but pools with a device that has binding
        conditions after all others (they are tried last). Cached, so `pools` keeps its identity
        for the candidate cache."""
        cached = self._order_cache.get(node_name)
        if cached is not None and cached[0] is pools:
            return cached[1]
        with_conditions = [p for p in pools if any(d.binding_conditions for d in p.devices)]
        last = {id(p) for p in with_conditions}
        ordered = [p for p in pools if id(p) not in last] + with_conditions if with_conditions else pools
        self._order_cache[node_name] = (pools, ordered)
        return ordered

    def _allocation_result(self, plan: ClaimPlan, chosen: list[ChosenDevice], search: _Search, node_name: str) -> AllocationResult:
        results = []
        for c in chosen:
            record = c.record
            results.append(
                DeviceRequestAllocationResult(
                    request=c.plan.full_name,
                    driver=record.driver,
                    pool=record.pool,
                    device=record.name,
                    admin_access=True if c.plan.admin_access else None,
                    tolerations=c.plan.tolerations,
                    binding_conditions=record.binding_conditions,
                    binding_failure_conditions=record.binding_failure_conditions,
                    share_id=c.share_id,
                    consumed_capacity={k: str(v) for k, v in c.consumed.items()} if c.consumed else None,
                )
            )
        config = self._config(plan, search)
        return AllocationResult(
            devices=DeviceAllocationResult(results=results or None, config=config or None),
            node_selector=_node_selector(chosen, node_name),
        )

    def _config(self, plan: ClaimPlan, search: _Search) -> list[DeviceAllocationConfiguration]:
        claim = plan.claim
        ci = search.plans.index(plan)
        config: list[DeviceAllocationConfiguration] = []
        class_ranges: dict[str, tuple[int, int]] = {}
        spec_requests = claim.spec.devices.requests or []
        chosen_plans: list[RequestPlan] = []
        for ri, subs in enumerate(plan.requests):
            request = subs[search.selected_sub.get((ci, ri), 0)] if plan.has_subrequests[ri] else subs[0]
            chosen_plans.append(request)
            class_name = request.device_class.metadata.name or ""
            if class_name in class_ranges:
                start, end = class_ranges[class_name]
                for i in range(start, end):
                    config[i].requests.append(request.full_name)
                continue
            start = len(config)
            for entry in request.device_class.spec.config or []:
                config.append(
                    DeviceAllocationConfiguration(source="FromClass", requests=[request.full_name], opaque=entry.opaque)
                )
            class_ranges[class_name] = (start, len(config))
        for entry in claim.spec.devices.config or []:
            if not entry.requests:
                config.append(DeviceAllocationConfiguration(source="FromClaim", requests=None, opaque=entry.opaque))
                continue
            # Once per entry, at the first request (or chosen subrequest) it names: the entry
            # carries all its request names already (Kubernetes stops at the first match too).
            for ri, request in enumerate(spec_requests):
                named = request.name in entry.requests or (
                    plan.has_subrequests[ri] and chosen_plans[ri].full_name in entry.requests)
                if named:
                    config.append(DeviceAllocationConfiguration(source="FromClaim", requests=list(entry.requests), opaque=entry.opaque))
                    break
        for entry in config:
            # "empty means all", as kube-scheduler writes it: every request is named, or the
            # subrequest chosen for it
            if entry.requests is not None and all(
                request.name in entry.requests or (plan.has_subrequests[ri] and chosen_plans[ri].full_name in entry.requests)
                for ri, request in enumerate(spec_requests)
            ):
                entry.requests = None
        return config

    # --- why not ---------------------------------------------------------------------------------

    def diagnose(self, plans: list[ClaimPlan], node: Node, pools: list[Pool]) -> NodeFailure:
        """The most specific reason the claims do not fit, looking at each request on its own."""
        node_name = node.metadata.name or ""
        if not pools:
            return NodeFailure(node_name, Reason.NO_DEVICES, "no ResourceSlice offers devices to this node")
        broken = [p for p in pools if not p.usable]
        for plan in plans:
            for ri, subs in enumerate(plan.requests):
                best: NodeFailure | None = None
                for request in subs:
                    failure = self._request_failure(plan, request, node, pools, node_name)
                    if failure is None:
                        best = None
                        break
                    best = best or failure
                if best is not None:
                    if broken and best.reason in (Reason.NO_DEVICES, Reason.CLASS_SELECTOR, Reason.REQUEST_SELECTOR):
                        pool = broken[0]
                        if pool.incomplete:
                            return NodeFailure(node_name, Reason.POOL_INCOMPLETE,
                                               f"{best.message}; resource pool {pool.describe()} is incomplete (being updated)")
                        return NodeFailure(node_name, Reason.POOL_INVALID,
                                           f"{best.message}; resource pool {pool.describe()} is invalid: {pool.invalid_reason}")
                    return best
        constrained = [p for p in plans if p.constraints]
        if constrained:
            c = constrained[0].constraints[0]
            what = "matchAttribute" if c.kind == "match" else "distinctAttribute"
            return NodeFailure(
                node_name, Reason.CONSTRAINT,
                f"ResourceClaim {_claim_name(constrained[0].claim)}: no combination of free devices satisfies the "
                f"constraints (first: {what} {c.attribute})",
                claim=_claim_name(constrained[0].claim),
            )
        return NodeFailure(node_name, Reason.NOT_ENOUGH_DEVICES,
                           "each request fits on its own, but together the claims need more free devices than this node has")

    def _request_failure(self, plan: ClaimPlan, request: RequestPlan, node: Node, pools: list[Pool], node_name: str) -> NodeFailure | None:
        who = f"ResourceClaim {_claim_name(plan.claim)}: request {request.full_name}"
        devices = [(d, p) for p in pools if p.usable for d in p.reachable]
        need = max(request.count, 1)
        class_name = request.device_class.metadata.name
        stages: list[tuple[Reason, str, Callable]] = []
        evaluate = self.matcher.evaluate
        stages.append((Reason.CLASS_SELECTOR, f"match the selectors of device class {class_name}",
                       lambda d, p: all(evaluate(e, d) is True for e in request.class_selectors)))
        stages.append((Reason.REQUEST_SELECTOR, "also match the request's selectors",
                       lambda d, p: all(evaluate(e, d) is True for e in request.request_selectors)))
        stages.append((Reason.IN_USE, "are free",
                       lambda d, p: request.admin_access or d.allow_multiple or not self.state.in_use(d.id)))
        stages.append((Reason.TAINTED, "are not tainted (or the taint is tolerated)",
                       lambda d, p: not taint_blocks(d, request.tolerations)))
        stages.append((Reason.CAPACITY, "have the requested capacity left",
                       lambda d, p: capacity_fits(d, request.capacity, self.state.shared_capacity(d.id), None)))
        stages.append((Reason.COUNTERS, "have their shared counters left", lambda d, p: self._counters_left(d, p)))
        where = {"claim": _claim_name(plan.claim), "request": request.full_name}
        if not devices:
            return NodeFailure(node_name, Reason.NO_DEVICES, f"{who}: the node has no devices in usable pools", **where)
        remaining = devices
        for reason, text, check in stages:
            before = len(remaining)
            remaining = [(d, p) for d, p in remaining if check(d, p)]
            if len(remaining) < need:
                if reason in (Reason.CLASS_SELECTOR, Reason.REQUEST_SELECTOR) and remaining:
                    # Some devices match: the selectors are not what is wrong, the count is.
                    reason = Reason.NOT_ENOUGH_DEVICES
                # counted among the devices the stage looked at: a NIC of another driver is no
                # GPU "in use"
                of = f"{before} devices" if reason is not Reason.IN_USE and before == len(devices) else \
                    f"{before} matching devices"
                return NodeFailure(node_name, reason, f"{who}: {len(remaining)} of {of} {text}, {need} needed", **where)
            if reason is Reason.REQUEST_SELECTOR:
                never = self._constraint_never_met(plan, request, [d for d, _ in remaining], need)
                if never:
                    return NodeFailure(node_name, Reason.CONSTRAINT, f"{who}: {never}", **where)
        return None

    @staticmethod
    def _constraint_never_met(plan: ClaimPlan, request: RequestPlan, matching: list[DeviceRecord],
                              need: int) -> str:
        """Why no `need` of the request's matching devices can meet one of the claim's constraints,
        whatever is in use: "" when some can. Each request of a matchAttribute constraint needs
        `need` devices of one value (of distinctAttribute, `need` values); so this holds for the
        claim whatever its other requests take, and waiting for devices to be freed never helps."""
        for c in plan.constraints:
            if c.requests and request.name not in c.requests and request.full_name not in c.requests:
                continue
            values: dict[object, int] = {}
            for record in matching:
                value = record.attribute(c.attribute)
                if value is not None:
                    values[value] = values.get(value, 0) + 1
            if c.kind == "match":
                most = max(values.values(), default=0)
                if most < need:
                    return (f"matchAttribute {c.attribute}: at most {most} of the node's {len(matching)} matching "
                            f"devices share one value, {need} needed")
            elif len(values) < need:
                return (f"distinctAttribute {c.attribute}: the node's {len(matching)} matching devices have "
                        f"{len(values)} distinct values, {need} needed")
        return ""

    def counters_left(self, record: DeviceRecord, pool: Pool) -> bool:
        """Whether the pool's shared counters still let this device be allocated on its own."""
        return self._counters_left(record, pool)

    def _counters_left(self, record: DeviceRecord, pool: Pool) -> bool:
        if not record.consumes:
            return True
        search = _Search(self, None, [pool], [], None, {})
        return search.counters_available(Candidate(record, pool))


def _node_selector(chosen: list[ChosenDevice], node_name: str) -> NodeSelector | None:
    """Where the claim can be used, as kube-scheduler computes it."""
    fields: list[NodeSelectorRequirement] = []
    expressions: list[NodeSelectorRequirement] = []
    for c in chosen:
        record = c.record
        if record.per_device_node_selection:
            name, selector = record.device.node_name, record.device.node_selector
        else:
            name, selector = record.slice_node_name, record.slice_node_selector
        if name or record.binds_to_node:
            return NodeSelector(
                node_selector_terms=[
                    NodeSelectorTerm(
                        match_fields=[NodeSelectorRequirement(key="metadata.name", operator="In", values=[node_name])]
                    )
                ]
            )
        if selector is not None and selector.node_selector_terms:
            if len(selector.node_selector_terms) > 1:
                raise AllocationError(
                    Reason.INVALID_CLAIM,
                    f"ResourceSlice {record.slice_name}: spec.nodeSelector: {len(selector.node_selector_terms)} terms are not supported",
                )
            term = selector.node_selector_terms[0]
            _add_requirements(term.match_fields or [], fields)
            _add_requirements(term.match_expressions or [], expressions)
    if fields or expressions:
        return NodeSelector(
            node_selector_terms=[NodeSelectorTerm(match_expressions=expressions or None, match_fields=fields or None)]
        )
    return None


def _add_requirements(new: list[NodeSelectorRequirement], into: list[NodeSelectorRequirement]) -> None:
    for r in new:
        values = set(r.values or ())
        if not any(e.key == r.key and e.operator == r.operator and set(e.values or ()) == values for e in into):
            into.append(r)

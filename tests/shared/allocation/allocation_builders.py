"""Small builders for allocator tests, named after the helpers of Kubernetes' allocator tests."""

from __future__ import annotations

import itertools
from typing import Any

from draplane.allocation import AllocatedState, Inventory, NodeAllocator, NodeFailure, NodePlacement
from draplane.api.core import Node
from draplane.api.meta import NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectMeta
from draplane.api.resource import (
    AllocationResult,
    CapacityRequestPolicy,
    CapacityRequestPolicyRange,
    CapacityRequirements,
    CELDeviceSelector,
    Counter,
    CounterSet,
    Device,
    DeviceAllocationResult,
    DeviceAttribute,
    DeviceCapacity,
    DeviceClaim,
    DeviceClaimConfiguration,
    DeviceClass,
    DeviceClassConfiguration,
    DeviceClassSpec,
    DeviceConstraint,
    DeviceCounterConsumption,
    DeviceRequest,
    DeviceRequestAllocationResult,
    DeviceSelector,
    DeviceSubRequest,
    DeviceTaint,
    DeviceToleration,
    ExactDeviceRequest,
    OpaqueDeviceConfiguration,
    ResourceClaim,
    ResourceClaimSpec,
    ResourceClaimStatus,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)

DRIVER_A = "driver-a.example.com"
DRIVER_B = "driver-b.example.com"
CLASS_A = "class-a"
CLASS_B = "class-b"
NODE_1 = "node-1"
NODE_2 = "node-2"


class Version(str):
    """Marks an attribute value as a version."""


def attrs(values: dict[str, Any] | None) -> dict[str, DeviceAttribute] | None:
    if values is None:
        return None
    out = {}
    for k, v in values.items():
        if isinstance(v, Version):
            out[k] = DeviceAttribute(version_value=str(v))
        elif isinstance(v, bool):
            out[k] = DeviceAttribute(bool_value=v)
        elif isinstance(v, int):
            out[k] = DeviceAttribute(int_value=v)
        else:
            out[k] = DeviceAttribute(string_value=v)
    return out


def capacity_policy(default=None, valid_values=None, min=None, max=None, step=None) -> CapacityRequestPolicy:
    rng = CapacityRequestPolicyRange(min=min, max=max, step=step) if min is not None else None
    return CapacityRequestPolicy(default=default, valid_values=valid_values, valid_range=rng)


def device(name: str, attributes: dict | None = None, capacity: dict | None = None, *, policies: dict | None = None,
           consumes: dict[str, dict[str, str]] | None = None, taints: list[DeviceTaint] | None = None,
           multi: bool | None = None, binding: list[str] | None = None, binding_failure: list[str] | None = None,
           binds_to_node: bool | None = None, node_name: str | None = None, all_nodes: bool | None = None,
           node_selector: NodeSelector | None = None) -> Device:
    caps = None
    if capacity is not None:
        caps = {k: DeviceCapacity(value=v, request_policy=(policies or {}).get(k)) for k, v in capacity.items()}
    return Device(
        name=name,
        attributes=attrs(attributes),
        capacity=caps,
        consumes_counters=[
            DeviceCounterConsumption(counter_set=s, counters={n: Counter(value=v) for n, v in cs.items()})
            for s, cs in consumes.items()
        ] if consumes else None,
        taints=taints,
        allow_multiple_allocations=multi,
        binding_conditions=binding,
        binding_failure_conditions=binding_failure,
        binds_to_node=binds_to_node,
        node_name=node_name,
        all_nodes=all_nodes,
        node_selector=node_selector,
    )


def slice_(name: str, node: str | None, pool: str, driver: str, *devices: Device, generation: int = 1,
           count: int = 1, all_nodes: bool | None = None, node_selector: NodeSelector | None = None,
           per_device: bool | None = None, counters: dict[str, dict[str, str]] | None = None) -> ResourceSlice:
    return ResourceSlice(
        metadata=ObjectMeta(name=name),
        spec=ResourceSliceSpec(
            driver=driver,
            pool=ResourcePool(name=pool, generation=generation, resource_slice_count=count),
            node_name=node,
            all_nodes=all_nodes,
            node_selector=node_selector,
            per_device_node_selection=per_device,
            devices=list(devices) if devices else None,
            shared_counters=[
                CounterSet(name=s, counters={n: Counter(value=v) for n, v in cs.items()}) for s, cs in counters.items()
            ] if counters else None,
        ),
    )


def one_device_slice(name: str, node: str, pool: str, driver: str, dev: str = "device-1") -> ResourceSlice:
    return slice_(name, node, pool, driver, device(dev))


def device_class(name: str, driver: str, *selectors: str, config: list[dict] | None = None) -> DeviceClass:
    exprs = list(selectors) or [f'device.driver == "{driver}"']
    return DeviceClass(
        metadata=ObjectMeta(name=name),
        spec=DeviceClassSpec(
            selectors=[DeviceSelector(cel=CELDeviceSelector(expression=e)) for e in exprs],
            config=[DeviceClassConfiguration(opaque=OpaqueDeviceConfiguration(driver=driver, parameters=p)) for p in config]
            if config else None,
        ),
    )


def selectors(*exprs: str) -> list[DeviceSelector] | None:
    return [DeviceSelector(cel=CELDeviceSelector(expression=e)) for e in exprs] or None


def request(name: str, cls: str, count: int | None = 1, *, mode: str | None = None, sel: tuple[str, ...] = (),
            admin: bool | None = None, tolerations: list[DeviceToleration] | None = None,
            capacity: dict[str, str] | None = None) -> DeviceRequest:
    return DeviceRequest(name=name, exactly=ExactDeviceRequest(
        device_class_name=cls, count=count if mode != "All" else None, allocation_mode=mode, selectors=selectors(*sel),
        admin_access=admin, tolerations=tolerations,
        capacity=CapacityRequirements(requests=capacity) if capacity else None,
    ))


def sub(name: str, cls: str, count: int = 1, *, mode: str | None = None, sel: tuple[str, ...] = (),
        tolerations=None, capacity=None) -> DeviceSubRequest:
    return DeviceSubRequest(
        name=name, device_class_name=cls, count=count if mode != "All" else None, allocation_mode=mode,
        selectors=selectors(*sel), tolerations=tolerations,
        capacity=CapacityRequirements(requests=capacity) if capacity else None,
    )


def first_available(name: str, *subs: DeviceSubRequest) -> DeviceRequest:
    return DeviceRequest(name=name, first_available=list(subs))


def match(attribute: str, *requests: str) -> DeviceConstraint:
    return DeviceConstraint(match_attribute=attribute, requests=list(requests) or None)


def distinct(attribute: str, *requests: str) -> DeviceConstraint:
    return DeviceConstraint(distinct_attribute=attribute, requests=list(requests) or None)


def claim_config(driver: str, params: Any, *requests: str) -> DeviceClaimConfiguration:
    return DeviceClaimConfiguration(requests=list(requests) or None,
                                    opaque=OpaqueDeviceConfiguration(driver=driver, parameters=params))


def claim(name: str, *requests: DeviceRequest, constraints=None, config=None, namespace: str = "default") -> ResourceClaim:
    return ResourceClaim(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=ResourceClaimSpec(devices=DeviceClaim(requests=list(requests), constraints=constraints, config=config)),
    )


def allocated(name: str, *devices: tuple, namespace: str = "default") -> ResourceClaim:
    """A claim holding (driver, pool, device[, shareID, consumedCapacity, adminAccess]) tuples."""
    results = []
    for d in devices:
        driver, pool, dev = d[:3]
        share = d[3] if len(d) > 3 else None
        consumed = d[4] if len(d) > 4 else None
        admin = d[5] if len(d) > 5 else None
        results.append(DeviceRequestAllocationResult(request="req", driver=driver, pool=pool, device=dev,
                                                     share_id=share, consumed_capacity=consumed, admin_access=admin))
    c = claim(name, request("req", CLASS_A), namespace=namespace)
    c.status = ResourceClaimStatus(allocation=AllocationResult(devices=DeviceAllocationResult(results=results)))
    return c


def node(name: str = NODE_1, **labels: str) -> Node:
    return Node(metadata=ObjectMeta(name=name, labels=labels or {"region": "region-1"}))


def label_selector(key: str, *values: str) -> NodeSelector:
    return NodeSelector(node_selector_terms=[NodeSelectorTerm(match_expressions=[
        NodeSelectorRequirement(key=key, operator="In", values=list(values))])])


def local_selector(name: str = NODE_1) -> NodeSelector:
    return NodeSelector(node_selector_terms=[NodeSelectorTerm(match_fields=[
        NodeSelectorRequirement(key="metadata.name", operator="In", values=[name])])])


_counter = itertools.count()


def share_ids():
    # a lowercase UUID, as the apiserver requires of a shareID; counted, so answers repeat
    return f"00000000-0000-4000-8000-{next(_counter):012d}"


def allocate(classes, slices, claims, *, on: Node | None = None, in_use=(), policy=None):
    """NodeAllocator on one node. Returns NodePlacement or NodeFailure; raises AllocationError."""
    from draplane.allocation import claim_key, get_policy

    state = AllocatedState()
    for c in in_use:
        state.add_claim(claim_key(c), c.status.allocation)
    allocator = NodeAllocator(Inventory(slices), state, {c.metadata.name: c for c in classes}, share_ids=share_ids)
    return allocator.allocate(claims, on or node(), get_policy(policy or "first-fit"))


def results(outcome) -> list[list[tuple]]:
    """Per claim: (request, driver, pool, device[, adminAccess]) as kube-scheduler wrote them."""
    assert isinstance(outcome, NodePlacement), f"expected an allocation, got {outcome}"
    out = []
    for allocation in outcome.allocations:
        rows = []
        for r in allocation.devices.results or []:
            row = (r.request, r.driver, r.pool, r.device)
            if r.admin_access:
                row += ("admin",)
            rows.append(row)
        out.append(rows)
    return out


def failed(outcome) -> bool:
    return isinstance(outcome, NodeFailure)

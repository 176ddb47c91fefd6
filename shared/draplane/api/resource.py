"""resource.k8s.io/v1: DeviceClass, ResourceSlice, ResourceClaim, ResourceClaimTemplate, DeviceTaintRule.

Field for field the v1 API of Kubernetes 1.37, so that what the apiserver returns decodes with
nothing lost and what we encode is what it accepts. Quantities stay strings here; the allocator
parses them with draplane.api.quantity.
"""

from __future__ import annotations

from typing import Any

import msgspec

from draplane.api.meta import Base, Condition, ListMeta, NodeSelector, ObjectMeta

API_VERSION = "resource.k8s.io/v1"
GROUP = "resource.k8s.io"


def _api_version() -> str:
    return API_VERSION


# --- shared pieces -------------------------------------------------------------------------------


class CELDeviceSelector(Base, kw_only=True):
    expression: str


class DeviceSelector(Base, kw_only=True):
    cel: CELDeviceSelector | None = None


class OpaqueDeviceConfiguration(Base, kw_only=True):
    driver: str
    parameters: Any = None  # a RawExtension: any JSON object, passed through untouched


class Counter(Base, kw_only=True):
    value: str


class DeviceToleration(Base, kw_only=True):
    key: str | None = None
    operator: str | None = None  # Exists | Equal (default Equal)
    value: str | None = None
    effect: str | None = None  # NoSchedule | NoExecute | None for all
    toleration_seconds: int | None = None


class DeviceTaint(Base, kw_only=True):
    key: str
    value: str | None = None
    effect: str
    time_added: str | None = None


# --- DeviceClass ---------------------------------------------------------------------------------


class DeviceClassConfiguration(Base, kw_only=True):
    opaque: OpaqueDeviceConfiguration | None = None


class DeviceClassSpec(Base, kw_only=True):
    selectors: list[DeviceSelector] | None = None
    config: list[DeviceClassConfiguration] | None = None
    extended_resource_name: str | None = None


class DeviceClass(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=_api_version)
    kind: str = msgspec.field(default_factory=lambda: "DeviceClass")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: DeviceClassSpec = msgspec.field(default_factory=DeviceClassSpec)


# --- ResourceSlice -------------------------------------------------------------------------------


class DeviceAttribute(Base, kw_only=True):
    """Exactly one of the four is set."""

    int_value: int | None = msgspec.field(default=None, name="int")
    bool_value: bool | None = msgspec.field(default=None, name="bool")
    string_value: str | None = msgspec.field(default=None, name="string")
    version_value: str | None = msgspec.field(default=None, name="version")

    def value(self) -> int | bool | str | None:
        for v in (self.int_value, self.bool_value, self.string_value, self.version_value):
            if v is not None:
                return v
        return None


class CapacityRequestPolicyRange(Base, kw_only=True):
    min: str
    max: str | None = None
    step: str | None = None


class CapacityRequestPolicy(Base, kw_only=True):
    default: str | None = None
    valid_values: list[str] | None = None
    valid_range: CapacityRequestPolicyRange | None = None


class DeviceCapacity(Base, kw_only=True):
    value: str
    request_policy: CapacityRequestPolicy | None = None


class DeviceCounterConsumption(Base, kw_only=True):
    counter_set: str
    counters: dict[str, Counter]


class Device(Base, kw_only=True):
    name: str
    attributes: dict[str, DeviceAttribute] | None = None
    capacity: dict[str, DeviceCapacity] | None = None
    consumes_counters: list[DeviceCounterConsumption] | None = None
    node_name: str | None = None
    node_selector: NodeSelector | None = None
    all_nodes: bool | None = None
    taints: list[DeviceTaint] | None = None
    binds_to_node: bool | None = None
    binding_conditions: list[str] | None = None
    binding_failure_conditions: list[str] | None = None
    allow_multiple_allocations: bool | None = None


class CounterSet(Base, kw_only=True):
    name: str
    counters: dict[str, Counter]


class ResourcePool(Base, kw_only=True):
    name: str
    generation: int
    resource_slice_count: int


class ResourceSliceSpec(Base, kw_only=True):
    driver: str
    pool: ResourcePool
    node_name: str | None = None
    node_selector: NodeSelector | None = None
    all_nodes: bool | None = None
    devices: list[Device] | None = None
    per_device_node_selection: bool | None = None
    shared_counters: list[CounterSet] | None = None


class ResourceSlice(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=_api_version)
    kind: str = msgspec.field(default_factory=lambda: "ResourceSlice")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: ResourceSliceSpec


# --- ResourceClaim -------------------------------------------------------------------------------


class CapacityRequirements(Base, kw_only=True):
    requests: dict[str, str] | None = None


class ExactDeviceRequest(Base, kw_only=True):
    device_class_name: str
    selectors: list[DeviceSelector] | None = None
    allocation_mode: str | None = None  # ExactCount (default) | All
    count: int | None = None
    admin_access: bool | None = None
    tolerations: list[DeviceToleration] | None = None
    capacity: CapacityRequirements | None = None


class DeviceSubRequest(Base, kw_only=True):
    name: str
    device_class_name: str
    selectors: list[DeviceSelector] | None = None
    allocation_mode: str | None = None
    count: int | None = None
    tolerations: list[DeviceToleration] | None = None
    capacity: CapacityRequirements | None = None


class DeviceRequest(Base, kw_only=True):
    name: str
    exactly: ExactDeviceRequest | None = None
    first_available: list[DeviceSubRequest] | None = None


class DeviceConstraint(Base, kw_only=True):
    requests: list[str] | None = None
    match_attribute: str | None = None
    distinct_attribute: str | None = None


class DeviceClaimConfiguration(Base, kw_only=True):
    requests: list[str] | None = None
    opaque: OpaqueDeviceConfiguration | None = None


class DeviceClaim(Base, kw_only=True):
    requests: list[DeviceRequest] | None = None
    constraints: list[DeviceConstraint] | None = None
    config: list[DeviceClaimConfiguration] | None = None


class ResourceClaimSpec(Base, kw_only=True):
    devices: DeviceClaim | None = None


class DeviceRequestAllocationResult(Base, kw_only=True):
    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool | None = None
    tolerations: list[DeviceToleration] | None = None
    binding_conditions: list[str] | None = None
    binding_failure_conditions: list[str] | None = None
    share_id: str | None = msgspec.field(default=None, name="shareID")
    consumed_capacity: dict[str, str] | None = None


class DeviceAllocationConfiguration(Base, kw_only=True):
    source: str  # FromClass | FromClaim
    requests: list[str] | None = None
    opaque: OpaqueDeviceConfiguration | None = None


class DeviceAllocationResult(Base, kw_only=True):
    results: list[DeviceRequestAllocationResult] | None = None
    config: list[DeviceAllocationConfiguration] | None = None


class AllocationResult(Base, kw_only=True):
    devices: DeviceAllocationResult | None = None
    node_selector: NodeSelector | None = None
    allocation_timestamp: str | None = None


class ResourceClaimConsumerReference(Base, kw_only=True):
    resource: str
    name: str
    uid: str
    api_group: str | None = None


class NetworkDeviceData(Base, kw_only=True):
    interface_name: str | None = None
    ips: list[str] | None = None
    hardware_address: str | None = None


class AllocatedDeviceStatus(Base, kw_only=True):
    driver: str
    pool: str
    device: str
    share_id: str | None = msgspec.field(default=None, name="shareID")
    conditions: list[Condition] | None = None
    data: Any = None
    network_data: NetworkDeviceData | None = None


class ResourceClaimStatus(Base, kw_only=True):
    allocation: AllocationResult | None = None
    reserved_for: list[ResourceClaimConsumerReference] | None = None
    devices: list[AllocatedDeviceStatus] | None = None


class ResourceClaim(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=_api_version)
    kind: str = msgspec.field(default_factory=lambda: "ResourceClaim")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: ResourceClaimSpec = msgspec.field(default_factory=ResourceClaimSpec)
    status: ResourceClaimStatus | None = None


class ResourceClaimTemplateSpec(Base, kw_only=True):
    metadata: ObjectMeta | None = None
    spec: ResourceClaimSpec = msgspec.field(default_factory=ResourceClaimSpec)


class ResourceClaimTemplate(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=_api_version)
    kind: str = msgspec.field(default_factory=lambda: "ResourceClaimTemplate")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: ResourceClaimTemplateSpec = msgspec.field(default_factory=ResourceClaimTemplateSpec)


# --- DeviceTaintRule -----------------------------------------------------------------------------


class DeviceTaintSelector(Base, kw_only=True):
    # Each set field must match; none set matches every device. (deviceClassName and selectors
    # were tombstoned in 1.35.)
    driver: str | None = None
    pool: str | None = None
    device: str | None = None


class DeviceTaintRuleSpec(Base, kw_only=True):
    # Without a selector the rule matches no device.
    device_selector: DeviceTaintSelector | None = None
    taint: DeviceTaint


class DeviceTaintRuleStatus(Base, kw_only=True):
    conditions: list[Condition] | None = None


class DeviceTaintRule(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=_api_version)
    kind: str = msgspec.field(default_factory=lambda: "DeviceTaintRule")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: DeviceTaintRuleSpec
    status: DeviceTaintRuleStatus | None = None


# --- lists, as the apiserver returns them --------------------------------------------------------


class DeviceClassList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[DeviceClass] = msgspec.field(default_factory=list)


class ResourceSliceList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[ResourceSlice] = msgspec.field(default_factory=list)


class ResourceClaimList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[ResourceClaim] = msgspec.field(default_factory=list)


class ResourceClaimTemplateList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[ResourceClaimTemplate] = msgspec.field(default_factory=list)


class DeviceTaintRuleList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[DeviceTaintRule] = msgspec.field(default_factory=list)

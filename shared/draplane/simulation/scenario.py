"""Simulated GPU nodes and workloads, as objects: used by the binder/allocator tests and bench/e2e.py.

Node agents with hardware profiles are the production path to ResourceSlices; these builders make
the same slices directly so that a test can pin exactly which devices exist.
"""

from __future__ import annotations

from draplane.api.core import Container, Node, NodeStatus, Pod, PodResourceClaim, PodSpec, ResourceClaimRef, ResourceRequirements
from draplane.api.meta import ObjectMeta
from draplane.api.resource import (
    CELDeviceSelector,
    DeviceAttribute,
    DeviceCapacity,
    DeviceClaim,
    DeviceClass,
    DeviceClassSpec,
    DeviceRequest,
    DeviceSelector,
    Device,
    ExactDeviceRequest,
    ResourceClaim,
    ResourceClaimSpec,
    ResourceClaimTemplate,
    ResourceClaimTemplateSpec,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)

GPU_DRIVER = "gpu.nvidia.com"
# The seed's intent, written as valid v1 (see DESIGN.md "The seed's example is not valid").
HIGH_MEMORY_EXPRESSION = (
    'device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))'
)


def gpu_node(name: str, *, cpu: str = "64", memory: str = "512Gi", pods: str = "110", labels: dict | None = None) -> Node:
    return Node(
        metadata=ObjectMeta(name=name, labels={"kubernetes.io/hostname": name, **(labels or {})}),
        status=NodeStatus(capacity={"cpu": cpu, "memory": memory, "pods": pods},
                          allocatable={"cpu": cpu, "memory": memory, "pods": pods}),
    )


def gpu_slice(node: str, gpus: int, memory: str, *, product: str = "NVIDIA H100 80GB HBM3", generation: int = 1) -> ResourceSlice:
    devices = [
        Device(
            name=f"gpu-{i}",
            attributes={
                "type": DeviceAttribute(string_value="gpu"),
                "uuid": DeviceAttribute(string_value=f"GPU-{node}-{i}"),
                "productName": DeviceAttribute(string_value=product),
                "resource.kubernetes.io/pcieRoot": DeviceAttribute(string_value=f"pci0000:{i // 2:02x}"),
            },
            capacity={"memory": DeviceCapacity(value=memory)},
        )
        for i in range(gpus)
    ]
    return ResourceSlice(
        metadata=ObjectMeta(name=f"{node}-{GPU_DRIVER}"),
        spec=ResourceSliceSpec(
            driver=GPU_DRIVER,
            pool=ResourcePool(name=node, generation=generation, resource_slice_count=1),
            node_name=node,
            devices=devices,
        ),
    )


def device_class(name: str = "gpu.nvidia.com", expression: str | None = None) -> DeviceClass:
    selectors = [DeviceSelector(cel=CELDeviceSelector(expression=f'device.driver == "{GPU_DRIVER}"'))]
    if expression:
        selectors.append(DeviceSelector(cel=CELDeviceSelector(expression=expression)))
    return DeviceClass(metadata=ObjectMeta(name=name), spec=DeviceClassSpec(selectors=selectors))


def claim_spec(device_class_name: str, count: int = 1, selector: str | None = None) -> ResourceClaimSpec:
    return ResourceClaimSpec(
        devices=DeviceClaim(
            requests=[
                DeviceRequest(
                    name="gpu",
                    exactly=ExactDeviceRequest(
                        device_class_name=device_class_name,
                        count=count,
                        selectors=[DeviceSelector(cel=CELDeviceSelector(expression=selector))] if selector else None,
                    ),
                )
            ]
        )
    )


def claim(namespace: str, name: str, device_class_name: str, count: int = 1, selector: str | None = None) -> ResourceClaim:
    return ResourceClaim(metadata=ObjectMeta(name=name, namespace=namespace),
                         spec=claim_spec(device_class_name, count, selector))


def claim_template(namespace: str, name: str, device_class_name: str, count: int = 1) -> ResourceClaimTemplate:
    return ResourceClaimTemplate(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=ResourceClaimTemplateSpec(spec=claim_spec(device_class_name, count)),
    )


def pod(
    namespace: str, name: str, *, claim_name: str | None = None, template_name: str | None = None,
    scheduler_name: str | None = "draplane", cpu: str | None = None,
) -> Pod:
    pod_claims = []
    if claim_name or template_name:
        pod_claims.append(PodResourceClaim(name="gpu", resource_claim_name=claim_name,
                                           resource_claim_template_name=template_name))
    return Pod(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=PodSpec(
            scheduler_name=scheduler_name,
            containers=[
                Container(
                    name="main",
                    image="registry.k8s.io/pause:3.10",
                    resources=ResourceRequirements(
                        requests={"cpu": cpu} if cpu else None,
                        claims=[ResourceClaimRef(name="gpu")] if pod_claims else None,
                    ),
                )
            ],
            resource_claims=pod_claims or None,
        ),
    )

"""Extended resources backed by DRA (KEP-5004): a pod that asks for `nvidia.com/gpu: 2` the
device-plugin way gets two devices of the DeviceClass that names that resource, through a
ResourceClaim made for the pod, as kube-scheduler 1.37 does it.

A DeviceClass names an extended resource explicitly (`spec.extendedResourceName`; where two
classes name the same one, the newer wins, then the lower name) or implicitly
(`deviceclass.resource.kubernetes.io/<class name>`). A resource the pod requests is backed by
DRA when a class maps it and no node offers it in `status.allocatable`: nodes with a device
plugin for it keep the device-plugin path.

The claim carries one request per container and resource (`container-<i>-request-<j>`, i the
container's index among init and regular containers, j the resource's index among the
container's sorted requests), init containers reusing what later long-lived containers ask
for, and the pod records which request serves which container in
`status.extendedResourceClaimStatus`. Pure: the binder makes the claim and writes the status.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from draplane.api.core import Container, Pod
from draplane.api.meta import ObjectMeta, OwnerReference
from draplane.api.quantity import QuantityError, parse_quantity
from draplane.api.resource import (
    DeviceClaim, DeviceClass, DeviceRequest, ExactDeviceRequest, ResourceClaim, ResourceClaimSpec,
)

EXTENDED_RESOURCE_CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
IMPLICIT_PREFIX = "deviceclass.resource.kubernetes.io/"
_DEFAULT_REQUESTS_PREFIX = "requests."


class ExtendedResourceError(ValueError):
    """A request the claim cannot be made from (a quantity that is not a whole number)."""


def is_dra_extended_resource_name(name: str) -> bool:
    """kube-scheduler's IsDRAExtendedResourceName: an extended resource (a qualified name outside
    the kubernetes.io domain, not a quota `requests.` name) or an implicit class name."""
    if name.startswith(IMPLICIT_PREFIX):
        return True
    native = "/" not in name or "kubernetes.io/" in name
    return not native and not name.startswith(_DEFAULT_REQUESTS_PREFIX)


class ClassResolver:
    """Resource name -> the DeviceClass that backs it, as Kubernetes' extended resource cache
    maps them."""

    def __init__(self, classes: Iterable[DeviceClass]) -> None:
        self._by_name: dict[str, DeviceClass] = {}
        explicit: dict[str, DeviceClass] = {}
        for device_class in classes:
            name = device_class.metadata.name or ""
            self._by_name[IMPLICIT_PREFIX + name] = device_class
            wanted = device_class.spec.extended_resource_name if device_class.spec else None
            if wanted:
                current = explicit.get(wanted)
                if current is None or _newer(device_class, current):
                    explicit[wanted] = device_class
        self._by_name.update(explicit)

    def class_for(self, resource: str) -> DeviceClass | None:
        return self._by_name.get(resource)


def _newer(candidate: DeviceClass, current: DeviceClass) -> bool:
    a, b = candidate.metadata.creation_timestamp or "", current.metadata.creation_timestamp or ""
    if a != b:
        return a > b  # RFC 3339 in UTC sorts as time
    return (candidate.metadata.name or "") < (current.metadata.name or "")


def _whole(container: Container, resource: str) -> int:
    text = ((container.resources.requests or {}) if container.resources else {}).get(resource)
    if text is None:
        return 0
    try:
        value = parse_quantity(text).value
    except QuantityError as exc:
        raise ExtendedResourceError(f"container {container.name}: resources.requests[{resource!r}]: {exc}") from None
    if value.denominator != 1:
        raise ExtendedResourceError(f"container {container.name}: resources.requests[{resource!r}]: {text} is not a "
                                    f"whole number of devices")
    return int(value)


def dra_backed_resources(pod: Pod, resolver: ClassResolver, offered: Callable[[str], bool]) -> dict[str, str]:
    """The pod's requested resources that DRA serves: resource -> DeviceClass name. `offered(r)`:
    whether some node offers r in its allocatable (then the device-plugin path is kept)."""
    out: dict[str, str] = {}
    for container in [*(pod.spec.init_containers or ()), *pod.spec.containers]:
        for resource in (container.resources.requests or {}) if container.resources else {}:
            if resource in out or not is_dra_extended_resource_name(resource) or _whole(container, resource) == 0:
                continue
            device_class = resolver.class_for(resource)
            if device_class is not None and not offered(resource):
                out[resource] = device_class.metadata.name or ""
    return out


def claim_requests(pod: Pod, resources: Mapping[str, str]) -> tuple[list[DeviceRequest], list[dict[str, str]]]:
    """The special claim's requests and the pod's request mappings (containerName, resourceName,
    requestName), as kube-scheduler's createRequestsAndMappings builds them."""
    init = list(pod.spec.init_containers or ())
    containers = [*init, *pod.spec.containers]
    long_lived = [i for i, c in enumerate(containers) if i >= len(init) or c.restart_policy == "Always"]
    short_lived = [i for i, c in enumerate(containers) if i < len(init) and c.restart_policy != "Always"]
    requests: list[DeviceRequest] = []
    mappings: list[dict[str, str]] = []
    for resource in sorted(resources):
        class_name = resources[resource]
        long_requests: list[DeviceRequest | None] = [None] * len(containers)
        long_mappings: list[dict[str, str]] = []
        for i in long_lived:
            request, found = _container_request(i, containers[i], resource, class_name, [])
            long_requests[i] = request
            long_mappings.extend(found)
        largest: DeviceRequest | None = None
        short_names: set[str] = set()
        short_mappings: list[dict[str, str]] = []
        for i in short_lived:
            request, found = _container_request(i, containers[i], resource, class_name, long_requests[i:])
            if request is not None:
                short_names.add(request.name)
                if largest is None or largest.exactly.count < request.exactly.count:
                    largest = request
            short_mappings.extend(found)
        if largest is not None and len(short_names) > 1:
            # init containers run one after the other: the largest of their requests serves them all
            short_names.discard(largest.name)
            for mapping in short_mappings:
                if mapping["requestName"] in short_names:
                    mapping["requestName"] = largest.name
        if largest is not None:
            requests.append(largest)
        requests.extend(r for r in long_requests if r is not None)
        mappings.extend(long_mappings)
        mappings.extend(short_mappings)
    requests.sort(key=lambda r: r.name)
    return requests, mappings


def _container_request(index: int, container: Container, resource: str, class_name: str,
                       reusable: list[DeviceRequest | None]) -> tuple[DeviceRequest | None, list[dict[str, str]]]:
    wanted = _whole(container, resource)
    if wanted == 0:
        return None, []
    mappings = []
    covered = 0
    for request in reusable:
        if request is None:
            continue
        covered += request.exactly.count
        mappings.append({"containerName": container.name, "resourceName": resource, "requestName": request.name})
        if covered >= wanted:
            return None, mappings
    position = sorted((container.resources.requests or {}) if container.resources else {}).index(resource)
    name = f"container-{index}-request-{position}"
    mappings.append({"containerName": container.name, "resourceName": resource, "requestName": name})
    return DeviceRequest(name=name, exactly=ExactDeviceRequest(device_class_name=class_name,
                                                               allocation_mode="ExactCount",
                                                               count=wanted - covered)), mappings


def special_claim(pod: Pod, requests: list[DeviceRequest]) -> ResourceClaim:
    """The claim kube-scheduler makes for the pod: owned by it (deleted with it), marked by the
    annotation, named after it."""
    meta = pod.metadata
    return ResourceClaim(
        metadata=ObjectMeta(
            namespace=meta.namespace, generate_name=f"{meta.name}-extended-resources-",
            annotations={EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"},
            owner_references=[OwnerReference(api_version="v1", kind="Pod", name=meta.name or "", uid=meta.uid or "",
                                             controller=True)],
        ),
        spec=ResourceClaimSpec(devices=DeviceClaim(requests=requests)),
    )


def find_special_claim(pod: Pod, claims: Iterable[ResourceClaim]) -> ResourceClaim | None:
    """The pod's claim for its extended resources, made by an earlier attempt."""
    for claim in claims:
        if (claim.metadata.annotations or {}).get(EXTENDED_RESOURCE_CLAIM_ANNOTATION) != "true":
            continue
        if any(ref.controller and ref.uid == pod.metadata.uid and ref.name == pod.metadata.name
               for ref in claim.metadata.owner_references or ()):
            return claim
    return None

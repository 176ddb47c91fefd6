"""What a pod asks of its node, as kube-scheduler counts it (component-helpers' PodRequests):
max(sum of its containers, its largest init container) plus overhead, a missing request
defaulted to the limit. Integers in the units the scheduler compares: CPU in millicores,
everything else in base units, rounded up. Computed once per pod so that callers can keep running
totals per node instead of re-reading every bound pod."""

from __future__ import annotations

import functools
from typing import Iterable

from draplane.api.core import Container, Node, Pod
from draplane.api.quantity import QuantityError, parse_quantity
from draplane.component_helpers.errors import SpecError

CPU = "cpu"
MEMORY = "memory"
EPHEMERAL_STORAGE = "ephemeral-storage"
PODS = "pods"


def _units(resource: str, text: str, where: str) -> int:
    """The integer the scheduler compares: millicores for CPU, rounded-up base units otherwise."""
    try:
        return _parsed_units(resource, text)
    except QuantityError as exc:
        raise SpecError(f"{where}[{resource!r}]: {exc}") from None


# Every shard reads the requests of every pod bound anywhere, and pods of one workload say the
# same few quantities: parsing them was 3 % of a follower shard's CPU. An invalid one raises and
# is not kept; the bound keeps odd inputs from growing it.
@functools.lru_cache(maxsize=4096)
def _parsed_units(resource: str, text: str) -> int:
    value = parse_quantity(text).value
    if resource == CPU:
        value *= 1000
    return -((-value.numerator) // value.denominator)


def _container_requests(container: Container, where: str) -> dict[str, int]:
    resources = container.resources
    if resources is None:
        return {}
    # The apiserver defaults a missing request to the limit; pods read from files have not been
    # through it, so do the same here.
    merged = dict(resources.limits or {})
    merged.update(resources.requests or {})
    return {name: _units(name, text, f"{where}.resources.requests") for name, text in merged.items()}


def pod_requests(pod: Pod) -> dict[str, int]:
    """What the pod asks of its node: max(sum of containers, largest init container) + overhead."""
    name = pod.metadata.name or "<unnamed>"
    total: dict[str, int] = {}
    for i, container in enumerate(pod.spec.containers):
        for resource, amount in _container_requests(container, f"pod {name}: spec.containers[{i}]").items():
            total[resource] = total.get(resource, 0) + amount
    # Init containers run one after another before the app containers, so only the largest counts.
    for i, container in enumerate(pod.spec.init_containers or ()):
        for resource, amount in _container_requests(container, f"pod {name}: spec.initContainers[{i}]").items():
            if amount > total.get(resource, 0):
                total[resource] = amount
    for resource, text in (pod.spec.overhead or {}).items():
        total[resource] = total.get(resource, 0) + _units(resource, text, f"pod {name}: spec.overhead")
    return total


def node_allocatable(node: Node) -> dict[str, int]:
    name = node.metadata.name or "<unnamed>"
    allocatable = (node.status.allocatable if node.status else None) or {}
    return {r: _units(r, text, f"node {name}: status.allocatable") for r, text in allocatable.items()}


def sum_requests(pods: Iterable[Pod]) -> tuple[dict[str, int], int]:
    """Total requests of the pods bound to a node, and how many there are."""
    total: dict[str, int] = {}
    count = 0
    for pod in pods:
        count += 1
        for resource, amount in pod_requests(pod).items():
            total[resource] = total.get(resource, 0) + amount
    return total, count

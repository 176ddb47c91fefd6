"""NodeResourcesFit: the node has room for the pod: a pod slot, and CPU, memory, ephemeral
storage and every other resource the pod requests, against allocatable less what the pods there
request. An extended resource that a claim made for the pod serves is left to DynamicResources
(the caller takes it out of the requests)."""

from __future__ import annotations

from typing import Mapping

from draplane.component_helpers.resource import CPU, EPHEMERAL_STORAGE, MEMORY, PODS, node_allocatable
from draplane.scheduling.framework.interface import NodeInfo, Rejection

NAME = "NodeResourcesFit"
REASON_TOO_MANY_PODS = "Too many pods"


def insufficient_resources(
    requests: Mapping[str, int],
    allocatable: Mapping[str, int],
    in_use: Mapping[str, int],
    bound_pod_count: int,
) -> list[str]:
    """Reasons the node lacks room, in kube-scheduler's order and words; empty when it fits."""
    reasons: list[str] = []
    # kube-scheduler treats a node without `pods` in allocatable as holding none; every kubelet
    # reports it, so a missing entry here means a hand-written node, which we do not limit.
    if PODS in allocatable and bound_pod_count + 1 > allocatable[PODS]:
        reasons.append(REASON_TOO_MANY_PODS)
    for resource in (CPU, MEMORY, EPHEMERAL_STORAGE):
        wanted = requests.get(resource, 0)
        if wanted > 0 and wanted > allocatable.get(resource, 0) - in_use.get(resource, 0):
            reasons.append(f"Insufficient {resource}")
    for resource in sorted(requests):
        if resource in (CPU, MEMORY, EPHEMERAL_STORAGE, PODS):
            continue
        wanted = requests[resource]
        # A request of zero is satisfied by any node, even one that never heard of the resource.
        if wanted > 0 and wanted > allocatable.get(resource, 0) - in_use.get(resource, 0):
            reasons.append(f"Insufficient {resource}")
    return reasons


def filter_node(requests: Mapping[str, int], node: NodeInfo) -> Rejection | None:
    reasons = insufficient_resources(requests, node_allocatable(node.node), node.requested, node.pod_count)
    return Rejection(NAME, tuple(reasons)) if reasons else None

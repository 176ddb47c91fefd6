"""Test helpers shared by the scheduling core's tests (not a test module)."""

from __future__ import annotations

from draplane.api.core import Pod
from draplane.api.resource import ResourceClaim, ResourceClaimConsumerReference, ResourceClaimStatus
from draplane.scheduling.placing import Placed, SchedulingState


def bind_where_placed(state: SchedulingState, pod: Pod, claim: ResourceClaim, node: str) -> None:
    """Place the pod with its claim, check that it lands on `node`, and record what the binder
    leaves behind: the claim allocated there and reserved for the pod, the pod bound."""
    placed = state.place_pod(pod, [claim])
    assert isinstance(placed, Placed) and placed.node == node, placed
    claim.status = ResourceClaimStatus(allocation=placed.allocations[claim.metadata.uid], reserved_for=[
        ResourceClaimConsumerReference(resource="pods", name=pod.metadata.name, uid=pod.metadata.uid)])
    state.set_claim(claim)
    pod.spec.node_name = node
    state.set_pod(pod)

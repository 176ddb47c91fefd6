"""DynamicResources: the pod's ResourceClaims, allocated by the structured allocator
(`draplane.allocation`) on the node.

Here are the plugin's own words and rules; the search itself runs from `placing`, which hands the
device allocator the pod's other filters as its node filter, as kube-scheduler's Filter runs
after the others for each node:

- PreFilter: claims allocated already pin the pod to their node (`allocation_node`); claims
  allocated on two nodes cannot be used together;
- Filter: the claims do not fit a node for one of the allocator's reasons, told as
  kube-scheduler counts them (`device_reason`) and grouped into draplane's failure classes
  (`failure_class`);
- Reserve/Unreserve and PreBind run in the shard's reservation and the binder's placement
  writer (`draplane.scheduling.reservations`, `draplane_binder.placement_writer`).
"""

from __future__ import annotations

from draplane.allocation.errors import Reason
from draplane.api.resource import AllocationResult
from draplane.scheduling.unschedulable import FailureReason

NAME = "DynamicResources"
# A node other than the one the pod's allocated claims are on.
REASON_CLAIM_ELSEWHERE = "resourceclaim not available on the node"
DETAIL_CLAIM_ELSEWHERE = "the pod's other claims are allocated on another node"


_CLASS_OF_REASON = {
    Reason.NO_DEVICES: FailureReason.NO_MATCHING_DEVICE,
    Reason.CLASS_SELECTOR: FailureReason.NO_MATCHING_DEVICE,
    Reason.REQUEST_SELECTOR: FailureReason.NO_MATCHING_DEVICE,
    Reason.TAINTED: FailureReason.DEVICES_TAINTED,
    Reason.POOL_INCOMPLETE: FailureReason.NO_MATCHING_DEVICE,
    Reason.POOL_INVALID: FailureReason.NO_MATCHING_DEVICE,
    Reason.CONSTRAINT: FailureReason.CONSTRAINT_FAILED,
    Reason.IN_USE: FailureReason.CAPACITY_EXHAUSTED,
    Reason.CAPACITY: FailureReason.CAPACITY_EXHAUSTED,
    Reason.COUNTERS: FailureReason.CAPACITY_EXHAUSTED,
    Reason.NOT_ENOUGH_DEVICES: FailureReason.CAPACITY_EXHAUSTED,
    Reason.SEARCH_LIMIT: FailureReason.CAPACITY_EXHAUSTED,
    Reason.NODE_FILTERED: FailureReason.NODE_DOES_NOT_FIT,
}


def failure_class(reason: Reason) -> FailureReason:
    return _CLASS_OF_REASON.get(reason, FailureReason.CAPACITY_EXHAUSTED)


# kube-scheduler's DynamicResources filter says this for a node where the claims do not fit.
CANNOT_ALLOCATE = "cannot allocate all claims"

_WORDS_OF_REASON = {
    Reason.NO_DEVICES: "the node has no devices",
    Reason.CLASS_SELECTOR: "no device matches the device class",
    Reason.REQUEST_SELECTOR: "no device matches the request's selectors",
    Reason.IN_USE: "capacity exhausted (too few matching devices are free)",
    Reason.TAINTED: "matching devices have taints the request does not tolerate",
    Reason.CAPACITY: "capacity exhausted (matching devices lack the requested capacity)",
    Reason.COUNTERS: "capacity exhausted (matching devices' shared counters are used up)",
    Reason.CONSTRAINT: "no combination of devices satisfies the claim's constraints",
    Reason.NOT_ENOUGH_DEVICES: "not enough devices",
    Reason.POOL_INCOMPLETE: "a resource pool is being updated",
    Reason.POOL_INVALID: "a resource pool is invalid",
    Reason.SEARCH_LIMIT: "the device search reached its limit",
}


def device_reason(failure) -> str:
    """A node's device failure as kube-scheduler's message counts it, named by claim and request,
    with no per-node numbers so that alike nodes count together. A per-node error is told in its
    own words, which name the claim and field: kube-scheduler would fail the attempt with them."""
    if getattr(failure, "from_error", False):
        return f"{CANNOT_ALLOCATE}: {failure.message}"
    words = _WORDS_OF_REASON.get(failure.reason, failure.message)
    if failure.claim and failure.request:
        return f"{CANNOT_ALLOCATE}: resourceclaim {failure.claim}, request {failure.request}: {words}"
    if failure.claim:
        return f"{CANNOT_ALLOCATE}: resourceclaim {failure.claim}: {words}"
    return f"{CANNOT_ALLOCATE}: {words}"


def allocation_node(allocation: AllocationResult | None) -> str | None:
    selector = allocation.node_selector if allocation else None
    for term in selector.node_selector_terms if selector else ():
        for req in term.match_fields or ():
            if req.key == "metadata.name" and req.operator == "In" and req.values and len(req.values) == 1:
                return req.values[0]
    return None

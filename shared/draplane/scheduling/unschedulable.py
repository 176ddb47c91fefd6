"""Why a pod cannot be placed, in words a user can act on.

Kubernetes says "cannot allocate all claims" and stops there. Here every node gets one of four
failure classes, and the message counts nodes per class, most common first, with the detail of the
first node in each class (for example which class or which constraint).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from draplane.scheduling.messages import NodeFailure

# Event and condition reasons, as kube-scheduler spells them.
CONDITION_REASON = "Unschedulable"
# The condition's reason when scheduling failed on an internal error rather than on the pod.
ERROR_CONDITION_REASON = "SchedulerError"
EVENT_REASON = "FailedScheduling"


class FailureReason(str, enum.Enum):
    NO_MATCHING_DEVICE = "NoMatchingDevice"
    CONSTRAINT_FAILED = "ConstraintFailed"
    CAPACITY_EXHAUSTED = "CapacityExhausted"
    NODE_DOES_NOT_FIT = "NodeDoesNotFit"

    @property
    def words(self) -> str:
        return _WORDS[self]


_WORDS = {
    FailureReason.NO_MATCHING_DEVICE: "no device matches the class",
    FailureReason.CONSTRAINT_FAILED: "a constraint failed",
    FailureReason.CAPACITY_EXHAUSTED: "capacity exhausted (matching devices are all in use)",
    FailureReason.NODE_DOES_NOT_FIT: "the node does not fit the pod",
}


def summarize(failures: Iterable[NodeFailure], total_nodes: int) -> str:
    """`0/3 nodes are available: 2 nodes: capacity exhausted ...; 1 node: no device matches ...`."""
    by_reason: dict[str, list[NodeFailure]] = {}
    for failure in failures:
        by_reason.setdefault(failure.reason, []).append(failure)
    if total_nodes == 0:
        return "0/0 nodes are available: the cluster has no nodes."
    parts = []
    for reason, group in sorted(by_reason.items(), key=lambda item: (-len(item[1]), item[0])):
        try:
            words = FailureReason(reason).words
        except ValueError:
            words = reason
        detail = next((f.detail for f in group if f.detail), "")
        noun = "node" if len(group) == 1 else "nodes"
        parts.append(f"{len(group)} {noun}: {words}" + (f" ({detail})" if detail else ""))
    available = total_nodes - sum(len(g) for g in by_reason.values())
    return f"{max(available, 0)}/{total_nodes} nodes are available: " + "; ".join(parts) + "."


def claim_problem(message: str) -> str:
    """A problem in the pod's own claims, which no node can solve."""
    return f"0 nodes are tried: {message}"

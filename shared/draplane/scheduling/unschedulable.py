"""Why a pod cannot be placed, in words a user can act on.

The message is kube-scheduler's, counting each node's reason in its words, where kube-scheduler
says only "cannot allocate all claims" for a device failure and this names the claim, the request
and why. Every node also gets one of four failure classes, for `draplane explain`'s table.
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
    DEVICES_TAINTED = "DevicesTainted"

    @property
    def words(self) -> str:
        return _WORDS[self]


_WORDS = {
    FailureReason.NO_MATCHING_DEVICE: "no device matches the class",
    FailureReason.CONSTRAINT_FAILED: "a constraint failed",
    FailureReason.CAPACITY_EXHAUSTED: "capacity exhausted (too few free matching devices)",
    FailureReason.NODE_DOES_NOT_FIT: "the node does not fit the pod",
    FailureReason.DEVICES_TAINTED: "matching devices are tainted (and the request does not tolerate it)",
}


def summarize(failures: Iterable[NodeFailure], total_nodes: int) -> str:
    """kube-scheduler's message: `0/4 nodes are available: 1 Insufficient cpu, 3 node(s) didn't
    match Pod's node affinity/selector.` Each node's reasons are counted, and the counts are
    listed in sorted order, as its FitError does. A node failing for a device reason counts as
    `cannot allocate all claims: resourceclaim ns/name, request r: <why>`."""
    if total_nodes == 0:
        return "0/0 nodes are available: the cluster has no nodes."
    counts: dict[str, int] = {}
    for failure in failures:
        for reason in failure.reasons or [_class_words(failure.reason)]:
            counts[reason] = counts.get(reason, 0) + 1
    parts = sorted(f"{count} {reason}" for reason, count in counts.items())
    return f"0/{total_nodes} nodes are available: " + ", ".join(parts) + "."


def _class_words(reason: str) -> str:
    try:
        return FailureReason(reason).words
    except ValueError:
        return reason


# Metric labels for why a pod could not be scheduled, beside the four failure classes.
CLAIM_ERROR = "ClaimError"  # the pod's claims themselves (an unknown class, a claim not there yet)
NO_NODES = "NoNodes"  # no node to try
GANG_WAITING = "GangWaiting"  # the pod's gang has fewer pods than its minCount, or no PodGroup yet
GANG_UNPLACEABLE = "GangUnplaceable"  # the gang's members do not fit together
VOLUME_UNBOUND = "VolumeUnbound"  # the pod's PersistentVolumeClaims (missing, lost, unbound immediate)


def failure_label(failures: Iterable[NodeFailure], claim_error: str = "") -> str:
    """One word for a metric's `reason` label: the failure class most nodes failed with (ties go
    to FailureReason's order), ClaimError when the claims themselves are the problem, NoNodes
    when there was no node. A closed set, unlike the messages, which name claims and nodes."""
    if claim_error:
        return CLAIM_ERROR
    counts: dict[str, int] = {}
    for failure in failures:
        counts[failure.reason] = counts.get(failure.reason, 0) + 1
    if not counts:
        return NO_NODES
    order = {reason.value: i for i, reason in enumerate(FailureReason)}
    # a reason outside the enum (a newer shard's) still gets a place, after the known ones
    return min(counts, key=lambda r: (-counts[r], order.get(r, len(order)), r))


def pre_filter_problem(total_nodes: int, message: str) -> str:
    """kube-scheduler's message when a PreFilter plugin rejects the pod before any node is
    looked at: `0/3 nodes are available: persistentvolumeclaim "data" not found.`"""
    return f"0/{total_nodes} nodes are available: {message}."


def claim_problem(message: str) -> str:
    """A problem in the pod's own claims, which no node can solve."""
    return f"0 nodes are tried: {message}"

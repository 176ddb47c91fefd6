"""SchedulingGates: a pod with `spec.schedulingGates` is not scheduled at all (PreEnqueue). Its
claims are neither allocated nor reserved; the apiserver has set `PodScheduled=False` with reason
`SchedulingGated`, and would refuse a binding. Once its last gate is removed it is queued as any
other pod."""

from __future__ import annotations

from draplane.api.core import Pod

NAME = "SchedulingGates"
CONDITION_REASON = "SchedulingGated"


def gates(pod: Pod) -> list[str]:
    return [g.name for g in pod.spec.scheduling_gates or ()]


def pre_enqueue(pod: Pod) -> str | None:
    """Why the pod is not queued, in kube-scheduler's words; None when it may be scheduled."""
    names = gates(pod)
    return f"waiting for scheduling gates: [{' '.join(names)}]" if names else None

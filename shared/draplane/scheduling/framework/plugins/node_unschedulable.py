"""NodeUnschedulable: a cordoned node (`spec.unschedulable`) takes only pods that tolerate the
`node.kubernetes.io/unschedulable` NoSchedule taint."""

from __future__ import annotations

from draplane.api.core import Pod, Taint
from draplane.component_helpers.taints import tolerates
from draplane.scheduling.framework.interface import NodeInfo, Rejection

NAME = "NodeUnschedulable"
REASON = "node(s) were unschedulable"
UNSCHEDULABLE_TAINT_KEY = "node.kubernetes.io/unschedulable"

_CORDON = Taint(key=UNSCHEDULABLE_TAINT_KEY, effect="NoSchedule")


def filter_node(pod: Pod, node: NodeInfo) -> Rejection | None:
    spec = node.node.spec
    if spec is None or not spec.unschedulable:
        return None
    if any(tolerates(t, _CORDON) for t in pod.spec.tolerations or ()):
        return None
    return Rejection(NAME, (REASON,))

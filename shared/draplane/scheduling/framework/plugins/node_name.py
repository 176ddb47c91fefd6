"""NodeName: a pod that names its node (`spec.nodeName`) fits only there. Its PreFilter names
that node (the runtime merges it with NodeAffinity's). kube-scheduler never queues such a pod (it
is bound already); the plugin matters to `draplane allocate` and `explain`, which are handed any
pod."""

from __future__ import annotations

from draplane.api.core import Pod
from draplane.scheduling.framework.interface import NodeInfo, Rejection

NAME = "NodeName"
REASON = "node(s) didn't match the requested node name"


def pre_filter(pod: Pod) -> frozenset[str] | None:
    """The one node the pod may go to; None: any."""
    return frozenset({pod.spec.node_name}) if pod.spec.node_name else None


def filter_node(pod: Pod, node: NodeInfo) -> Rejection | None:
    wanted = pod.spec.node_name
    if not wanted or wanted == node.name:
        return None
    return Rejection(NAME, (REASON,))

"""TaintToleration: every NoSchedule and NoExecute taint of the node must be tolerated by the pod.
kube-scheduler 1.37 counts the node under one reason that no longer names the taint; our detail
still does."""

from __future__ import annotations

from draplane.api.core import Pod, Taint
from draplane.component_helpers.taints import untolerated_taint
from draplane.scheduling.framework.interface import NodeInfo, Rejection

NAME = "TaintToleration"
REASON = "node(s) had untolerated taint(s)"
DETAIL_PREFIX = "node(s) had untolerated taint "


def detail(taint: Taint) -> str:
    inner = f"{taint.key}: {taint.value}" if taint.value else taint.key
    return f"{DETAIL_PREFIX}{{{inner}}}"


def filter_node(pod: Pod, node: NodeInfo) -> Rejection | None:
    spec = node.node.spec
    taint = untolerated_taint(pod.spec.tolerations or (), (spec.taints or ()) if spec else ())
    if taint is None:
        return None
    return Rejection(NAME, (REASON,), (detail(taint),))

"""NodePorts: no host port the pod asks for is held on the node already (the same protocol and
port, on the same IP or on 0.0.0.0 by either side)."""

from __future__ import annotations

from typing import Iterable

from draplane.api.core import Pod, PodSpec
from draplane.scheduling.framework.interface import HostPort, NodeInfo, Rejection

NAME = "NodePorts"
REASON = "node(s) didn't have free ports for the requested pod ports"
ALL_HOST_IPS = "0.0.0.0"


def pod_host_ports(spec: PodSpec) -> tuple[HostPort, ...]:
    """The host ports the pod holds, as kube-scheduler's GetHostPorts reads them: every container's,
    and those of init containers that run as long as the pod (restartPolicy Always)."""
    containers = [c for c in spec.init_containers or () if c.restart_policy == "Always"] + list(spec.containers)
    return tuple(HostPort(p.protocol or "TCP", p.host_ip or ALL_HOST_IPS, p.host_port)
                 for c in containers for p in c.ports or () if (p.host_port or 0) > 0)


def ports_conflict(wanted: Iterable[HostPort], in_use: Iterable[HostPort]) -> bool:
    """kube-scheduler's HostPortInfo.CheckConflict for each wanted port: the same protocol and
    port, held on the same IP, or on 0.0.0.0 by either side."""
    in_use = list(in_use)
    for w in wanted:
        for u in in_use:
            if u.port == w.port and u.protocol == w.protocol and (
                    w.ip == ALL_HOST_IPS or u.ip == ALL_HOST_IPS or u.ip == w.ip):
                return True
    return False


def pre_filter(pod: Pod) -> tuple[HostPort, ...] | None:
    """The host ports the pod wants; None (Skip) when it wants none."""
    return pod_host_ports(pod.spec) or None


def filter_node(wanted: tuple[HostPort, ...] | None, node: NodeInfo) -> Rejection | None:
    if not wanted or not ports_conflict(wanted, node.ports):
        return None
    return Rejection(NAME, (REASON,))

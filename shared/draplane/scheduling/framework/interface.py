"""What passes between the framework's extension points. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import msgspec

from draplane.api.core import Node


class HostPort(msgspec.Struct, frozen=True, array_like=True):
    """A host port a pod holds on its node, with kube-scheduler's defaults filled in."""

    protocol: str
    ip: str
    port: int


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A node as a Filter sees it (kube-scheduler's NodeInfo): the Node, what the pods there
    request and how many they are, and the host ports they hold. `ports` may be lazy: only
    NodePorts reads it, and only for a pod that asks for a host port."""

    node: Node
    requested: Mapping[str, int]
    pod_count: int
    ports: Iterable[HostPort] = ()

    @property
    def name(self) -> str:
        return self.node.metadata.name or ""


@dataclass(frozen=True, slots=True)
class Rejection:
    """A Filter's refusal of a node: the plugin, the reasons kube-scheduler counts in
    `0/N nodes are available: …`, and our own detail (a taint named, where 1.37 no longer does)."""

    plugin: str
    reasons: tuple[str, ...]
    detail: tuple[str, ...] = ()

    @property
    def details(self) -> tuple[str, ...]:
        return self.detail or self.reasons


class PreFilterRejected(ValueError):
    """A PreFilter refused the pod on every node at once: kube-scheduler then runs no Filter, and
    counts every node under `reason`."""

    def __init__(self, plugin: str, reason: str) -> None:
        super().__init__(reason)
        self.plugin = plugin
        self.reason = reason

"""The selectors of core/v1 Service and ReplicationController and apps/v1 ReplicaSet and
StatefulSet: what kube-scheduler's default topology spreading reads of them (the pods a pod's
service or controller selects are the pods its replicas spread among).

Partial and read-only, like draplane.api.core.
"""

from __future__ import annotations

import msgspec

from draplane.api.meta import Base, ListMeta, ObjectMeta
from draplane.api.policy import LabelSelector


class ServiceSpec(Base, kw_only=True):
    # None: a service without a selector (its endpoints are managed by hand), which selects no pod
    selector: dict[str, str] | None = None


class Service(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=lambda: "v1")
    kind: str = msgspec.field(default_factory=lambda: "Service")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: ServiceSpec = msgspec.field(default_factory=ServiceSpec)


class ServiceList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[Service] = msgspec.field(default_factory=list)


class ReplicationControllerSpec(Base, kw_only=True):
    selector: dict[str, str] | None = None


class ReplicationController(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=lambda: "v1")
    kind: str = msgspec.field(default_factory=lambda: "ReplicationController")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: ReplicationControllerSpec = msgspec.field(default_factory=ReplicationControllerSpec)


class ReplicationControllerList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[ReplicationController] = msgspec.field(default_factory=list)


class SelectorSpec(Base, kw_only=True):
    selector: LabelSelector | None = None


class ReplicaSet(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=lambda: "apps/v1")
    kind: str = msgspec.field(default_factory=lambda: "ReplicaSet")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: SelectorSpec = msgspec.field(default_factory=SelectorSpec)


class ReplicaSetList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[ReplicaSet] = msgspec.field(default_factory=list)


class StatefulSet(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=lambda: "apps/v1")
    kind: str = msgspec.field(default_factory=lambda: "StatefulSet")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: SelectorSpec = msgspec.field(default_factory=SelectorSpec)


class StatefulSetList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[StatefulSet] = msgspec.field(default_factory=list)

"""scheduling.k8s.io/v1beta1 PodGroup (KEP-4671, the Workload API's runtime gang object), as far
as gang placement reads it. Served by kube-apiserver 1.37 with the GenericWorkload gate (beta, off
by default) and the API version switched on; `draplane up` switches both on."""

from __future__ import annotations

import msgspec

from draplane.api.meta import Base, ListMeta, ObjectMeta

API_VERSION = "scheduling.k8s.io/v1beta1"


class GangSchedulingPolicy(Base, kw_only=True):
    min_count: int | None = None


class BasicSchedulingPolicy(Base, kw_only=True):
    pass


class PodGroupSchedulingPolicy(Base, kw_only=True):
    basic: BasicSchedulingPolicy | None = None
    gang: GangSchedulingPolicy | None = None


class TopologyConstraint(Base, kw_only=True):
    # A node label whose one value all the group's pods share (gate TopologyAwareWorkloadScheduling).
    key: str | None = None


class PodGroupSchedulingConstraints(Base, kw_only=True):
    topology: list[TopologyConstraint] | None = None


class PodGroupResourceClaim(Base, kw_only=True):
    name: str
    resource_claim_name: str | None = None
    resource_claim_template_name: str | None = None


class PodGroupSpec(Base, kw_only=True):
    scheduling_policy: PodGroupSchedulingPolicy = msgspec.field(default_factory=PodGroupSchedulingPolicy)
    scheduling_constraints: PodGroupSchedulingConstraints | None = None
    resource_claims: list[PodGroupResourceClaim] | None = None
    priority: int | None = None
    priority_class_name: str | None = None


class PodGroup(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=lambda: API_VERSION)
    kind: str = msgspec.field(default_factory=lambda: "PodGroup")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PodGroupSpec = msgspec.field(default_factory=PodGroupSpec)


class PodGroupList(Base, kw_only=True):
    api_version: str | None = None
    kind: str | None = None
    metadata: ListMeta = msgspec.field(default_factory=ListMeta)
    items: list[PodGroup] = msgspec.field(default_factory=list)

"""The parts of core/v1 Pod and Node that scheduling needs.

Unlike the resource.k8s.io models these are deliberately partial: we read pods and nodes, and write
them only through patches and subresources, never by sending a decoded object back.
"""

from __future__ import annotations

import msgspec

from draplane.api.meta import Base, Condition, ListMeta, NodeSelector, NodeSelectorTerm, ObjectMeta
from draplane.api.policy import LabelSelector


class Taint(Base, kw_only=True):
    key: str
    effect: str
    value: str | None = None
    time_added: str | None = None


class Toleration(Base, kw_only=True):
    key: str | None = None
    operator: str | None = None
    value: str | None = None
    effect: str | None = None
    toleration_seconds: int | None = None


class NodeSpec(Base, kw_only=True):
    taints: list[Taint] | None = None
    unschedulable: bool | None = None
    provider_id: str | None = msgspec.field(default=None, name="providerID")


class NodeStatus(Base, kw_only=True):
    capacity: dict[str, str] | None = None
    allocatable: dict[str, str] | None = None
    conditions: list[Condition] | None = None
    # what the kubelet says the node supports (NodeDeclaredFeatures reads it)
    declared_features: list[str] | None = None


class Node(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=lambda: "v1")
    kind: str = msgspec.field(default_factory=lambda: "Node")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: NodeSpec | None = None
    status: NodeStatus | None = None


class ResourceClaimRef(Base, kw_only=True):
    name: str


class ResourceRequirements(Base, kw_only=True):
    requests: dict[str, str] | None = None
    limits: dict[str, str] | None = None
    claims: list[ResourceClaimRef] | None = None


class ContainerPort(Base, kw_only=True):
    container_port: int
    name: str | None = None
    # A host port is taken on the node: no two pods there may hold the same (protocol, IP, port),
    # 0.0.0.0 (or no IP) holding it on every IP.
    host_port: int | None = None
    protocol: str | None = None  # TCP (the default), UDP or SCTP
    host_ip: str | None = msgspec.field(default=None, name="hostIP")  # not "hostIp"


class ContainerRestartRuleOnExitCodes(Base, kw_only=True):
    operator: str | None = None
    values: list[int] | None = None


class ContainerRestartRule(Base, kw_only=True):
    action: str | None = None
    exit_codes: ContainerRestartRuleOnExitCodes | None = None


class VolumeMount(Base, kw_only=True):
    name: str
    mount_path: str = ""
    read_only: bool | None = None
    sub_path: str | None = None
    # alpha (VolumeBindMountOptions): needs a node that declares the feature
    bind_mount_options: list[str] | None = None


class Container(Base, kw_only=True):
    name: str
    image: str | None = None
    resources: ResourceRequirements | None = None
    ports: list[ContainerPort] | None = None
    # Always on an init container: a sidecar, running (and holding its ports) as long as the pod
    restart_policy: str | None = None
    restart_policy_rules: list[ContainerRestartRule] | None = None
    volume_mounts: list[VolumeMount] | None = None


class PreferredSchedulingTerm(Base, kw_only=True):
    weight: int
    preference: NodeSelectorTerm


class NodeAffinity(Base, kw_only=True):
    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] | None = None


class PodAffinityTerm(Base, kw_only=True):
    """Pods (by `label_selector`, in `namespaces` or those `namespace_selector` picks; the term
    owner's namespace when neither is set) and the domain (`topology_key`, a node label) they count
    in. The apiserver folds matchLabelKeys/mismatchLabelKeys into the label selector when it takes
    the pod; they are kept so nothing a user set is dropped."""

    topology_key: str
    label_selector: LabelSelector | None = None
    namespaces: list[str] | None = None
    namespace_selector: LabelSelector | None = None
    match_label_keys: list[str] | None = None
    mismatch_label_keys: list[str] | None = None


class WeightedPodAffinityTerm(Base, kw_only=True):
    weight: int
    pod_affinity_term: PodAffinityTerm


class PodAffinity(Base, kw_only=True):
    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] | None = None
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] | None = None


class PodAntiAffinity(Base, kw_only=True):
    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] | None = None
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] | None = None


class Affinity(Base, kw_only=True):
    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAntiAffinity | None = None


class TopologySpreadConstraint(Base, kw_only=True):
    max_skew: int
    topology_key: str
    when_unsatisfiable: str  # DoNotSchedule (a filter) or ScheduleAnyway (a score only)
    label_selector: LabelSelector | None = None
    min_domains: int | None = None
    node_affinity_policy: str | None = None  # Honor (the default) or Ignore
    node_taints_policy: str | None = None  # Ignore (the default) or Honor
    match_label_keys: list[str] | None = None


class PodResourceClaim(Base, kw_only=True):
    name: str
    resource_claim_name: str | None = None
    resource_claim_template_name: str | None = None


class PodSchedulingGate(Base, kw_only=True):
    """A gate another controller (Kueue, a quota admission) holds the pod with: no scheduler
    touches a pod while `spec.schedulingGates` names any. Gates can only be removed once set."""

    name: str


class PodSchedulingGroup(Base, kw_only=True):
    """The group a pod is scheduled with (KEP-4671, gate GenericWorkload): a PodGroup of
    scheduling.k8s.io/v1beta1 in the pod's namespace, which may not exist yet."""

    pod_group_name: str | None = None


class PersistentVolumeClaimVolumeSource(Base, kw_only=True):
    claim_name: str
    read_only: bool | None = None


class EphemeralVolumeSource(Base, kw_only=True):
    # The claim the ephemeral volume controller makes from it is named <pod>-<volume>; scheduling
    # reads that claim, not the template, which is kept opaque.
    volume_claim_template: dict | None = None


class Volume(Base, kw_only=True):
    """A pod volume, as far as scheduling reads it: the claims it uses. Other sources (emptyDir,
    configMap, ...) decode to a name alone."""

    name: str
    persistent_volume_claim: PersistentVolumeClaimVolumeSource | None = None
    ephemeral: EphemeralVolumeSource | None = None


class PodSpec(Base, kw_only=True):
    containers: list[Container] = msgspec.field(default_factory=list)
    init_containers: list[Container] | None = None
    node_name: str | None = None
    scheduler_name: str | None = None
    node_selector: dict[str, str] | None = None
    affinity: Affinity | None = None
    tolerations: list[Toleration] | None = None
    resource_claims: list[PodResourceClaim] | None = None
    overhead: dict[str, str] | None = None
    priority: int | None = None
    priority_class_name: str | None = None
    # PreemptLowerPriority (the default) or Never: whether this pod may evict others to fit.
    preemption_policy: str | None = None
    termination_grace_period_seconds: int | None = None
    scheduling_group: PodSchedulingGroup | None = None
    scheduling_gates: list[PodSchedulingGate] | None = None
    topology_spread_constraints: list[TopologySpreadConstraint] | None = None
    volumes: list[Volume] | None = None
    ephemeral_containers: list[Container] | None = None
    host_network: bool | None = None
    # false: the pod runs in its own user namespace
    host_users: bool | None = None


class PodResourceClaimStatus(Base, kw_only=True):
    name: str
    resource_claim_name: str | None = None


class ContainerExtendedResourceRequest(Base, kw_only=True):
    container_name: str
    resource_name: str
    request_name: str


class PodExtendedResourceClaimStatus(Base, kw_only=True):
    """Which request of the claim made for the pod's DRA-backed extended resources serves which
    container (KEP-5004); the kubelet reads it."""

    request_mappings: list[ContainerExtendedResourceRequest] = msgspec.field(default_factory=list)
    resource_claim_name: str = ""


class PodStatus(Base, kw_only=True):
    phase: str | None = None
    conditions: list[Condition] | None = None
    resource_claim_statuses: list[PodResourceClaimStatus] | None = None
    nominated_node_name: str | None = None
    start_time: str | None = None
    extended_resource_claim_status: PodExtendedResourceClaimStatus | None = None


class Pod(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=lambda: "v1")
    kind: str = msgspec.field(default_factory=lambda: "Pod")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PodSpec = msgspec.field(default_factory=PodSpec)
    status: PodStatus | None = None


class PodList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[Pod] = msgspec.field(default_factory=list)


class NodeList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[Node] = msgspec.field(default_factory=list)

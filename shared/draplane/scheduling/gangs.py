"""Which gang a pending pod belongs to, what the gang asks, and which gangs have enough members to
be placed. Pure: no I/O.

The gang is read from the Workload API (KEP-4671), which kube-apiserver 1.37 serves with the
GenericWorkload gate: a pod names its group in `spec.schedulingGroup.podGroupName`; the PodGroup
(scheduling.k8s.io/v1beta1) says `spec.schedulingPolicy.gang.minCount` (the members that must be
placed together; `basic` instead of `gang` means no gang) and, with TopologyAwareWorkloadScheduling,
`spec.schedulingConstraints.topology[0].key`, a node label whose one value all members share.

The Workload API has no field for a device-attribute domain or for a preference, so those are
annotations on the PodGroup:

- `draplane.io/gang-device-domain: gpu.nvidia.com/cliqueId`: every device of the gang has one value
  of this attribute (fully qualified); it replaces a node-label topology key;
- `draplane.io/gang-topology: preferred`: try the domains (tightest first), then the whole
  cluster; `required` (the default) waits for a domain with room.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from draplane.allocation.gang import DomainKind, GangTopology
from draplane.api.core import PodSpec
from draplane.api.scheduling import PodGroup

DEVICE_DOMAIN_ANNOTATION = "draplane.io/gang-device-domain"
TOPOLOGY_ANNOTATION = "draplane.io/gang-topology"


class GangSpecError(ValueError):
    """A PodGroup whose gang cannot be read; the text names the PodGroup and the field."""


@dataclass(frozen=True, slots=True)
class GangSpec:
    key: str  # namespace/name of the PodGroup
    min_count: int
    topology: GangTopology | None = None


def pod_group_key(namespace: str, spec: PodSpec | None) -> str | None:
    """namespace/podGroupName of the pod's group, None for a pod that is in none."""
    group = spec.scheduling_group if spec is not None else None
    if group is None or not group.pod_group_name:
        return None
    return f"{namespace}/{group.pod_group_name}"


def gang_spec(group: PodGroup) -> GangSpec | None:
    """The gang a PodGroup asks for; None when its policy is `basic` (its pods are placed alone)."""
    meta = group.metadata
    key = f"{meta.namespace or ''}/{meta.name or ''}"
    where = f"PodGroup {key}"
    policy = group.spec.scheduling_policy
    if policy.gang is None:
        if policy.basic is None:
            raise GangSpecError(f"{where}: spec.schedulingPolicy: one of basic or gang must be set")
        return None
    min_count = policy.gang.min_count
    if not isinstance(min_count, int) or isinstance(min_count, bool) or min_count < 1:
        raise GangSpecError(f"{where}: spec.schedulingPolicy.gang.minCount: must be a positive integer, got {min_count!r}")
    annotations = meta.annotations or {}
    preference = annotations.get(TOPOLOGY_ANNOTATION, "required")
    if preference not in ("required", "preferred"):
        raise GangSpecError(f"{where}: metadata.annotations[{TOPOLOGY_ANNOTATION!r}]: must be required or preferred, "
                            f"got {preference!r}")
    required = preference == "required"
    device_domain = annotations.get(DEVICE_DOMAIN_ANNOTATION)
    if device_domain is not None:
        domain, _, name = device_domain.rpartition("/")
        if not domain or not name:
            raise GangSpecError(f"{where}: metadata.annotations[{DEVICE_DOMAIN_ANNOTATION!r}]: a fully qualified device "
                                f"attribute (domain/name) is needed, got {device_domain!r}")
        return GangSpec(key, min_count, GangTopology(device_domain, DomainKind.DEVICE_ATTRIBUTE, required))
    constraints = group.spec.scheduling_constraints
    topology = (constraints.topology or []) if constraints is not None else []
    if len(topology) > 1:
        raise GangSpecError(f"{where}: spec.schedulingConstraints.topology: at most one constraint, got {len(topology)}")
    if topology:
        if not topology[0].key:
            raise GangSpecError(f"{where}: spec.schedulingConstraints.topology[0].key: required")
        return GangSpec(key, min_count, GangTopology(topology[0].key, DomainKind.NODE_LABEL, required))
    return GangSpec(key, min_count)


class GangWaitingRoom:
    """Pending members per gang, until a gang has its minimum count. Bounded: at most `max_gangs`
    gangs (the one least recently joined is forgotten first; its members come again with the
    binder's next retry) and `max_members` each, or the gang's minimum count where that is
    larger (a bound below it would keep the gang waiting for ever; each member kept is a pod that
    exists, so memory stays bounded by the cluster's pods)."""

    def __init__(self, max_gangs: int = 10_000, max_members: int = 4_096) -> None:
        self.max_gangs = max_gangs
        self.max_members = max_members
        self._gangs: OrderedDict[str, OrderedDict[str, object]] = OrderedDict()
        self._gang_of: dict[str, str] = {}

    def join(self, gang: str, member: str, pending: object, min_count: int = 0) -> None:
        """The member is pending (again): its latest message replaces the one kept. `min_count`:
        the gang's minimum count, which the room always has space for."""
        previous = self._gang_of.get(member)
        if previous is not None and previous != gang:
            self.leave(member)
        members = self._gangs.get(gang)
        if members is None:
            while len(self._gangs) >= self.max_gangs:
                _, forgotten = self._gangs.popitem(last=False)
                for m in forgotten:
                    self._gang_of.pop(m, None)
            members = self._gangs[gang] = OrderedDict()
        self._gangs.move_to_end(gang)
        if member not in members and len(members) >= max(self.max_members, min_count):
            oldest, _ = members.popitem(last=False)
            self._gang_of.pop(oldest, None)
        members[member] = pending
        self._gang_of[member] = gang

    def leave(self, member: str) -> None:
        """The member is placed, deleted or no longer in the gang."""
        gang = self._gang_of.pop(member, None)
        if gang is None:
            return
        members = self._gangs.get(gang)
        if members is not None:
            members.pop(member, None)
            if not members:
                del self._gangs[gang]

    def members(self, gang: str) -> list[object]:
        return list(self._gangs.get(gang, {}).values())

    def ready(self, spec: GangSpec, placed: int = 0) -> list[object] | None:
        """The pending members to place together when, with the `placed` ones already running,
        they reach the gang's minimum count; None while it waits."""
        members = self._gangs.get(spec.key)
        if not members or placed + len(members) < spec.min_count:
            return None
        return list(members.values())

    def waiting_for(self, spec: GangSpec, placed: int = 0) -> str:
        """Why the gang's pods wait, for their PodScheduled condition."""
        have = placed + len(self._gangs.get(spec.key, {}))
        return f"waiting for the gang's minimum count: {have} of {spec.min_count} pods of PodGroup {spec.key} exist"

    def __len__(self) -> int:
        return len(self._gangs)

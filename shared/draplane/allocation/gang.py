"""Gangs: every member of a job placed, or none. Pure: no I/O, no asyncio.

kube-scheduler 1.37 places a gang's pods one at a time and keeps each pod's first device choice;
when that choice leaves a later member no room the whole gang fails, although another choice would
fit them all (kubernetes/kubernetes#138765). Here the search is joint:

- members are assigned to nodes depth first, each trying the nodes it fits on alone;
- the members that share a node are allocated *together* by the node allocator, so adding one to
  a node chooses again the devices of those already there (Kubernetes' own search backtracks over
  claims, requests and subrequests within one allocation);
- when a member fits nowhere, the members before it move (backtracking over their nodes);
- all of it within a `SearchBudget` of node allocations and seconds, after which the gang is
  declared unplaceable with `budget_exhausted` set.

Members alike (the same claims' specs and pod spec) are interchangeable, so the search only tries
their assignments in one order of nodes; without that, 8 alike members over 12 nodes would be tried
in every permutation. A failure of a set of alike members on a node is remembered for the search.

A claim named by several members (a claim shared by the pods, or reserved for the pod group) is
allocated once, with the first member that names it; the members after it use that allocation and
must go to a node its node selector admits. Its devices are chosen again only when that first
member moves. A claim allocated before (its status.allocation) is kept: its member goes where
that allocation's node selector admits.

Topology (`GangTopology`): all members within one domain, named by a node-label key (a rack) or by a
device attribute that every device of the gang shares (an NVLink clique); the domains are tried
tightest first (the fewest free devices), so a gang fills a partly used rack before an empty one.
Not required: the domains first, then the whole cluster.

The search writes its tentative allocations into the cluster's `AllocatedState` (so that devices
of pools shared between nodes and counters are seen by every later step) and takes every one of
them back before it returns, placed or not; `commit_gang` then records a placement in the cluster.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from draplane.api.codec import encode_json
from draplane.api.core import Node, Pod
import msgspec

from draplane.api.resource import AllocationResult, CELDeviceSelector, DeviceSelector, ResourceClaim
from draplane.allocation.allocator import ClaimPlan, NodePlacement
from draplane.allocation.device_allocator import DeviceAllocator
from draplane.allocation.errors import AllocationError
from draplane.component_helpers.errors import SpecError
from draplane.component_helpers.node_affinity import term_matches
from draplane.component_helpers.resource import pod_requests
from draplane.allocation.scoring import ScoringPolicy
from draplane.allocation.state import claim_key

# What the pods already bound to a node request (sum_requests' answer): (requests, pod count).
BoundRequests = Callable[[str], tuple[Mapping[str, int], int]]
# The pod's node-local filters (the scheduling framework's node_fit) on a node, given its requests
# and what the pods there request: passed in, because the framework sits above this search.
PodFits = Callable[[Pod, Node, Mapping[str, int], tuple[Mapping[str, int], int]], bool]


class DomainKind(str, enum.Enum):
    NODE_LABEL = "node-label"
    DEVICE_ATTRIBUTE = "device-attribute"


@dataclass(frozen=True, slots=True)
class GangTopology:
    """All members within one domain: nodes with one value of the label `key`, or devices with one
    value of the attribute `key` (fully qualified, `gpu.nvidia.com/cliqueId`)."""

    key: str
    kind: DomainKind = DomainKind.NODE_LABEL
    required: bool = True


@dataclass(frozen=True, slots=True)
class GangMember:
    """One pod of the gang: its name (namespace/name), its claims and, for node fit (place_gang's
    `pod_fits`), the pod."""

    name: str
    claims: tuple[ResourceClaim, ...]
    pod: Pod | None = None
    # Filters beyond node fit that the member's own state decides (its volumes, in
    # draplane.scheduling.framework.plugins.volume_binding): a node it refuses takes no part of this member.
    # `constraint_key` tells members apart whose filters differ, as their specs do.
    node_allowed: Callable[[Node], bool] | None = None
    constraint_key: bytes = b""


@dataclass(frozen=True, slots=True)
class Gang:
    name: str
    members: tuple[GangMember, ...]
    topology: GangTopology | None = None


@dataclass(frozen=True, slots=True)
class SearchBudget:
    """Bounds of one gang's search: node allocations tried, and wall seconds."""

    node_attempts: int = 5_000
    seconds: float = 2.0


@dataclass(slots=True)
class NodeGroupPlacement:
    """The claims allocated on one node for the gang, each with its allocation."""

    node: str
    members: tuple[str, ...]
    claims: list[ResourceClaim]
    allocations: list[AllocationResult]
    placement: NodePlacement


@dataclass(slots=True)
class GangPlacement:
    gang: str
    nodes: dict[str, str]  # member -> node
    groups: list[NodeGroupPlacement]
    domain: str | None
    attempts: int

    def claims_allocated(self) -> dict[str, AllocationResult]:
        return {claim_key(c): a for g in self.groups for c, a in zip(g.claims, g.allocations)}


@dataclass(slots=True)
class GangUnplaceable:
    """The one explanation of a gang that does not fit: where each member fits alone, which did not
    fit at all, and how far the joint search got."""

    gang: str
    message: str
    fits_alone: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unplaced: tuple[str, ...] = ()
    budget_exhausted: bool = False
    attempts: int = 0

    def __str__(self) -> str:
        return self.message


class GangError(ValueError):
    """A gang that cannot be searched as given (no members, a member twice)."""


# --- the search ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Member:
    index: int
    spec: GangMember
    shape: tuple
    requests: Mapping[str, int]
    own_claims: list[ResourceClaim]  # named by this member only
    shared_claims: list[ResourceClaim]  # named by several members
    # Claims allocated before (status.allocation): kept as they are, the member goes where they are.
    allocated: list[AllocationResult] = field(default_factory=list)

    def admitted_by_allocated(self, node: Node) -> bool:
        return all(_allocation_admits(a, node) for a in self.allocated)


@dataclass(slots=True)
class _Step:
    """One member put on a node: what the node's group held before, so that it can be undone."""

    member: _Member
    node: str
    previous: NodeGroupPlacement | None
    placed_shared: list[str]  # shared claims this step allocated first


class _BudgetExhausted(Exception):
    pass


class _GangSearch:
    def __init__(self, cluster: DeviceAllocator, members: list[_Member], policy: ScoringPolicy,
                 bound: BoundRequests | None, budget: SearchBudget, deadline: float, attempts: list[int],
                 pod_fits: PodFits | None = None):
        self.devices = cluster
        self.pod_fits = pod_fits
        self.members = members
        self.policy = policy
        self.bound = bound
        self.budget = budget
        self.deadline = deadline
        self.attempts = attempts  # shared by every domain of one gang: [count]
        self.groups: dict[str, NodeGroupPlacement] = {}
        self.node_of: dict[int, str] = {}
        self.steps: list[_Step] = []
        self.shared_owner: dict[str, tuple[str, AllocationResult]] = {}  # claim -> (node, allocation)
        self.failed: set[tuple] = set()
        self.deepest: dict[int, str] = {}
        self.stuck_at: int | None = None
        self.plans: dict[str, ClaimPlan] = {}
        self.selector: str | None = None  # set by run() for a device-attribute domain
        self.restricted: dict[str, ResourceClaim] = {}
        # Remembered failures are only sound when no pool is visible from several nodes and no
        # device attribute restricts the devices (then a node's outcome depends on it alone).
        self.memo_ok = not cluster.inventory.has_shared_pools()

    # --- undoable steps ----------------------------------------------------------------------------

    def put_member_on_node(self, member: _Member, node_name: str, attribute: tuple[str, object] | None) -> bool:
        """Allocate the node's gang claims again with `member` among them; True when they fit.

        The claims of the members on the node are chosen again together; shared claims allocated
        by an earlier step stay as they are (other members may use them on other nodes)."""
        previous = self.groups.get(node_name)
        group_members = [self.members[i] for i, n in self.node_of.items() if n == node_name] + [member]
        memo_key = (node_name, tuple(sorted(m.shape for m in group_members)))
        memo = self.memo_ok and not any(m.shared_claims for m in group_members)
        if memo and memo_key in self.failed:
            return False
        node = self.devices.nodes[node_name]
        if not member.admitted_by_allocated(node):
            return False
        if not self._node_fits(group_members, node):
            self.failed.add(memo_key)
            return False
        for c in member.shared_claims:
            owner = self.shared_owner.get(claim_key(c))
            if owner is not None and not _allocation_admits(owner[1], node):
                return False
        new_shared = [c for c in member.shared_claims if claim_key(c) not in self.shared_owner]
        pinned = ([(c, a) for c, a in zip(previous.claims, previous.allocations) if claim_key(c) in self.shared_owner]
                  if previous else [])
        movable = [c for m in group_members for c in m.own_claims] + new_shared
        self._take_back(previous)
        self._hold_claims(pinned)
        placement = self._allocate(movable, node)
        if placement is not None and attribute is not None and not _all_devices_have(placement, attribute):
            placement = None
        if placement is None:
            self._take_back_claims([c for c, _ in pinned])
            self._hold(previous)
            if memo:
                self.failed.add(memo_key)
            return False
        claims = [c for c, _ in pinned] + movable
        allocations = [a for _, a in pinned] + list(placement.allocations)
        self._hold_claims(list(zip(movable, placement.allocations)))
        self.groups[node_name] = NodeGroupPlacement(
            node_name, tuple(m.spec.name for m in group_members), claims, allocations, placement)
        for c, a in zip(movable, placement.allocations):
            if any(c is s for s in new_shared):
                self.shared_owner[claim_key(c)] = (node_name, a)
        self.node_of[member.index] = node_name
        self.steps.append(_Step(member, node_name, previous, [claim_key(c) for c in new_shared]))
        return True

    def take_member_off_node(self) -> None:
        """Undo the last `put_member_on_node`: the node's group as it was before."""
        step = self.steps.pop()
        self._take_back(self.groups.pop(step.node))
        for key in step.placed_shared:
            self.shared_owner.pop(key, None)
        if step.previous is not None:
            self._hold(step.previous)
            self.groups[step.node] = step.previous
        del self.node_of[step.member.index]

    def take_everything_back(self) -> None:
        while self.steps:
            self.take_member_off_node()

    # --- search ------------------------------------------------------------------------------------

    def run(self, node_names: list[str], attribute: tuple[str, object] | None) -> bool:
        if attribute is not None:
            self.selector = attribute_selector(attribute[0], attribute[1])
        candidates = self._alone_candidates(node_names, attribute)
        if any(not candidates[m.shape] for m in self.members):
            return False
        return self._place(0, candidates, attribute)

    def _place(self, i: int, candidates: dict[tuple, list[str]], attribute) -> bool:
        if i == len(self.members):
            return True
        member = self.members[i]
        nodes = candidates[member.shape]
        start = 0
        if i > 0 and self.members[i - 1].shape == member.shape:
            # Alike members: only assignments in the order of the candidate list (no permutations).
            start = nodes.index(self.node_of[i - 1])
        used = set(self.node_of.values())
        # The nodes the gang already uses first: members close together, whole nodes left free.
        order = [n for n in nodes[start:] if n in used] + [n for n in nodes[start:] if n not in used]
        for node_name in order:
            if self.put_member_on_node(member, node_name, attribute):
                if len(self.node_of) > len(self.deepest):
                    self.deepest = dict(self.node_of)
                if self._place(i + 1, candidates, attribute):
                    return True
                self.take_member_off_node()
        if self.stuck_at is None or i >= self.stuck_at:
            self.stuck_at = i
        return False

    def _alone_candidates(self, node_names: list[str], attribute) -> dict[tuple, list[str]]:
        """Per member shape: the nodes it fits on alone, best score first."""
        out: dict[tuple, list[str]] = {}
        for member in self.members:
            if member.shape in out:
                continue
            scored = []
            for order, name in enumerate(node_names):
                node = self.devices.nodes[name]
                if not member.admitted_by_allocated(node) or not self._node_fits([member], node):
                    continue
                if any(not _allocation_admits(o[1], node) for c in member.shared_claims
                       if (o := self.shared_owner.get(claim_key(c))) is not None):
                    continue
                placement = self._allocate(list(member.own_claims) + list(member.shared_claims), node)
                if placement is None or (attribute is not None and not _all_devices_have(placement, attribute)):
                    continue
                scored.append((placement.score, order, name))
            out[member.shape] = [name for _, _, name in sorted(scored)]
        return out

    def _allocate(self, claims: list[ResourceClaim], node: Node) -> NodePlacement | None:
        self.attempts[0] += 1
        if self.attempts[0] > self.budget.node_attempts or time.monotonic() > self.deadline:
            raise _BudgetExhausted()
        if not claims:
            return NodePlacement(node.metadata.name or "", [], [])
        if self.selector is not None:
            # The domain's devices only: the allocator chooses among them, rather than choosing
            # and being refused after.
            claims = [self._restricted(c) for c in claims]
        plans = [self._plan(c) for c in claims]
        outcome = self.devices.allocator.allocate(claims, node, self.policy, plans=plans, diagnose=False)
        return outcome if isinstance(outcome, NodePlacement) else None

    def _restricted(self, claim: ResourceClaim) -> ResourceClaim:
        key = claim_key(claim)
        copy = self.restricted.get(key)
        if copy is None:
            copy = self.restricted[key] = restricted_claim(claim, self.selector)
        return copy

    def _plan(self, claim: ResourceClaim) -> ClaimPlan:
        key = claim_key(claim)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self.devices.allocator.plan(claim)
        return plan

    def _node_fits(self, group: list[_Member], node: Node) -> bool:
        used, count = self.bound(node.metadata.name or "") if self.bound else ({}, 0)
        used = dict(used)
        for m in group[:-1]:
            for r, v in m.requests.items():
                used[r] = used.get(r, 0) + v
        newest = group[-1]
        if newest.spec.node_allowed is not None and not newest.spec.node_allowed(node):
            return False
        if newest.spec.pod is None or self.pod_fits is None:
            return True
        return self.pod_fits(newest.spec.pod, node, newest.requests, (used, count + len(group) - 1))

    def _hold(self, group: NodeGroupPlacement | None) -> None:
        if group is not None:
            self._hold_claims(list(zip(group.claims, group.allocations)))

    def _take_back(self, group: NodeGroupPlacement | None) -> None:
        if group is not None:
            self._take_back_claims(group.claims)

    def _hold_claims(self, allocated: list[tuple[ResourceClaim, AllocationResult]]) -> None:
        for c, a in allocated:
            self.devices.state.add_claim(claim_key(c), a)

    def _take_back_claims(self, claims: list[ResourceClaim]) -> None:
        for c in claims:
            self.devices.state.remove_claim(claim_key(c))


def _allocation_admits(allocation: AllocationResult, node: Node) -> bool:
    """A claim already allocated can be used on `node`: its node selector (if any) matches."""
    selector = allocation.node_selector
    if selector is None or not selector.node_selector_terms:
        return True
    labels = node.metadata.labels or {}
    name = node.metadata.name or ""
    return any(term_matches(t, labels, name, "allocation.nodeSelector") for t in selector.node_selector_terms)


def attribute_selector(name: str, value: tuple[str, object]) -> str:
    """CEL that admits only devices whose attribute `name` (fully qualified) has `value`; a device
    without it is not selected (a missing key would be a runtime error, which fails allocation)."""
    domain, _, ident = name.rpartition("/")
    kind, raw = value
    literal = {"string": json.dumps(raw), "int": str(raw), "bool": "true" if raw else "false"}.get(kind)
    if literal is None:  # a version
        attr = f"device.attributes[{json.dumps(domain)}][{json.dumps(ident)}]"
        return f"{json.dumps(ident)} in device.attributes[{json.dumps(domain)}] && {attr}.compareTo(semver({json.dumps(raw)})) == 0"
    attr = f"device.attributes[{json.dumps(domain)}][{json.dumps(ident)}]"
    return f"{json.dumps(ident)} in device.attributes[{json.dumps(domain)}] && {attr} == {literal}"


def restricted_claim(claim: ResourceClaim, selector: str) -> ResourceClaim:
    """A copy of the claim whose every request (and subrequest) also needs `selector`: what it is
    allocated is valid for the claim itself, whose selectors are a subset."""
    extra = DeviceSelector(cel=CELDeviceSelector(expression=selector))
    devices = claim.spec.devices
    if devices is None or not devices.requests:
        return claim
    requests = []
    for r in devices.requests:
        if r.exactly is not None:
            r = msgspec.structs.replace(r, exactly=msgspec.structs.replace(
                r.exactly, selectors=[*(r.exactly.selectors or []), extra]))
        if r.first_available:
            r = msgspec.structs.replace(r, first_available=[
                msgspec.structs.replace(sub, selectors=[*(sub.selectors or []), extra]) for sub in r.first_available])
        requests.append(r)
    spec = msgspec.structs.replace(claim.spec, devices=msgspec.structs.replace(devices, requests=requests))
    return msgspec.structs.replace(claim, spec=spec)


def _all_devices_have(placement: NodePlacement, attribute: tuple[str, object]) -> bool:
    name, value = attribute
    return all(c.record.attribute(name) == value for chosen in placement.chosen for c in chosen)


# --- domains -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Domain:
    label: str | None  # "rack=r1", "gpu.nvidia.com/cliqueId=a"; None: the whole cluster
    nodes: list[str]
    attribute: tuple[str, object] | None
    free: float  # free devices (milli), an upper bound


def gang_domains(cluster: DeviceAllocator, topology: GangTopology | None) -> list[_Domain]:
    """The domains to try, in order: tightest (fewest free devices) first, then the whole cluster
    when the topology is only preferred."""
    every = sorted(cluster.nodes)
    whole = _Domain(None, every, None, sum(cluster.device_free_milli(n) for n in every))
    if topology is None:
        return [whole]
    domains: list[_Domain] = []
    if topology.kind is DomainKind.NODE_LABEL:
        by_value: dict[str, list[str]] = {}
        for name in every:
            value = (cluster.nodes[name].metadata.labels or {}).get(topology.key)
            if value is not None:
                by_value.setdefault(value, []).append(name)
        for value, nodes in by_value.items():
            free = sum(cluster.device_free_milli(n) for n in nodes)
            domains.append(_Domain(f"{topology.key}={value}", nodes, None, free))
    else:
        by_attr: dict[object, tuple[set[str], float]] = {}
        for name in every:
            for pool in cluster.inventory.pools_for_node(cluster.nodes[name]):
                for record in pool.devices:
                    attr = record.attribute(topology.key)
                    if attr is None:
                        continue
                    nodes, free = by_attr.get(attr, (set(), 0.0))
                    nodes.add(name)
                    by_attr[attr] = (nodes, free + (0.0 if cluster.state.is_allocated(record.id) else 1000.0))
        for attr, (nodes, free) in by_attr.items():
            domains.append(_Domain(f"{topology.key}={attr[1]}", sorted(nodes), (topology.key, attr), free))
    domains.sort(key=lambda d: (d.free, d.label))
    if not topology.required:
        domains.append(whole)
    return domains


# --- entry points --------------------------------------------------------------------------------


def _members(gang: Gang) -> list[_Member]:
    if not gang.members:
        raise GangError(f"gang {gang.name}: no members")
    names = [m.name for m in gang.members]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise GangError(f"gang {gang.name}: member {twice[0]} is listed twice")
    def is_allocated(c: ResourceClaim) -> bool:
        return c.status is not None and c.status.allocation is not None

    refs: dict[str, int] = {}
    for m in gang.members:
        for key in {claim_key(c) for c in m.claims if not is_allocated(c)}:
            refs[key] = refs.get(key, 0) + 1
    out = []
    for m in gang.members:
        try:
            requests = pod_requests(m.pod) if m.pod is not None else {}
        except SpecError as exc:
            raise GangError(f"gang {gang.name}: member {m.name}: {exc}") from None
        allocated = [c.status.allocation for c in m.claims if is_allocated(c)]
        shape = (tuple(encode_json(c.spec) for c in m.claims if not is_allocated(c)),
                 tuple(claim_key(c) for c in m.claims if not is_allocated(c) and refs[claim_key(c)] > 1),
                 tuple(encode_json(a) for a in allocated),
                 encode_json(m.pod.spec) if m.pod is not None else b"", m.constraint_key)
        own = [c for c in m.claims if not is_allocated(c) and refs[claim_key(c)] == 1]
        shared = [c for c in m.claims if not is_allocated(c) and refs[claim_key(c)] > 1]
        out.append(_Member(0, m, shape, requests, own, shared, allocated))
    return out


def _largest_first(cluster: DeviceAllocator, members: list[_Member]) -> list[_Member]:
    """Members asking the most devices first (they have the fewest places to go); alike members
    next to each other, as the search's symmetry rule wants."""
    def devices(m: _Member) -> int:
        return sum(cluster.allocator.plan(c).min_devices for c in m.own_claims + m.shared_claims)  # bad claims fail here
    ordered = sorted(members, key=lambda m: (-devices(m), m.shape, m.spec.name))
    for i, m in enumerate(ordered):
        m.index = i
    return ordered


def place_gang(
    cluster: DeviceAllocator,
    gang: Gang,
    *,
    budget: SearchBudget = SearchBudget(),
    bound: BoundRequests | None = None,
    policy: ScoringPolicy | None = None,
    pod_fits: PodFits | None = None,
) -> GangPlacement | GangUnplaceable:
    """Every member of the gang placed, jointly, or the one reason it cannot be. The cluster's state
    is as before when this returns; `commit_gang` records a placement.

    Raises GangError for a gang that cannot be searched, AllocationError for a claim the allocator
    rejects (its message names the claim and field). A member with a pod needs `pod_fits`."""
    if pod_fits is None:
        with_pod = [m.name for m in gang.members if m.pod is not None]
        if with_pod:
            raise GangError(f"gang {gang.name}: member {with_pod[0]} has a pod, and nothing checks its node fit")
    policy = policy or cluster.policy
    members = _largest_first(cluster, _members(gang))
    demand = sum(cluster.allocator.plan(c).min_devices
                 for c in {claim_key(c): c for m in members for c in m.own_claims + m.shared_claims}.values())
    attempts = [0]
    deadline = time.monotonic() + budget.seconds
    exhausted = False
    best: _GangSearch | None = None
    too_small: list[_Domain] = []
    for domain in gang_domains(cluster, gang.topology):
        if domain.free < 1000.0 * demand:
            too_small.append(domain)  # fewer free devices than the gang asks: no search can fit it
            continue
        search = _GangSearch(cluster, members, policy, bound, budget, deadline, attempts, pod_fits)
        try:
            placed = search.run(domain.nodes, domain.attribute)
        except _BudgetExhausted:
            placed, exhausted = False, True
        except AllocationError:
            search.take_everything_back()
            raise
        if placed:
            groups = [search.groups[n] for n in sorted(search.groups)]
            nodes = {search.members[i].spec.name: n for i, n in search.node_of.items()}
            search.take_everything_back()
            return GangPlacement(gang.name, nodes, groups, domain.label, attempts[0])
        if best is None or len(search.deepest) > len(best.deepest):
            best = search
        search.take_everything_back()
        if exhausted:
            break
    return _explain(cluster, gang, members, best, policy, bound, exhausted, attempts[0], demand, too_small, pod_fits)


def commit_gang(cluster: DeviceAllocator, placement: GangPlacement) -> None:
    """Record a placement's allocations in the cluster (its caches learn of every node touched)."""
    for group in placement.groups:
        cluster.commit(group.claims, NodePlacement(group.node, group.allocations, []))


def release_gang(cluster: DeviceAllocator, placement: GangPlacement) -> None:
    """Undo `commit_gang`: every claim the placement allocated is free again."""
    for group in placement.groups:
        for claim in group.claims:
            cluster.release_claim(claim)


def _explain(cluster: DeviceAllocator, gang: Gang, members: list[_Member], best: _GangSearch | None,
             policy: ScoringPolicy, bound: BoundRequests | None, exhausted: bool, attempts: int,
             demand: int, too_small: list[_Domain], pod_fits: PodFits | None) -> GangUnplaceable:
    # Where each member fits alone, on the whole cluster's state as it is (the search took back
    # everything); budget-free, as it is one allocation per member shape and node.
    probe = _GangSearch(cluster, members, policy, bound, SearchBudget(node_attempts=1 << 62, seconds=1e9),
                        float("inf"), [0], pod_fits)
    alone = probe._alone_candidates(sorted(cluster.nodes), None)
    fits = {m.spec.name: tuple(alone[m.shape]) for m in members}
    nowhere = tuple(m.spec.name for m in members if not alone[m.shape])
    parts = [f"gang {gang.name}: {len(members)} members, placed none of them"]
    if nowhere:
        parts.append(f"{len(nowhere)} fit on no node even alone ({_names(nowhere)})")
    by_nodes: dict[tuple[str, ...], list[str]] = {}
    for m in members:
        if alone[m.shape]:
            by_nodes.setdefault(tuple(alone[m.shape]), []).append(m.spec.name)
    for nodes, names in by_nodes.items():
        parts.append(f"{_names(names)} fit alone on {len(nodes)} node(s) ({_names(nodes)})")
    if best is not None and best.deepest:
        placed = [f"{members[i].spec.name} on {n}" for i, n in sorted(best.deepest.items())]
        missing = [members[i].spec.name for i in range(len(members)) if i not in best.deepest]
        parts.append(f"together at most {len(best.deepest)} of {len(members)} fit ({_names(placed)}); "
                     f"then no room for {_names(missing)}")
    if too_small:
        shown = [f"{d.label or 'the cluster'} has {d.free / 1000:g}" for d in too_small]
        parts.append(f"the gang asks {demand} devices; too few free: {_names(shown, 3)}")
    if gang.topology is not None:
        parts.append(f"{'within one' if gang.topology.required else 'preferring one'} {gang.topology.kind.value} "
                     f"domain of {gang.topology.key}")
    if exhausted:
        parts.append(f"search budget exhausted after {attempts} node allocations")
    else:
        parts.append(f"searched {attempts} node allocations")
    return GangUnplaceable(gang.name, "; ".join(parts), fits, nowhere, exhausted, attempts)


def _names(items: Sequence[str], limit: int = 6) -> str:
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"

"""A gang placed from what a shard knows: the members' pods and claims through the gang core
(`draplane.allocation.gang`) on the shard's `SchedulingState`, answered as one `Placed` per member,
the form in which the shard reserves and publishes a pod's placement. Pure: no I/O.

The shard (draplane_allocator.shard) commits every member's `Placed` with one compare-and-set per
node (reservation_protocol.commit_gang) and publishes the placements only once all of them held,
taking back the ones written when one fails (abandon_gang); a crash between writes leaves
reservations without placements, which the binder never binds and whose leases lapse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence

import msgspec

from draplane.allocation.errors import AllocationError
from draplane.allocation.gang import Gang, GangError, GangMember, GangPlacement, GangUnplaceable, SearchBudget, place_gang
from draplane.component_helpers.errors import SpecError
from draplane.component_helpers.resource import pod_requests
from draplane.allocation.state import claim_key
from draplane.api.core import Node, Pod
from draplane.api.resource import ResourceClaim, ResourceClaimStatus
from draplane.scheduling import preemption
from draplane.scheduling.framework.plugins import volume_binding
from draplane.scheduling.gangs import GangSpec
from draplane.scheduling.framework.runtime import node_fit, volume_reasons
from draplane.scheduling.placing import SchedulingState, Placed


@dataclasses.dataclass(slots=True)
class GangPlaced:
    """Every member's placement (pod UID -> Placed), all of which must be committed together."""

    gang: str
    members: dict[str, Placed]
    placement: GangPlacement


def _as_allocated(state: SchedulingState, claim: ResourceClaim) -> ResourceClaim:
    """A claim reserved in the bucket but not yet written to Kubernetes counts as allocated."""
    if claim.status is not None and claim.status.allocation is not None:
        return claim
    reservation = state.reserved.get(claim.metadata.uid or "")
    if reservation is None:
        return claim
    return msgspec.structs.replace(claim, status=ResourceClaimStatus(allocation=reservation.allocation))


def _volumes_allow(volumes: volume_binding.PodVolumes | None) -> Callable[[Node], bool] | None:
    if volumes is None:
        return None
    return lambda node: not volume_reasons(volumes, node.metadata.name or "", node.metadata.labels or {})


def place_gang_members(
    state: SchedulingState,
    spec: GangSpec,
    members: Sequence[tuple[Pod, Sequence[ResourceClaim]]],
    *,
    budget: SearchBudget = SearchBudget(),
    gone: Collection[str] = (),
    volumes: Mapping[str, volume_binding.PodVolumes] | None = None,
) -> GangPlaced | GangUnplaceable:
    """All members placed on the shard's state, or the gang's one explanation. The state is as
    before when this returns. `gone`: uids of bound pods to count as evicted (their CPU and memory
    off their nodes; preemption frees their claims in the core itself). `volumes`: per member
    uid, what the binder's VolumeBinding PreFilter found (draplane.scheduling.framework.plugins.volume_binding). Raises GangError (and
    AllocationError) for a gang that cannot be searched, naming the member or claim."""
    gang_members = []
    by_key: dict[str, tuple[Pod, list[ResourceClaim]]] = {}
    for pod, claims in members:
        key = f"{pod.metadata.namespace or ''}/{pod.metadata.name or ''}"
        ready = [_as_allocated(state, c) for c in claims]
        by_key[key] = (pod, ready)
        pod_volumes = (volumes or {}).get(pod.metadata.uid or "")
        gang_members.append(GangMember(key, tuple(ready), pod, node_allowed=_volumes_allow(pod_volumes),
                                       constraint_key=msgspec.msgpack.encode(pod_volumes) if pod_volumes else b""))

    def bound(node: str):
        pods = state.pods_here(node)
        own = {p.metadata.uid for p, _ in members}
        used: dict[str, int] = {}
        count = 0
        for uid, requests in pods.items():
            if uid in own or uid in gone:
                continue  # a member placed before and retried counts once, as itself
            count += 1
            for resource, amount in requests.items():
                used[resource] = used.get(resource, 0) + amount
        return used, count

    outcome = place_gang(state.devices, Gang(spec.key, tuple(gang_members), spec.topology), budget=budget, bound=bound,
                         pod_fits=node_local_fits)
    if isinstance(outcome, GangUnplaceable):
        return outcome
    allocated = outcome.claims_allocated()
    placed: dict[str, Placed] = {}
    for key, node in outcome.nodes.items():
        pod, claims = by_key[key]
        allocations = {}
        new_claims = []
        for c in claims:
            uid = c.metadata.uid or ""
            if c.status is not None and c.status.allocation is not None:
                allocations[uid] = c.status.allocation
            else:
                allocations[uid] = allocated[claim_key(c)]
                new_claims.append(uid)
        try:
            requests = pod_requests(pod)
        except SpecError as exc:  # place_gang read them already; kept for a clear message
            raise GangError(f"gang {spec.key}: member {key}: {exc}") from None
        placed[pod.metadata.uid or ""] = Placed(node=node, allocations=allocations, new_claims=new_claims,
                                                requests=requests)
    return GangPlaced(spec.key, placed, outcome)


def gang_preemption_for(
    state: SchedulingState,
    spec: GangSpec,
    members: Sequence[tuple[Pod, Sequence[ResourceClaim]]],
    *,
    budget: SearchBudget = SearchBudget(),
    volumes: Mapping[str, volume_binding.PodVolumes] | None = None,
) -> preemption.GangPreemptionPlan | preemption.NoPreemption | None:
    """For a gang `place_gang_members` could not place: the lower-priority pods whose eviction
    lets all its members fit together (`preemption.plan_gang_preemption`), or why there are none.
    None when preemption has nothing to say: no pod anywhere has a lower priority, or a member's
    claim is allocated or reserved already (held by an earlier preemption, or on its way). The
    state is as before when this returns."""
    priority = min(preemption.pod_priority(pod) for pod, _ in members)
    if not any(p.priority < priority for pods in state.running.values() for p in pods.values()):
        return None
    for _, claims in members:
        for claim in claims:
            if (claim.metadata.uid or "") in state.reserved or (claim.status is not None
                                                                 and claim.status.allocation is not None):
                return None
    in_use = {f"{c.metadata.namespace}/{c.metadata.name}": c for c in state.claims.values()
              if c.status is not None and c.status.allocation is not None}
    released = preemption.ReleasedClaims(state.devices, in_use)
    # each trial is a whole-gang search: a tenth of a normal one's, the plan has a second in all
    trial_budget = SearchBudget(node_attempts=min(budget.node_attempts, 500), seconds=min(budget.seconds, 0.2))

    def try_place(gone: Sequence[preemption.RunningPod]) -> GangPlaced | None:
        released.restore_all()
        released.release_unused(gone)
        outcome = place_gang_members(state, spec, members, budget=trial_budget, gone={p.uid for p in gone},
                                     volumes=volumes)
        return outcome if isinstance(outcome, GangPlaced) else None

    try:
        return preemption.plan_gang_preemption(
            spec.key, [pod for pod, _ in members],
            running={node: list(pods.values()) for node, pods in state.running.items()},
            budgets=list(state.budgets.values()), try_place=try_place)
    finally:
        released.restore_all()


__all__ = ["AllocationError", "GangError", "GangPlaced", "gang_preemption_for", "place_gang_members"]


def node_local_fits(pod, node, requests, in_use) -> bool:
    """The framework's node-local filters, for the gang search (allocation.gang.PodFits)."""
    return node_fit(pod, node, requests=requests, in_use=in_use).fits

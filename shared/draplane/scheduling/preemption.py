"""DRA-aware preemption: which lower-priority pods to evict so that a pod that fits nowhere fits.

Pure: it reads the allocator core's `DeviceAllocator` and the pods bound to each node, and answers with a
plan (the node, the victims, the placement the preemptor gets once they are gone) or with why
preemption cannot help. The shell evicts, nominates and holds; nothing here writes.

kube-scheduler's rules (pkg/scheduler/framework/plugins/defaultpreemption and
framework/preemption), kept:
- a pod with `preemptionPolicy: Never` never preempts;
- only pods of strictly lower priority (`spec.priority`, 0 when unset) may be victims;
- a node whose failure no eviction can cure (node affinity, an untolerated taint, a cordon, the
  pod's required pod affinity, a missing topology label) is not a candidate: "Preemption is not
  helpful for scheduling.";
- a node refused for what its pods hold (a host port, required anti-affinity either way, a
  topology spread skew) is one: the filters are run again on the node with each trial set of
  victims gone, so a victim is evicted for the port or the anti-affinity it holds, and never
  when evicting it does not let the pod fit;
- on each candidate node every potential victim is removed first, and if the pod still does not
  fit the node is dropped: nobody is evicted for a pod that would not fit after eviction;
- then victims are given back one by one, most important first (higher priority, then the
  earlier start), those whose eviction would break a PodDisruptionBudget before the others, and
  each stays if the pod still fits without it;
- a PodDisruptionBudget with an empty selector protects nothing; a pod already in a budget's
  `status.disruptedPods` does not count against it again.

Where draplane differs, and why:
- the devices are part of the fit: the victims' claims are released in the core (only a claim
  whose every consumer is a victim frees its devices; a claim shared with a pod that stays keeps
  them), the preemptor's claims are searched on the node, and the claims are put back;
- candidate nodes are ranked by the fewest victims, then the lowest highest victim priority, then
  the lowest sum of priorities, then the least work lost (the victims' running seconds), then the
  node's order: kube-scheduler ranks priorities before the count, but evicting one priority-5 pod
  instead of eight priority-4 ones is the cheaper choice for the people running them;
- victims are evicted through the Eviction API, which refuses any eviction that would break a
  PodDisruptionBudget. So a node whose victims would break one is not chosen at all: another node
  is, or the pod stays pending with a reason naming the budget (kube-scheduler deletes the
  victims and only prefers nodes with fewer violations).

A gang (`plan_gang_preemption`) preempts as a whole: kube-scheduler 1.37 preempts for one pod at a
time only. Its priority is its lowest member's; with every lower-priority pod gone the whole gang
must fit together (else nobody is evicted), then victims are given back, first a node's worth at a
time (the nodes whose victims matter most first), then one by one as above, each staying evicted
only if the gang no longer fits without its eviction. The trials are bounded
(`GANG_PREEMPTION_TRIALS` joint placements, `GANG_PREEMPTION_SECONDS` in all); a search that
runs out evicts nobody, rather than more than it needs.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from draplane.allocation.allocator import NodePlacement
from draplane.allocation.device_allocator import DeviceAllocator
from draplane.allocation.errors import AllocationError, NodeFailure
from draplane.component_helpers.resource import pod_requests
from draplane.scheduling.framework.interface import HostPort
from draplane.scheduling.framework.plugins import node_ports
from draplane.scheduling.framework.runtime import NODE_LOCAL_UNRESOLVABLE, node_fit
from draplane.api.core import Pod
from draplane.api.policy import LabelSelectorError, PodDisruptionBudget, label_selector_matches, selector_is_empty
from draplane.api.resource import ResourceClaim

PREEMPT_NEVER = "Never"

# kube-scheduler's words, so that a user who knows its messages recognises them.
NOT_ELIGIBLE_NEVER = "not eligible due to preemptionPolicy=Never."
NOT_HELPFUL = "Preemption is not helpful for scheduling."
NO_VICTIMS = "No preemption victims found for incoming pod."


def pod_priority(pod: Pod) -> int:
    return pod.spec.priority or 0


def preemption_refusal(pod: Pod) -> str | None:
    """Why this pod may not preempt at all, or None when it may."""
    if pod.spec.preemption_policy == PREEMPT_NEVER:
        return NOT_ELIGIBLE_NEVER
    return None


def _timestamp(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return float(calendar.timegm(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class RunningPod:
    """A pod bound to a node, as preemption sees it."""

    namespace: str
    name: str
    uid: str
    node: str
    priority: int
    requests: Mapping[str, int]
    labels: Mapping[str, str] = field(default_factory=dict)
    claims: tuple[str, ...] = ()  # "namespace/name" of the claims it uses
    started: float | None = None  # seconds since the epoch (status.startTime), None if not started
    terminating: bool = False  # deletionTimestamp set: already on its way out, evicted or not
    grace_seconds: int = 30  # spec.terminationGracePeriodSeconds: how long an eviction may take

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @classmethod
    def from_pod(cls, pod: Pod, requests: dict[str, int] | None = None) -> RunningPod:
        """`requests`: pod_requests(pod), when the caller has it already."""
        namespace = pod.metadata.namespace or "default"
        claims = []
        for status in (pod.status.resource_claim_statuses if pod.status else None) or ():
            if status.resource_claim_name:
                claims.append(f"{namespace}/{status.resource_claim_name}")
        for reference in pod.spec.resource_claims or ():
            if reference.resource_claim_name:
                claims.append(f"{namespace}/{reference.resource_claim_name}")
        return cls(
            namespace=namespace, name=pod.metadata.name or "", uid=pod.metadata.uid or "",
            node=pod.spec.node_name or "", priority=pod_priority(pod),
            requests=pod_requests(pod) if requests is None else requests,
            labels=dict(pod.metadata.labels or {}), claims=tuple(dict.fromkeys(claims)),
            started=_timestamp(pod.status.start_time if pod.status else None),
            terminating=pod.metadata.deletion_timestamp is not None,
            grace_seconds=30 if pod.spec.termination_grace_period_seconds is None
            else pod.spec.termination_grace_period_seconds,
        )


def _more_important_first(pod: RunningPod) -> tuple:
    # kube-scheduler's MoreImportantPod: higher priority, then the one that started earlier.
    return (-pod.priority, pod.started if pod.started is not None else float("inf"), pod.key)


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    preemptor: str  # "namespace/name"
    priority: int
    node: str
    victims: tuple[RunningPod, ...]
    placement: NodePlacement  # what the preemptor gets once the victims are gone

    def explain(self) -> str:
        names = ", ".join(f"{v.key} (priority {v.priority})" for v in self.victims)
        return (f"preempting {len(self.victims)} pod(s) on node {self.node} for {self.preemptor} "
                f"(priority {self.priority}): {names}; with them gone its claims and requests fit there")


@dataclass(frozen=True, slots=True)
class AwaitingVictims:
    """The pod will fit on `node` once pods already terminating there are gone (evicted by an
    earlier preemption, say): evicting more now would take more than it needs, so it waits, as
    kube-scheduler's "a terminating pod on the nominated node" rule makes it wait."""

    preemptor: str
    node: str
    terminating: tuple[str, ...]
    placement: NodePlacement | None = None  # what the preemptor gets once they are gone
    going: tuple[RunningPod, ...] = ()

    def explain(self) -> str:
        return (f"waiting for {len(self.terminating)} terminating pod(s) on node {self.node} "
                f"({', '.join(self.terminating)}) to free what {self.preemptor} needs")


@dataclass(frozen=True, slots=True)
class NoPreemption:
    preemptor: str
    reason: str  # one line, kube-scheduler's shape: "preemption: 0/N nodes are available: ..."
    per_node: Mapping[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Budgets:
    """Disruptions still allowed per budget while victims are chosen on one node."""

    budgets: Sequence[PodDisruptionBudget]
    allowed: list[int]

    @classmethod
    def of(cls, budgets: Sequence[PodDisruptionBudget]) -> _Budgets:
        return cls(budgets, [(b.status.disruptions_allowed if b.status else 0) for b in budgets])

    def violated_by(self, pod: RunningPod) -> list[str]:
        """Counts the pod's eviction against each budget that covers it; the budgets it breaks."""
        broken = []
        for i, budget in enumerate(self.budgets):
            if (budget.metadata.namespace or "default") != pod.namespace or selector_is_empty(budget.spec.selector):
                continue
            name = f"{budget.metadata.namespace}/{budget.metadata.name}"
            try:
                covers = label_selector_matches(budget.spec.selector, pod.labels, f"poddisruptionbudget {name}: spec.selector")
            except LabelSelectorError:
                continue  # the apiserver validates selectors; one it let through protects nothing we can read
            if not covers:
                continue
            if pod.name in ((budget.status.disrupted_pods if budget.status else None) or {}):
                continue
            self.allowed[i] -= 1
            if self.allowed[i] < 0:
                broken.append(name)
        return broken


@dataclass(slots=True)
class _NodeOutcome:
    victims: list[RunningPod]
    placement: NodePlacement
    broken_budgets: list[str]

    def rank(self, order: int, now: float) -> tuple:
        priorities = [v.priority for v in self.victims]
        lost = sum(max(0.0, now - v.started) for v in self.victims if v.started is not None)
        return (len(self.victims), max(priorities, default=0), sum(priorities), lost, order)


class ReleasedClaims:
    """The victims' claims taken out of the core while one node is tried, and put back after.

    A claim frees its devices only when every consumer in its status.reservedFor is a victim."""

    def __init__(self, cluster: DeviceAllocator, claims_in_use: Mapping[str, ResourceClaim]):
        self.devices = cluster
        self.claims_in_use = claims_in_use
        self.released: dict[str, ResourceClaim] = {}

    def _consumers(self, key: str) -> set[str]:
        claim = self.claims_in_use[key]
        return {r.uid for r in ((claim.status.reserved_for if claim.status else None) or ())}

    def release_unused(self, victims: Iterable[RunningPod]) -> None:
        """Release every claim all of whose consumers are among the victims."""
        victim_uids = {v.uid for v in victims}
        for victim in victims:
            for key in victim.claims:
                if key in self.released or key not in self.claims_in_use:
                    continue
                if self._consumers(key) <= victim_uids:
                    self.devices.release_claim(key)
                    self.released[key] = self.claims_in_use[key]

    def restore_used(self, victims: Iterable[RunningPod]) -> None:
        """Put back every released claim that some pod outside the victims uses again."""
        victim_uids = {v.uid for v in victims}
        for key in list(self.released):
            if not self._consumers(key) <= victim_uids:
                self.devices.add_allocated_claim(self.released.pop(key))

    def restore_all(self) -> None:
        for claim in self.released.values():
            self.devices.add_allocated_claim(claim)
        self.released.clear()


def plan_preemption(
    cluster: DeviceAllocator,
    pod: Pod,
    claims: Sequence[ResourceClaim],
    *,
    running: Mapping[str, Sequence[RunningPod]],
    claims_in_use: Mapping[str, ResourceClaim],
    budgets: Sequence[PodDisruptionBudget] = (),
    in_use: Callable[[str], tuple[Mapping[str, int], int]] | None = None,
    ports_in_use: Callable[[str], Sequence[HostPort]] | None = None,
    blocked: Callable[[str], bool] | None = None,
    now: float | None = None,
    refused_without: Callable[[str, frozenset[str]], str | None] | None = None,
) -> PreemptionPlan | AwaitingVictims | NoPreemption:
    """The cheapest set of lower-priority victims on one node whose eviction lets `pod` and its
    (unallocated) `claims` fit there, or why there is none.

    `running`: node -> the pods bound there. `claims_in_use`: "namespace/name" -> allocated claim,
    for the claims those pods use. `in_use(node)`: the summed requests and count of every pod bound
    to the node (defaults to summing `running`); `ports_in_use(node)`: the host ports held there;
    `blocked(node)`: a node that a filter rejects whatever is evicted (UnschedulableAndUnresolvable
    in kube-scheduler). `refused_without(node, uids)`: why the filters that read other pods (host
    ports, InterPodAffinity, PodTopologySpread) refuse the node with the pods of those uids gone,
    None when none does; without it a host port held on a node rules the node out. The cluster's
    state is the same afterwards."""
    key = f"{pod.metadata.namespace or 'default'}/{pod.metadata.name}"
    refusal = preemption_refusal(pod)
    if refusal:
        return NoPreemption(key, f"preemption: {refusal}")
    now = time.time() if now is None else now
    priority = pod_priority(pod)
    requests = pod_requests(pod)
    awaiting = _fits_once_terminating_pods_go(cluster, pod, claims, running, claims_in_use, requests, in_use,
                                              priority, refused_without)
    if awaiting is not None:
        node, pods, placement = awaiting
        return AwaitingVictims(key, node, tuple(p.key for p in pods), placement, tuple(pods))
    outcomes: dict[str, _NodeOutcome] = {}
    per_node: dict[str, str] = {}
    for order, name in enumerate(sorted(cluster.nodes)):
        node = cluster.nodes[name]
        bound = list(running.get(name, ()))
        used, count = in_use(name) if in_use else _summed(bound)
        # Reasons no eviction cures end the node's chances at once.
        # Without refused_without a host port held there counts as such: evicting its holder is
        # left undone. With it, the port's holder is a victim like any other (NodePorts' refusal is
        # Unschedulable, not UnschedulableAndUnresolvable, in kube-scheduler).
        ports = ports_in_use(name) if ports_in_use and refused_without is None else None
        blocking = [plugin for plugin in node_fit(pod, node, requests=requests, in_use=({}, 0),
                                                  ports_in_use=ports).plugins
                    if plugin in NODE_LOCAL_UNRESOLVABLE or plugin == node_ports.NAME]
        if blocking or (blocked is not None and blocked(name)):
            per_node[name] = NOT_HELPFUL
            continue
        # A terminating pod is no victim: it is going anyway (counted as gone), and evicting it
        # again frees nothing.
        going = [p for p in bound if p.terminating]
        candidates = sorted((p for p in bound if p.priority < priority and not p.terminating),
                            key=_more_important_first)
        if not candidates:
            per_node[name] = NO_VICTIMS
            continue
        outcome = _victims_on_node(cluster, pod, claims, name, candidates, budgets, requests, used, count,
                                   claims_in_use, going=going, refused_without=refused_without)
        if isinstance(outcome, str):
            per_node[name] = outcome
        elif outcome.broken_budgets:
            per_node[name] = ("evicting " + ", ".join(v.key for v in outcome.victims) + " would violate "
                              + ", ".join(f"PodDisruptionBudget {b}" for b in sorted(set(outcome.broken_budgets))))
        else:
            outcomes[name] = outcome
            per_node[name] = "preemption would make room"
    if not outcomes:
        return NoPreemption(key, _summary(per_node, len(cluster.nodes)), per_node)
    order = {name: i for i, name in enumerate(sorted(cluster.nodes))}
    best = min(outcomes, key=lambda n: outcomes[n].rank(order[n], now))
    chosen = outcomes[best]
    return PreemptionPlan(key, priority, best, tuple(sorted(chosen.victims, key=_more_important_first)),
                          chosen.placement)


def _fits_once_terminating_pods_go(cluster, pod, claims, running, claims_in_use, requests, in_use, priority,
                                   refused_without=None):
    """The first node where the pod fits with only its lower-priority terminating pods gone."""
    for name in sorted(cluster.nodes):
        going = [p for p in running.get(name, ()) if p.terminating and p.priority < priority]
        if not going:
            continue
        used, count = in_use(name) if in_use else _summed(running.get(name, ()))
        outcome = _victims_on_node(cluster, pod, claims, name, going, (), requests, used, count, claims_in_use,
                                   reprieve=False, refused_without=refused_without)
        if not isinstance(outcome, str):
            return name, going, outcome.placement
    return None


def _summed(pods: Iterable[RunningPod]) -> tuple[dict[str, int], int]:
    total: dict[str, int] = {}
    count = 0
    for p in pods:
        count += 1
        for resource, amount in p.requests.items():
            total[resource] = total.get(resource, 0) + amount
    return total, count


def _victims_on_node(cluster, pod, claims, name, candidates, budgets, requests, used, count,
                     claims_in_use, *, reprieve: bool = True, going: Sequence[RunningPod] = (),
                     refused_without: Callable[[str, frozenset[str]], str | None] | None = None) -> _NodeOutcome | str:
    """kube-scheduler's SelectVictimsOnNode with devices: remove every candidate, check the pod
    fits, give victims back most important first (budget-breaking ones before the rest). `going`
    (terminating pods) count as gone throughout and are never victims. The filters that read
    other pods are asked again for each trial set (`refused_without`), as kube-scheduler runs its
    filters on the node with the victims removed."""
    node = cluster.nodes[name]
    released = ReleasedClaims(cluster, claims_in_use)
    evicted: list[RunningPod] = list(candidates)

    def fits() -> NodePlacement | str:
        freed_requests, freed = _summed([*going, *evicted])
        remaining = {r: used.get(r, 0) - freed_requests.get(r, 0) for r in used}
        fit = node_fit(pod, node, requests=requests, in_use=(remaining, count - freed))
        if not fit.fits:
            return ", ".join(fit.reasons)
        if refused_without is not None:
            why = refused_without(name, frozenset(p.uid for p in (*going, *evicted)))
            if why is not None:
                return why
        try:
            outcome = cluster.allocate_on_node(claims, name)
        except AllocationError as exc:
            return exc.message
        if isinstance(outcome, NodeFailure):
            return outcome.message
        return outcome

    try:
        released.release_unused([*going, *evicted])
        first = fits()
        if isinstance(first, str):
            return first  # would not fit even with every lower-priority pod gone
        if not reprieve:
            return _NodeOutcome(evicted, first, [])
        ledger = _Budgets.of(budgets)
        breaking = [(p, ledger.violated_by(p)) for p in candidates]
        order = [item for item in breaking if item[1]] + [item for item in breaking if not item[1]]
        broken: list[str] = []
        for victim, would_break in order:
            evicted.remove(victim)
            released.restore_used([*going, *evicted])
            outcome = fits()
            if isinstance(outcome, str):  # needed after all: evict it
                evicted.append(victim)
                released.release_unused([*going, *evicted])
                broken.extend(would_break)
        # The placement must be the one for the final victim set.
        final = fits()
        if isinstance(final, str):  # cannot happen: the last check above had this set
            return final
        return _NodeOutcome(evicted, final, broken)
    finally:
        released.restore_all()


def _summary(per_node: Mapping[str, str], total: int) -> str:
    counts: dict[str, int] = {}
    for reason in per_node.values():
        counts[reason] = counts.get(reason, 0) + 1
    parts = sorted(f"{n} {reason.rstrip('.')}" for reason, n in counts.items())
    return f"preemption: 0/{total} nodes are available: " + ", ".join(parts) + "."


# --- gangs -------------------------------------------------------------------------------------------

# Joint placements tried while a gang's victims are given back; each is a whole-gang search.
GANG_PREEMPTION_TRIALS = 200
# ... and the wall time they may take in all: the search runs on the shard's event loop (the
# review measured 8.8 s for 200 trials on 210 nodes before these bounds).
GANG_PREEMPTION_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class GangPreemptionPlan:
    gang: str  # the PodGroup's namespace/name
    priority: int
    victims: tuple[RunningPod, ...]
    placement: object  # what the gang's search returned with the victims gone (GangPlaced)

    def victims_on(self, node: str) -> tuple[RunningPod, ...]:
        return tuple(v for v in self.victims if v.node == node)

    def explain(self) -> str:
        nodes = sorted({v.node for v in self.victims})
        names = ", ".join(f"{v.key} (priority {v.priority})" for v in self.victims[:8])
        if len(self.victims) > 8:
            names += f" and {len(self.victims) - 8} more"
        return (f"preempting {len(self.victims)} pod(s) on {len(nodes)} node(s) ({', '.join(nodes)}) for gang "
                f"{self.gang} (priority {self.priority}): {names}; with them gone all its members fit together")


def plan_gang_preemption(
    gang: str,
    members: Sequence[Pod],
    *,
    running: Mapping[str, Sequence[RunningPod]],
    budgets: Sequence[PodDisruptionBudget] = (),
    try_place: Callable[[Sequence[RunningPod]], object | None],
    trials: int = GANG_PREEMPTION_TRIALS,
    seconds: float = GANG_PREEMPTION_SECONDS,
) -> GangPreemptionPlan | NoPreemption:
    """The victims whose eviction lets every member of `gang` fit together, or why there are none.

    `try_place(gone)`: the gang's joint placement with the pods `gone` evicted (their claims
    freed, their requests off their nodes), or None when it does not fit so; the caller leaves its
    state as it was after each call."""
    for member in members:
        if preemption_refusal(member):
            key = f"{member.metadata.namespace or 'default'}/{member.metadata.name}"
            return NoPreemption(gang, f"preemption: member {key} is {NOT_ELIGIBLE_NEVER}")
    priority = min(pod_priority(m) for m in members)
    own = {m.metadata.uid for m in members}
    bound = [p for pods in running.values() for p in pods if p.uid not in own and p.priority < priority]
    # terminating pods are going anyway: counted as gone, never victims
    going = [p for p in bound if p.terminating]
    evicted = sorted((p for p in bound if not p.terminating), key=_more_important_first)
    if not evicted:
        return NoPreemption(gang, f"preemption: {NO_VICTIMS}")
    by_node: dict[str, list[RunningPod]] = {}
    for p in evicted:
        by_node.setdefault(p.node, []).append(p)
    if len(by_node) + 1 > trials:
        # giving back one node per trial could not finish: say so before any search is spent
        return NoPreemption(gang, f"preemption: lower-priority pods run on {len(by_node)} nodes, more than the "
                                  f"{trials} joint placements the search may try: nobody is evicted")
    deadline = time.monotonic() + seconds
    best = try_place([*going, *evicted])
    used = 1
    if best is None:
        return NoPreemption(gang, f"preemption: the gang does not fit together even with all {len(evicted)} "
                                  f"lower-priority pods gone. {NOT_HELPFUL}")
    # whole nodes given back first: the nodes whose most important victim matters most first
    node_order = sorted(by_node, key=lambda n: (_more_important_first(by_node[n][0]), n))
    ledger = _Budgets.of(budgets)
    breaking = {p.uid: bool(ledger.violated_by(p)) for p in evicted}
    one_by_one = sorted(evicted, key=lambda p: (not breaking[p.uid], _more_important_first(p)))
    out_of_trials = NoPreemption(gang, f"preemption: gave up choosing victims at the search budget ({trials} joint "
                                       f"placements or {seconds:g} s): nobody is evicted rather than more than needed")
    for node in node_order:
        if used >= trials or time.monotonic() > deadline:
            return out_of_trials
        used += 1
        trial = [p for p in evicted if p.node != node]
        placed = try_place([*going, *trial])
        if placed is not None:
            evicted, best = trial, placed
    for victim in one_by_one:
        if victim not in evicted:
            continue  # its node's victims were all given back
        if used >= trials or time.monotonic() > deadline:
            return out_of_trials
        used += 1
        trial = [p for p in evicted if p is not victim]
        placed = try_place([*going, *trial])
        if placed is not None:
            evicted, best = trial, placed
    final = _Budgets.of(budgets)
    broken = sorted({b for p in evicted for b in final.violated_by(p)})
    if broken:
        return NoPreemption(gang, "preemption: evicting " + ", ".join(v.key for v in evicted) + " would violate "
                            + ", ".join(f"PodDisruptionBudget {b}" for b in broken))
    return GangPreemptionPlan(gang, priority, tuple(sorted(evicted, key=_more_important_first)), best)

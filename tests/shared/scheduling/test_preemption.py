"""Preemption's pure core: who is evicted, where, and when nobody is."""

from __future__ import annotations

import pytest

from draplane.allocation import DeviceAllocator, NodePlacement
from draplane.api.meta import ObjectMeta
from draplane.api.policy import LabelSelector, PodDisruptionBudget, PodDisruptionBudgetSpec, PodDisruptionBudgetStatus
from draplane.api.resource import ResourceClaimConsumerReference, ResourceClaimStatus
from draplane.simulation import scenario
from draplane.scheduling.preemption import (
    NO_VICTIMS,
    NOT_ELIGIBLE_NEVER,
    NOT_HELPFUL,
    NoPreemption,
    PreemptionPlan,
    RunningPod,
    plan_preemption,
)

NOW = 1_000_000.0


class Fleet:
    """Nodes of 8 GPUs, each GPU held by a running one-GPU pod of the given priority."""

    def __init__(self, nodes: int = 3, gpus: int = 8, cpu: str = "64"):
        self.devices = DeviceAllocator(classes=[scenario.device_class("gpu.nvidia.com")], policy="first-fit")
        for i in range(nodes):
            name = f"node-{i}"
            self.devices.set_node(scenario.gpu_node(name, cpu=cpu, labels={"rack": f"r{i % 2}"}))
            self.devices.apply_slice(scenario.gpu_slice(name, gpus, "80Gi"))
        self.running: dict[str, list[RunningPod]] = {}
        self.claims = {}

    def run(self, node: str, name: str, *, priority: int = 0, gpus: int = 1, cpu: int = 1000,
            started: float = NOW - 3600, labels: dict | None = None, shared_with: RunningPod | None = None) -> RunningPod:
        uid = f"uid-{name}"
        if shared_with is not None:
            key = shared_with.claims[0]
            claim = self.claims[key]
            claim.status.reserved_for.append(ResourceClaimConsumerReference(resource="pods", name=name, uid=uid))
        else:
            claim = scenario.claim("ns", f"claim-{name}", "gpu.nvidia.com", count=gpus)
            claim.metadata.uid = f"cuid-{name}"
            placement = self.devices.allocate_on_node([claim], node)
            assert isinstance(placement, NodePlacement), placement
            claim.status = ResourceClaimStatus(
                allocation=placement.allocations[0],
                reserved_for=[ResourceClaimConsumerReference(resource="pods", name=name, uid=uid)])
            self.devices.add_allocated_claim(claim)
            key = f"ns/claim-{name}"
            self.claims[key] = claim
        pod = RunningPod(namespace="ns", name=name, uid=uid, node=node, priority=priority,
                         requests={"cpu": cpu}, labels=labels or {}, claims=(key,), started=started)
        self.running.setdefault(node, []).append(pod)
        return pod

    def fill(self, *, priority: int = 0, started_by_node: dict[str, float] | None = None, labels=None) -> None:
        for node in sorted(self.devices.nodes):
            for g in range(8):
                self.run(node, f"{node}-p{g}", priority=priority,
                         started=(started_by_node or {}).get(node, NOW - 3600), labels=labels)

    def plan(self, pod, claims, budgets=()):
        return plan_preemption(self.devices, pod, claims, running=self.running, claims_in_use=self.claims,
                               budgets=budgets, now=NOW)


def preemptor(gpus: int = 8, priority: int = 1000, cpu: str | None = None, policy: str | None = None):
    pod = scenario.pod("ns", "big", claim_name="big-claim", cpu=cpu)
    pod.metadata.uid = "uid-big"
    pod.spec.priority = priority
    pod.spec.preemption_policy = policy
    claim = scenario.claim("ns", "big-claim", "gpu.nvidia.com", count=gpus)
    claim.metadata.uid = "cuid-big"
    return pod, [claim]


def budget(name: str, labels: dict, allowed: int) -> PodDisruptionBudget:
    return PodDisruptionBudget(
        metadata=ObjectMeta(namespace="ns", name=name),
        spec=PodDisruptionBudgetSpec(selector=LabelSelector(match_labels=labels)),
        status=PodDisruptionBudgetStatus(disruptions_allowed=allowed))


def test_an_eight_gpu_pod_on_a_full_cluster_evicts_exactly_one_nodes_pods():
    fleet = Fleet()
    # node-1's pods started last: evicting them loses the least work.
    fleet.fill(started_by_node={"node-1": NOW - 60})
    pod, claims = preemptor()
    assert not isinstance(fleet.devices.allocate(claims), NodePlacement)  # full
    plan = fleet.plan(pod, claims)
    assert isinstance(plan, PreemptionPlan)
    assert plan.node == "node-1"
    assert sorted(v.name for v in plan.victims) == [f"node-1-p{g}" for g in range(8)]
    assert plan.placement.node == "node-1" and len(plan.placement.allocations[0].devices.results) == 8
    assert "preempting 8 pod(s) on node node-1 for ns/big (priority 1000)" in plan.explain()
    # The core's state is as it was: the cluster is still full.
    assert not isinstance(fleet.devices.allocate(claims), NodePlacement)


def test_only_as_many_victims_as_needed_and_the_fewest_win():
    fleet = Fleet(nodes=2)
    for g in range(6):  # node-0: 6 of 8 GPUs in use
        fleet.run("node-0", f"a{g}")
    for g in range(8):
        fleet.run("node-1", f"b{g}")
    pod, claims = preemptor(gpus=4)
    plan = fleet.plan(pod, claims)
    assert plan.node == "node-0" and len(plan.victims) == 2


def test_lower_priority_victims_are_preferred_when_counts_tie():
    fleet = Fleet(nodes=2)
    for node, priority in (("node-0", 50), ("node-1", 10)):
        for g in range(8):
            fleet.run(node, f"{node}-{g}", priority=priority)
    plan = fleet.plan(*preemptor(gpus=1))
    assert plan.node == "node-1" and [v.priority for v in plan.victims] == [10]


def test_the_least_important_pods_go_first_on_a_node():
    fleet = Fleet(nodes=1)
    for g in range(8):
        fleet.run("node-0", f"p{g}", priority=g * 10)
    plan = fleet.plan(*preemptor(gpus=3))
    assert sorted(v.priority for v in plan.victims) == [0, 10, 20]


def test_equal_or_higher_priority_pods_are_never_victims():
    fleet = Fleet(nodes=2)
    fleet.fill(priority=1000)
    outcome = fleet.plan(*preemptor())
    assert isinstance(outcome, NoPreemption)
    assert outcome.reason == f"preemption: 0/2 nodes are available: 2 {NO_VICTIMS.rstrip('.')}."


def test_preemption_policy_never_waits():
    fleet = Fleet()
    fleet.fill()
    outcome = fleet.plan(*preemptor(policy="Never"))
    assert isinstance(outcome, NoPreemption) and outcome.reason == f"preemption: {NOT_ELIGIBLE_NEVER}"


def test_nobody_is_evicted_for_a_pod_that_would_not_fit_after_eviction():
    fleet = Fleet(nodes=2)
    fleet.fill()
    outcome = fleet.plan(*preemptor(gpus=9))
    assert isinstance(outcome, NoPreemption)
    assert outcome.reason.startswith("preemption: 0/2 nodes are available: 2 ")
    assert set(outcome.per_node.values()) == {next(iter(outcome.per_node.values()))}


def test_a_budget_moves_the_choice_to_another_node():
    fleet = Fleet(nodes=2)
    fleet.fill(started_by_node={"node-0": NOW - 60})  # node-0 would lose the least work
    for pod in fleet.running["node-0"]:
        object.__setattr__(pod, "labels", {"app": "train"})
    plan = fleet.plan(*preemptor(), budgets=[budget("train", {"app": "train"}, 0)])
    assert isinstance(plan, PreemptionPlan) and plan.node == "node-1"


def test_a_budget_that_protects_every_node_leaves_the_pod_pending_with_its_name():
    fleet = Fleet(nodes=2)
    fleet.fill(labels={"app": "train"})
    outcome = fleet.plan(*preemptor(), budgets=[budget("train", {"app": "train"}, 3)])
    assert isinstance(outcome, NoPreemption)
    assert "would violate PodDisruptionBudget ns/train" in outcome.reason
    # Three disruptions were allowed: a pod needing three GPUs may preempt.
    plan = fleet.plan(*preemptor(gpus=3), budgets=[budget("train", {"app": "train"}, 3)])
    assert isinstance(plan, PreemptionPlan) and len(plan.victims) == 3


def test_a_budget_with_an_empty_selector_protects_nothing():
    fleet = Fleet(nodes=1)
    fleet.fill()
    empty = budget("all", {}, 0)
    assert isinstance(fleet.plan(*preemptor(), budgets=[empty]), PreemptionPlan)


def test_a_claim_shared_with_a_pod_that_stays_keeps_its_device():
    fleet = Fleet(nodes=1)
    low = fleet.run("node-0", "low", priority=0)
    fleet.run("node-0", "high-sharer", priority=2000, shared_with=low)
    for g in range(7):
        fleet.run("node-0", f"p{g}", priority=0)
    # Evicting "low" frees nothing: its claim stays reserved for the priority-2000 pod.
    outcome = fleet.plan(*preemptor(gpus=8))
    assert isinstance(outcome, NoPreemption)
    plan = fleet.plan(*preemptor(gpus=7))
    assert isinstance(plan, PreemptionPlan) and "low" not in {v.name for v in plan.victims}


def test_cpu_counts_too():
    fleet = Fleet(nodes=1, cpu="8")
    for g in range(4):
        fleet.run("node-0", f"p{g}", cpu=2000)  # all 8 CPUs in use, 4 GPUs free
    plan = fleet.plan(*preemptor(gpus=1, cpu="3"))
    assert isinstance(plan, PreemptionPlan) and len(plan.victims) == 2


def test_nodes_the_pod_cannot_use_are_not_helped_by_preemption():
    fleet = Fleet(nodes=2)
    fleet.fill()
    pod, claims = preemptor()
    pod.spec.node_selector = {"rack": "r1"}
    plan = fleet.plan(pod, claims)
    assert isinstance(plan, PreemptionPlan) and plan.node == "node-1"
    pod.spec.node_selector = {"rack": "nowhere"}
    outcome = fleet.plan(pod, claims)
    assert outcome.reason == f"preemption: 0/2 nodes are available: 2 {NOT_HELPFUL.rstrip('.')}."


@pytest.mark.parametrize("start", ["2026-12-01T10:00:00Z", None, "garbage"])
def test_running_pod_from_a_pod_object(start):
    pod = scenario.pod("ns", "p", claim_name="c", cpu="2")
    pod.metadata.uid = "u"
    pod.spec.node_name = "node-0"
    pod.spec.priority = 7
    from draplane.api.core import PodStatus
    pod.status = PodStatus(start_time=start)
    running = RunningPod.from_pod(pod)
    assert running.priority == 7 and running.requests == {"cpu": 2000} and running.claims == ("ns/c",)
    assert (running.started is not None) == (start == "2026-12-01T10:00:00Z")


def test_a_pod_that_fits_once_terminating_pods_are_gone_waits_for_them():
    from draplane.scheduling.preemption import AwaitingVictims
    fleet = Fleet(nodes=2)
    fleet.fill()
    for i, victim in enumerate(fleet.running["node-1"]):
        fleet.running["node-1"][i] = RunningPod(**{**{f: getattr(victim, f) for f in victim.__slots__},
                                                   "terminating": True})
    outcome = fleet.plan(*preemptor())
    assert isinstance(outcome, AwaitingVictims) and outcome.node == "node-1" and len(outcome.terminating) == 8
    # Terminating pods are not victims a second time: with only four of them, four more are evicted.
    fleet = Fleet(nodes=1)
    fleet.fill()
    for i in range(4):
        victim = fleet.running["node-0"][i]
        fleet.running["node-0"][i] = RunningPod(**{**{f: getattr(victim, f) for f in victim.__slots__},
                                                   "terminating": True})
    plan = fleet.plan(*preemptor())
    assert isinstance(plan, PreemptionPlan) and len(plan.victims) == 4
    assert not any(v.terminating for v in plan.victims)


# --- the hold: what a preemption frees stays the preemptor's ---------------------------------------


def _shard_state_with_full_node():
    """A shard's SchedulingState: one 8-GPU node, each GPU allocated to a bound priority-0 pod."""
    import time as _time

    from draplane.scheduling.placing import SchedulingState, Placed

    state = SchedulingState()
    state.set_class(scenario.device_class("gpu.nvidia.com"))
    state.set_node(scenario.gpu_node("node-0"))
    state.set_feed_entry("node.node-0", [scenario.gpu_slice("node-0", 8, "80Gi")])
    victims = []
    for g in range(8):
        claim = scenario.claim("ns", f"c{g}", "gpu.nvidia.com")
        claim.metadata.uid = f"cuid-{g}"
        pod = scenario.pod("ns", f"low-{g}", claim_name=f"c{g}")
        pod.metadata.uid = f"puid-{g}"
        placed = state.place_pod(pod, [claim])
        assert isinstance(placed, Placed)
        claim.status = ResourceClaimStatus(allocation=placed.allocations[claim.metadata.uid], reserved_for=[
            ResourceClaimConsumerReference(resource="pods", name=pod.metadata.name, uid=pod.metadata.uid)])
        state.set_claim(claim)
        pod.spec.node_name = "node-0"
        state.set_pod(pod)
        victims.append((pod, claim))
    big = scenario.pod("ns", "big", claim_name="big-claim")
    big.metadata.uid = "puid-big"
    big.spec.priority = 1000
    big_claim = scenario.claim("ns", "big-claim", "gpu.nvidia.com", count=8)
    big_claim.metadata.uid = "cuid-big"
    return state, victims, big, big_claim, _time.time()


def _hold(state, plan, pod, claim, victims, now):
    from draplane.scheduling import reservation_protocol as protocol
    from draplane.scheduling import reservations as rv

    allocation = plan.placement.allocations[0]
    reservation = rv.Reservation(claim_uid=claim.metadata.uid, claim_namespace="ns", claim_name=claim.metadata.name,
                                 pod_uid=pod.metadata.uid, devices=rv.devices_of(allocation), allocation=allocation,
                                 reserved_at=now, expires_at=now + 90, shard=0)
    pod_reservation = rv.PodReservation(pod_uid=pod.metadata.uid, pod_namespace="ns", pod_name=pod.metadata.name,
                                        requests={}, reserved_at=now, expires_at=now + 90, shard=0)
    entry = rv.NodeReservations(node=plan.node)
    step = protocol.nominate(entry, [reservation], pod_reservation, victims, now, state.claim_is_allocated)
    state.set_reservations(plan.node, step.entry)
    return reservation


def test_what_a_preemption_frees_is_held_for_the_preemptor_until_its_victims_go():
    from draplane.scheduling.placing import NotPlaced, Placed

    state, victims, big, big_claim, now = _shard_state_with_full_node()
    assert isinstance(state.place_pod(big, [big_claim]), NotPlaced)
    plan = state.preemption_for(big, [big_claim], now)
    assert isinstance(plan, PreemptionPlan) and len(plan.victims) == 8
    reservation = _hold(state, plan, big, big_claim, {c.metadata.uid for _, c in victims}, now)
    # While the victims' claims still hold the GPUs, the preemptor waits, and says why.
    waiting = state.place_pod(big, [big_claim])
    assert isinstance(waiting, NotPlaced)
    assert "held for it while the pods preempted for it go" in waiting.message
    assert state.preemption_for(big, [big_claim], now) is None  # nobody else is evicted meanwhile
    # The victims go: their claims are released, yet a newcomer gets none of the eight GPUs...
    for pod, claim in victims:
        state.set_pod(pod, deleted=True)
        state.set_claim(claim, deleted=True)
    newcomer = scenario.pod("ns", "newcomer", claim_name="n")
    newcomer.metadata.uid = "puid-n"
    n_claim = scenario.claim("ns", "n", "gpu.nvidia.com")
    n_claim.metadata.uid = "cuid-n"
    assert isinstance(state.place_pod(newcomer, [n_claim]), NotPlaced)
    # ...and the preemptor is placed on them, nothing new to reserve.
    placed = state.place_pod(big, [big_claim])
    assert isinstance(placed, Placed) and placed.node == "node-0" and placed.new_claims == []
    assert placed.allocations["cuid-big"] == reservation.allocation


def test_a_hold_may_share_only_the_victims_devices():
    import pytest as _pytest

    from draplane.scheduling import reservations as rv

    state, victims, big, big_claim, now = _shard_state_with_full_node()
    plan = state.preemption_for(big, [big_claim], now)
    from draplane.scheduling import reservation_protocol as protocol
    allocation = plan.placement.allocations[0]
    taken = rv.Reservation(claim_uid="cuid-0", claim_namespace="ns", claim_name="c0", pod_uid="puid-0",
                           devices=rv.devices_of(victims[0][1].status.allocation),
                           allocation=victims[0][1].status.allocation, reserved_at=now, expires_at=None, shard=0)
    entry = rv.NodeReservations(node="node-0", claims={"cuid-0": taken})
    hold = rv.Reservation(claim_uid="cuid-big", claim_namespace="ns", claim_name="big-claim", pod_uid="puid-big",
                          devices=rv.devices_of(allocation), allocation=allocation, reserved_at=now,
                          expires_at=now + 90, shard=0)
    # cuid-0 is not among the victims named: its device is taken.
    with _pytest.raises(rv.ReservationConflict):
        protocol.nominate(entry, [hold], None, {"cuid-1"}, now, state.claim_is_allocated)
    step = protocol.nominate(entry, [hold], None, {"cuid-0"}, now, state.claim_is_allocated)
    assert set(step.entry.claims) == {"cuid-0", "cuid-big"}

"""A gang placed on a shard's SchedulingState: one Placed per member, reservations counted, none held."""

import time

from draplane.allocation.gang import GangUnplaceable
from draplane.scheduling import reservations as rv
from draplane.simulation import scenario
from scheduling_builders import bind_where_placed
from draplane.scheduling.gang_placing import GangPlaced, place_gang_members
from draplane.scheduling.gangs import GangSpec
from draplane.scheduling.placing import SchedulingState, Placed


def with_uid(obj, uid):
    obj.metadata.uid = uid
    return obj


def eight_gpu_state(nodes: int) -> SchedulingState:
    state = SchedulingState()
    state.set_class(scenario.device_class())
    for i in range(nodes):
        name = f"node-{i:02d}"
        state.set_node(scenario.gpu_node(name))
        state.set_feed_entry(f"node.{name}", [scenario.gpu_slice(name, 8, "80Gi")])
    return state


def members(gang: str, pods: int, gpus: int):
    out = []
    for i in range(pods):
        claim = with_uid(scenario.claim("ns", f"{gang}-{i}", "gpu.nvidia.com", count=gpus), f"{gang}-c{i}")
        out.append((with_uid(scenario.pod("ns", f"{gang}-{i}", claim_name=claim.metadata.name, cpu="1"), f"{gang}-p{i}"), [claim]))
    return out


def test_two_8_by_8_gangs_on_12_nodes_one_placed_the_other_refused_whole():
    state = eight_gpu_state(12)
    first = place_gang_members(state, GangSpec("ns/a", 8), members("a", 8, 8))
    assert isinstance(first, GangPlaced)
    assert len({p.node for p in first.members.values()}) == 8
    assert all(isinstance(p, Placed) and len(p.new_claims) == 1 and p.requests == {"cpu": 1000}
               for p in first.members.values())
    # The shard reserves them: the reservations take the devices and the pods' CPU.
    now = time.time()
    for pod_uid, placed in first.members.items():
        (claim_uid,) = placed.new_claims
        reservation = rv.Reservation(
            claim_uid=claim_uid, claim_namespace="ns", claim_name=claim_uid, pod_uid=pod_uid,
            devices=rv.devices_of(placed.allocations[claim_uid]), allocation=placed.allocations[claim_uid],
            reserved_at=now, expires_at=now + 30)
        state.set_reservations(placed.node, rv.add(rv.NodeReservations(node=placed.node), [reservation]))
    before = dict(state.devices.state.claims())
    second = place_gang_members(state, GangSpec("ns/b", 8), members("b", 8, 8))
    assert isinstance(second, GangUnplaceable)
    assert "the gang asks 64 devices; too few free: the cluster has 32" in second.message
    assert state.devices.state.claims() == before
    # Four members of 8 do fit, on the four free nodes.
    four = place_gang_members(state, GangSpec("ns/b", 4), members("b", 4, 8))
    assert isinstance(four, GangPlaced)
    assert {p.node for p in four.members.values()}.isdisjoint({p.node for p in first.members.values()})


# --- preemption for a whole gang -----------------------------------------------------------------------

from draplane.scheduling.gang_placing import gang_preemption_for  # noqa: E402
from draplane.scheduling.preemption import GangPreemptionPlan, NoPreemption  # noqa: E402


def full_state(nodes: int, *, priority: int = 0) -> SchedulingState:
    """`nodes` 8-GPU nodes, every GPU allocated to a bound one-GPU pod of `priority`."""
    state = eight_gpu_state(nodes)
    for n in range(nodes):
        node = f"node-{n:02d}"
        for g in range(8):
            name = f"low-{n}-{g}"
            claim = with_uid(scenario.claim("ns", f"{name}-gpu", "gpu.nvidia.com"), f"cuid-{name}")
            pod = with_uid(scenario.pod("ns", name, claim_name=claim.metadata.name), f"puid-{name}")
            pod.spec.priority = priority
            bind_where_placed(state, pod, claim, node)
    return state


def high(gang_members, priority: int = 1000, policy: str | None = None):
    for pod, _ in gang_members:
        pod.spec.priority = priority
        pod.spec.preemption_policy = policy
    return gang_members


def test_a_gang_of_two_8_gpu_pods_on_a_full_cluster_evicts_exactly_two_nodes_pods():
    state = full_state(4)
    gang = high(members("big", 2, 8))
    assert isinstance(place_gang_members(state, GangSpec("ns/big", 2), gang), GangUnplaceable)
    before = dict(state.devices.state.claims())
    plan = gang_preemption_for(state, GangSpec("ns/big", 2), gang)
    assert isinstance(plan, GangPreemptionPlan), plan
    nodes = {v.node for v in plan.victims}
    assert len(plan.victims) == 16 and len(nodes) == 2, [v.key for v in plan.victims]
    assert {p.node for p in plan.placement.members.values()} == nodes
    assert "preempting 16 pod(s) on 2 node(s)" in plan.explain() and "for gang ns/big (priority 1000)" in plan.explain()
    assert state.devices.state.claims() == before, "the search must put every victim's claim back"


def test_a_gang_evicts_only_the_pods_it_needs_on_a_partly_full_node():
    state = full_state(2)
    gang = high(members("pair", 2, 2))  # 4 GPUs in all
    plan = gang_preemption_for(state, GangSpec("ns/pair", 2), gang)
    assert isinstance(plan, GangPreemptionPlan), plan
    assert len(plan.victims) == 4, [v.key for v in plan.victims]


def test_nobody_is_evicted_for_a_gang_that_would_not_fit_even_then():
    state = full_state(2)
    gang = high(members("huge", 3, 8))  # 24 GPUs on a 16-GPU cluster
    plan = gang_preemption_for(state, GangSpec("ns/huge", 3), gang)
    assert isinstance(plan, NoPreemption)
    assert "does not fit together even with all 16 lower-priority pods gone" in plan.reason


def test_a_gang_member_with_preemption_policy_never_keeps_the_gang_from_preempting():
    state = full_state(2)
    gang = high(members("polite", 2, 8))
    gang[1][0].spec.preemption_policy = "Never"
    plan = gang_preemption_for(state, GangSpec("ns/polite", 2), gang)
    assert isinstance(plan, NoPreemption) and "member ns/polite-1 is not eligible due to preemptionPolicy=Never" in plan.reason


def test_equal_priority_pods_are_no_victims_of_a_gang():
    state = full_state(2, priority=1000)
    assert gang_preemption_for(state, GangSpec("ns/big", 2), high(members("big", 2, 8))) is None


def test_the_gang_search_budget_evicts_nobody_rather_than_too_many():
    from draplane.scheduling import preemption

    state = full_state(3)
    gang = high(members("big", 1, 8))
    calls = []

    def try_place(gone):
        calls.append(len(gone))
        return object() if len(gone) == 24 else None  # fits only with every pod gone: nothing is given back

    plan = preemption.plan_gang_preemption("ns/big", [p for p, _ in gang],
                                           running={n: list(p.values()) for n, p in state.running.items()},
                                           try_place=try_place, trials=4)
    assert isinstance(plan, NoPreemption) and "gave up choosing victims at the search budget (4 joint" in plan.reason
    assert len(calls) == 4


def test_a_gang_facing_more_victim_nodes_than_trials_is_refused_before_any_search():
    from draplane.scheduling import preemption

    state = full_state(3)
    gang = high(members("big", 1, 8))
    calls = []
    plan = preemption.plan_gang_preemption("ns/big", [p for p, _ in gang],
                                           running={n: list(p.values()) for n, p in state.running.items()},
                                           try_place=lambda gone: calls.append(1), trials=3)
    assert isinstance(plan, NoPreemption) and "lower-priority pods run on 3 nodes, more than the 3" in plan.reason
    assert calls == []


# --- members' volumes ----------------------------------------------------------------------------------

from draplane.api.meta import NodeSelector, NodeSelectorRequirement, NodeSelectorTerm  # noqa: E402
from draplane.scheduling.framework.plugins.volume_binding import BoundVolume, PodVolumes  # noqa: E402


def pinned_to(node: str) -> PodVolumes:
    """A bound claim whose volume lives on `node` alone."""
    return PodVolumes(bound=(BoundVolume(claim="data", volume=f"pv-{node}", node_affinity=NodeSelector(
        node_selector_terms=[NodeSelectorTerm(match_expressions=[NodeSelectorRequirement(
            key="kubernetes.io/hostname", operator="In", values=[node])])])),))


def test_each_gang_member_goes_where_its_volume_is_and_a_member_whose_volume_is_nowhere_fails_the_gang():
    state = eight_gpu_state(4)
    gang = members("v", 2, 1)  # alike but for their volumes: busy-first packing alone puts both on one node
    volumes = {"v-p0": pinned_to("node-03"), "v-p1": pinned_to("node-01")}
    placed = place_gang_members(state, GangSpec("ns/v", 2), gang, volumes=volumes)
    assert isinstance(placed, GangPlaced)
    assert {uid: p.node for uid, p in placed.members.items()} == {"v-p0": "node-03", "v-p1": "node-01"}
    nowhere = place_gang_members(state, GangSpec("ns/v", 2), gang,
                                 volumes={**volumes, "v-p1": pinned_to("node-99")})
    assert isinstance(nowhere, GangUnplaceable)

"""A gang placed on a shard's ClusterState: one Placed per member, reservations counted, none held."""

import time

from draplane.allocation.gang import GangUnplaceable
from draplane.scheduling import reservations as rv
from draplane.scheduling import scenario
from draplane.scheduling.gang_placing import GangPlaced, place_gang_members
from draplane.scheduling.gangs import GangSpec
from draplane.scheduling.placing import ClusterState, Placed


def with_uid(obj, uid):
    obj.metadata.uid = uid
    return obj


def eight_gpu_state(nodes: int) -> ClusterState:
    state = ClusterState()
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
    before = dict(state.cluster.state.claims())
    second = place_gang_members(state, GangSpec("ns/b", 8), members("b", 8, 8))
    assert isinstance(second, GangUnplaceable)
    assert "the gang asks 64 devices; too few free: the cluster has 32" in second.message
    assert state.cluster.state.claims() == before
    # Four members of 8 do fit, on the four free nodes.
    four = place_gang_members(state, GangSpec("ns/b", 4), members("b", 4, 8))
    assert isinstance(four, GangPlaced)
    assert {p.node for p in four.members.values()}.isdisjoint({p.node for p in first.members.values()})

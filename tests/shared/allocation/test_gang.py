"""Gangs placed jointly by the pure core: all members or none, with re-chosen devices, topology,
shared claims, one explanation, and a bounded search."""

from __future__ import annotations

import time

import pytest

from draplane.allocation import DeviceAllocator, NodePlacement, Unallocatable
from draplane.allocation.gang import (
    DomainKind,
    Gang,
    GangError,
    GangMember,
    GangPlacement,
    GangTopology,
    GangUnplaceable,
    SearchBudget,
    commit_gang,
    release_gang,
)
from draplane.allocation.gang import place_gang as place_gang_with
from draplane.api.core import Container, Node, NodeSpec, NodeStatus, Pod, PodSpec, ResourceRequirements
from draplane.scheduling.gang_placing import node_local_fits
from draplane.api.meta import ObjectMeta

from allocation_builders import (
    CLASS_A,
    DRIVER_A as A,
    claim,
    device,
    device_class,
    first_available,
    request,
    share_ids,
    slice_,
    sub,
)


def place_gang(cluster, gang, **kwargs):
    """place_gang with the scheduling framework's node fit, as the shard hands it over."""
    kwargs.setdefault("pod_fits", node_local_fits)
    return place_gang_with(cluster, gang, **kwargs)


def gpu_node(name: str, gpus: int = 8, cliques: list[str] | None = None) -> object:
    devices = [device(f"gpu-{i}", {"clique": cliques[i]} if cliques else None) for i in range(gpus)]
    return slice_(name, name, name, A, *devices)


def k8s_node(name: str, cpu: str = "64", **labels: str) -> Node:
    return Node(metadata=ObjectMeta(name=name, labels={"kubernetes.io/hostname": name, **labels}),
                spec=NodeSpec(), status=NodeStatus(allocatable={"cpu": cpu, "memory": "512Gi", "pods": "110"}))


def make_cluster(slices, nodes=(), policy="draplane") -> DeviceAllocator:
    c = DeviceAllocator(slices=slices, classes=[device_class(CLASS_A, A)], nodes=nodes, policy=policy, share_ids=share_ids)
    c.ensure_nodes_from_slices()
    return c


def pod(name: str, cpu: str = "1") -> Pod:
    return Pod(metadata=ObjectMeta(name=name, namespace="default"),
               spec=PodSpec(containers=[Container(name="main", resources=ResourceRequirements(requests={"cpu": cpu}))]))


def gpu_gang(name: str, pods: int, gpus: int, topology: GangTopology | None = None, cpu: str | None = None) -> Gang:
    members = tuple(
        GangMember(f"default/{name}-{i}", (claim(f"{name}-{i}-gpus", request("gpus", CLASS_A, gpus)),),
                   pod(f"{name}-{i}", cpu) if cpu else None)
        for i in range(pods)
    )
    return Gang(f"default/{name}", members, topology)


def held_claims(c: DeviceAllocator) -> set[str]:
    return set(c.state.claims())


def devices_of(placement: GangPlacement) -> dict[str, list[str]]:
    return {k: [r.device for r in a.devices.results] for k, a in placement.claims_allocated().items()}


# --- kubernetes/kubernetes#138765 ------------------------------------------------------------------


def partitionable_node() -> list:
    # One GPU of 80Gi that can be given whole or as two halves (they draw on the same counters).
    counters = {"gpu-0": {"memory": "80Gi"}}
    devices = [
        device("gpu-0", {"kind": "whole"}, consumes={"gpu-0": {"memory": "80Gi"}}),
        device("gpu-0-half-0", {"kind": "half"}, consumes={"gpu-0": {"memory": "40Gi"}}),
        device("gpu-0-half-1", {"kind": "half"}, consumes={"gpu-0": {"memory": "40Gi"}}),
    ]
    return [slice_("node-1-counters", "node-1", "node-1", A, count=2, counters=counters),
            slice_("node-1-gpus", "node-1", "node-1", A, *devices, count=2)]


def whole_or_half(name: str):
    return claim(name, first_available(
        "gpu",
        sub("whole", CLASS_A, sel=(f'device.attributes["{A}"].kind == "whole"',)),
        sub("half", CLASS_A, sel=(f'device.attributes["{A}"].kind == "half"',)),
    ))


def test_kubernetes_138765_two_members_whole_or_half_both_get_a_half():
    gang = Gang("default/pair", (
        GangMember("default/pair-0", (whole_or_half("pair-0-gpu"),)),
        GangMember("default/pair-1", (whole_or_half("pair-1-gpu"),)),
    ))
    # Greedy, one pod at a time as kube-scheduler does: the first takes the whole GPU (its first
    # choice), and the second finds nothing left.
    greedy = make_cluster(partitionable_node(), policy="first-fit")
    first = greedy.allocate([gang.members[0].claims[0]])
    greedy.commit([gang.members[0].claims[0]], first)
    assert [r.device for r in first.allocations[0].devices.results] == ["gpu-0"]
    assert isinstance(greedy.allocate([gang.members[1].claims[0]]), Unallocatable)

    for policy in ("first-fit", "draplane"):
        c = make_cluster(partitionable_node(), policy=policy)
        placed = place_gang(c, gang)
        assert isinstance(placed, GangPlacement), str(placed)
        assert devices_of(placed) == {"default/pair-0-gpu": ["gpu-0-half-0"], "default/pair-1-gpu": ["gpu-0-half-1"]} or \
            devices_of(placed) == {"default/pair-0-gpu": ["gpu-0-half-1"], "default/pair-1-gpu": ["gpu-0-half-0"]}
        assert [r.request for a in placed.claims_allocated().values() for r in a.devices.results] == ["gpu/half", "gpu/half"]
        assert held_claims(c) == set(), "the search must take back its tentative allocations"
        commit_gang(c, placed)
        assert held_claims(c) == {"default/pair-0-gpu", "default/pair-1-gpu"}


# --- two 8 x 8-GPU gangs on 12 nodes -----------------------------------------------------------------


def test_two_gangs_of_8_by_8_gpus_on_12_nodes_one_placed_whole_the_other_not_at_all():
    c = make_cluster([gpu_node(f"node-{i:02d}") for i in range(12)])
    first, second = gpu_gang("train-a", 8, 8), gpu_gang("train-b", 8, 8)
    placed = place_gang(c, first)
    assert isinstance(placed, GangPlacement), str(placed)
    assert len(set(placed.nodes.values())) == 8
    commit_gang(c, placed)
    before = held_claims(c)
    refused = place_gang(c, second)
    assert isinstance(refused, GangUnplaceable)
    assert held_claims(c) == before, "no GPU may be held for the gang that did not fit"
    assert not any(k.startswith("default/train-b") for k in held_claims(c))
    # One explanation: where each fits alone (the 4 free nodes), how far the joint search got.
    assert refused.unplaced == ()
    assert set(refused.fits_alone["default/train-b-0"]) == set(f"node-{i:02d}" for i in range(12)) - set(placed.nodes.values())
    assert "8 members, placed none of them" in refused.message
    assert "fit alone on 4 node(s)" in refused.message
    assert "the gang asks 64 devices; too few free: the cluster has 32" in refused.message
    assert not refused.budget_exhausted
    # When the first finishes, the second fits whole.
    release_gang(c, placed)
    assert isinstance(place_gang(c, second), GangPlacement)


def test_a_member_that_fits_nowhere_is_named():
    c = make_cluster([gpu_node(f"node-{i}") for i in range(2)])
    gang = Gang("default/odd", (
        GangMember("default/odd-0", (claim("odd-0-gpus", request("gpus", CLASS_A, 4)),)),
        GangMember("default/odd-1", (claim("odd-1-gpus", request("gpus", CLASS_A, 9)),)),
    ))
    refused = place_gang(c, gang)
    assert isinstance(refused, GangUnplaceable)
    assert refused.unplaced == ("default/odd-1",)
    assert "1 fit on no node even alone (default/odd-1)" in refused.message
    assert "default/odd-0 fit alone on 2 node(s) (node-0, node-1)" in refused.message


def test_members_share_a_node_when_cpu_allows_and_spread_when_not():
    c = make_cluster([gpu_node("node-0"), gpu_node("node-1")], nodes=[k8s_node("node-0", cpu="8"), k8s_node("node-1", cpu="8")])
    together = place_gang(c, gpu_gang("small", 2, 4, cpu="4"))
    assert isinstance(together, GangPlacement) and len(set(together.nodes.values())) == 1
    apart = place_gang(c, gpu_gang("wide", 2, 4, cpu="5"))
    assert isinstance(apart, GangPlacement) and len(set(apart.nodes.values())) == 2
    # Bound pods' requests count: with 4 CPUs used on each node, two 5-CPU members fit nowhere.
    refused = place_gang(c, gpu_gang("wide", 2, 4, cpu="5"), bound=lambda n: ({"cpu": 4000}, 1))
    assert isinstance(refused, GangUnplaceable) and len(refused.unplaced) == 2


def test_a_claim_shared_by_members_is_allocated_once():
    c = make_cluster([gpu_node("node-0", gpus=3), gpu_node("node-1", gpus=3)])
    shared = claim("shared-gpu", request("gpu", CLASS_A, 1))
    gang = Gang("default/share", (
        GangMember("default/share-0", (shared, claim("share-0-own", request("gpu", CLASS_A, 1)))),
        GangMember("default/share-1", (shared, claim("share-1-own", request("gpu", CLASS_A, 1)))),
    ))
    placed = place_gang(c, gang)
    assert isinstance(placed, GangPlacement), str(placed)
    allocated = placed.claims_allocated()
    assert sorted(allocated) == ["default/share-0-own", "default/share-1-own", "default/shared-gpu"]
    # A node-local shared claim pins every member that names it to its node: both members are
    # there, and a third would need a 4th GPU on it; each node has 3, so that gang cannot be placed.
    assert len(set(placed.nodes.values())) == 1
    assert isinstance(place_gang(make_cluster([gpu_node("node-0", gpus=3), gpu_node("node-1", gpus=3)]), Gang(
        "default/three", (*gang.members, GangMember("default/share-2", (shared, claim("share-2-own", request("gpu", CLASS_A, 1))))),
    )), GangUnplaceable)
    commit_gang(c, placed)
    assert set(held_claims(c)) == set(allocated)


# --- topology --------------------------------------------------------------------------------------


def racked_cluster() -> DeviceAllocator:
    # r1: 2 nodes, r2: 4 nodes, r3: 6 nodes, of 8 GPUs each.
    racks = ["r1"] * 2 + ["r2"] * 4 + ["r3"] * 6
    names = [f"node-{i:02d}" for i in range(len(racks))]
    return make_cluster([gpu_node(n) for n in names],
                        nodes=[k8s_node(n, rack=r) for n, r in zip(names, racks)])


def test_a_gang_with_a_rack_constraint_lands_in_one_rack_the_tightest_that_fits():
    c = racked_cluster()
    rack = GangTopology("rack")
    placed = place_gang(c, gpu_gang("ranked", 4, 8, topology=rack))
    assert isinstance(placed, GangPlacement), str(placed)
    racks = {c.nodes[n].metadata.labels["rack"] for n in placed.nodes.values()}
    assert racks == {"r2"} and placed.domain == "rack=r2"  # r1 is too small, r3 roomier than needed
    commit_gang(c, placed)
    # Now only r3 has room for 4 whole nodes; a gang of 7 fits no rack, though 8 nodes are free.
    assert {c.nodes[n].metadata.labels["rack"] for n in place_gang(c, gpu_gang("next", 4, 8, topology=rack)).nodes.values()} == {"r3"}
    refused = place_gang(c, gpu_gang("big", 7, 8, topology=rack))
    assert isinstance(refused, GangUnplaceable) and "within one node-label domain of rack" in refused.message
    # Preferred, not required: it spreads over racks rather than wait.
    spread = place_gang(c, gpu_gang("big", 7, 8, topology=GangTopology("rack", required=False)))
    assert isinstance(spread, GangPlacement) and spread.domain is None


def test_a_gang_within_one_device_attribute_domain():
    # Two nodes whose GPUs sit in two NVLink cliques each: a and b on node-0, b and c on node-1.
    c = make_cluster([gpu_node("node-0", 8, ["a"] * 4 + ["b"] * 4), gpu_node("node-1", 8, ["b"] * 4 + ["c"] * 4)])
    c.commit([claim("busy", request("gpu", CLASS_A, 1))],
             c.allocate_on_node([claim("busy", request("gpu", CLASS_A, 1))], "node-0"))  # takes one of clique a
    topology = GangTopology(f"{A}/clique", DomainKind.DEVICE_ATTRIBUTE)
    placed = place_gang(c, gpu_gang("nvl", 2, 4, topology=topology))
    assert isinstance(placed, GangPlacement), str(placed)
    assert placed.domain == f"{A}/clique=b"  # a has 3 free, c only 4 on one node: b is the one
    chosen = {d for devs in devices_of(placed).values() for d in devs}
    assert chosen == {"gpu-4", "gpu-5", "gpu-6", "gpu-7", "gpu-0", "gpu-1", "gpu-2", "gpu-3"}
    assert set(placed.nodes.values()) == {"node-0", "node-1"}
    for group in placed.groups:
        expected = {"node-0": {"gpu-4", "gpu-5", "gpu-6", "gpu-7"}, "node-1": {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}}[group.node]
        assert {r.device for a in group.allocations for r in a.devices.results} == expected


# --- the budget ------------------------------------------------------------------------------------


def test_the_budget_bounds_the_search_time():
    # 9 members of 5 GPUs and 6 of 3 on 8 nodes of 8 GPUs: 63 GPUs of 64 asked, but no node holds
    # two of 5, so it cannot fit. Every member's claim differs (a selector true for all), so no two
    # are alike: only the budget stops a search through all their assignments.
    c = make_cluster([gpu_node(f"node-{i:02d}") for i in range(8)])
    members = tuple(
        GangMember(f"default/m-{i}", (claim(f"m-{i}", request("gpus", CLASS_A, 5 if i < 9 else 3,
                                                              sel=(f'device.driver == "{A}" || {i} < 0',))),))
        for i in range(15))
    gang = Gang("default/odd-sizes", members)
    started = time.monotonic()
    refused = place_gang(c, gang, budget=SearchBudget(node_attempts=300, seconds=5.0))
    assert isinstance(refused, GangUnplaceable) and refused.budget_exhausted
    assert "search budget exhausted after 301 node allocations" in refused.message
    assert "together at most" in refused.message and "then no room for" in refused.message
    assert time.monotonic() - started < 5.0
    started = time.monotonic()
    timed = place_gang(c, gang, budget=SearchBudget(node_attempts=10**9, seconds=0.3))
    assert isinstance(timed, GangUnplaceable) and timed.budget_exhausted
    assert time.monotonic() - started < 2.0
    assert held_claims(c) == set()


def test_bad_gangs_are_named():
    c = make_cluster([gpu_node("node-0")])
    with pytest.raises(GangError, match="gang default/empty: no members"):
        place_gang(c, Gang("default/empty", ()))
    twice = GangMember("default/p", (claim("p", request("gpu", CLASS_A)),))
    with pytest.raises(GangError, match="member default/p is listed twice"):
        place_gang(c, Gang("default/twice", (twice, twice)))


def test_a_claim_the_allocator_rejects_is_an_error_naming_it():
    from draplane.allocation import AllocationError

    c = make_cluster([gpu_node("node-0")])
    gang = Gang("default/bad", (GangMember("default/bad-0", (claim("bad-0-gpus", request("gpus", "no-such-class", 1)),)),))
    with pytest.raises(AllocationError, match="bad-0-gpus"):
        place_gang(c, gang)
    assert held_claims(c) == set()


@pytest.mark.parametrize("seed", range(40))
def test_the_joint_search_finds_a_placement_whenever_one_exists(seed):
    # Small random gangs against every assignment of members to nodes, each node's members
    # allocated together: the pruned search must agree, and leave the state as it found it.
    import itertools
    import random

    rng = random.Random(seed)
    sizes = [rng.randint(1, 4) for _ in range(3)]
    c = make_cluster([gpu_node(f"node-{i}", gpus=g) for i, g in enumerate(sizes)])
    for i in range(rng.randint(0, 2)):  # something already running
        busy = claim(f"busy-{i}", request("gpu", CLASS_A, 1))
        placement = c.allocate([busy])
        if not isinstance(placement, Unallocatable):
            c.commit([busy], placement)
    before = held_claims(c)
    members = tuple(GangMember(f"default/m-{i}", (claim(f"m-{i}", request("gpus", CLASS_A, rng.randint(1, 3))),))
                    for i in range(rng.randint(2, 4)))
    names = sorted(c.nodes)

    def assignment_fits(nodes) -> bool:
        for n in set(nodes):
            claims = [m.claims[0] for m, at in zip(members, nodes) if at == n]
            if not isinstance(c.allocate_on_node(claims, n), NodePlacement):
                return False
        return True

    exists = any(assignment_fits(nodes) for nodes in itertools.product(names, repeat=len(members)))
    outcome = place_gang(c, Gang("default/random", members))
    assert isinstance(outcome, GangPlacement) == exists, (sizes, [m.claims[0].spec.devices.requests[0].exactly.count for m in members], str(outcome))
    assert held_claims(c) == before
    if exists:
        commit_gang(c, outcome)
        assert held_claims(c) == before | {f"default/m-{i}" for i in range(len(members))}


def test_a_claim_allocated_before_is_kept_and_pins_its_member():
    from draplane.api.resource import ResourceClaimStatus

    c = make_cluster([gpu_node("node-0", gpus=2), gpu_node("node-1", gpus=2)])
    earlier = claim("earlier", request("gpu", CLASS_A, 1))
    placement = c.allocate_on_node([earlier], "node-1")
    c.commit([earlier], placement)
    earlier.status = ResourceClaimStatus(allocation=placement.allocations[0])
    gang = Gang("default/pinned", (
        GangMember("default/pinned-0", (earlier, claim("pinned-0-own", request("gpu", CLASS_A, 1)))),
        GangMember("default/pinned-1", (claim("pinned-1-own", request("gpu", CLASS_A, 2)),)),
    ))
    placed = place_gang(c, gang)
    assert isinstance(placed, GangPlacement), str(placed)
    assert placed.nodes == {"default/pinned-0": "node-1", "default/pinned-1": "node-0"}
    assert sorted(placed.claims_allocated()) == ["default/pinned-0-own", "default/pinned-1-own"]
    assert held_claims(c) == {"default/earlier"}
    assert c.state.claims()["default/earlier"][0].device[2] == placement.allocations[0].devices.results[0].device


def test_a_member_with_a_pod_and_nothing_to_check_its_node_fit_is_refused():
    c = make_cluster([gpu_node("node-0")], nodes=[k8s_node("node-0", cpu="8")])
    with pytest.raises(GangError, match="nothing checks its node fit"):
        place_gang_with(c, gpu_gang("small", 2, 4, cpu="4"))

"""Across nodes: the scoring policies, the per-shape cache, and incremental updates."""

from __future__ import annotations

import pytest

from allocation_builders import (
    CLASS_A,
    DRIVER_A,
    allocated,
    claim,
    claim_config,
    device,
    device_class,
    first_available,
    match,
    node,
    request,
    slice_,
    sub,
)
from draplane.allocation import (
    AllocationError,
    DeviceAllocator,
    NodePlacement,
    Reason,
    ScoringPolicy,
    Unallocatable,
    get_policy,
    register_policy,
)
from draplane.allocation.state import AllocatedState
from draplane.api.resource import AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult

A = DRIVER_A
ROOT = "resource.kubernetes.io/pcieRoot"
NUMA = "resource.kubernetes.io/numaNode"


def gpu_node(name: str, n: int = 4, roots=None) -> object:
    roots = roots or [f"pci{i // 2}" for i in range(n)]
    return slice_(f"{name}-slice", name, name, A, *[device(f"gpu-{i}", {ROOT: roots[i], NUMA: i // 2}) for i in range(n)])


def cluster(*slices, policy="draplane", nodes=()) -> DeviceAllocator:
    c = DeviceAllocator(slices=slices, classes=[device_class(CLASS_A, A)], nodes=nodes, policy=policy)
    c.ensure_nodes_from_slices()
    return c


def take(c: DeviceAllocator, name: str, count: int = 1, **kw) -> NodePlacement:
    cl = claim(name, request("gpu", CLASS_A, count))
    placement = c.allocate([cl], **kw)
    assert isinstance(placement, NodePlacement), placement
    c.commit([cl], placement)
    return placement


def devices_of(p: NodePlacement) -> list[str]:
    return [r.device for r in p.allocations[0].devices.results]


def test_first_fit_takes_first_node_and_first_devices():
    c = cluster(gpu_node("node-b"), gpu_node("node-a"), policy="first-fit")
    p = take(c, "c0", 2)
    assert p.node == "node-a" and devices_of(p) == ["gpu-0", "gpu-1"]


def test_draplane_keeps_a_claim_under_one_pcie_root():
    # gpu-0 and gpu-1 sit on different roots: first-fit splits the claim, draplane does not.
    roots = ["pciA", "pciB", "pciB", "pciA"]
    ff = take(cluster(gpu_node("node-a", roots=roots), policy="first-fit"), "c0", 2)
    dp = take(cluster(gpu_node("node-a", roots=roots)), "c0", 2)
    assert devices_of(ff) == ["gpu-0", "gpu-1"]
    assert sorted(devices_of(dp)) in (["gpu-0", "gpu-3"], ["gpu-1", "gpu-2"])


def test_draplane_fills_partially_used_root_before_a_whole_one():
    c = cluster(gpu_node("node-a"))
    first = take(c, "c0", 1)
    second = take(c, "c1", 1)
    roots = {d: f"pci{int(d[-1]) // 2}" for d in devices_of(first) + devices_of(second)}
    assert len(set(roots.values())) == 1, "the second single GPU should share the first one's root"


def test_draplane_packs_busy_node_and_keeps_whole_nodes_free():
    c = cluster(gpu_node("node-a"), gpu_node("node-b"))
    c.add_allocated_claim(allocated("busy", (A, "node-b", "gpu-0")))
    assert take(c, "c0", 1).node == "node-b"
    ff = cluster(gpu_node("node-a"), gpu_node("node-b"), policy="first-fit")
    ff.add_allocated_claim(allocated("busy", (A, "node-b", "gpu-0")))
    assert take(ff, "c0", 1).node == "node-a"


def test_draplane_fills_shared_devices_before_splitting_new_ones():
    s = slice_("s", "node-a", "node-a", A, device("gpu-0", capacity={"memory": "8Gi"}, multi=True),
               device("gpu-1", capacity={"memory": "8Gi"}, multi=True))
    c = cluster(s)
    c.add_allocated_claim(allocated("other", (A, "node-a", "gpu-1", "share-x", {"memory": "2Gi"})))
    cl = claim("c0", request("gpu", CLASS_A, capacity={"memory": "2Gi"}))
    p = c.allocate([cl])
    assert devices_of(p) == ["gpu-1"]
    ff = cluster(s, policy="first-fit")
    ff.add_allocated_claim(allocated("other", (A, "node-a", "gpu-1", "share-x", {"memory": "2Gi"})))
    assert devices_of(ff.allocate([cl])) == ["gpu-0"]


def test_commit_invalidates_only_the_node_and_never_gives_a_device_twice():
    c = cluster(gpu_node("node-a"), gpu_node("node-b"))
    taken = set()
    for i in range(8):
        p = take(c, f"c{i}")
        taken.add((p.node, devices_of(p)[0]))
    assert len(taken) == 8
    out = c.allocate([claim("c9", request("gpu", CLASS_A))], explain=True)
    assert isinstance(out, Unallocatable)
    assert {f.node for f in out.failures} == {"node-a", "node-b"}
    assert all(f.reason is Reason.IN_USE for f in out.failures)


def test_release_frees_devices():
    c = cluster(gpu_node("node-a", n=1))
    take(c, "c0")
    assert isinstance(c.allocate([claim("c1", request("gpu", CLASS_A))]), Unallocatable)
    c.release_claim("default/c0")
    assert isinstance(c.allocate([claim("c1", request("gpu", CLASS_A))]), NodePlacement)


def test_new_slice_makes_a_node_feasible():
    c = cluster(gpu_node("node-a", n=1))
    take(c, "c0")
    assert isinstance(c.allocate([claim("c1", request("gpu", CLASS_A))]), Unallocatable)
    c.apply_slice(gpu_node("node-b", n=1))
    c.ensure_nodes_from_slices()
    assert c.allocate([claim("c1", request("gpu", CLASS_A))]).node == "node-b"
    c.remove_slice("node-b-slice")
    assert isinstance(c.allocate([claim("c1", request("gpu", CLASS_A))]), Unallocatable)


def test_node_filter_is_applied_at_pick_time():
    c = cluster(gpu_node("node-a"), gpu_node("node-b"), policy="first-fit")
    p = c.allocate([claim("c0", request("gpu", CLASS_A))], node_filter=lambda n: n.metadata.name != "node-a")
    assert p.node == "node-b"
    out = c.allocate([claim("c0", request("gpu", CLASS_A))], node_filter=lambda n: False, explain=True)
    assert isinstance(out, Unallocatable) and all(f.reason is Reason.NODE_FILTERED for f in out.failures)


def test_node_labels_select_network_attached_devices():
    from allocation_builders import label_selector

    s = slice_("net", None, "net", A, device("nic-0"), node_selector=label_selector("zone", "z1"))
    c = cluster(s, nodes=[node("node-a", zone="z0"), node("node-b", zone="z1")])
    p = c.allocate([claim("c0", request("gpu", CLASS_A))])
    assert p.node == "node-b"
    assert p.allocations[0].node_selector == label_selector("zone", "z1")


def test_fatal_errors_raise_across_nodes():
    c = cluster(gpu_node("node-a"))
    with pytest.raises(AllocationError) as err:
        c.allocate([claim("c0", request("gpu", "missing"))])
    assert err.value.reason is Reason.UNKNOWN_CLASS


def test_claims_together_on_one_node():
    c = cluster(gpu_node("node-a", n=2), gpu_node("node-b", n=2), policy="first-fit")
    c.add_allocated_claim(allocated("busy", (A, "node-a", "gpu-0")))
    claims = [claim(f"c{i}", request("gpu", CLASS_A)) for i in range(2)]
    p = c.allocate(claims)
    assert p.node == "node-b" and len(p.allocations) == 2


def test_custom_policy_through_registry():
    class LastNode(ScoringPolicy):
        name = "last-node"

        # The default likeness hooks keep nodes apart: this score reads the node's name.

        def score_placement(self, placement, view):
            return -ord(placement.node[-1])

    register_policy(LastNode())
    c = cluster(gpu_node("node-a"), gpu_node("node-b"), policy="last-node")
    assert take(c, "c0").node == "node-b"
    with pytest.raises(KeyError, match="unknown scoring policy"):
        get_policy("nope")


def test_allocated_state_add_remove():
    state = AllocatedState()
    result = AllocationResult(devices=DeviceAllocationResult(results=[
        DeviceRequestAllocationResult(request="r", driver=A, pool="p", device="d0"),
        DeviceRequestAllocationResult(request="r", driver=A, pool="p", device="d1", share_id="s", consumed_capacity={"m": "1Gi"}),
        DeviceRequestAllocationResult(request="r", driver=A, pool="p", device="d2", admin_access=True),
    ]))
    state.add_claim("ns/c", result)
    assert state.in_use((A, "p", "d0")) and not state.in_use((A, "p", "d1")) and not state.in_use((A, "p", "d2"))
    assert state.shared_capacity((A, "p", "d1")) == {"m": 1 << 30}
    assert state.is_allocated((A, "p", "d1"))
    version = state.pool_version((A, "p"))
    state.remove_claim("ns/c")
    assert not state.in_use((A, "p", "d0")) and state.shared_capacity((A, "p", "d1")) is None
    assert state.pool_version((A, "p")) > version


def test_replace_pool_updates_one_node():
    c = cluster(gpu_node("node-a", n=1), gpu_node("node-b", n=1), policy="first-fit")
    assert take(c, "c0").node == "node-a"
    c.replace_pool(A, "node-a", [gpu_node("node-a", n=2)])
    p = c.allocate([claim("c1", request("gpu", CLASS_A))])
    assert (p.node, devices_of(p)) == ("node-a", ["gpu-1"])
    c.replace_pool(A, "node-a", [])
    assert c.allocate([claim("c1", request("gpu", CLASS_A))]).node == "node-b"


def mig_node(name: str) -> list:
    counters = {f"gpu-{g}": {"memory": "40Gi"} for g in range(2)}
    migs = [device(f"gpu-{g}-mig-{m}", {"type": "mig"}, consumes={f"gpu-{g}": {"memory": "10Gi"}}) for g in range(2) for m in range(4)]
    return [slice_(f"{name}-counters", name, name, A, count=2, counters=counters),
            slice_(f"{name}-migs", name, name, A, *migs, count=2)]


def test_draplane_partitions_an_already_partitioned_gpu_first():
    c = cluster(*mig_node("node-a"))
    c.add_allocated_claim(allocated("other", (A, "node-a", "gpu-1-mig-0")))
    assert devices_of(take(c, "c0")) == ["gpu-1-mig-1"]
    ff = cluster(*mig_node("node-a"), policy="first-fit")
    ff.add_allocated_claim(allocated("other", (A, "node-a", "gpu-1-mig-0")))
    assert devices_of(take(ff, "c0")) == ["gpu-0-mig-0"]


def test_partitioned_gpu_commit_invalidates_only_its_node():
    c = cluster(*mig_node("node-a"), *mig_node("node-b"))
    take(c, "c0")  # the first allocation counts the classes' shares (see DeviceAllocator._check_scarcity)
    epoch = c._epoch
    for i in range(1, 16):
        take(c, f"c{i}")
    assert c._epoch == epoch, "node-local counter pools must not force a cluster-wide rebuild"
    assert isinstance(c.allocate([claim("c16", request("gpu", CLASS_A))]), Unallocatable)


def test_alike_nodes_share_one_search(monkeypatch):
    from draplane.allocation.allocator import NodeAllocator

    calls = []
    original = NodeAllocator.allocate

    def counting(self, claims, node, *args, **kwargs):
        calls.append(node.metadata.name)
        return original(self, claims, node, *args, **kwargs)

    monkeypatch.setattr(NodeAllocator, "allocate", counting)
    c = cluster(*[gpu_node(f"node-{i:02d}") for i in range(20)])
    p = take(c, "c0", 2)
    assert len(calls) == 1, calls  # one search for all twenty alike nodes; the pick is placed like it
    assert p.node == "node-00"
    calls.clear()
    take(c, "c1", 2)
    assert len(calls) <= 1, calls  # the changed node at most


def test_draplane_keeps_a_whole_node_for_a_later_big_claim():
    # node-a is empty, node-b already runs something. A single-GPU claim then an 8-GPU claim:
    # first-fit breaks node-a open and the big claim finds no whole node; draplane does not.
    def run(policy):
        c = cluster(gpu_node("node-a", n=8), gpu_node("node-b", n=8), policy=policy)
        c.add_allocated_claim(allocated("busy", (A, "node-b", "gpu-0")))
        take(c, "small", 1)
        return c.allocate([claim("big", request("gpu", CLASS_A, 8))])

    assert isinstance(run("first-fit"), Unallocatable)
    assert run("draplane").node == "node-a"


@pytest.mark.parametrize("policy", ["draplane", "first-fit"])
def test_a_placement_taken_from_an_alike_node_is_what_the_search_on_the_picked_node_finds(policy, monkeypatch):
    # Nodes alike but for their pool and device names (and UUIDs): the cluster searches one of
    # them and places claims on the others like it (NodeAllocator.place_like). Each answer must
    # be the one a search on the picked node gives: devices, names, config, node selector, score.
    from random import Random

    from draplane.allocation.allocator import NodeAllocator
    from draplane.api.codec import encode_json

    placed_like = []
    original = NodeAllocator.place_like

    def counting(self, template, positions, node, pools):
        placed_like.append(node.metadata.name)
        return original(self, template, positions, node, pools)

    monkeypatch.setattr(NodeAllocator, "place_like", counting)
    slices = []
    for n in range(12):
        name = f"node-{n:02d}"
        slices.append(slice_(f"{name}-slice", name, f"pool-{n:02d}", A, *[
            device(f"gpu-{g}" if n % 2 else f"dev{g}x", {ROOT: f"pci{g // 2}", NUMA: g // 4, "uuid": f"GPU-{n}-{g}"},
                   {"memory": "80Gi"}, binding=["ready"] if n >= 10 else None)
            for g in range(8)]))
    classes = [device_class(CLASS_A, A, config=[{"from": "class"}]),
               device_class("big", A, f'device.capacity["{A}"].memory.isGreaterThan(quantity("40Gi"))')]
    c = DeviceAllocator(slices=slices, classes=classes, policy=policy)
    c.ensure_nodes_from_slices()
    rng = Random(3)
    for i in range(60):
        size = rng.choice([1, 1, 2, 2, 4, 8])
        kind = rng.random()
        if kind < 0.3:
            cl = claim(f"c{i}", request("gpu", CLASS_A, size), constraints=[match(ROOT if size <= 2 else NUMA)])
        elif kind < 0.5:
            cl = claim(f"c{i}", first_available("gpu", sub("big", "big", size), sub("any", CLASS_A, size)))
        else:
            cl = claim(f"c{i}", request("gpu", CLASS_A, size), config=[claim_config(A, {"from": "claim"})])
        placement = c.allocate([cl])
        if not isinstance(placement, NodePlacement):
            continue
        searched = c.allocator.allocate([cl], c.nodes[placement.node], c.policy)
        assert isinstance(searched, NodePlacement)
        assert encode_json(placement.allocations) == encode_json(searched.allocations)
        assert placement.score == searched.score
        assert ([[(d.record.id, d.pool.id, d.plan.full_name) for d in chosen] for chosen in placement.chosen]
                == [[(d.record.id, d.pool.id, d.plan.full_name) for d in chosen] for chosen in searched.chosen])
        c.commit([cl], placement)
    assert len(placed_like) >= 8, placed_like  # the path under test was taken


class _PrefersFreeCPU(ScoringPolicy):
    """Device scores all 0; the node term is the pod's share of the node's free CPU, so the
    emptiest node (by CPU) wins: the right node is known without the cluster's heaps."""

    name = "test-prefers-free-cpu"
    reads_node_resources = True

    def node_resources_score(self, device_free, device_taken, free, requests):
        return requests[0] / max(1, free[0])


@pytest.mark.parametrize("seed", range(6))
def test_the_cpu_memory_term_picks_what_scoring_every_node_picks_as_pods_come_and_go(seed):
    """`allocate(node_resources=...)` keeps a heap per pod size: after commits, releases, CPU that
    taken and given back with a report (`node_resources_changed`), and taken without one (caught
    when the node comes to the top), the node it picks is the one scoring every node picks."""
    import random

    from draplane.allocation.device_allocator import NodeResources

    rng = random.Random(seed)
    names = [f"n{i:02d}" for i in range(24)]
    c = cluster(*[gpu_node(n, 4) for n in names], policy=_PrefersFreeCPU())
    free_cpu = {n: rng.randrange(1_000, 64_000, 500) for n in names}
    gpus_free = {n: 4 for n in names}
    held: list[tuple] = []
    for step in range(300):
        pod_cpu = rng.choice((500, 1_000, 4_000))
        resources = NodeResources(pod_cpu, 0, lambda n: (free_cpu[n], 0))
        count = rng.choice((1, 1, 2))
        reachable = [n for n in names if gpus_free[n] >= count]
        expected = min(reachable, key=lambda n: (pod_cpu / max(1, free_cpu[n]), n)) if reachable else None
        cl = claim(f"c{step}", request("gpu", CLASS_A, count))
        placement = c.allocate([cl], node_resources=resources)
        if expected is None:
            assert isinstance(placement, Unallocatable)
        else:
            assert isinstance(placement, NodePlacement) and placement.node == expected, (step, placement)
            c.commit([cl], placement)
            gpus_free[expected] -= count
            free_cpu[expected] -= pod_cpu
            c.node_resources_changed(expected)
            held.append((cl, expected, count, pod_cpu))
        action = rng.random()
        if held and action < 0.3:  # a pod goes: its devices and CPU come back
            gone, where, count, cpu = held.pop(rng.randrange(len(held)))
            c.release_claim(gone)
            gpus_free[where] += count
            free_cpu[where] += cpu
            c.node_resources_changed(where)
        elif action < 0.45:  # CPU taken on a node by a pod without devices, reported
            where = rng.choice(names)
            free_cpu[where] = max(0, free_cpu[where] - rng.randrange(500, 8_000, 500))
            c.node_resources_changed(where)
        elif action < 0.6:  # a pod without devices goes: CPU back, reported (only the report tells)
            where = rng.choice(names)
            free_cpu[where] += rng.randrange(500, 8_000, 500)
            c.node_resources_changed(where)
        elif action < 0.7:  # CPU taken and nobody said: a worse score is still found out
            where = rng.choice(names)
            free_cpu[where] = max(0, free_cpu[where] - rng.randrange(500, 8_000, 500))


def test_a_node_that_fails_the_node_filter_is_asked_again_next_time():
    from draplane.allocation.device_allocator import NodeResources

    c = cluster(gpu_node("a", 2), gpu_node("b", 2), policy=_PrefersFreeCPU())
    free = {"a": 8_000, "b": 4_000}
    resources = NodeResources(1_000, 0, lambda n: (free[n], 0))
    first = c.allocate([claim("one", request("gpu", CLASS_A))], node_resources=resources,
                       node_filter=lambda n: n.metadata.name != "a")
    assert first.node == "b"
    again = c.allocate([claim("two", request("gpu", CLASS_A))], node_resources=resources)
    assert again.node == "a"


def test_a_tie_break_number_orders_equal_nodes_its_own_way_and_never_overrides_a_better_score():
    """Shards pass their index: among nodes that score the same each picks its own first, so they
    do not all race for one node; a node that scores better is still picked by every one."""
    names = [f"n{i}" for i in range(8)]
    firsts = set()
    for tie_break in range(6):
        c = DeviceAllocator(slices=[gpu_node(n, 2) for n in names], classes=[device_class(CLASS_A, A)], tie_break=tie_break)
        c.ensure_nodes_from_slices()
        first = take(c, f"first-{tie_break}").node
        firsts.add(first)
        if tie_break == 0:
            assert first == "n0"  # by name
        # the node half used now packs better than the empty ones, whatever the tie break
        assert take(c, f"second-{tie_break}").node == first
    assert len(firsts) > 1


def test_the_cpu_memory_term_never_picks_a_node_whose_outcome_stopped_being_a_placement():
    """`allocate` replaces a node's outcome in place when a search there finds no placement after
    all (no change log names the node): the arrays must not offer it again."""
    from draplane.allocation.device_allocator import NodeResources
    from draplane.allocation.errors import NodeFailure

    c = cluster(gpu_node("a", 2), gpu_node("b", 2), policy=_PrefersFreeCPU())
    free = {"a": 8_000, "b": 4_000}
    resources = NodeResources(1_000, 0, lambda n: (free[n], 0))
    first = c.allocate([claim("one", request("gpu", CLASS_A))], node_resources=resources)
    assert first.node == "a"
    index = next(iter(c._shapes.values()))
    index.entries["a"].outcome = NodeFailure("a", Reason.NOT_DIAGNOSED, "no placement after all")
    assert c.allocate([claim("two", request("gpu", CLASS_A))], node_resources=resources).node == "b"


def test_the_cpu_memory_term_takes_a_nan_score_and_amounts_beyond_int64():
    from draplane.allocation.device_allocator import NodeResources

    class NaNOnA(_PrefersFreeCPU):
        name = "test-nan-on-a"

        def node_resources_score(self, device_free, device_taken, free, requests):
            return float("nan") if free[0] == 8_000 else 0.0

    c = cluster(gpu_node("a", 2), gpu_node("b", 2), policy=NaNOnA())
    free = {"a": 8_000, "b": 4_000}
    assert c.allocate([claim("one", request("gpu", CLASS_A))],
                      node_resources=NodeResources(1_000, 0, lambda n: (free[n], 0))).node == "b"
    huge = cluster(gpu_node("a", 2), gpu_node("b", 2), policy=_PrefersFreeCPU())
    placed = huge.allocate([claim("one", request("gpu", CLASS_A))],
                           node_resources=NodeResources(1_000, 1 << 70, lambda n: (1 << 64, 1 << 80)))
    assert isinstance(placed, NodePlacement)

"""Property test: random slices and claims.

Every allocation returned is valid (selectors, constraints, counters, capacity, counts, no device
twice), and `first-fit` and `draplane` agree on whether the claims can be allocated.
The validity check is written independently of the allocator: it reads the generated data directly.
"""

from __future__ import annotations

from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocation_builders import (
    CLASS_A,
    DRIVER_A,
    NODE_1,
    allocate,
    allocated,
    claim,
    device,
    device_class,
    distinct,
    first_available,
    match,
    request,
    slice_,
    sub,
)
from draplane.allocation import NodeFailure, NodePlacement
from draplane.api.resource import DeviceTaint, DeviceToleration

A = DRIVER_A
SIZE_SELECTOR = 'device.attributes["%s"].size >= %d'
CLASSES = [device_class(CLASS_A, A)]


@st.composite
def scenarios(draw):
    n_devices = draw(st.integers(1, 7))
    devices = []
    specs = {}
    for i in range(n_devices):
        kind = draw(st.sampled_from(["plain", "plain", "partition", "shared"]))
        size = draw(st.integers(1, 3))
        root = draw(st.sampled_from(["r0", "r1", "r2"]))
        name = f"dev-{i}"
        tainted = draw(st.integers(0, 4)) == 0
        spec = {"kind": kind, "size": size, "root": root, "tainted": tainted}
        taints = [DeviceTaint(key="broken", effect="NoSchedule")] if tainted else None
        if kind == "partition":
            spec["consumes"] = draw(st.integers(1, 4))
            devices.append(device(name, {"size": size, "root": root}, consumes={"gpu": {"mem": str(spec["consumes"])}}, taints=taints))
        elif kind == "shared":
            spec["capacity"] = draw(st.integers(2, 6))
            devices.append(device(name, {"size": size, "root": root}, capacity={"mem": str(spec["capacity"])}, multi=True, taints=taints))
        else:
            devices.append(device(name, {"size": size, "root": root}, taints=taints))
        specs[name] = spec
    counter_total = draw(st.integers(1, 6))
    slices = [slice_("devices", NODE_1, "pool", A, *devices, count=2),
              slice_("counters", NODE_1, "pool", A, count=2, counters={"gpu": {"mem": str(counter_total)}})]
    in_use = []
    plain = [n for n, s in specs.items() if s["kind"] == "plain"]
    taken = draw(st.lists(st.sampled_from(plain), unique=True, max_size=2)) if plain else []
    if taken:
        in_use.append(allocated("in-use", *[(A, "pool", n) for n in taken]))

    claims = []
    for ci in range(draw(st.integers(1, 2))):
        requests = []
        for ri in range(draw(st.integers(1, 2))):
            count = draw(st.integers(1, 3))
            min_size = draw(st.integers(0, 3))
            sel = (SIZE_SELECTOR % (A, min_size),) if min_size else ()
            capacity = {"mem": str(draw(st.integers(1, 3)))} if draw(st.booleans()) and draw(st.booleans()) else None
            if draw(st.integers(0, 3)) == 0:
                requests.append(first_available(f"r{ri}", sub("big", CLASS_A, count, sel=sel, capacity=capacity),
                                                sub("small", CLASS_A, 1)))
            else:
                tolerations = [DeviceToleration(key="broken", operator="Exists")] if draw(st.booleans()) else None
                requests.append(request(f"r{ri}", CLASS_A, count, sel=sel, capacity=capacity, tolerations=tolerations))
        constraints = []
        which = draw(st.sampled_from([None, "match", "distinct"]))
        if which == "match":
            constraints.append(match(f"{A}/root"))
        elif which == "distinct":
            constraints.append(distinct(f"{A}/root"))
        claims.append(claim(f"c{ci}", *requests, constraints=constraints or None))
    return specs, counter_total, slices, in_use, claims


def _request_specs(c):
    out = {}
    for r in c.spec.devices.requests:
        if r.exactly is not None:
            out[r.name] = r.exactly
        else:
            for s in r.first_available:
                out[f"{r.name}/{s.name}"] = s
    return out


def check_valid(specs, counter_total, in_use, claims, placement: NodePlacement) -> None:
    taken = {r.device for c in in_use for r in c.status.allocation.devices.results}
    exclusive: set[str] = set()
    counters_used = 0
    shared_used: dict[str, Fraction] = {}
    partitions_used: set[str] = set()
    for c, allocation in zip(claims, placement.allocations):
        results = allocation.devices.results
        by_request: dict[str, list[str]] = {}
        wanted = _request_specs(c)
        for r in results:
            spec = specs[r.device]
            req = wanted[r.request]
            by_request.setdefault(r.request, []).append(r.device)
            if spec["tainted"]:
                assert req.tolerations, f"{r.device} is tainted and {r.request} does not tolerate it"
            for s in req.selectors or []:
                threshold = int(s.cel.expression.rsplit(">=", 1)[1])
                assert spec["size"] >= threshold, (r.device, s.cel.expression)
            cap = (req.capacity.requests or {}) if req.capacity else {}
            if spec["kind"] == "shared":
                assert r.share_id and r.consumed_capacity
                shared_used[r.device] = shared_used.get(r.device, Fraction(0)) + int(r.consumed_capacity["mem"])
                if cap:
                    assert int(r.consumed_capacity["mem"]) == int(cap["mem"])
            else:
                assert r.share_id is None
                if cap:
                    assert spec["kind"] != "plain" or False, "plain devices have no capacity to request"
                assert r.device not in taken, f"{r.device} is in use"
                assert r.device not in exclusive, f"{r.device} given twice"
                exclusive.add(r.device)
                if spec["kind"] == "partition":
                    partitions_used.add(r.device)
        # every top-level request got exactly one alternative, with its count
        for rq in c.spec.devices.requests:
            names = [n for n in by_request if n == rq.name or n.startswith(rq.name + "/")]
            assert len(names) == 1, (rq.name, names)
            got = by_request[names[0]]
            assert len(got) == wanted[names[0]].count
        devices = [r.device for r in results]
        for constraint in c.spec.devices.constraints or []:
            roots = [specs[d]["root"] for d in devices]
            if constraint.match_attribute:
                assert len(set(roots)) <= 1
            else:
                assert len(set(roots)) == len(roots)
    counters_used = sum(specs[d]["consumes"] for d in partitions_used)
    assert counters_used <= counter_total
    for name, used in shared_used.items():
        assert used <= specs[name]["capacity"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_allocations_are_valid_and_policies_agree(scenario):
    specs, counter_total, slices, in_use, claims = scenario
    outcomes = {}
    for policy in ("first-fit", "draplane"):
        out = allocate(CLASSES, slices, claims, in_use=in_use, policy=policy)
        assert isinstance(out, (NodePlacement, NodeFailure))
        if isinstance(out, NodePlacement):
            check_valid(specs, counter_total, in_use, claims, out)
        outcomes[policy] = isinstance(out, NodePlacement)
    assert outcomes["first-fit"] == outcomes["draplane"], outcomes


@st.composite
def cluster_runs(draw):
    kinds = draw(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=4))
    slices = []
    for n, (count, size) in enumerate(kinds):
        devices = [device(f"gpu-{i}", {"size": size if i % 2 == 0 else 1, "uuid": f"n{n}-{i}",
                                       "resource.kubernetes.io/pcieRoot": f"pci{i // 2}"}) for i in range(count)]
        slices.append(slice_(f"node-{n}-slice", f"node-{n}", f"node-{n}", A, *devices))
    claims = []
    for i in range(draw(st.integers(1, 8))):
        min_size = draw(st.integers(0, 3))
        sel = (SIZE_SELECTOR % (A, min_size),) if min_size else ()
        constraints = [match("resource.kubernetes.io/pcieRoot")] if draw(st.booleans()) else None
        claims.append(claim(f"c{i}", request("gpu", CLASS_A, draw(st.integers(1, 2)), sel=sel), constraints=constraints))
    return slices, claims


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster_runs(), st.sampled_from(["first-fit", "draplane"]))
def test_cluster_choices_match_direct_search(run, policy):
    """The per-shape cache and node likeness never change the answer: the cluster picks a node on
    which a fresh search succeeds, first-fit picks the first such node, and when it finds none no
    node has room."""
    from draplane.allocation import DeviceAllocator, Inventory, NodeAllocator, get_policy
    from draplane.allocation.device_allocator import Unallocatable

    slices, claims = run
    cluster = DeviceAllocator(slices=slices, classes=CLASSES, policy=policy)
    cluster.ensure_nodes_from_slices()
    held = set()
    for c in claims:
        outcome = cluster.allocate([c])
        direct = NodeAllocator(Inventory(slices), cluster.state, cluster.classes)
        placements = {n: direct.allocate([c], cluster.nodes[n], get_policy(policy)) for n in sorted(cluster.nodes)}
        fits = [n for n, p in placements.items() if isinstance(p, NodePlacement)]
        if isinstance(outcome, Unallocatable):
            assert fits == []
            continue
        assert outcome.node in fits
        if policy == "first-fit":
            assert outcome.node == fits[0]
        assert outcome.score == min(placements[n].score for n in fits)
        assert outcome.allocations == placements[outcome.node].allocations
        for r in outcome.allocations[0].devices.results:
            assert (r.pool, r.device) not in held
            held.add((r.pool, r.device))
        cluster.commit([c], outcome)

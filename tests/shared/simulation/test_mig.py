"""The MIG workload of `draplane simulate --mig`: A100 placement rules, the replay, the bound."""

from __future__ import annotations

import dataclasses

from draplane.allocation import Cluster, NodePlacement
from draplane.allocation.fragmentation import FragmentationAwareDraplane
from draplane.cli import main
from draplane.simulation import mig


def test_the_a100_rules_come_from_the_node_agent_profile():
    shape = mig.gpu_shape()
    assert [(p.name, p.slices, p.starts) for p in shape.profiles] == [
        ("1g.5gb", 1, (0, 1, 2, 3, 4, 5, 6)), ("2g.10gb", 2, (0, 2, 4)), ("3g.20gb", 4, (0, 4)),
        ("4g.20gb", 4, (0,)), ("7g.40gb", 8, (0,)),
    ]
    configs = mig.gpu_configurations(shape)
    # Counts of (1g, 2g, 3g, 4g, 7g) one A100 holds at once, maximal: seven 1g (the eighth memory
    # slice has no compute), a 4g beside a 3g, never two 4g, and a 7g alone.
    assert (7, 0, 0, 0, 0) in configs and (0, 0, 1, 1, 0) in configs and (0, 0, 0, 0, 1) in configs
    assert (0, 0, 2, 0, 0) in configs and (3, 0, 0, 1, 0) in configs
    assert all(c[3] <= 1 and (c[4] == 0 or sum(c) == 1) for c in configs)
    assert not any(a != b and all(x >= y for x, y in zip(a, b)) for a in configs for b in configs)


def one_node_cluster(policy) -> Cluster:
    nodes, slices = mig.node_slices(1)
    return Cluster(slices=slices, classes=[mig.mig_device_class()], nodes=nodes, policy=policy)


def test_draplane_keeps_the_4g_placement_that_first_fit_blocks():
    """On an empty A100 first-fit puts a 1g at memory slice 0, the only start a 4g may take; draplane
    takes a slice that blocks the fewest placements, so a 4g still fits beside it."""
    placed = {}
    for name, policy in (("first-fit", "first-fit"), ("draplane", FragmentationAwareDraplane())):
        cluster = one_node_cluster(policy)
        small = mig.mig_claim("small", "1g.5gb")
        placement = cluster.allocate([small])
        assert isinstance(placement, NodePlacement)
        cluster.commit([small], placement)
        device = placement.allocations[0].devices.results[0].device
        # Then a 4g on the same GPU: first-fit's GPU 0 has none left.
        big = mig.mig_claim("big", "4g.20gb")
        on_same = cluster.allocator.allocate([big], cluster.node(placement.node), cluster.policy,
                                             plans=[cluster.allocator.plan(big)], diagnose=False)
        gpu = device.split("-mig-")[0]
        same_gpu = isinstance(on_same, NodePlacement) and any(
            r.device.startswith(gpu + "-") for r in on_same.allocations[0].devices.results)
        placed[name] = (device, same_gpu)
    assert placed["first-fit"][0] == "gpu-0-mig-1g-5gb-0"
    assert placed["draplane"][0].startswith("gpu-0-mig-1g-5gb-") and placed["draplane"][0] != "gpu-0-mig-1g-5gb-0"
    assert placed["draplane"][1]


def test_no_policy_refuses_fewer_than_the_bound():
    requests = mig.mig_requests(7, 120, 8, 1.2)
    bound = mig.placement_bound(requests, 8, time_limit=20)
    assert 0 <= bound.fewest_refused
    results = [mig.replay(requests, 1, policy, 7) for policy in ("first-fit", FragmentationAwareDraplane())]
    for result in results:
        assert result.requests == 120
        assert bound.fewest_refused <= result.refused < 120
        assert sum(n for _, n in result.refused_by_profile) == result.refused
    again = mig.replay(requests, 1, "first-fit", 7)  # seeded: the same run again
    assert dataclasses.replace(again, seconds=0.0) == dataclasses.replace(results[0], seconds=0.0)


def test_requests_are_seeded_and_loaded_as_asked():
    a = mig.mig_requests(3, 500, 32, 1.0)
    assert a == mig.mig_requests(3, 500, 32, 1.0) and a != mig.mig_requests(4, 500, 32, 1.0)
    assert {r.profile for r in a} == {"1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"}
    assert all(r.departure > r.arrival for r in a)


def test_simulate_mig_prints_the_table_and_bench_lines(tmp_path, capsys):
    code = main(["simulate", "--mig", "--mig-nodes", "1", "--mig-requests", "80", "--seeds", "1", "--bound",
                 "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "refused %" in out and "stranded slices" in out and "bound" in out
    assert "BENCH name=simulate_mig_first-fit refused_pct=" in out and "BENCH name=simulate_mig_draplane " in out
    assert "BENCH name=simulate_mig_bound " in out
    assert (tmp_path / "mig.csv").read_text().startswith("policy,seed,requests,refused")
    assert main(["simulate", "--mig", "--policy", "fgd", "--out", str(tmp_path)]) == 2
    assert main(["simulate", "--out", str(tmp_path)]) == 2

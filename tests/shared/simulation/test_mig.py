"""The MIG workload of `draplane simulate --mig`: A100 and H100 placement rules, the replay, the bound."""

from __future__ import annotations

import dataclasses

import pytest

from draplane.allocation import DeviceAllocator, NodePlacement
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


def one_node_cluster(policy) -> DeviceAllocator:
    nodes, slices = mig.node_slices(1)
    return DeviceAllocator(slices=slices, classes=[mig.mig_device_class()], nodes=nodes, policy=policy)


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


# --- H100 80GB (the node agent's h100-mig profile) -------------------------------------------------

H100_STARTS = {"1g.10gb": (0, 1, 2, 3, 4, 5, 6), "1g.20gb": (0, 2, 4, 6), "2g.20gb": (0, 2, 4),
               "3g.40gb": (0, 4), "4g.40gb": (0,), "7g.80gb": (0,)}


def test_the_h100_rules_come_from_the_node_agent_profile():
    shape = mig.gpu_shape("h100-mig")
    assert shape.gpus_per_node == 8 and shape.memory_slices == 8
    assert [(p.name, p.starts) for p in shape.profiles] == list(H100_STARTS.items())
    assert [p.slices for p in shape.profiles] == [1, 2, 2, 4, 4, 8]
    configs = mig.gpu_configurations(shape)
    # Counts of (1g.10gb, 1g.20gb, 2g, 3g, 4g, 7g): seven 1g.10gb, or six and a 1g.20gb on slices 6-7;
    # four 1g.20gb; three 2g and a 1g of either kind; a 4g beside a 3g; never more than seven
    # instances (seven compute slices).
    for config in [(7, 0, 0, 0, 0, 0), (6, 1, 0, 0, 0, 0), (0, 4, 0, 0, 0, 0), (0, 0, 0, 1, 1, 0),
                   (1, 0, 3, 0, 0, 0), (0, 1, 3, 0, 0, 0), (0, 2, 0, 0, 1, 0), (0, 0, 0, 0, 0, 1)]:
        assert config in configs
    assert all(sum(c) <= 7 and c[4] <= 1 and (c[5] == 0 or sum(c) == 1) for c in configs)
    assert not any(a != b and all(x >= y for x, y in zip(a, b)) for a in configs for b in configs)


def test_h100_nodes_publish_exactly_the_valid_placements():
    _, slices = mig.node_slices(1, "h100-mig")
    devices = [d for s in slices for d in s.spec.devices or ()]
    migs = [d for d in devices if d.name.startswith("gpu-0-mig-")]
    attr = lambda d, name: d.attributes[name].value()  # noqa: E731
    starts = {}
    for device in migs:
        starts.setdefault(attr(device, "profile"), []).append(attr(device, "placementStart"))
        start, size = attr(device, "placementStart"), attr(device, "placementSize")
        used = {k for k in device.consumes_counters[0].counters if k.startswith("memory-slice-")}
        assert used == {f"memory-slice-{i}" for i in range(start, start + size)}
    assert {name: tuple(sorted(s)) for name, s in starts.items()} == H100_STARTS
    # Eight GPUs, each the whole GPU and its 18 placements, split over slices of at most 64 devices
    # (the apiserver's limit when devices consume counters).
    assert len(devices) == 8 * 19 and all(len(s.spec.devices or ()) <= 64 for s in slices)


def placed_at(profile: str, gpu: int, start: int):
    """A claim for one placement: the profile, on GPU `gpu`, starting at memory slice `start`."""
    claim = mig.mig_claim(f"{profile}-{gpu}-{start}", profile)
    selector = claim.spec.devices.requests[0].exactly.selectors[0].cel
    attrs = f"device.attributes['{mig.DRIVER}']"
    selector.expression += f" && {attrs}.parentIndex == {gpu} && {attrs}.placementStart == {start}"
    return claim


def test_h100_counters_refuse_invalid_starts_and_overlaps():
    nodes, slices = mig.node_slices(1, "h100-mig")
    cluster = DeviceAllocator(slices=slices, classes=[mig.mig_device_class()], nodes=nodes, policy="first-fit")

    def place(profile, start):
        claim = placed_at(profile, 0, start)
        placement = cluster.allocate([claim])
        if isinstance(placement, NodePlacement):
            cluster.commit([claim], placement)
            return True
        return False

    assert not place("1g.20gb", 1)  # two slices wide: even starts only
    assert not place("1g.10gb", 7)  # the eighth memory slice has no compute slice of its own
    assert not place("4g.40gb", 4)
    assert place("1g.20gb", 6)
    assert not place("1g.10gb", 6) and not place("1g.10gb", 7)  # slices 6 and 7 are taken
    assert place("1g.10gb", 5)
    assert not place("3g.40gb", 4) and not place("7g.80gb", 0)
    assert place("2g.20gb", 2) and place("1g.20gb", 0)
    assert not place("4g.40gb", 0)  # slices 0-3 are taken
    assert place("1g.10gb", 4)
    assert not any(place(name, start) for name, starts in H100_STARTS.items() for start in starts)  # full


def test_an_h100_placement_past_the_last_memory_slice_is_rejected():
    from draplane.nodes.profile import ProfileError, parse_profile

    text = """
name: x
driverVersion: '1.2.3'
gpus:
  - count: 1
    productName: NVIDIA H100 80GB HBM3
    architecture: Hopper
    cudaComputeCapability: '9.0'
    memory: 81559Mi
    mig:
      memorySlices: 8
      multiprocessors: 132
      profiles: [{name: 1g.20gb, memory: 20096Mi, multiprocessors: 26, placements: [{start: 7, size: 2}]}]
"""
    with pytest.raises(ProfileError, match="1g.20gb.*start=7 size=2"):
        parse_profile(text)


def test_h100_requests_come_from_its_profiles_and_no_policy_beats_the_bound():
    requests = mig.mig_requests(7, 120, 8, 1.2, node_profile="h100-mig")
    assert requests == mig.mig_requests(7, 120, 8, 1.2, node_profile="h100-mig")
    assert {r.profile for r in requests} <= set(H100_STARTS) and "1g.20gb" in {r.profile for r in requests}
    with pytest.raises(KeyError, match="h100-mig"):
        mig.mig_requests(7, 10, 8, 1.0, mix=(("1g.5gb", 1.0),), node_profile="h100-mig")
    bound = mig.placement_bound(requests, 8, time_limit=20, node_profile="h100-mig")
    results = [mig.replay(requests, 1, policy, 7, node_profile="h100-mig")
               for policy in ("first-fit", FragmentationAwareDraplane())]
    for result in results:
        assert bound.fewest_refused <= result.refused < 120
        assert {name for name, _ in result.refused_by_profile} <= set(H100_STARTS)
    again = mig.replay(requests, 1, "first-fit", 7, node_profile="h100-mig")
    assert dataclasses.replace(again, seconds=0.0) == dataclasses.replace(results[0], seconds=0.0)


def test_simulate_mig_runs_each_profile_asked_for(tmp_path, capsys):
    from draplane.cli.simulate import MIG_NODE_PROFILES

    assert MIG_NODE_PROFILES == mig.NODE_PROFILES
    code = main(["simulate", "--mig", "--mig-profile", "a100-mig", "--mig-profile", "h100-mig", "--mig-nodes", "1",
                 "--mig-requests", "40", "--seeds", "1", "--bound", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "1 a100-mig nodes (8 GPUs)" in out and "1 h100-mig nodes (8 GPUs)" in out
    assert "BENCH name=simulate_mig_draplane " in out and "BENCH name=simulate_mig_h100_draplane " in out
    assert "BENCH name=simulate_mig_h100_bound " in out
    for node_profile in ("a100-mig", "h100-mig"):
        assert (tmp_path / node_profile / "mig.csv").read_text().startswith("policy,seed,requests,refused")

"""bench/chaos.py: its checks on made-up cases, and a short chaos run, one round of every fault,
that must lose and double nothing (the 10-minute one is the benchmark)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from draplane.api.meta import ObjectMeta
from draplane.api.resource import (
    AllocationResult,
    DeviceAllocationResult,
    DeviceRequestAllocationResult,
    ResourceClaim,
    ResourceClaimSpec,
    ResourceClaimStatus,
)

from bench_scripts import BENCH, load  # tests/bench/bench_scripts.py

chaos = load("chaos")
SCRIPT = BENCH / "chaos.py"


def _claim(name: str, *results: tuple[str, str, dict]) -> ResourceClaim:
    """results: (node, device, extra fields of the result)"""
    return ResourceClaim(
        metadata=ObjectMeta(name=name, namespace="ns", uid=name),
        spec=ResourceClaimSpec(),
        status=ResourceClaimStatus(allocation=AllocationResult(devices=DeviceAllocationResult(results=[
            DeviceRequestAllocationResult(request="gpu", driver="gpu.nvidia.com", pool=node, device=device, **extra)
            for node, device, extra in results]))),
    )


@pytest.fixture(scope="module")
def pools():
    facts = {}
    for profile, node in (("dgx-h100", "dgx"), ("a100-mig", "a100"), ("l4-shared", "shared")):
        for driver, devices in chaos.agent_devices(profile, node).items():
            facts[(driver, node)] = chaos.pool_facts(devices)
    return facts


def test_one_device_for_two_claims_is_found_unless_one_has_admin_access(pools):
    first, second = _claim("a", ("dgx", "gpu-0", {})), _claim("b", ("dgx", "gpu-0", {}))
    (problem,) = chaos.devices_given_twice([first, second], pools)
    assert "gpu.nvidia.com/dgx/gpu-0 given to 2 claims: ns/a, ns/b" in problem
    admin = _claim("c", ("dgx", "gpu-0", {"admin_access": True}))
    assert chaos.devices_given_twice([first, admin], pools) == []


def test_a_shared_gpu_is_given_out_up_to_its_memory(pools):
    shares = [_claim(f"s{i}", ("shared", "gpu-0", {"share_id": f"{i:08d}-0000-0000-0000-000000000000",
                                                  "consumed_capacity": {"memory": "8Gi"}})) for i in range(3)]
    # 23034Mi: two shares of 8Gi fit, a third does not
    assert chaos.devices_given_twice(shares[:2], pools) == []
    (problem,) = chaos.devices_given_twice(shares, pools)
    assert problem.startswith("shared device gpu.nvidia.com/shared/gpu-0: memory")


def test_overlapping_mig_placements_and_the_whole_gpu_exceed_the_counters(pools):
    whole = _claim("whole", ("a100", "gpu-0", {}))
    slice_ = _claim("mig", ("a100", "gpu-0-mig-1g-5gb-0", {}))
    other_gpu = _claim("other", ("a100", "gpu-1-mig-1g-5gb-0", {}))
    assert chaos.devices_given_twice([slice_, other_gpu], pools) == []
    problems = chaos.devices_given_twice([whole, slice_], pools)
    assert problems and all("a100 counter gpu-0-counter-set/" in p for p in problems)
    (unknown,) = chaos.devices_given_twice([_claim("x", ("a100", "gpu-9", {}))], pools)
    assert "not one an agent publishes" in unknown


def test_slices_stale_or_duplicated_against_the_agents_devices():
    from draplane.api.resource import Device, ResourcePool, ResourceSlice, ResourceSliceSpec

    def slice_(name, generation, devices, taints=False):
        return ResourceSlice(metadata=ObjectMeta(name=name), spec=ResourceSliceSpec(
            driver="gpu.nvidia.com", node_name="n", pool=ResourcePool(name="n", generation=generation, resource_slice_count=1),
            devices=[Device(name=d, **({"taints": [{"key": "k", "effect": "NoSchedule"}]} if taints else {}))
                     for d in devices]))

    expected = {("gpu.nvidia.com", "n"): {"gpu-0", "gpu-1"}}
    assert chaos.slice_problems([slice_("a", 2, ["gpu-0", "gpu-1"])], expected) == ([], [])
    stale, duplicated = chaos.slice_problems([slice_("a", 2, ["gpu-0", "gpu-1"]), slice_("b", 2, ["gpu-1"])], expected)
    assert stale == [] and duplicated == ["pool gpu.nvidia.com/n: devices in two slices: ['gpu-1']"]
    stale, _ = chaos.slice_problems([slice_("a", 2, ["gpu-0"]), slice_("old", 1, ["gpu-0", "gpu-1"])], expected)
    assert any("older generations" in s for s in stale) and any("1 of the agent's devices missing" in s for s in stale)
    stale, _ = chaos.slice_problems([slice_("a", 2, ["gpu-0", "gpu-1"], taints=True)], expected)
    assert stale == ["pool gpu.nvidia.com/n: 2 devices still tainted, e.g. ['gpu-0', 'gpu-1']"]
    stale, _ = chaos.slice_problems([], expected)
    assert stale == ["pool gpu.nvidia.com/n: no ResourceSlice"]


def test_audit_events_missing_or_repeated():
    def line(seq, kind, uid, event_id=None):
        base = {"seq": seq, "kind": kind, "id": event_id or f"{kind}/{uid}/{seq}"}
        if kind == "placed":
            return {**base, "pod": {"uid": uid}}
        return {**base, "claims": [{"uid": uid}]}

    lines = [line(1, "placed", "p1"), line(2, "released", "c1"), line(4, "placed", "p2"),
             line(5, "placed", "p2"), line(6, "released", "c2", event_id="released/c2"),
             line(7, "released", "c2", event_id="released/c2")]
    found = chaos.audit_differences(lines, {"p1", "p2", "p3"}, {"c1": 1, "c2": 1, "c3": 1})
    assert found["missing_placed"] == 1 and found["missing_released"] == 1  # p3, c3
    assert found["repeated_placed"] == 1 and found["repeated_ids"] == 1 and found["repeated_released"] == 1
    assert found["sequence_gaps"] == 1  # seq 3


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_a_round_of_every_fault_loses_and_doubles_nothing(tmp_path):
    """The whole control plane on this machine (3 NATS servers, 3 shards, 10 nodes), pods at one
    per second, 15 s without faults, then 75 s of faults about every 4 s: one round, each kind at
    least once (the 10-minute run is the benchmark). About 2 minutes on 2 loaded cores; the 2-minute
    phase it replaced gave about 15 faults in 173 s."""
    command = [sys.executable, str(SCRIPT), "--minutes", "1.25", "--calm-minutes", "0.25", "--nodes", "10",
               "--rate", "1", "--seed", "7", "--fault-interval", "4", "--settle-seconds", "90",
               "--workdir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    table = done.stdout[done.stdout.find("chaos run:"):]
    print(table)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    assert "BENCH name=chaos_result lost=0 doubled=0" in done.stdout
    assert "BENCH name=chaos_ratio" in done.stdout
    (injected,) = [line for line in done.stdout.splitlines() if line.strip().startswith("faults injected")]
    missing = [kind for kind in chaos.FAULT_KINDS if f"{kind} " not in injected]
    assert not missing, f"faults never injected: {missing}\n{injected}"

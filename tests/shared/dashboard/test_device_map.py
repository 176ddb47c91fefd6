"""draplane.dashboard.device_map: NATS' facts turned into rows of device cells.

The nodes are the shipped hardware profiles, turned into slices the way the node agent and the
inventory service do; reservations are written as the shards write them.
"""

from __future__ import annotations

import msgspec

import draplane.dashboard.device_map as device_map
from draplane.api.resource import (
    AllocationResult,
    Device,
    DeviceAllocationResult,
    DeviceCapacity,
    DeviceRequestAllocationResult,
    DeviceTaint,
    ResourceSlice,
)
from draplane.dashboard.device_map import DeviceMapBuilder, RuleTaints
from draplane.dashboard.scheduling_facts import SchedulingFacts
from draplane.messages import audit
from draplane.messages.inventory import SCHEMA_VERSION, FeedEntry
from draplane.simulation import scenario
from draplane.scheduling.messages import ClaimPlacement, ClaimRef, Placement, PodRef
from draplane.scheduling.reservations import NodeReservations, PodReservation, Reservation, devices_of
from draplane.nodes.slices import NodeRef, plan_node
from draplane.nodes.hardware import driver_devices
from draplane.nodes.profile import load_profile, profile_hardware

GPU = "gpu.nvidia.com"
NOW = 1_800_000_000.0


def profile_slices(profile: str, node: str) -> list[ResourceSlice]:
    drivers = driver_devices(profile_hardware(load_profile(profile), node))
    return [s for plan in plan_node(NodeRef(node, f"uid-{node}"), drivers, []) for s in plan.creates]


def node_entry(node: str, slices: list[ResourceSlice], *, stale: bool = False) -> FeedEntry:
    return FeedEntry(schema_version=SCHEMA_VERSION, key=f"node.{node}", node=node, stale=stale, slices=slices)


def allocation(pool: str, *devices: str, share: str | None = None, consumed: dict | None = None) -> AllocationResult:
    return AllocationResult(devices=DeviceAllocationResult(results=[
        DeviceRequestAllocationResult(request="gpu", driver=GPU, pool=pool, device=d, share_id=share,
                                      consumed_capacity=consumed)
        for d in devices
    ]))


def reservation(claim: str, pod_uid: str, result: AllocationResult, *, confirmed: bool = True) -> Reservation:
    return Reservation(claim_uid=f"uid-{claim}", claim_namespace="team", claim_name=claim, pod_uid=pod_uid,
                       devices=devices_of(result), allocation=result, reserved_at=NOW - 10,
                       expires_at=None if confirmed else NOW + 20)


def entry(node: str, *reservations: Reservation, pods: dict | None = None) -> NodeReservations:
    return NodeReservations(node=node, claims={r.claim_uid: r for r in reservations}, pods=pods or {})


def cells_by_device(m, node: str) -> dict:
    (row,) = [r for r in m.rows if r.name == node]
    return {c.device: c for c in row.cells}


def test_an_empty_a100_node_is_one_row_of_every_gpu_and_mig_placement_all_free():
    feed = {"node.a100-0": node_entry("a100-0", profile_slices("a100-mig", "a100-0"))}
    m = DeviceMapBuilder().build(feed, {}, SchedulingFacts(), NOW)
    (row,) = m.rows
    assert (row.name, row.kind, row.stale, row.note) == ("a100-0", "node", False, "")
    # Each of the 8 GPUs: the whole GPU and 7 + 3 + 2 + 1 + 1 MIG placements.
    assert len(row.cells) == 8 * 15
    assert m.totals == {"free": 120, "allocated": 0, "shared": 0, "tainted": 0, "blocked": 0}
    groups = {}
    for cell in row.cells:
        groups.setdefault(cell.group, []).append(cell.device)
    assert len(groups) == 8 and all(len(devices) == 15 for devices in groups.values())
    assert groups["gpu-0-counter-set"][0] == "gpu-0"  # the whole GPU first, then its placements
    cells = cells_by_device(m, "a100-0")
    assert cells["gpu-0"].detail == "NVIDIA A100-SXM4-40GB, memory 40Gi"
    assert cells["gpu-0-mig-1g-5gb-0"].detail == "MIG 1g.5gb, memory 4864Mi"
    assert cells["gpu-0"].id == "gpu.nvidia.com/a100-0/gpu-0"


def test_a_mig_placement_held_is_allocated_with_its_claim_pod_and_score_and_blocks_what_overlaps_it():
    feed = {"node.a100-0": node_entry("a100-0", profile_slices("a100-mig", "a100-0"))}
    facts = SchedulingFacts()
    pod = PodRef(namespace="team", name="trainer", uid="pod-1")
    result = allocation("a100-0", "gpu-0-mig-1g-5gb-0")
    facts.apply_message(Placement(pod=pod, node="a100-0", shard=1, first_seen=NOW - 12, expires_at=NOW + 30,
                                  claims=[ClaimPlacement(claim=ClaimRef(namespace="team", name="slice", uid="uid-slice"),
                                                         allocation=result)],
                                  policy="draplane", score=41.5), now=NOW - 9)
    reservations = {"a100-0": entry("a100-0", reservation("slice", "pod-1", result))}
    m = DeviceMapBuilder().build(feed, reservations, facts, NOW)
    cells = cells_by_device(m, "a100-0")
    held = cells["gpu-0-mig-1g-5gb-0"]
    assert held.state == "allocated"
    assert [msgspec.to_builtins(h) for h in held.holders] == [
        {"claim": "team/slice", "pod": "team/trainer", "node": "a100-0", "policy": "draplane", "score": 41.5}]
    # The whole GPU and the placements over memory slice 0 cannot be had now; the others can.
    assert cells["gpu-0"].state == "blocked"
    assert sorted(d for d, c in cells.items() if c.state == "blocked") == [
        "gpu-0", "gpu-0-mig-2g-10gb-0", "gpu-0-mig-3g-20gb-0", "gpu-0-mig-4g-20gb-0", "gpu-0-mig-7g-40gb-0"]
    assert cells["gpu-0-mig-1g-5gb-1"].state == "free" and cells["gpu-1"].state == "free"
    assert m.totals["allocated"] == 1 and m.totals["blocked"] == 5


def test_a_claim_under_a_lease_is_allocated_and_says_so_and_its_pod_is_named_by_the_pod_reservation():
    feed = {"node.h100-0": node_entry("h100-0", [scenario.gpu_slice("h100-0", 4, "80Gi")])}
    result = allocation("h100-0", "gpu-1", "gpu-2")
    pods = {"pod-9": PodReservation(pod_uid="pod-9", pod_namespace="team", pod_name="big", requests={},
                                    reserved_at=NOW - 1, expires_at=NOW + 29)}
    reservations = {"h100-0": entry("h100-0", reservation("pair", "pod-9", result, confirmed=False), pods=pods)}
    m = DeviceMapBuilder().build(feed, reservations, SchedulingFacts(), NOW)
    cells = cells_by_device(m, "h100-0")
    assert [cells[d].state for d in ("gpu-0", "gpu-1", "gpu-2", "gpu-3")] == ["free", "allocated", "allocated", "free"]
    (holder,) = cells["gpu-1"].holders
    assert (holder.claim, holder.pod, holder.lease, holder.score) == ("team/pair", "team/big", True, None)


def test_a_pod_nobody_named_is_shown_by_its_uid():
    feed = {"node.h100-0": node_entry("h100-0", [scenario.gpu_slice("h100-0", 1, "80Gi")])}
    reservations = {"h100-0": entry("h100-0", reservation("c", "pod-x", allocation("h100-0", "gpu-0")))}
    m = DeviceMapBuilder().build(feed, reservations, SchedulingFacts(), NOW)
    assert cells_by_device(m, "h100-0")["gpu-0"].holders[0].pod == "uid pod-x"


def shareable_slice(node: str) -> ResourceSlice:
    base = scenario.gpu_slice(node, 2, "80Gi")
    devices = [msgspec.structs.replace(base.spec.devices[0], allow_multiple_allocations=True,
                                       capacity={"memory": DeviceCapacity(value="80Gi")}),
               base.spec.devices[1]]
    return msgspec.structs.replace(base, spec=msgspec.structs.replace(base.spec, devices=devices))


def test_a_share_of_a_device_that_allows_multiple_allocations_is_shared_with_each_holder():
    feed = {"node.n": node_entry("n", [shareable_slice("n")])}
    first = allocation("n", "gpu-0", share="11111111-0000-0000-0000-000000000001", consumed={"memory": "20Gi"})
    second = allocation("n", "gpu-0", share="11111111-0000-0000-0000-000000000002", consumed={"memory": "30Gi"})
    reservations = {"n": entry("n", reservation("a", "pod-a", first), reservation("b", "pod-b", second))}
    m = DeviceMapBuilder().build(feed, reservations, SchedulingFacts(), NOW)
    cells = cells_by_device(m, "n")
    assert cells["gpu-0"].state == "shared" and cells["gpu-1"].state == "free"
    assert [(h.claim, h.share) for h in cells["gpu-0"].holders] == [
        ("team/a", "11111111-0000-0000-0000-000000000001"), ("team/b", "11111111-0000-0000-0000-000000000002")]
    assert "shareable" in cells["gpu-0"].detail


def tainted(slice_: ResourceSlice, *names: str) -> ResourceSlice:
    taint = DeviceTaint(key="draplane.dev/agent-silent", effect="NoSchedule")
    devices = [msgspec.structs.replace(d, taints=[taint]) if d.name in names else d for d in slice_.spec.devices]
    return msgspec.structs.replace(slice_, spec=msgspec.structs.replace(slice_.spec, devices=devices))


def test_a_stale_node_s_tainted_devices_are_tainted_and_the_row_says_stale():
    feed = {"node.l4-0": node_entry("l4-0", [tainted(scenario.gpu_slice("l4-0", 2, "24Gi"), "gpu-0", "gpu-1")],
                                    stale=True)}
    m = DeviceMapBuilder().build(feed, {}, SchedulingFacts(), NOW)
    (row,) = m.rows
    assert row.stale and [c.state for c in row.cells] == ["tainted", "tainted"]
    assert row.cells[0].taints == ["draplane.dev/agent-silent:NoSchedule"]


def rule_event(kind: str, rule: str, taint: str, *devices: tuple[str, str]) -> audit.AuditEvent:
    return audit.AuditEvent(id=f"{kind}/rule/{rule}/1", kind=kind, at=NOW, by=[f"devicetaintrule {rule}", "shard-0"],
                            devices=[audit.DeviceRef(driver=GPU, pool=p, device=d) for p, d in devices],
                            reason=f"devicetaintrule {rule} {'deleted' if kind == 'untainted' else 'applied'}: {taint}")


def test_a_device_taint_rule_from_the_audit_stream_taints_free_devices_until_it_is_deleted():
    feed = {"node.n": node_entry("n", [scenario.gpu_slice("n", 3, "80Gi")])}
    reservations = {"n": entry("n", reservation("c", "pod-c", allocation("n", "gpu-1")))}
    rules = RuleTaints()
    rules.apply_audit(rule_event("tainted", "maintenance", "example.com/repair=soon:NoExecute", ("n", "gpu-0"), ("n", "gpu-1")))
    rules.apply_audit(rule_event("tainted", "note", "example.com/note=x:None", ("n", "gpu-2")))
    builder = DeviceMapBuilder()
    cells = cells_by_device(builder.build(feed, reservations, SchedulingFacts(), NOW, rules), "n")
    assert cells["gpu-0"].state == "tainted"
    assert cells["gpu-0"].taints == ["example.com/repair=soon:NoExecute (devicetaintrule maintenance)"]
    assert cells["gpu-1"].state == "allocated"  # a held device stays held; the taint is listed
    assert cells["gpu-1"].taints == ["example.com/repair=soon:NoExecute (devicetaintrule maintenance)"]
    assert cells["gpu-2"].state == "free"  # effect None never keeps a device from anyone
    rules.apply_audit(rule_event("untainted", "maintenance", "example.com/repair=soon:NoExecute", ("n", "gpu-0")))
    cells = cells_by_device(builder.build(feed, reservations, SchedulingFacts(), NOW, rules), "n")
    assert cells["gpu-0"].state == "free" and cells["gpu-0"].taints == []


def test_the_inventory_s_own_taint_events_are_left_to_the_feed():
    rules = RuleTaints()
    rules.apply_audit(audit.AuditEvent(id="tainted/node/n/t", kind="tainted", at=NOW, by=["inventory"], node="n",
                                       devices=[audit.DeviceRef(driver=GPU, pool="n", device="gpu-0")],
                                       reason="node n: agent silent"))
    assert rules.of((GPU, "n", "gpu-0")) == [] and rules.version == 0


def test_rows_are_nodes_by_name_then_pools_not_local_to_one_node_and_classes_are_no_rows():
    network = scenario.gpu_slice("ignored", 2, "1Gi")
    network = msgspec.structs.replace(network, metadata=msgspec.structs.replace(network.metadata, name="fabric"),
                                      spec=msgspec.structs.replace(network.spec, node_name=None, all_nodes=True,
                                                                   pool=msgspec.structs.replace(network.spec.pool, name="fabric")))
    feed = {
        "pool.gpu.nvidia.com.fabric": FeedEntry(schema_version=SCHEMA_VERSION, key="pool.gpu.nvidia.com.fabric",
                                                slices=[network]),
        "node.b": node_entry("b", [scenario.gpu_slice("b", 1, "80Gi")]),
        "node.a": node_entry("a", [scenario.gpu_slice("a", 1, "80Gi")]),
        "class.gpu": FeedEntry(schema_version=SCHEMA_VERSION, key="class.gpu", device_class=scenario.device_class("gpu")),
    }
    reservations = {"a": entry("a", reservation("net", "pod-n", allocation("fabric", "gpu-1")))}
    m = DeviceMapBuilder().build(feed, reservations, SchedulingFacts(), NOW)
    assert [(r.name, r.kind) for r in m.rows] == [("a", "node"), ("b", "node"), ("gpu.nvidia.com/fabric", "pool")]
    assert [c.state for c in m.rows[2].cells] == ["free", "allocated"]
    assert m.rows[2].cells[1].holders[0].node == "a"


def test_a_pool_being_rewritten_shows_its_devices_and_says_it_is_incomplete():
    half = scenario.gpu_slice("n", 2, "80Gi")
    half = msgspec.structs.replace(half, spec=msgspec.structs.replace(
        half.spec, pool=msgspec.structs.replace(half.spec.pool, resource_slice_count=2)))
    m = DeviceMapBuilder().build({"node.n": node_entry("n", [half])}, {}, SchedulingFacts(), NOW)
    (row,) = m.rows
    assert len(row.cells) == 2 and "incomplete" in row.note


def test_only_rows_whose_entry_or_holders_changed_are_computed_again(monkeypatch):
    computed = []
    real = device_map._row_states

    def counting(entry, reservations):
        computed.append(entry.node)
        return real(entry, reservations)

    monkeypatch.setattr(device_map, "_row_states", counting)
    feed = {f"node.{n}": node_entry(n, [scenario.gpu_slice(n, 2, "80Gi")]) for n in ("a", "b", "c")}
    builder = DeviceMapBuilder()
    builder.build(feed, {}, SchedulingFacts(), NOW)
    assert sorted(computed) == ["a", "b", "c"]
    computed.clear()
    builder.build(feed, {}, SchedulingFacts(), NOW)
    assert computed == []
    reservations = {"b": entry("b", reservation("c1", "p1", allocation("b", "gpu-0")))}
    m = builder.build(feed, reservations, SchedulingFacts(), NOW)
    assert computed == ["b"] and cells_by_device(m, "b")["gpu-0"].state == "allocated"
    computed.clear()
    feed["node.c"] = node_entry("c", [scenario.gpu_slice("c", 3, "80Gi")])
    del feed["node.a"]
    m = builder.build(feed, reservations, SchedulingFacts(), NOW)
    assert computed == ["c"] and [r.name for r in m.rows] == ["b", "c"]


def test_the_map_carries_the_pending_list():
    facts = SchedulingFacts()
    facts.pod_unschedulable("u1", "team/waiting", reason="0/1 nodes are available: 1 cannot allocate all claims.",
                            decided_by="shard-0", at=NOW - 1)
    m = DeviceMapBuilder().build({}, {}, facts, NOW)
    assert m.rows == [] and [(p.pod, p.reason) for p in m.pending.pods] == [
        ("team/waiting", "0/1 nodes are available: 1 cannot allocate all claims.")]


def test_a_device_of_a_plain_slice_gets_its_product_and_memory_as_detail():
    bare = Device(name="x")
    assert device_map._detail(bare) == ""
    assert device_map._group(GPU, bare) == GPU

"""`draplane free`: free capacity by DeviceClass and node, read from NATS and printed."""

from __future__ import annotations

import io
import json

import msgspec
import pytest
from rich.console import Console

from draplane.allocation.free_capacity import free_capacity
from draplane.api.resource import (
    AllocationResult, DeviceAllocationResult, DeviceClass, DeviceRequestAllocationResult, ResourceSlice,
)
from draplane.cli import main
from draplane.cli.free import free_json, print_tables
from draplane.localenv.environment import standard_device_classes
from draplane.messages.inventory import SCHEMA_VERSION, FeedEntry, InventoryNames, encode
from draplane.scheduling import reservations as rv
from draplane.jetstream import streams
from draplane.scheduling.messages import Subjects
from draplane.nodes.slices import NodeRef, plan_node
from draplane.nodes.hardware import driver_devices
from draplane.nodes.profile import load_profile, profile_hardware

CLASSES = [msgspec.convert(c, DeviceClass) for c in standard_device_classes()]
MIG_SLICE = "gpu-0-mig-3g-20gb-0"


def profile_slices(profile: str, node: str) -> list[ResourceSlice]:
    drivers = driver_devices(profile_hardware(load_profile(profile), node))
    return [s for plan in plan_node(NodeRef(node, f"uid-{node}"), drivers, []) for s in plan.creates]


def one_mig(node: str) -> AllocationResult:
    return AllocationResult(devices=DeviceAllocationResult(results=[
        DeviceRequestAllocationResult(request="mig", driver="gpu.nvidia.com", pool=node, device=MIG_SLICE)]))


def test_the_tables_name_classes_nodes_and_what_still_fits():
    free = free_capacity(profile_slices("a100-mig", "a100-0") + profile_slices("l4", "l4-0"), CLASSES,
                         {"c": one_mig("a100-0")})
    out = io.StringIO()
    print_tables(free, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "Free devices by DeviceClass" in text and "By node" in text
    assert "15×3g.20gb" in text and "7×7g.40gb" in text
    gpus = next(line for line in text.splitlines() if line.startswith("│ gpu.nvidia.com"))
    # 7 A100s whole and 4 L4s; the A100 with a 3g.20gb slice cannot be given whole: blocked
    assert [cell.strip() for cell in gpus.split("│")[2:6]] == ["2", "12", "11", "1 blocked"]
    assert "1 allocated, 8 blocked" in text  # the slice, and the 8 placements over its memory slices


def test_an_80_column_table_never_cuts_a_class_name():
    long_class = msgspec.structs.replace(CLASSES[0], metadata=msgspec.structs.replace(
        CLASSES[0].metadata, name="high-memory-gpu.example.com"))
    free = free_capacity(profile_slices("a100-mig", "a100-0") + profile_slices("l4", "l4-0"),
                         CLASSES + [long_class], {"c": one_mig("a100-0")})
    out = io.StringIO()
    print_tables(free, Console(file=out, width=80, color_system=None))
    text = out.getvalue()
    by_class, by_node = text.split("By node")
    for name in ("gpu.nvidia.com", "mig.nvidia.com", "high-memory-gpu.example.com"):
        assert f"│ {name} " in by_class and f"│ {name} " in by_node, (name, text)
    assert "│ a100-0 " in by_node and "│ l4-0 " in by_node, text


def test_json_says_blocked_as_the_table_does():
    free = free_capacity(profile_slices("a100-mig", "a100-0"), CLASSES, {"c": one_mig("a100-0")})
    by_class = {c["deviceClass"]: c for c in free_json(free)["byClass"]}
    assert by_class["gpu.nvidia.com"]["states"]["blocked"] == 1
    assert "unavailable" not in json.dumps(free_json(free))


def test_a_device_taint_rule_counts_its_devices_tainted():
    """A NoSchedule DeviceTaintRule on every GPU of a node: none of them is free, all are tainted,
    as the scheduler and the device map see them; a NoExecute rule the same, an effect of None not."""
    from draplane.api.meta import ObjectMeta
    from draplane.api.resource import DeviceTaint, DeviceTaintRule, DeviceTaintRuleSpec, DeviceTaintSelector

    def rule(effect: str) -> DeviceTaintRule:
        return DeviceTaintRule(metadata=ObjectMeta(name=f"maintenance-{effect.lower()}"), spec=DeviceTaintRuleSpec(
            device_selector=DeviceTaintSelector(driver="gpu.nvidia.com", pool="l4-0"),
            taint=DeviceTaint(key="example.com/maintenance", value="planned", effect=effect)))

    slices = profile_slices("l4", "l4-0") + profile_slices("l4", "l4-1")
    for effect, tainted in (("NoSchedule", 4), ("NoExecute", 4), ("None", 0)):
        free = free_capacity(slices, CLASSES, {}, [rule(effect)])
        (row,) = [r for r in free.nodes if r.node == "l4-0" and r.device_class == "gpu.nvidia.com"]
        assert (row.states["tainted"], row.whole_free) == (tainted, 4 - tainted), effect
        (other,) = [r for r in free.nodes if r.node == "l4-1" and r.device_class == "gpu.nvidia.com"]
        assert (other.states["tainted"], other.whole_free) == (0, 4)


def test_json_has_the_same_numbers():
    free = free_capacity(profile_slices("a100-mig", "a100-0"), CLASSES, {"c": one_mig("a100-0")})
    out = free_json(free)
    by_class = {c["deviceClass"]: c for c in out["byClass"]}
    assert by_class["gpu.nvidia.com"]["freeWhole"] == 7
    assert by_class["mig.nvidia.com"]["partitionsFree"]["1g.5gb"] == 52  # 4 of gpu-0's 7 slices taken by 3g
    assert by_class["mig.nvidia.com"]["states"]["allocated"] == 1
    (row,) = [r for r in out["byNode"] if r["deviceClass"] == "mig.nvidia.com"]
    assert row["node"] == "a100-0" and row["devices"] == 112
    json.dumps(out)  # plain JSON


@pytest.mark.integration
async def test_free_reads_the_feed_and_the_reservations_from_nats(nats, control_plane, subject_prefix, capsys):
    js = nats.jetstream()
    names = InventoryNames(prefix=subject_prefix)
    from nats.js.api import KeyValueConfig

    feed = await js.create_key_value(KeyValueConfig(bucket=names.feed_bucket, history=1))
    node = "a100-free-0"
    key = names.node_key(node)
    await feed.put(key, encode(FeedEntry(schema_version=SCHEMA_VERSION, key=key, node=node,
                                         slices=profile_slices("a100-mig", node))))
    for device_class in CLASSES:
        class_key = names.class_key(device_class.metadata.name)
        await feed.put(class_key, encode(FeedEntry(schema_version=SCHEMA_VERSION, key=class_key,
                                                   device_class=device_class)))
    bucket = await streams.reservation_bucket(js, Subjects(prefix=subject_prefix))
    allocation = one_mig(node)
    entry = rv.NodeReservations(node=node, claims={"claim-1": rv.Reservation(
        claim_uid="claim-1", claim_namespace="ns", claim_name="c", pod_uid="pod-1",
        devices=rv.devices_of(allocation), allocation=allocation, reserved_at=1.0, expires_at=None)})
    await bucket.put(rv.node_key(node), rv.encode_entry(entry))
    # a DeviceTaintRule on gpu-7, as the binder publishes it in the cluster bucket
    from draplane.api.meta import ObjectMeta
    from draplane.api.resource import DeviceTaint, DeviceTaintRule, DeviceTaintRuleSpec, DeviceTaintSelector
    from draplane.scheduling import cluster_feed

    rule = DeviceTaintRule(metadata=ObjectMeta(name="gpu-7-out"), spec=DeviceTaintRuleSpec(
        device_selector=DeviceTaintSelector(driver="gpu.nvidia.com", pool=node, device="gpu-7"),
        taint=DeviceTaint(key="example.com/broken", effect="NoSchedule")))
    cluster = await streams.cluster_bucket(js, Subjects(prefix=subject_prefix))
    await cluster.put(cluster_feed.key_of(rule), cluster_feed.encode(rule))

    code = await __import__("asyncio").to_thread(
        main, ["free", f"--nats={control_plane.nats_url}", f"--prefix={subject_prefix}", "-o", "json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    by_class = {c["deviceClass"]: c for c in out["byClass"]}
    assert by_class["gpu.nvidia.com"]["states"]["tainted"] == 1
    assert by_class["gpu.nvidia.com"]["freeWhole"] == 6  # gpu-0 has the 3g.20gb slice, gpu-7 the taint
    await cluster.delete(cluster_feed.key_of(rule))
    code = await __import__("asyncio").to_thread(
        main, ["free", f"--nats={control_plane.nats_url}", f"--prefix={subject_prefix}", "-o", "json"])
    out = json.loads(capsys.readouterr().out)
    by_class = {c["deviceClass"]: c for c in out["byClass"]}
    assert by_class["gpu.nvidia.com"]["freeWhole"] == 7
    assert by_class["mig.nvidia.com"]["partitionsFree"]["3g.20gb"] == 15


def test_free_says_so_when_nats_cannot_be_reached(capsys):
    assert main(["free", "--nats=nats://127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert "cannot read NATS at nats://127.0.0.1:1" in err
    assert "--workdir" not in err  # a URL was given: nothing to guess about


def test_with_no_up_running_the_error_names_the_workdir_flag(tmp_path, monkeypatch, capsys):
    """`up --workdir X` was started, and `free` run without the flag looks in the default one."""
    monkeypatch.delenv("DRAPLANE_NATS_URL", raising=False)
    monkeypatch.setenv("DRAPLANE_STATE", str(tmp_path / "state"))
    monkeypatch.setattr("draplane.cli.free.CONNECT_SECONDS", 0.5)
    assert main(["free"]) == 1
    err = capsys.readouterr().err
    assert "no `draplane up` is running in the default workdir" in err
    assert "give the same --workdir DIR here" in err, err
    assert main(["free", f"--workdir={tmp_path / 'elsewhere'}"]) == 1
    assert f"no `draplane up` is running with --workdir {tmp_path / 'elsewhere'}" in capsys.readouterr().err

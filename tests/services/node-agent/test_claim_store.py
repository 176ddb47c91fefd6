"""The prepared claims' checkpoint and files: written before the answer, restored at start, and
never half-written or silently forgotten."""

from __future__ import annotations

import json

import pytest

from draplane_node_agent.claim_store import CheckpointError, ClaimStore, write_atomically
from draplane_node_agent.preparation import ClaimRef, PreparedClaim, PreparedDevice, cdi_spec_file_name

DRIVER = "gpu.nvidia.com"


def prepared(uid: str, *devices: str) -> PreparedClaim:
    return PreparedClaim(claim=ClaimRef(namespace="ns", name=f"c-{uid}", uid=uid), driver=DRIVER, devices=[
        PreparedDevice(request_names=["gpu"], pool="n1", device=d, cdi_device_ids=[f"k8s.draplane.io/claim={uid}_{d}"],
                       env={"X": d}, file_name=f"{DRIVER}_{d}", file_text=f"device: {d}\n")
        for d in devices])


def store(tmp_path, node="n1", driver=DRIVER) -> ClaimStore:
    s = ClaimStore(driver=driver, node=node, plugin_dir=tmp_path / "plugins" / driver, cdi_dir=tmp_path / "cdi")
    s.load()
    return s


def test_record_writes_files_then_checkpoint_and_a_new_store_reads_it(tmp_path):
    s = store(tmp_path)
    s.record(prepared("u1", "gpu-0", "gpu-1"))
    spec = json.loads((tmp_path / "cdi" / cdi_spec_file_name("u1", DRIVER)).read_text())
    assert [d["containerEdits"]["env"] for d in spec["devices"]] == [["X=gpu-0"], ["X=gpu-1"]]
    assert (s.device_file_dir("u1") / f"{DRIVER}_gpu-1").read_text() == "device: gpu-1\n"
    again = store(tmp_path)
    assert again.get("u1") == prepared("u1", "gpu-0", "gpu-1")


def test_forget_removes_files_and_entry_and_is_idempotent(tmp_path):
    s = store(tmp_path)
    s.record(prepared("u1", "gpu-0"))
    assert s.forget("u1")
    assert not s.forget("u1")
    assert list((tmp_path / "cdi").iterdir()) == [] and not s.device_file_dir("u1").exists()
    assert store(tmp_path).all() == []


def test_restore_rewrites_lost_files_and_removes_orphans(tmp_path):
    s = store(tmp_path)
    s.record(prepared("u1", "gpu-0"))
    # After a reboot /var/run/cdi is empty; a crash between files and checkpoint left an orphan;
    # another driver's spec in the same folder is not ours to touch.
    (tmp_path / "cdi" / cdi_spec_file_name("u1", DRIVER)).unlink()
    (tmp_path / "cdi" / cdi_spec_file_name("orphan", DRIVER)).write_text("{}")
    (s.claims_dir / "orphan").mkdir()
    other = tmp_path / "cdi" / cdi_spec_file_name("u9", "net.example.com")
    other.write_text("{}")
    fresh = store(tmp_path)
    assert fresh.restore() == (1, 1)
    assert (tmp_path / "cdi" / cdi_spec_file_name("u1", DRIVER)).exists()
    assert not (tmp_path / "cdi" / cdi_spec_file_name("orphan", DRIVER)).exists()
    assert not (s.claims_dir / "orphan").exists() and other.exists()


@pytest.mark.parametrize("damage, match", [
    (lambda text: text[: len(text) // 2], "cannot be read"),
    (lambda text: text.replace("gpu-0", "gpu-7"), "checksum mismatch"),
    (lambda text: text.replace('"version":1', '"version":9'), "version 9 is not 1"),
])
def test_a_damaged_checkpoint_stops_the_agent_naming_the_file(tmp_path, damage, match):
    s = store(tmp_path)
    s.record(prepared("u1", "gpu-0"))
    s.checkpoint_path.write_text(damage(s.checkpoint_path.read_text()))
    with pytest.raises(CheckpointError, match=match) as info:
        store(tmp_path)
    assert str(s.checkpoint_path) in str(info.value)


def test_a_checkpoint_of_another_node_is_refused(tmp_path):
    store(tmp_path).record(prepared("u1", "gpu-0"))
    with pytest.raises(CheckpointError, match="belongs to driver gpu.nvidia.com on node n1, not gpu.nvidia.com on n2"):
        store(tmp_path, node="n2")


def test_write_atomically_replaces_whole_and_survives_a_leftover_read_only_tmp(tmp_path):
    target = tmp_path / "f"
    write_atomically(target, b"one", 0o444)
    leftover = tmp_path / ".f.tmp"
    leftover.write_bytes(b"half")
    leftover.chmod(0o444)
    write_atomically(target, b"two", 0o444)
    assert target.read_bytes() == b"two" and not leftover.exists()

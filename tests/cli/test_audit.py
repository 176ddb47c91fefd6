"""`draplane audit`: the audit log read back, as text or JSON lines, filtered."""

from __future__ import annotations

import json

from draplane.audit_log import encode_line
from draplane.cli import main
from draplane.messages import audit


def write_log(path) -> None:
    claim = audit.ClaimDevices(namespace="ml", name="llm-gpu", uid="c-1",
                               devices=[audit.DeviceRef(driver="gpu.nvidia.com", pool="dgx-0", device="gpu-3")])
    events = [
        audit.AuditEvent(id="placed/p-1", kind="placed", at=1767225600.25, by=["shard-1", "draplane-binder-ab"],
                         node="dgx-0", pod=audit.PodName(namespace="ml", name="llm", uid="p-1"), claims=[claim],
                         policy="draplane", score=12.5, reason="the best-scoring node under policy draplane"),
        audit.AuditEvent(id="rejected/p-2/x", kind="rejected", at=1767225601.0, by=["shard-0", "draplane-binder-ab"],
                         pod=audit.PodName(namespace="ml", name="big", uid="p-2"),
                         reason="0/4 nodes are available: 4 cannot allocate all claims"),
        audit.AuditEvent(id="released/c-1/9", kind="released", at=1767225602.0, by=["draplane-binder-ab"],
                         node="dgx-0", claims=[claim], reason="claim deleted"),
    ]
    path.write_bytes(b"".join(encode_line(i + 1, e, 1767225603.0) for i, e in enumerate(events)))


def test_text_says_when_what_who_where_which_devices_and_why(tmp_path, capsys):
    log = tmp_path / "audit.jsonl"
    write_log(log)
    assert main(["audit", "--log", str(log)]) == 0
    placed, rejected, released = capsys.readouterr().out.splitlines()
    assert placed.startswith("2026-01-01T00:00:00.250Z  placed")
    assert "pod ml/llm" in placed and "node dgx-0" in placed and "resourceclaim ml/llm-gpu: dgx-0/gpu-3" in placed
    assert "score 12.5 (draplane)" in placed and "by shard-1, draplane-binder-ab" in placed and "[seq 1]" in placed
    assert "why: 0/4 nodes are available" in rejected
    assert "why: claim deleted" in released


def test_filters_and_json_lines(tmp_path, capsys):
    log = tmp_path / "audit.jsonl"
    write_log(log)
    assert main(["audit", "--log", str(log), "--claim", "ml/llm-gpu", "-o", "json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["seq"], line["kind"]) for line in lines] == [(1, "placed"), (3, "released")]
    assert main(["audit", "--log", str(log), "--pod", "big"]) == 0
    assert capsys.readouterr().out.count("\n") == 1
    assert main(["audit", "--log", str(log), "--kind", "released", "--node", "dgx-0"]) == 0
    assert "released" in capsys.readouterr().out
    assert main(["audit", "--log", str(log), "--since", "2026-01-01T00:00:01.5Z"]) == 0
    assert capsys.readouterr().out.count("\n") == 1


def test_bad_since_and_missing_log_are_said(tmp_path, capsys):
    assert main(["audit", "--log", str(tmp_path / "none.jsonl"), "--since", "yesterday"]) == 2
    assert "give a duration" in capsys.readouterr().err
    assert main(["audit", "--log", str(tmp_path / "none.jsonl")]) == 1
    assert "cannot read the audit log" in capsys.readouterr().err


def test_a_reader_that_closes_the_pipe_gets_no_traceback(tmp_path):
    """`draplane audit | head -1`: head exits after one line, and the rest of the writes fail."""
    import subprocess
    import sys

    log = tmp_path / "audit.jsonl"
    write_log(log)
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join(lines * 3000))  # far more than a pipe's buffer holds
    command = f"{sys.executable} -m draplane.cli audit --log {log} | head -1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.stdout.count("\n") == 1 and "placed" in done.stdout
    assert done.stderr == "", done.stderr
    assert done.returncode == 141  # as a shell reports a command ended by SIGPIPE


def test_rotated_files_are_read_oldest_first_before_the_current_log(tmp_path, capsys):
    log = tmp_path / "audit.jsonl"
    write_log(log)
    lines = log.read_bytes().splitlines(keepends=True)
    (tmp_path / "audit.jsonl.2").write_bytes(lines[0])
    (tmp_path / "audit.jsonl.1").write_bytes(lines[1])
    log.write_bytes(lines[2])
    assert main(["audit", "--log", str(log), "-o", "json"]) == 0
    assert [json.loads(line)["seq"] for line in capsys.readouterr().out.splitlines()] == [1, 2, 3]

"""draplane.audit_log: lines that carry their stream sequence, a torn tail cut off, filters."""

from __future__ import annotations

import os

import pytest

from draplane import audit_log
from draplane.audit_log import Filter, LogFile, decode_line, encode_line, parse_since, read_lines, read_tail
from draplane.messages import audit


def event(i: int, **fields) -> audit.AuditEvent:
    base = dict(id=f"placed/pod-{i}", kind="placed", at=1000.0 + i, by=["shard-0"], node=f"n{i % 2}",
                pod=audit.PodName(namespace="ns", name=f"p{i}", uid=f"pod-{i}"),
                claims=[audit.ClaimDevices(namespace="ns", name=f"c{i}", uid=f"claim-{i}",
                                           devices=[audit.DeviceRef(driver="d", pool="n", device=f"gpu-{i}")])])
    return audit.AuditEvent(**{**base, **fields})


def test_a_line_is_the_event_with_its_sequence():
    line = decode_line(encode_line(7, event(1), recorded_at=5.0))
    assert (line.seq, line.recorded_at, line.id, line.claims[0].devices[0].device) == (7, 5.0, "placed/pod-1", "gpu-1")


def test_the_tail_gives_the_last_sequence_and_drops_a_torn_line():
    data = b"".join(encode_line(i, event(i)) for i in range(1, 4))
    torn = encode_line(4, event(4))[:-10]
    tail = read_tail(data + torn, 0)
    assert tail.last_seq == 3 and tail.valid_size == len(data) and tail.torn_bytes == len(torn)
    assert tail.recent_ids == ["placed/pod-1", "placed/pod-2", "placed/pod-3"]


def test_a_tail_read_from_the_middle_skips_the_partial_first_line():
    data = b"".join(encode_line(i, event(i)) for i in range(1, 4))
    tail = read_tail(data[5:], 5)
    assert tail.last_seq == 3 and tail.recent_ids == ["placed/pod-2", "placed/pod-3"]
    assert tail.unreadable_lines == 0


def test_an_empty_log_starts_at_zero():
    assert read_tail(b"", 0).last_seq == 0


def test_the_file_is_cut_back_to_its_last_complete_line_when_opened(tmp_path):
    path = tmp_path / "audit.jsonl"
    whole = encode_line(1, event(1))
    path.write_bytes(whole + b'{"seq": 2, "id": "pla')
    log = LogFile(path)
    tail = log.open()
    assert tail.last_seq == 1 and path.read_bytes() == whole
    log.append(encode_line(2, event(2)))
    log.close()
    assert [line.seq for line in read_lines(path.read_bytes().splitlines())] == [1, 2]


def test_a_failed_append_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "audit.jsonl"
    log = LogFile(path)
    log.open()
    log.append(encode_line(1, event(1)))
    before = path.read_bytes()
    real_fsync = os.fsync

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(audit_log.os, "fsync", full_disk)
    with pytest.raises(OSError):
        log.append(encode_line(2, event(2)))
    monkeypatch.setattr(audit_log.os, "fsync", real_fsync)
    assert path.read_bytes() == before
    log.append(encode_line(2, event(2)))
    assert [line.seq for line in read_lines(path.read_bytes().splitlines())] == [1, 2]


def test_filters_by_claim_pod_node_kind_and_time():
    raw = [encode_line(i, event(i)) for i in range(1, 5)]
    raw.append(encode_line(5, event(5, id="released/claim-2/9", kind="released", pod=None, node="n0",
                                    claims=[audit.ClaimDevices(namespace="ns", name="c2", uid="claim-2")])))
    raw.append(b"not a line\n")
    lines = lambda f: [line.seq for line in read_lines(raw, f)]  # noqa: E731
    assert lines(Filter(claim="c2")) == [2, 5]
    assert lines(Filter(claim="ns/c2")) == [2, 5] and lines(Filter(claim="other/c2")) == []
    assert lines(Filter(pod="ns/p3")) == [3]
    assert lines(Filter(node="n1")) == [1, 3]
    assert lines(Filter(kinds=frozenset({"released"}))) == [5]
    assert lines(Filter(since=1003.0)) == [3, 4, 5]


def test_since_takes_a_duration_or_a_time():
    assert parse_since("10m", now=1000.0) == 400.0
    assert parse_since("1d", now=100000.0) == 100000.0 - 86400
    assert parse_since("2026-01-01T00:00:00Z") == 1767225600.0
    with pytest.raises(ValueError, match="give a duration"):
        parse_since("yesterday")


def test_the_log_rotates_past_max_bytes_keeps_its_backups_and_resumes_after_a_rotation(tmp_path):
    path = tmp_path / "audit.jsonl"
    line = len(encode_line(12, event(12), recorded_at=5.0))  # the longest: three lines fit a file, four do not
    log = LogFile(path, max_bytes=3 * line, backups=2)
    assert log.open().last_seq == 0
    for seq in range(1, 13):  # 12 lines, 3 a file: 4 files written, the oldest dropped
        log.append(encode_line(seq, event(seq), recorded_at=5.0))
    log.close()
    files = audit_log.log_files(path)
    assert [f.name for f in files] == ["audit.jsonl.2", "audit.jsonl.1", "audit.jsonl"]
    seqs = [line.seq for f in files for line in read_lines(f.read_bytes().splitlines())]
    assert seqs == list(range(4, 13)) and log.rotations == 3
    assert all(f.stat().st_size <= 3 * line + 50 for f in files)
    # a stop right after a rotation: the new log is empty, the resume point is the last file's end
    log = LogFile(path, max_bytes=3 * line, backups=2)
    log.open()
    log.append(encode_line(13, event(13), recorded_at=5.0))  # the full file rotates first
    log.close()
    path.write_bytes(b"")
    tail = LogFile(path, max_bytes=3 * line, backups=2).open()
    assert tail.last_seq == 12 and tail.recent_ids[-1] == "placed/pod-12"


def test_rotation_limits_are_checked():
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        LogFile(audit_log.Path("x"), max_bytes=0)
    with pytest.raises(ValueError, match="backups must be at least 1"):
        LogFile(audit_log.Path("x"), backups=0)


def test_a_rotation_that_fails_leaves_the_log_writable_and_is_tried_again(tmp_path, monkeypatch):
    path = tmp_path / "audit.jsonl"
    line = len(encode_line(12, event(12), recorded_at=5.0))
    log = LogFile(path, max_bytes=line, backups=2)
    log.open()
    log.append(encode_line(1, event(1), recorded_at=5.0))
    real_open = os.open

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(audit_log.os, "open", full_disk)
    with pytest.raises(OSError):
        log.append(encode_line(2, event(2), recorded_at=5.0))
    monkeypatch.setattr(audit_log.os, "open", real_open)
    log.append(encode_line(2, event(2), recorded_at=5.0))  # the rotation again, now it works
    log.close()
    seqs = [line.seq for f in audit_log.log_files(path) for line in read_lines(f.read_bytes().splitlines())]
    assert seqs == [1, 2]

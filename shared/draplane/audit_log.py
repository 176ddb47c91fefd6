"""The audit log's format: JSON lines written by `draplane-audit`, read back by `draplane audit`.

Each line is one `AuditLine`: the event as published, plus `seq`, its sequence in the audit
stream, and `recorded_at`. The sequence is in the line, not in a side file, so that the event and
the position it was read up to are written by one `write()` and cannot disagree: after a crash the
last complete line says where to resume, and a line cut short by the crash is cut off (its event
was never acknowledged, so JetStream delivers it again).

The pure parts (encoding lines, finding where a log ends, filtering) are functions here; `LogFile`
is the file itself (append + fsync, truncate a torn tail), used by the subscriber in a thread.

Rotation, as logrotate's numbering: once the log would pass `max_bytes`, audit.jsonl becomes
audit.jsonl.1 (and .1 becomes .2, up to `backups`; the oldest goes) and a new audit.jsonl
begins. Each step is one rename, so a crash between them loses no line; a new, still empty log
resumes from the end of audit.jsonl.1. `draplane audit` reads the rotated files, oldest first.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec

from draplane.messages.audit import AuditEvent

LOG_NAME = "audit.jsonl"
# How much of the log's end is read at start: enough for RECENT_IDS lines of a few hundred bytes.
TAIL_BYTES = 8 * 1024 * 1024
# Event ids remembered to drop a publisher's repeat that JetStream's duplicate window let through.
RECENT_IDS = 20_000
# Rotation defaults (draplane-audit's --max-bytes and --backups): 100 MiB a file, 5 kept.
DEFAULT_MAX_BYTES = 100 * 1024 * 1024
DEFAULT_BACKUPS = 5


def rotated_path(path: Path, number: int) -> Path:
    return path.with_name(f"{path.name}.{number}")


def log_files(path: Path) -> list[Path]:
    """The log and its rotated files that exist, oldest first (audit.jsonl.N ... .1, audit.jsonl)."""
    # every number there, not only up to a gap: a rotation cut short leaves one
    numbered = []
    if path.parent.is_dir():
        for candidate in path.parent.glob(f"{glob.escape(path.name)}.*"):
            suffix = candidate.name[len(path.name) + 1:]
            if suffix.isdigit():
                numbered.append((int(suffix), candidate))
    return [p for _, p in sorted(numbered, reverse=True)] + ([path] if path.exists() else [])


class AuditLine(AuditEvent, kw_only=True, omit_defaults=True):
    seq: int
    recorded_at: float


_line_encoder = msgspec.json.Encoder()
_line_decoder = msgspec.json.Decoder(AuditLine)


def encode_line(seq: int, event: AuditEvent, recorded_at: float | None = None) -> bytes:
    fields = {f: getattr(event, f) for f in event.__struct_fields__}
    line = AuditLine(**fields, seq=seq, recorded_at=time.time() if recorded_at is None else recorded_at)
    return _line_encoder.encode(line) + b"\n"


def unreadable_line(seq: int, size: int, why: str, recorded_at: float | None = None) -> bytes:
    """What stands in the log for a message that was not an audit event: the stream's sequence is
    accounted for, and a reader sees that something was skipped and why."""
    now = time.time() if recorded_at is None else recorded_at
    event = AuditEvent(id=f"unreadable/{seq}", kind="unreadable", at=now, by=["draplane-audit"],
                       reason=f"{why} ({size} bytes)")
    return encode_line(seq, event, now)


def line_json(line: AuditLine) -> bytes:
    return _line_encoder.encode(line)


def decode_line(line: bytes) -> AuditLine:
    return _line_decoder.decode(line)


@dataclasses.dataclass(slots=True)
class Tail:
    """Where the log ends: its last sequence, the size without a torn last line, recent ids."""

    last_seq: int
    valid_size: int
    recent_ids: list[str]
    torn_bytes: int = 0  # a line cut short by a crash, dropped
    unreadable_lines: int = 0  # complete lines that do not parse (edited by hand?), skipped


def read_tail(chunk: bytes, chunk_offset: int) -> Tail:
    """The end of a log from its last `len(chunk)` bytes, which start at `chunk_offset`."""
    end = chunk_offset + len(chunk)
    last_newline = chunk.rfind(b"\n")
    complete = chunk[: last_newline + 1] if last_newline >= 0 else b""
    torn = len(chunk) - len(complete)
    lines = complete.split(b"\n")[:-1] if complete else []
    if chunk_offset > 0 and lines:
        lines = lines[1:]  # the chunk began inside a line
    last_seq = 0
    ids: list[str] = []
    unreadable = 0
    for raw in lines:
        if not raw.strip():
            continue
        try:
            line = decode_line(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            unreadable += 1
            continue
        last_seq = max(last_seq, line.seq)
        ids.append(line.id)
    return Tail(last_seq=last_seq, valid_size=end - torn, recent_ids=ids[-RECENT_IDS:], torn_bytes=torn,
                unreadable_lines=unreadable)


class LogFile:
    """The log on disk. Blocking calls: the subscriber runs them in a thread."""

    def __init__(self, path: Path, *, max_bytes: int | None = None, backups: int = DEFAULT_BACKUPS):
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"audit log {path}: max_bytes must be positive, got {max_bytes}")
        if backups < 1:
            raise ValueError(f"audit log {path}: backups must be at least 1, got {backups}")
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._fd: int | None = None
        self.size = 0
        self.rotations = 0

    def open(self) -> Tail:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o640)
        if created:
            _fsync_dir(self.path.parent)
        size = os.fstat(self._fd).st_size
        offset = max(0, size - TAIL_BYTES)
        chunk = os.pread(self._fd, size - offset, offset)
        tail = read_tail(chunk, offset)
        if tail.torn_bytes:
            os.ftruncate(self._fd, tail.valid_size)
            os.fsync(self._fd)
        self.size = tail.valid_size
        previous = rotated_path(self.path, 1)
        if tail.last_seq == 0 and previous.exists():
            # rotated just before a stop: where to resume, and the recent ids, are in the last file
            with previous.open("rb") as handle:
                end = handle.seek(0, os.SEEK_END)
                start = max(0, end - TAIL_BYTES)
                handle.seek(start)
                before = read_tail(handle.read(), start)
            tail = dataclasses.replace(tail, last_seq=before.last_seq, recent_ids=before.recent_ids)
        return tail

    def _rotate(self) -> None:
        """audit.jsonl -> .1 -> .2 ... -> .`backups` (the oldest dropped), then a new audit.jsonl."""
        assert self._fd is not None
        # The old descriptor stays open (and in use) until the new file is: a failure here (a
        # full disk, too many files) raises OSError with the log still writable, and the next
        # append tries the rotation again.
        for number in range(self.backups, 0, -1):
            source = rotated_path(self.path, number - 1) if number > 1 else self.path
            if source.exists():
                os.replace(source, rotated_path(self.path, number))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o640)
        old, self._fd = self._fd, fd
        os.close(old)
        _fsync_dir(self.path.parent)
        self.size = 0
        self.rotations += 1

    def append(self, data: bytes) -> None:
        """Write and fsync, or leave the file as it was: a failed write (a full disk) is cut off
        again, so the next attempt does not append after half a line. Rotates first when the
        data would take the log past `max_bytes` (a batch is never split between two files)."""
        assert self._fd is not None
        if self.max_bytes is not None and self.size > 0 and self.size + len(data) > self.max_bytes:
            self._rotate()
        start = self.size
        try:
            view = memoryview(data)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            os.fsync(self._fd)
        except OSError:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass
            raise
        self.size = start + len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading it back -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Filter:
    claim: str | None = None  # "ns/name" or "name"
    pod: str | None = None
    node: str | None = None
    since: float | None = None  # unix seconds
    kinds: frozenset[str] = frozenset()

    def matches(self, line: AuditLine) -> bool:
        if self.since is not None and line.at < self.since:
            return False
        if self.kinds and line.kind not in self.kinds:
            return False
        if self.node is not None and line.node != self.node:
            return False
        if self.pod is not None and (line.pod is None or not _names(self.pod, line.pod.namespace, line.pod.name)):
            return False
        if self.claim is not None and not any(_names(self.claim, c.namespace, c.name) for c in line.claims):
            return False
        return True


def _names(wanted: str, namespace: str, name: str) -> bool:
    return wanted == f"{namespace}/{name}" if "/" in wanted else wanted == name


def read_lines(lines: Iterable[bytes], where: Filter = Filter()) -> Iterator[AuditLine]:
    """The log's lines that match, one at a time (a log of any size in constant memory)."""
    for raw in lines:
        if not raw.strip():
            continue
        try:
            line = decode_line(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if where.matches(line):
            yield line


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """`10m`, `2h`, `1d` ago, or an RFC 3339 time; unix seconds. ValueError says what is accepted."""
    now = time.time() if now is None else now
    match = _DURATION.match(text.strip())
    if match:
        return now - float(match.group(1)) * _UNITS[match.group(2)]
    from datetime import datetime

    try:
        return datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ValueError(f"--since {text!r}: give a duration (30s, 10m, 2h, 1d) or a time "
                         "(2026-05-01T12:00:00Z)") from None

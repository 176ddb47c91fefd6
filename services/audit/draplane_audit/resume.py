"""The audit subscriber's decisions, pure: where to resume, and what a fetched batch becomes.

Exactly once, and why it holds:
- The log is the one record of progress. Each line carries its event's stream sequence, and the
  subscriber acknowledges a batch only after its lines are written and fsynced.
- At start, the durable consumer is kept only if it agrees with the log: everything up to the log's
  last sequence acknowledged and nothing delivered beyond it. Otherwise it is created again to
  start right after the log's last sequence. (A consumer that had delivered messages to the process
  that died would redeliver them only after their ack wait, after newer ones: resuming from the log
  instead keeps the log in stream order, with no gap.)
- A message at or below the last sequence written (redelivered: the ack was lost) is acknowledged
  and not written again; an event whose id was written recently (a publisher's repeat that
  JetStream's duplicate window did not catch) likewise.
- A message that is not an audit event is written as an `unreadable` line, counted, and
  terminated, so it is never redelivered: not a crash, not a loop.
"""

from __future__ import annotations

import collections
import dataclasses

from draplane.audit_log import encode_line, unreadable_line
from draplane.messages.audit import AuditEvent, MessageError, decode_event


@dataclasses.dataclass(frozen=True, slots=True)
class ConsumerState:
    ack_floor: int  # stream sequence acknowledged up to
    delivered: int  # stream sequence delivered up to
    ack_pending: int


@dataclasses.dataclass(frozen=True, slots=True)
class Resume:
    """Bind the durable consumer as it is."""


@dataclasses.dataclass(frozen=True, slots=True)
class StartAt:
    """Create the durable consumer (again) to deliver from this stream sequence."""

    sequence: int
    why: str


def resume_plan(log_last: int, consumer: ConsumerState | None, stream_first: int, stream_last: int) -> Resume | StartAt:
    if stream_last < log_last:
        # The stream was made anew (NATS lost its store): its sequences started over.
        return StartAt(max(1, stream_first), f"the stream ends at {stream_last}, before the log's last event "
                                             f"{log_last}: it was created again; reading it from its start")
    if consumer is None:
        return StartAt(log_last + 1, "no consumer yet")
    if consumer.ack_floor == log_last and consumer.delivered == log_last and consumer.ack_pending == 0:
        return Resume()
    return StartAt(log_last + 1, f"the consumer (acknowledged {consumer.ack_floor}, delivered {consumer.delivered}, "
                                 f"{consumer.ack_pending} pending) does not match the log (last {log_last})")


class RecentIds:
    """The ids of the last `limit` events written, in a bounded set."""

    def __init__(self, ids=(), limit: int = 20_000):
        self._order: collections.deque[str] = collections.deque()
        self._set: set[str] = set()
        self.limit = limit
        for i in ids:
            self.add(i)

    def __contains__(self, event_id: str) -> bool:
        return event_id in self._set

    def add(self, event_id: str) -> None:
        if event_id in self._set:
            return
        self._order.append(event_id)
        self._set.add(event_id)
        while len(self._order) > self.limit:
            self._set.discard(self._order.popleft())

    def __len__(self) -> int:
        return len(self._order)


@dataclasses.dataclass(slots=True)
class Batch:
    data: bytes  # the lines to append, in one write
    ack: list[int]  # indexes of the fetched messages to acknowledge once written
    term: list[int]  # indexes to terminate (not audit events)
    last_seq: int  # the log's last sequence once written
    kinds: collections.Counter  # events written, by kind
    events: list[AuditEvent]  # the events written
    redelivered: int = 0
    repeated: int = 0
    unreadable: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (seq, why)
    gaps: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # missing stream sequences, first..last

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.events]


def plan_batch(messages: list[tuple[int, bytes]], last_seq: int, recent: RecentIds, now: float) -> Batch:
    """`messages`: (stream sequence, data) as fetched, in order. Nothing here writes or acks."""
    lines: list[bytes] = []
    batch = Batch(data=b"", ack=[], term=[], last_seq=last_seq, kinds=collections.Counter(), events=[])
    seen_here: set[str] = set()
    for index, (seq, data) in enumerate(messages):
        if seq <= batch.last_seq:
            batch.redelivered += 1
            batch.ack.append(index)
            continue
        if seq > batch.last_seq + 1 and batch.last_seq > 0:
            # Sequences of a stream are contiguous; missing ones were removed before we read them
            # (their max age passed while the subscriber was down). Said, not hidden.
            batch.gaps.append((batch.last_seq + 1, seq - 1))
        try:
            event = decode_event(data)
        except MessageError as exc:
            lines.append(unreadable_line(seq, len(data), str(exc), now))
            batch.unreadable.append((seq, str(exc)))
            batch.term.append(index)
            batch.last_seq = seq
            continue
        batch.last_seq = seq
        batch.ack.append(index)
        if event.id in recent or event.id in seen_here:
            batch.repeated += 1
            continue
        seen_here.add(event.id)
        lines.append(encode_line(seq, event, now))
        batch.kinds[event.kind] += 1
        batch.events.append(event)
    batch.data = b"".join(lines)
    return batch

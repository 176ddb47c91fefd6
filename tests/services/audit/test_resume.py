"""draplane_audit.resume: where the subscriber resumes, and what a fetched batch becomes."""

from __future__ import annotations

from draplane.audit_log import decode_line
from draplane.messages import audit
from draplane_audit.resume import ConsumerState, RecentIds, Resume, StartAt, plan_batch, resume_plan


def data(i: int, kind: str = "placed") -> bytes:
    return audit.encode_event(audit.AuditEvent(id=f"{kind}/pod-{i}", kind=kind, at=float(i), by=["binder"]))


def lines(batch) -> list:
    return [decode_line(raw) for raw in batch.data.splitlines()]


def test_a_consumer_that_agrees_with_the_log_is_kept():
    assert resume_plan(10, ConsumerState(ack_floor=10, delivered=10, ack_pending=0), 1, 50) == Resume()


def test_a_crash_between_write_and_ack_resumes_after_the_log_not_the_consumer():
    # Written up to 12, acknowledged up to 10: starting from the consumer would write 11 and 12 twice.
    plan = resume_plan(12, ConsumerState(ack_floor=10, delivered=12, ack_pending=2), 1, 50)
    assert isinstance(plan, StartAt) and plan.sequence == 13


def test_messages_delivered_to_the_dead_process_are_read_from_the_log_position_in_order():
    # Delivered up to 20 but written up to 10: kept, the consumer would send 21.. now and 11..20
    # only after their ack wait; resuming at 11 keeps the log in stream order with no gap.
    plan = resume_plan(10, ConsumerState(ack_floor=10, delivered=20, ack_pending=10), 1, 50)
    assert isinstance(plan, StartAt) and plan.sequence == 11


def test_no_consumer_starts_after_the_log_and_a_new_stream_from_its_start():
    assert resume_plan(0, None, 1, 0) == StartAt(1, "no consumer yet")
    plan = resume_plan(500, ConsumerState(500, 500, 0), 1, 3)
    assert isinstance(plan, StartAt) and plan.sequence == 1 and "created again" in plan.why


def test_a_batch_is_written_in_order_with_each_line_naming_its_sequence():
    batch = plan_batch([(1, data(1)), (2, data(2)), (3, data(3, "released"))], 0, RecentIds(), now=9.0)
    assert [(line.seq, line.kind) for line in lines(batch)] == [(1, "placed"), (2, "placed"), (3, "released")]
    assert batch.ack == [0, 1, 2] and batch.term == [] and batch.last_seq == 3
    assert batch.kinds == {"placed": 2, "released": 1}


def test_redelivered_messages_are_acknowledged_and_not_written_again():
    batch = plan_batch([(4, data(4)), (5, data(5)), (6, data(6))], 5, RecentIds(), now=9.0)
    assert [line.seq for line in lines(batch)] == [6]
    assert batch.ack == [0, 1, 2] and batch.redelivered == 2


def test_an_event_published_twice_is_written_once():
    recent = RecentIds(["placed/pod-1"])
    batch = plan_batch([(8, data(1)), (9, data(2)), (10, data(2))], 7, recent, now=9.0)
    assert [line.id for line in lines(batch)] == ["placed/pod-2"]
    assert batch.repeated == 2 and batch.ack == [0, 1, 2] and batch.last_seq == 10


def test_a_malformed_message_is_recorded_as_unreadable_and_terminated():
    batch = plan_batch([(1, data(1)), (2, b"\x00garbage"), (3, data(3))], 0, RecentIds(), now=9.0)
    written = lines(batch)
    assert [(line.seq, line.kind) for line in written] == [(1, "placed"), (2, "unreadable"), (3, "placed")]
    assert "not an audit event" in written[1].reason
    assert batch.term == [1] and batch.ack == [0, 2] and batch.unreadable[0][0] == 2


def test_missing_sequences_are_reported_as_a_gap():
    batch = plan_batch([(5, data(5)), (9, data(9))], 4, RecentIds(), now=9.0)
    assert batch.gaps == [(6, 8)]


def test_recent_ids_are_bounded():
    recent = RecentIds(limit=3)
    for i in range(10):
        recent.add(f"id-{i}")
    assert len(recent) == 3 and "id-9" in recent and "id-6" not in recent

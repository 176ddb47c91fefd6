"""Which unanswered PendingPods the binder sends again: only those their shard acknowledged and
whose answer, had there been one, the binder would have handled by now."""

from draplane_binder.in_flight import (
    ANSWER_EXPECTED_SECONDS,
    InFlight,
    lost,
    to_ask_about,
    waiting_for_answers,
)

LATE = ANSWER_EXPECTED_SECONDS + 1
PENDING_LAST = 100_000  # the pending stream's last sequence: every test's PendingPods are in it


def test_a_young_pending_pod_is_neither_asked_about_nor_lost():
    in_flight = {"a": InFlight(since=100.0, shard=0, sequence=5)}
    now = 100.0 + ANSWER_EXPECTED_SECONDS
    assert not waiting_for_answers(in_flight, now)
    assert to_ask_about(in_flight, now) == set()
    assert lost(in_flight, {0: 10}, now, pending_last=PENDING_LAST, results_last=3, results_handled=3) == []


def test_a_backlog_no_shard_has_reached_is_not_sent_again():
    # 20,000 queued and no shard running: no consumer, no floor; nothing is lost, look after look
    in_flight = {f"p{i}": InFlight(since=0.0, shard=i % 2, sequence=i + 1) for i in range(20000)}
    assert to_ask_about(in_flight, LATE) == {0, 1}
    for now in (LATE, LATE + 5, LATE + 10):
        assert lost(in_flight, {}, now, pending_last=PENDING_LAST, results_last=0, results_handled=0) == []
        assert lost(in_flight, {0: None, 1: None}, now, pending_last=PENDING_LAST, results_last=0, results_handled=0) == []


def test_acknowledged_ones_are_sent_again_once_the_answers_before_them_are_handled():
    in_flight = {
        "acked": InFlight(since=0.0, shard=0, sequence=7),
        "at-the-floor": InFlight(since=0.0, shard=0, sequence=9),
        "still-queued": InFlight(since=0.0, shard=0, sequence=10),
        "other-shard": InFlight(since=0.0, shard=1, sequence=3),
    }
    # first look: the floors passed two of them; their answers may be among results 1..40
    assert lost(in_flight, {0: 9, 1: 2}, LATE, pending_last=PENDING_LAST, results_last=40, results_handled=12) == []
    assert in_flight["acked"].answer_by == 40 and in_flight["still-queued"].answer_by is None
    assert to_ask_about(in_flight, LATE) == {0, 1}  # still-queued and other-shard wait for a floor
    # the binder has not handled result 40 yet: an answer may be waiting behind its writes
    assert lost(in_flight, {0: 9, 1: 2}, LATE + 5, pending_last=PENDING_LAST, results_last=55, results_handled=39) == []
    # it has: no answer came, and none will
    assert sorted(lost(in_flight, {0: 9, 1: 2}, LATE + 10, pending_last=PENDING_LAST, results_last=60, results_handled=40)) == [
        "acked", "at-the-floor"]


def test_an_unknown_results_sequence_decides_nothing():
    in_flight = {"acked": InFlight(since=0.0, shard=0, sequence=7)}
    assert lost(in_flight, {0: 9}, LATE, pending_last=PENDING_LAST, results_last=None, results_handled=None) == []
    assert in_flight["acked"].answer_by is None
    lost(in_flight, {0: 9}, LATE, pending_last=PENDING_LAST, results_last=5, results_handled=None)
    assert lost(in_flight, {0: 9}, LATE + 5, pending_last=PENDING_LAST, results_last=5, results_handled=None) == []


def test_a_backlog_slower_than_any_age_bound_is_still_not_sent_again():
    # 20,000 pods drained at 7 pods/s take 48 minutes: the last ones wait that long, answered later
    in_flight = {f"p{i}": InFlight(since=0.0, shard=0, sequence=i + 1) for i in range(20000)}
    assert lost(in_flight, {0: 5000}, 3600.0, pending_last=20000, results_last=5000, results_handled=0) == []
    assert lost(in_flight, {0: 5000}, 3605.0, pending_last=20000, results_last=5100, results_handled=4999) == []


def test_an_unknown_sequence_or_a_stream_made_again_is_sent_again():
    in_flight = {
        "no-ack": InFlight(since=0.0, shard=0),
        "beyond-the-new-pending-stream": InFlight(since=0.0, shard=0, sequence=50),
        "queued": InFlight(since=0.0, shard=0, sequence=9),
        "answer-beyond-the-new-results-stream": InFlight(since=0.0, shard=0, sequence=3, answer_by=70),
    }
    assert sorted(lost(in_flight, {0: 1}, LATE, pending_last=10, results_last=12, results_handled=0)) == [
        "answer-beyond-the-new-results-stream", "beyond-the-new-pending-stream", "no-ack"]
    assert to_ask_about(in_flight, LATE) == {0}

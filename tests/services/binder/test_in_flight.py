"""Which unanswered PendingPods the binder sends again: only those their shard acknowledged."""

from draplane_binder.in_flight import ANSWER_EXPECTED_SECONDS, GIVE_UP_SECONDS, InFlight, lost, to_ask_about

LATE = ANSWER_EXPECTED_SECONDS + 1


def test_a_young_pending_pod_is_neither_asked_about_nor_lost():
    in_flight = {"a": InFlight(since=100.0, shard=0, sequence=5)}
    assert to_ask_about(in_flight, 100.0 + ANSWER_EXPECTED_SECONDS) == set()
    assert lost(in_flight, {0: 10}, 100.0 + ANSWER_EXPECTED_SECONDS) == []


def test_a_backlog_no_shard_has_reached_is_not_sent_again():
    # 20,000 queued and no shard running: no consumer, no floor; nothing is lost
    in_flight = {f"p{i}": InFlight(since=0.0, shard=i % 2, sequence=i + 1) for i in range(20000)}
    assert to_ask_about(in_flight, LATE) == {0, 1}
    assert lost(in_flight, {}, LATE) == []
    assert lost(in_flight, {0: None, 1: None}, LATE) == []


def test_acknowledged_and_unanswered_ones_are_sent_again_those_above_the_floor_wait():
    in_flight = {
        "acked": InFlight(since=0.0, shard=0, sequence=7),
        "at-the-floor": InFlight(since=0.0, shard=0, sequence=9),
        "still-queued": InFlight(since=0.0, shard=0, sequence=10),
        "other-shard": InFlight(since=0.0, shard=1, sequence=3),
    }
    assert sorted(lost(in_flight, {0: 9, 1: 2}, LATE)) == ["acked", "at-the-floor"]


def test_an_unknown_sequence_or_a_very_old_one_is_sent_again():
    in_flight = {
        "no-ack": InFlight(since=0.0, shard=0),
        "ancient": InFlight(since=0.0, shard=0, sequence=50),
        "queued": InFlight(since=GIVE_UP_SECONDS - LATE, shard=0, sequence=51),
    }
    now = GIVE_UP_SECONDS + 1
    assert sorted(lost(in_flight, {0: 1}, now)) == ["ancient", "no-ack"]
    # the one past giving up needs no floor, nor does one without a sequence
    assert to_ask_about(in_flight, now) == {0}

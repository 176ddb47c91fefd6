"""draplane.scheduling.cluster_changes: the binder's change batches, and how a shard counts the
stream sequences it has taken in."""

import pytest

from draplane.scheduling import cluster_changes as cc


def test_a_round_round_trips_in_order_and_large_values_are_named_not_carried():
    big = b"x" * (cc.MAX_VALUE_IN_BATCH + 1)
    changes = [cc.change("pod.a", 7, b"pod"), cc.change("claim.b", 8, None), cc.change("claim.c", 9, big)]
    assert changes[2] == cc.Change("claim.c", 9, None, True)
    [batch] = cc.encode_batches("binder-1", changes)
    decoded = cc.decode_changes("meta.changes.t.1", batch)
    assert decoded.binder == "binder-1"
    assert decoded.changes == [cc.Change("pod.a", 7, b"pod"), cc.Change("claim.b", 8, None),
                               cc.Change("claim.c", 9, None, True)]
    assert len(batch) < 200  # the large value is not in it


def test_a_large_round_is_split_into_batches_of_bounded_size_in_order():
    changes = [cc.change(f"pod.{i}", i, b"v" * 1000) for i in range(1, 101)]
    batches = cc.encode_batches("b", changes, max_bytes=10_000)
    assert len(batches) > 5
    assert all(len(b) < 12_000 for b in batches)
    names = [c.revision for b in batches for c in cc.decode_changes("k", b).changes]
    assert names == list(range(1, 101))


def test_an_unreadable_batch_names_its_key():
    with pytest.raises(cc.ChangesError, match="'meta.changes.t.3'"):
        cc.decode_changes("meta.changes.t.3", b"\xc1 not msgpack")
    with pytest.raises(cc.ChangesError):
        cc.decode_changes("meta.changes.t.3", cc._ENCODER.encode({"binder": 1}))


def test_batch_keys_are_their_own():
    key = cc.changes_key("a1b2", 12)
    assert cc.is_changes_key(key) and key == "meta.changes.a1b2.12"
    assert not cc.is_changes_key("meta.synced") and not cc.is_changes_key("pod.meta.changes.x")


def test_taken_advances_over_what_follows_and_keeps_what_is_ahead():
    taken = cc.Taken(10)
    assert taken.has(3) and taken.has(10) and not taken.has(11)
    taken.take(11)
    assert taken.upto == 11 and taken.missing() is None
    taken.take(14)  # a batch named 14: 12 and 13 are missing
    taken.take(15)
    assert taken.upto == 11 and taken.has(14) and not taken.has(12)
    assert taken.missing() == (12, 15)
    taken.take(12)
    assert taken.upto == 12 and taken.missing() == (13, 15)
    assert taken.highest() == 15
    taken.take(13)  # the gap closes: everything up to 15 is taken
    assert taken.upto == 15 and taken.missing() is None and not taken.ahead
    assert taken.highest() == 15


def test_taken_through_a_read_of_the_stream_and_what_lies_beyond_it():
    taken = cc.Taken(0)
    for sequence in (5, 9, 12):
        taken.take(sequence)
    taken.take_through(8)  # the stream was read up to 8 (what was not there was overwritten)
    assert taken.upto == 9 and taken.ahead == {12}  # 9 was taken already: the count goes on over it
    taken.take_through(4)  # behind: nothing changes
    assert taken.upto == 9
    taken.take(10)
    taken.take(11)
    assert taken.upto == 12 and not taken.ahead

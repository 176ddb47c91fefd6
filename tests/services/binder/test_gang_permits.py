"""draplane_binder.gang_permits: a gang's members, placed together, pass Permit all or none."""

from __future__ import annotations

import asyncio

import pytest

from draplane.scheduling.messages import GangCommit
from draplane_binder import gang_permits as gp
from draplane_binder.gang_permits import GangPermits


async def _kept() -> None:
    return None


def _commit(members: int, commit: str = "c1") -> GangCommit:
    return GangCommit(key="ns/workers", commit=commit, members=members)


async def test_the_members_go_on_together_once_all_have_passed_permit():
    permits = GangPermits(timeout=5)
    first = asyncio.create_task(permits.wait(_commit(3), "a", _kept))
    second = asyncio.create_task(permits.wait(_commit(3), "b", _kept))
    await asyncio.sleep(0.05)
    assert not first.done() and not second.done()  # two of three: they wait
    assert await permits.wait(_commit(3), "c", _kept) is None
    assert await first is None and await second is None


async def test_one_member_failing_turns_the_waiting_ones_and_the_late_ones_back():
    permits = GangPermits(timeout=5)
    waiting = asyncio.create_task(permits.wait(_commit(3), "a", _kept))
    await asyncio.sleep(0.01)
    permits.reject(_commit(3), "member ns/b failed: the pod is gone")
    assert await waiting == "member ns/b failed: the pod is gone"
    # a member whose Placement is handled after that learns it at once
    assert await permits.wait(_commit(3), "c", _kept) == "member ns/b failed: the pod is gone"


async def test_a_failure_after_the_gang_went_on_changes_nothing():
    permits = GangPermits(timeout=5)
    assert await permits.wait(_commit(1), "a", _kept) is None
    permits.reject(_commit(1), "member ns/a failed in PreBind")
    assert await permits.wait(_commit(1), "a", _kept) is None  # redelivered: still open


async def test_members_that_never_come_time_the_gang_out_and_keep_the_leases_meanwhile(monkeypatch):
    monkeypatch.setattr(gp, "KEEP_ALIVE_SECONDS", 0.05)
    kept = []

    async def keep():
        kept.append(1)

    permits = GangPermits(timeout=0.3)
    why = await permits.wait(_commit(2), "a", keep)
    assert why == "1 of its 2 members passed Permit within 0.3 s"
    assert len(kept) >= 3


async def test_the_barriers_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(gp, "MAX_BARRIERS", 3)
    permits = GangPermits(timeout=5)
    for i in range(10):
        assert await permits.wait(_commit(1, f"c{i}"), "a", _kept) is None
    assert len(permits) <= 3


def test_a_gang_bigger_than_the_binder_can_hold_unacknowledged_is_not_held_back():
    permits = GangPermits()
    assert permits.can_gather(_commit(50_000))  # no limit known yet
    permits.max_members = 16_384  # the results consumer's max_ack_pending
    assert permits.can_gather(_commit(16_384))
    assert not permits.can_gather(_commit(16_385))  # its last members would never be delivered


# --- marks: a barrier that opened, for a binder that restarts (real NATS) ---------------------------


async def _marks(nats, subject_prefix):
    from draplane.jetstream import streams
    from draplane.scheduling.messages import Subjects

    kv = await streams.gang_permits_bucket(nats.jetstream(), Subjects(prefix=subject_prefix), ttl=60)
    return gp.GangPermitMarks(kv)


@pytest.mark.integration
async def test_a_restarted_binder_lets_the_rest_of_an_opened_gang_pass_at_once(nats, subject_prefix):
    marks = await _marks(nats, subject_prefix)
    before = GangPermits(timeout=5, marks=marks)
    first = asyncio.create_task(before.wait(_commit(2, "opened-commit"), "a", _kept))
    assert await before.wait(_commit(2, "opened-commit"), "b", _kept) is None
    assert await first is None
    assert await marks.opened("opened-commit")
    # the binder dies after binding a (acknowledged) and before b; b's Placement comes again to a
    # new binder, which has no barriers in memory: it passes at once, not after the timeout
    after = GangPermits(timeout=30, marks=marks)
    assert await asyncio.wait_for(after.wait(_commit(2, "opened-commit"), "b", _kept), 5) is None
    # and a failure after that changes nothing, as for a barrier opened here
    after.reject(_commit(2, "opened-commit"), "member ns/b failed in PreBind")
    assert await after.wait(_commit(2, "opened-commit"), "b", _kept) is None


@pytest.mark.integration
async def test_a_gang_whose_barrier_never_opened_still_waits_and_times_out_after_a_restart(nats, subject_prefix):
    marks = await _marks(nats, subject_prefix)
    after = GangPermits(timeout=0.3, marks=marks)
    why = await after.wait(_commit(2, "never-opened"), "b", _kept)
    assert why == "1 of its 2 members passed Permit within 0.3 s"
    assert not await marks.opened("never-opened")


async def test_a_mark_that_cannot_be_read_or_written_leaves_the_members_waiting_for_each_other(caplog):
    class Unanswering:
        async def get(self, key):
            raise asyncio.TimeoutError

        async def put(self, key, value):
            raise asyncio.TimeoutError

    permits = GangPermits(timeout=5, marks=gp.GangPermitMarks(Unanswering()))
    first = asyncio.create_task(permits.wait(_commit(2, "c9"), "a", _kept))
    await asyncio.sleep(0.05)
    assert not first.done()  # not passed on a mark it could not read
    assert await permits.wait(_commit(2, "c9"), "b", _kept) is None
    assert await first is None
    assert any("could not record that its barrier opened" in r.getMessage() for r in caplog.records)

"""A shard waits while the binder's backlog of placements is big, and does not ask for it before
every batch when it is small (a pure test: a stand-in for JetStream's stream info)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from draplane_allocator import answers as answers_module
from draplane_allocator.answers import MAX_BINDER_BACKLOG
from draplane_allocator.shard import Shard


class _JetStream:
    def __init__(self, backlogs: list[int]):
        self.backlogs = backlogs
        self.asked = 0

    async def stream_info(self, name: str):
        self.asked += 1
        backlog = self.backlogs.pop(0) if len(self.backlogs) > 1 else self.backlogs[0]
        return SimpleNamespace(state=SimpleNamespace(messages=backlog))


def _shard(js: _JetStream) -> Shard:
    return Shard(SimpleNamespace(jetstream=lambda: js), index=0, prefix="bp.")


async def test_a_small_backlog_is_not_asked_again_for_a_moment():
    js = _JetStream([3])
    shard = _shard(js)
    for _ in range(10):
        await shard.answers.wait_for_binder()
    assert js.asked == 1


async def test_a_backlog_near_the_limit_is_asked_before_every_batch(monkeypatch):
    js = _JetStream([MAX_BINDER_BACKLOG - 1])
    shard = _shard(js)
    for _ in range(3):
        await shard.answers.wait_for_binder()
    assert js.asked == 3


async def test_a_full_backlog_is_waited_out(monkeypatch):
    monkeypatch.setattr(answers_module, "BACKLOG_RECHECK_SECONDS", 0.0)
    js = _JetStream([MAX_BINDER_BACKLOG, MAX_BINDER_BACKLOG + 5, 0])
    shard = _shard(js)
    await asyncio.wait_for(shard.answers.wait_for_binder(), 5.0)
    assert js.asked == 3


async def test_what_the_shard_published_since_counts_toward_the_backlog():
    js = _JetStream([MAX_BINDER_BACKLOG // 2 - 10])
    shard = _shard(js)
    await shard.answers.wait_for_binder()
    shard.answers.published_since_backlog += 9  # as Answers.publish counts them
    await shard.answers.wait_for_binder()
    assert js.asked == 1
    shard.answers.published_since_backlog += 1  # a burst: the backlog may be at half the limit by now
    await shard.answers.wait_for_binder()
    assert js.asked == 2

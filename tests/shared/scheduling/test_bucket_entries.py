"""streams.bucket_entries ends the replay on the entry with nothing pending behind it, not on
nats-py's early None (a fake watcher: the race is in nats-py, between its consumer-info read and
the messages in flight)."""

import asyncio
import contextlib
from types import SimpleNamespace

import nats.errors

from draplane.scheduling import streams


class _Watcher:
    def __init__(self, script):
        self.script = list(script)
        self.stopped = False

    async def updates(self, timeout):
        if not self.script:
            await asyncio.sleep(timeout)
            raise nats.errors.TimeoutError
        item = self.script.pop(0)
        if item == "wait":
            await asyncio.sleep(timeout)
            raise nats.errors.TimeoutError
        return item

    async def stop(self):
        self.stopped = True


class _Bucket:
    def __init__(self, script):
        self.watcher = _Watcher(script)

    async def watchall(self):
        return self.watcher


def _entry(key, delta):
    return SimpleNamespace(key=key, delta=delta, operation=None, value=b"v")


async def _read(bucket, count):
    got = []
    async with contextlib.aclosing(streams.bucket_entries(bucket)) as entries:
        async for entry in entries:
            got.append(None if entry is None else entry.key)
            if len(got) == count:
                break
    return got


async def test_an_early_none_then_the_replay_ends_on_delta_zero():
    bucket = _Bucket([None, _entry("a", 2), _entry("b", 1), _entry("c", 0), None, _entry("d", 0)])
    assert await _read(bucket, 5) == ["a", "b", "c", None, "d"]
    assert bucket.watcher.stopped


async def test_a_none_with_nothing_after_it_is_an_empty_bucket():
    assert await _read(_Bucket([None, "wait", _entry("later", 0)]), 2) == [None, "later"]


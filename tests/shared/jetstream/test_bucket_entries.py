"""streams.bucket_entries ends the replay on the entry with nothing pending behind it, not on
nats-py's early None (a fake watcher: the race is in nats-py, between its consumer-info read and
the messages in flight)."""

import asyncio
import contextlib
from types import SimpleNamespace

import nats.errors
import pytest

from draplane.jetstream import streams


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

    async def watch(self, keys):
        assert keys == ">"  # every key, as nats-py's watchall asks
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



class _QueueBucket:
    """The same, through the queue nats-py's KeyWatcher keeps (`_updates`), which bucket_entries
    reads directly when it is there."""

    def __init__(self, items):
        self.watcher = SimpleNamespace(_updates=asyncio.Queue(), stopped=False)
        for item in items:
            self.watcher._updates.put_nowait(item)

        async def stop():
            self.watcher.stopped = True
        self.watcher.stop = stop

    async def watch(self, keys):
        assert keys == ">"  # every key, as nats-py's watchall asks
        return self.watcher


async def test_read_from_nats_py_queue_an_early_none_then_the_replay_ends_on_delta_zero():
    bucket = _QueueBucket([None, _entry("a", 2), _entry("b", 1), _entry("c", 0), None, _entry("d", 0)])
    assert await _read(bucket, 5) == ["a", "b", "c", None, "d"]
    assert bucket.watcher.stopped


async def test_read_from_nats_py_queue_a_none_with_nothing_after_it_is_an_empty_bucket():
    bucket = _QueueBucket([None])

    async def later():
        await asyncio.sleep(streams.EMPTY_BUCKET_GRACE_SECONDS * 2)
        bucket.watcher._updates.put_nowait(_entry("later", 0))
    task = asyncio.create_task(later())
    assert await _read(bucket, 2) == [None, "later"]
    await task


async def test_read_from_nats_py_queue_a_watcher_stopped_under_the_reader_is_an_error_its_watch_restarts_on():
    from nats.js.kv import KeyValue
    bucket = _QueueBucket([_entry("a", 0), KeyValue.KeyWatcher.STOP_ITER])
    with pytest.raises(nats.errors.Error, match="watcher was stopped"):
        await _read(bucket, 10)


async def test_read_from_nats_py_queue_a_long_replay_lets_other_tasks_run():
    bucket = _QueueBucket([_entry(f"k{i}", 999 - i) for i in range(1000)])
    ran = []

    async def other():
        while True:
            ran.append(1)
            await asyncio.sleep(0)
    task = asyncio.create_task(other())
    try:
        got = await _read(bucket, 1001)
    finally:
        task.cancel()
    assert got[-1] is None and len(got) == 1001
    assert len(ran) >= 1000 // streams.YIELD_EVERY_ENTRIES

"""The binder's work queue: deduplicated, and never one key in two workers at once."""

import asyncio

from draplane_binder.work_queue import WorkQueue


async def test_a_key_queued_twice_before_it_is_taken_is_processed_once():
    queue = WorkQueue()
    queue.put("a")
    queue.put("a")
    queue.put("b")
    assert len(queue) == 2
    assert await queue.get() == "a"
    assert await queue.get() == "b"
    assert len(queue) == 0


async def test_a_key_put_while_a_worker_has_it_waits_for_done():
    queue = WorkQueue()
    queue.put("pod")
    taken = await queue.get()
    queue.put("pod")  # an event about the pod while the first worker is still on it
    second = asyncio.ensure_future(queue.get())
    await asyncio.sleep(0.01)
    assert not second.done(), "a second worker took a key the first has not finished"
    assert len(queue) == 1
    queue.done(taken)
    assert await asyncio.wait_for(second, 1.0) == "pod"
    queue.done("pod")
    assert len(queue) == 0


async def test_done_without_a_new_put_does_not_requeue():
    queue = WorkQueue()
    queue.put("pod")
    queue.done(await queue.get())
    queue.put("other")
    assert await queue.get() == "other"
    assert len(queue) == 0


async def test_a_failing_key_backs_off_exponentially_and_forget_resets_it():
    queue = WorkQueue(initial_backoff=0.01, max_backoff=0.04)
    assert [queue.retry_later("pod") for _ in range(4)] == [0.01, 0.02, 0.04, 0.04]
    assert len(queue) == 0  # not queued until its backoff passed
    assert await asyncio.wait_for(queue.get(), 1.0) == "pod"
    queue.done("pod")
    queue.forget("pod")
    assert queue.retry_later("pod") == 0.01

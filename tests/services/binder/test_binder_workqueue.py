"""The binder's work queue: deduplicated, and never one key in two workers at once."""

import asyncio

import pytest

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


@pytest.mark.tracebacks_expected
async def test_a_worker_retries_a_failure_tells_it_and_goes_on_with_the_next_key(caplog):
    from draplane.kube import KubeApiError
    from draplane_binder.work_queue import work

    class Errors:
        count = 0

        def inc(self):
            self.count += 1

    queue = WorkQueue(initial_backoff=5.0)
    seen, told = [], []

    async def reconcile(key):
        seen.append(key)
        if key[1] == "broken":
            raise ValueError("a bug met by one object")
        if key[1] == "gone":
            raise KubeApiError(404, "NotFound", "not found", "GET", "/api/v1/namespaces/ns/pods/gone")

    async def tell(key, exc, delay):
        told.append((key, repr(exc), delay))

    errors = Errors()
    worker = asyncio.create_task(work(queue, reconcile, kind="pod", errors=errors, on_failure=tell))
    for name in ("broken", "gone", "fine"):
        queue.put(("ns", name))
    await asyncio.sleep(0.05)
    worker.cancel()
    assert seen == [("ns", "broken"), ("ns", "gone"), ("ns", "fine")]  # the failure did not stop it
    assert errors.count == 1 and told == [(("ns", "broken"), "ValueError('a bug met by one object')", 5.0)]
    assert "pod ns/broken: reconcile failed; retrying in 5.0 s" in caplog.text

"""draplane.tasks: cancel_all cancels again a task that swallows its first cancellation;
guarded_task restarts a crashed loop with a growing delay, never in a hot loop."""

import asyncio

import logging

from draplane import tasks
from draplane.tasks import cancel_all, guarded_task, restart_delay


async def test_a_task_that_swallows_one_cancel_is_cancelled_again():
    swallowed = []

    async def stubborn():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.append(True)  # as asyncio.wait_for can in 3.11 when a result arrives with the cancel
        await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await cancel_all([task], timeout=2.0) == set()
    assert swallowed and task.cancelled()
    assert loop.time() - started < 1.0  # the second round, not the whole timeout


async def test_what_does_not_stop_in_time_is_returned():
    listening = asyncio.Event()

    async def deaf_until_told():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if listening.is_set():
                    raise

    task = asyncio.create_task(deaf_until_told())
    await asyncio.sleep(0)
    assert await cancel_all([task], timeout=0.4) == {task}
    listening.set()
    assert await cancel_all([task], timeout=0.4) == set()


def test_the_restart_delay_doubles_up_to_its_ceiling():
    assert [restart_delay(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert restart_delay(50) == tasks.RESTART_MAX_SECONDS


async def test_a_crashed_loop_is_logged_and_started_again_after_its_delay(monkeypatch, caplog):
    slept = []

    async def no_wait(seconds):
        slept.append(seconds)

    runs = []

    async def flaky():
        runs.append(len(runs))
        if len(runs) < 4:
            raise RuntimeError(f"crash {len(runs)}")

    monkeypatch.setattr(tasks.asyncio, "sleep", no_wait)
    with caplog.at_level(logging.ERROR):
        await guarded_task(flaky, "feed", logging.getLogger("t"), owner="shard 3")
    assert len(runs) == 4
    assert slept == [1.0, 2.0, 4.0]  # crashes in a row back off: no hot loop
    assert "shard 3: feed crashed; restarting it in 4 s" in caplog.text
    assert "RuntimeError: crash 3" in caplog.text


async def test_cancelling_a_guarded_loop_stops_it():
    started = asyncio.Event()

    async def forever():
        started.set()
        await asyncio.sleep(3600)

    task = guarded_task(forever, "watch", logging.getLogger("t"))
    await started.wait()
    assert task.get_name() == "watch"
    assert await cancel_all([task], timeout=2.0) == set()
    assert task.cancelled()

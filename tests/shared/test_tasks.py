"""draplane.tasks.cancel_all: a task that swallows its first cancellation is cancelled again."""

import asyncio

from draplane.tasks import cancel_all


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

"""Running and stopping a service's tasks.

Python 3.11's asyncio.wait_for can swallow a cancellation that arrives just as the awaited
result does (fixed in 3.12). A watch loop whose queue is never empty, as a bucket watcher under
load, then keeps running after one cancel: a shard's stop waited out its whole timeout for its
reservations watch. So a task still running after a short wait is cancelled again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

CANCEL_ROUNDS = 4


async def cancel_all(tasks: list[asyncio.Task], timeout: float = 10.0) -> set[asyncio.Task]:
    """Cancel `tasks` and wait for them, cancelling again those still running; returns the ones
    that did not stop within `timeout`."""
    pending = {t for t in tasks if not t.done()}
    for _ in range(CANCEL_ROUNDS):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=timeout / CANCEL_ROUNDS)
    return pending


# A crashed loop is started again after RESTART_FIRST_SECONDS, doubling with each crash in a row
# up to RESTART_MAX_SECONDS: a loop that fails at once (NATS refusing it, a bad setting) must not
# spin. A loop that ran RESTART_RESET_SECONDS before it crashed starts the count afresh.
RESTART_FIRST_SECONDS = 1.0
RESTART_MAX_SECONDS = 30.0
RESTART_RESET_SECONDS = 60.0


def log_task_failure(task: asyncio.Task, log: logging.Logger) -> None:
    """A done-callback's body for a one-off task: its exception logged, never lost unseen."""
    if not task.cancelled() and task.exception() is not None:
        log.error("task %s failed", task.get_name(), exc_info=task.exception())


def restart_delay(crashes_in_a_row: int) -> float:
    return min(RESTART_MAX_SECONDS, RESTART_FIRST_SECONDS * 2 ** max(0, crashes_in_a_row - 1))


def guarded_task(loop: Callable[[], Awaitable], name: str, log: logging.Logger, *, owner: str = "") -> asyncio.Task:
    """Run a service's long-lived loop as a task: a crash is logged (with `owner`, the service or
    shard it belongs to) and the loop started again after restart_delay, never silently lost. A
    loop that returns is done; cancelling the task stops it."""

    async def guarded() -> None:
        crashes = 0
        while True:
            started = time.monotonic()
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - logged and restarted, never silently lost
                crashes = 1 if time.monotonic() - started >= RESTART_RESET_SECONDS else crashes + 1
                delay = restart_delay(crashes)
                log.exception("%s%s crashed; restarting it in %.0f s", f"{owner}: " if owner else "", name, delay)
                await asyncio.sleep(delay)

    return asyncio.create_task(guarded(), name=f"{owner} {name}" if owner else name)

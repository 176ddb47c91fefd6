"""Stopping a service's tasks.

Python 3.11's asyncio.wait_for can swallow a cancellation that arrives just as the awaited
result does (fixed in 3.12). A watch loop whose queue is never empty, as a bucket watcher under
load, then keeps running after one cancel: a shard's stop waited out its whole timeout for its
reservations watch. So a task still running after a short wait is cancelled again.
"""

from __future__ import annotations

import asyncio

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

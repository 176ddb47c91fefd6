"""The binder's queues of pods and claims to reconcile (client-go's workqueue, in asyncio)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from draplane.kube import KubeApiError

log = logging.getLogger(__name__)

class WorkQueue:
    """A set-backed queue with client-go's workqueue guarantees: a key queued twice before it is
    taken is processed once, and a key is never processed by two workers at once. A key put while
    a worker has it is held back and queued again when that worker calls `done`.

    Why the second guarantee: two workers reconciling one pod at once would each create a claim
    from its template (the claims cache learns of the first create only when it returns).
    """

    __slots__ = ("_queue", "_queued", "_processing", "_again", "_failures", "_initial", "_max")

    def __init__(self, *, initial_backoff: float = 0.1, max_backoff: float = 30.0) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._queued: set = set()
        self._processing: set = set()
        self._again: set = set()
        # key -> failures in a row, for client-go's per-item exponential backoff
        self._failures: dict = {}
        self._initial = initial_backoff
        self._max = max_backoff

    def retry_later(self, key) -> float:
        """Put the key back after a backoff that doubles with each failure in a row (an error
        that lasts is retried ever more slowly, never in a hot loop). Returns the delay."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay = min(self._max, self._initial * 2 ** failures)
        asyncio.get_running_loop().call_later(delay, self.put, key)
        return delay

    def forget(self, key) -> None:
        """The key was handled: its next failure starts the backoff afresh."""
        self._failures.pop(key, None)

    def put(self, key) -> None:
        if key in self._processing:
            self._again.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    async def get(self):
        key = await self._queue.get()
        self._queued.discard(key)
        self._processing.add(key)
        return key

    def done(self, key) -> None:
        self._processing.discard(key)
        if key in self._again:
            self._again.discard(key)
            self.put(key)

    def __len__(self) -> int:
        return len(self._queued) + len(self._again)


async def work(queue: WorkQueue, reconcile: Callable[[tuple[str, str]], Awaitable[None]], *, kind: str, errors,
               on_failure: Callable[[tuple[str, str], Exception, float], Awaitable[None]] | None = None) -> None:
    """A worker: reconcile each key taken from the queue. A conflict or an apiserver error worth
    retrying puts the key back after its backoff; a 404 drops it (the watch brings what changed);
    any other failure is counted in `errors`, logged, retried after its backoff and handed to
    `on_failure`. One bad object never stops the worker. `kind` names the objects in the logs."""
    while True:
        key = await queue.get()
        try:
            await reconcile(key)
            queue.forget(key)
        except KubeApiError as exc:
            if exc.is_conflict or exc.retryable:
                delay = queue.retry_later(key)
                log.log(logging.DEBUG if exc.is_conflict else logging.WARNING,
                        "%s %s/%s: %s; retrying in %.1f s", kind, *key, exc, delay)
            elif not exc.is_not_found:
                log.warning("%s %s/%s: %s", kind, *key, exc)
        except Exception as exc:  # noqa: BLE001 - one bad object must not stop the worker
            errors.inc()
            delay = queue.retry_later(key)
            log.exception("%s %s/%s: reconcile failed; retrying in %.1f s", kind, *key, delay)
            if on_failure is not None:
                await on_failure(key, exc, delay)
        finally:
            queue.done(key)

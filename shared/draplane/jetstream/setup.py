"""Setting up streams and buckets at start, riding out a JetStream that does not answer yet.

A service creates or looks up its streams and buckets before it starts its loops. On a NATS
cluster those API requests can go unanswered for seconds: a stream's leader is still being
elected (503), the meta leader has not placed a replicated stream yet (500, "insufficient
resources"), or the servers are starved of CPU (a request times out; seen in CI, where a shard
of the chaos bench exited at start on `nats: timeout` from `key_value`). Each of those steps is
idempotent, so it is simply asked again, with a growing wait, until it answers or a deadline
passes; then the error names the step and what JetStream last said. An answer that is a real
refusal (400, a bad config) is raised at once: asking again would not change it. A permission the
identity lacks is no answer at all (the server replies -ERR on the connection, the request times
out), so it is asked again until the deadline, each warning saying it may be that.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

T = TypeVar("T")

# Long enough for a 3-server cluster to elect its leaders on a busy machine; short enough that
# a service pointed at a NATS without JetStream says so while someone is still watching.
GIVE_UP_AFTER_SECONDS = 300.0
FIRST_WAIT_SECONDS = 0.5
LONGEST_WAIT_SECONDS = 5.0

# What says "not now" rather than "no".
NOT_ANSWERED_YET = (
    nats.errors.TimeoutError,            # no reply in time: a starved or electing server
    asyncio.TimeoutError,
    nats.errors.NoRespondersError,       # JetStream not serving (yet) on the server we reach
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,  # 503: no leader for the stream yet
    nats.js.errors.ServerError,          # 500: e.g. no peers to place the replicas on yet
    nats.js.errors.NoStreamResponseError,  # a put to a stream made a moment ago, whose leader is being elected
)


_TIMEOUTS = (nats.errors.TimeoutError, asyncio.TimeoutError)
# A request the server refuses for want of a permission gets no reply either: the refusal comes
# as an -ERR on the connection, which the service's NATS error log shows.
_TIMEOUT_HINT = ": a server starting, electing or starved of CPU, or a permission this identity lacks"


class JetStreamNotAnswering(RuntimeError):
    """A setup step that JetStream did not answer before the deadline."""


def next_wait(previous: float | None, *, first: float = FIRST_WAIT_SECONDS, longest: float = LONGEST_WAIT_SECONDS,
              jitter: float = 0.0) -> float:
    """Doubling from `first` up to `longest`; `jitter` in [0, 1) spreads services that started
    together (a fraction of the wait, drawn by the caller) so they do not ask in lockstep."""
    wait = first if previous is None else min(longest, previous * 2)
    return wait * (1.0 + jitter * 0.5)


async def until_answered(step: Callable[[], Awaitable[T]], what: str, *, log: logging.Logger,
                         give_up_after: float = GIVE_UP_AFTER_SECONDS,
                         sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
                         clock: Callable[[], float] = time.monotonic,
                         draw: Callable[[], float] = random.random) -> T:
    """`step()`'s result, asking again while JetStream does not answer yet. `what` names the
    step for the logs and the error ("creating stream DRAPLANE_PENDING")."""
    deadline = clock() + give_up_after
    wait: float | None = None
    attempt = 0
    while True:
        attempt += 1
        try:
            result = await step()
        except NOT_ANSWERED_YET as exc:
            wait = next_wait(wait, jitter=draw())
            left = deadline - clock()
            if left <= 0:
                raise JetStreamNotAnswering(
                    f"{what}: JetStream did not answer in {attempt} tries over {give_up_after:.0f} s; "
                    f"the last try got {exc!r}") from exc
            wait = min(wait, left)
            log.warning("%s: JetStream did not answer (%r%s); asking again in %.1f s (try %d)",
                        what, exc, _TIMEOUT_HINT if isinstance(exc, _TIMEOUTS) else "", wait, attempt)
            await sleep(wait)
            continue
        if attempt > 1:
            log.info("%s: answered on try %d", what, attempt)
        return result

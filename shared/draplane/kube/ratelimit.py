"""How long to wait before the next request to the apiserver: a client-side token bucket, and the
backoff after an answer that says "not now" (429 Too Many Requests, 5xx) or after no answer at all.

Pure: the caller passes the clock in and does the sleeping (draplane.kube.client).

The bucket is client-go's (`flowcontrol.NewTokenBucketRateLimiter`): `qps` tokens a second, at most
`burst` saved up; a request takes one. It hands out reservations, as golang.org/x/time/rate does,
rather than being polled: each caller learns at once how long to sleep and then goes, so waiting
callers are served in order and none of them spins.
"""

from __future__ import annotations

import email.utils
import random
from datetime import datetime, timezone

# client-go's defaults (rest.DefaultQPS, rest.DefaultBurst) are for a generic client. kube-scheduler
# runs with 50 and 100; the services choose their own (their --kube-api-qps and --kube-api-burst).
DEFAULT_QPS = 5.0
DEFAULT_BURST = 10

# An apiserver's Retry-After is obeyed up to this: APF says 1 s, and a header of an hour (a proxy's,
# a misconfiguration) must not stall a worker for that long. The caller retries again after it.
MAX_RETRY_AFTER_SECONDS = 30.0
# Without Retry-After: 0.2 s doubling per attempt, at most 8 s, with full jitter below that.
BACKOFF_INITIAL_SECONDS = 0.2
BACKOFF_MAX_SECONDS = 8.0


class TokenBucket:
    """`qps` <= 0 means no limit (kubectl's and client-go's -1: the server's APF is the only guard)."""

    __slots__ = ("qps", "burst", "_tokens", "_at")

    def __init__(self, qps: float, burst: int, *, now: float = 0.0):
        if qps > 0 and burst < 1:
            raise ValueError(f"burst must be at least 1 when qps is {qps:g}, got {burst}")
        self.qps = qps
        self.burst = burst
        self._tokens = float(burst)
        self._at = now

    @property
    def unlimited(self) -> bool:
        return self.qps <= 0

    def reserve(self, now: float) -> float:
        """Take a token; the seconds to wait before using it (0 when one was saved up).

        Tokens may go negative: that is the queue of reservations already handed out, each of
        which waits until the bucket has refilled past it.
        """
        if self.unlimited:
            return 0.0
        if now > self._at:
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps)
            self._at = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.qps


def retry_after_seconds(header: str | None, *, now: datetime | None = None) -> float | None:
    """The delay a Retry-After header asks for (delta-seconds or an HTTP date), bounded by
    MAX_RETRY_AFTER_SECONDS; None when there is no usable header."""
    if not header:
        return None
    header = header.strip()
    if header.isdigit():
        seconds = float(header)
    else:
        try:
            when = email.utils.parsedate_to_datetime(header)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = (when - (now or datetime.now(timezone.utc))).total_seconds()
    return min(MAX_RETRY_AFTER_SECONDS, max(0.0, seconds))


def retry_delay(attempt: int, retry_after: float | None, *, rng: random.Random | None = None) -> float:
    """Seconds before retry number `attempt` (1 for the first retry).

    The server's Retry-After when it sent one, stretched by up to 10 % so that clients turned away
    together do not all come back in the same millisecond; otherwise exponential backoff with full
    jitter (uniform below the doubling bound), which spreads retries the most.
    """
    draw = (rng or random).random()
    if retry_after is not None:
        return retry_after * (1.0 + 0.1 * draw)
    bound = min(BACKOFF_MAX_SECONDS, BACKOFF_INITIAL_SECONDS * 2 ** max(0, attempt - 1))
    # never quite zero: a retry at once is what the backoff is there to avoid
    return bound * (0.1 + 0.9 * draw)

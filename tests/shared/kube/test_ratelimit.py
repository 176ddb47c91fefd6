"""The client-side token bucket and the retry delays, on a clock the tests move by hand."""

import random
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest

from draplane.kube.ratelimit import (
    BACKOFF_MAX_SECONDS,
    MAX_RETRY_AFTER_SECONDS,
    TokenBucket,
    retry_after_seconds,
    retry_delay,
)


def test_a_burst_goes_at_once_then_requests_are_spaced_by_one_over_qps():
    bucket = TokenBucket(10.0, 3, now=0.0)
    assert [bucket.reserve(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    # the 4th, 5th and 6th in the same instant queue behind each other, 0.1 s apart
    assert [round(bucket.reserve(0.0), 6) for _ in range(3)] == [0.1, 0.2, 0.3]


def test_tokens_refill_at_qps_up_to_the_burst_only():
    bucket = TokenBucket(2.0, 4, now=0.0)
    for _ in range(4):
        bucket.reserve(0.0)
    assert bucket.reserve(0.5) == 0.0  # one token came back in half a second
    assert bucket.reserve(0.5) == pytest.approx(0.5)
    # a long idle time saves up no more than the burst
    assert [bucket.reserve(1000.0) for _ in range(4)] == [0.0] * 4
    assert bucket.reserve(1000.0) == pytest.approx(0.5)


def test_the_average_rate_over_many_requests_is_qps():
    bucket = TokenBucket(50.0, 100, now=0.0)
    waits = [bucket.reserve(0.0) for _ in range(1100)]
    # 100 at once, the next 1,000 spread over 20 s
    assert max(waits) == pytest.approx(1000 / 50.0)


def test_no_limit_and_a_bad_burst():
    assert TokenBucket(0.0, 0).reserve(0.0) == 0.0
    assert TokenBucket(-1.0, 0).unlimited
    with pytest.raises(ValueError, match="burst must be at least 1"):
        TokenBucket(5.0, 0)


def test_retry_after_in_seconds_or_as_a_date_and_bounded():
    now = datetime(2026, 12, 2, 1, 0, 0, tzinfo=timezone.utc)
    assert retry_after_seconds("1") == 1.0
    assert retry_after_seconds(" 7 ") == 7.0
    assert retry_after_seconds("3600") == MAX_RETRY_AFTER_SECONDS
    assert retry_after_seconds(format_datetime(now + timedelta(seconds=12), usegmt=True), now=now) == pytest.approx(12.0)
    assert retry_after_seconds(format_datetime(now - timedelta(seconds=12), usegmt=True), now=now) == 0.0
    for unusable in (None, "", "soon", "-1", "1.5"):
        assert retry_after_seconds(unusable) is None


def test_retry_delay_obeys_retry_after_with_a_little_jitter():
    rng = random.Random(1)
    delays = [retry_delay(1, 2.0, rng=rng) for _ in range(200)]
    assert 2.0 <= min(delays) and max(delays) <= 2.2
    assert len(set(delays)) > 100  # clients turned away together do not come back together


def test_retry_delay_without_retry_after_doubles_is_jittered_and_capped():
    rng = random.Random(2)
    for attempt, bound in ((1, 0.2), (2, 0.4), (3, 0.8), (6, 6.4), (7, BACKOFF_MAX_SECONDS), (30, BACKOFF_MAX_SECONDS)):
        delays = [retry_delay(attempt, None, rng=rng) for _ in range(300)]
        assert 0.1 * bound <= min(delays) and max(delays) <= bound
        assert max(delays) > 0.8 * bound and min(delays) < 0.3 * bound  # full jitter over the range

"""The audit publisher's retries, against a stand-in JetStream that fails on cue (pure unit test:
the chaos run in tests/bench shows the same against real NATS servers being killed)."""

from __future__ import annotations

import time

import nats.js.errors

from draplane.audit_publisher import AuditPublisher
from draplane.messages.audit import AuditEvent


class FlakyJetStream:
    def __init__(self, failures: int):
        self.failures = failures
        self.calls: list[tuple[str, dict]] = []

    async def publish(self, subject, payload, timeout=None, headers=None):
        self.calls.append((subject, dict(headers or {})))
        if self.failures:
            self.failures -= 1
            raise nats.js.errors.NoStreamResponseError()
        return None


def event() -> AuditEvent:
    return AuditEvent(id="placed/uid-1", kind="placed", at=1.0, by=["binder"])


async def test_a_publish_during_a_leader_election_is_tried_again_with_the_same_id():
    js = FlakyJetStream(failures=2)
    publisher = AuditPublisher(js, "draplane.", retry_for=5.0)
    started = time.monotonic()
    assert await publisher.publish_and_wait(event())
    assert len(js.calls) == 3 and {h["Nats-Msg-Id"] for _, h in js.calls} == {"placed/uid-1"}
    assert publisher.counters == {"published": 1, "failed": 0, "dropped": 0}
    assert time.monotonic() - started >= 0.25 + 0.5  # backed off, not a hot loop


async def test_a_publish_that_keeps_failing_gives_up_after_its_time_and_is_counted():
    js = FlakyJetStream(failures=10_000)
    publisher = AuditPublisher(js, "draplane.", retry_for=1.0)
    started = time.monotonic()
    assert not await publisher.publish_and_wait(event())
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed <= 2.5 and len(js.calls) <= 5
    assert publisher.counters["failed"] == 1

"""Setup steps asked again while JetStream does not answer: pure retries with a fake clock, then a
real 3-server cluster that has lost its quorum while a service creates its streams and bucket."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest

from draplane.jetstream.setup import (
    FIRST_WAIT_SECONDS,
    LONGEST_WAIT_SECONDS,
    JetStreamNotAnswering,
    next_wait,
    until_answered,
)
from draplane.localenv import binaries
from draplane.localenv.natscluster import NatsCluster
from draplane.jetstream import streams
from draplane.scheduling.messages import Subjects

log = logging.getLogger("test")


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _failing(errors: list[BaseException], result: object = "done"):
    calls = []

    async def step():
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return result

    return step, calls


def _service_unavailable() -> nats.js.errors.ServiceUnavailableError:
    return nats.js.errors.ServiceUnavailableError(code=503, description="JetStream system temporarily unavailable")


async def test_a_step_not_answered_yet_is_asked_again_with_growing_waits(caplog):
    fake = FakeTime()
    step, calls = _failing([nats.errors.TimeoutError(), _service_unavailable(), nats.errors.NoRespondersError(),
                            nats.js.errors.NoStreamResponseError()])
    with caplog.at_level(logging.INFO, logger="test"):
        result = await until_answered(step, "creating stream DRAPLANE_PENDING", log=log,
                                      sleep=fake.sleep, clock=fake.clock, draw=lambda: 0.0)
    assert result == "done" and len(calls) == 5
    assert fake.slept == [FIRST_WAIT_SECONDS, FIRST_WAIT_SECONDS * 2, FIRST_WAIT_SECONDS * 4, FIRST_WAIT_SECONDS * 8]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4 and all("creating stream DRAPLANE_PENDING" in w for w in warnings)
    assert "a permission this identity lacks" in warnings[0]  # a timeout says what it may mean
    assert "a permission" not in warnings[1]  # a 503 is plainly JetStream not serving yet
    assert any("answered on try 5" in r.getMessage() for r in caplog.records)


async def test_a_refusal_is_raised_at_once_without_asking_again():
    fake = FakeTime()
    refusal = nats.js.errors.BadRequestError(code=400, err_code=10052, description="replicas > 1 not supported")
    step, calls = _failing([refusal])
    with pytest.raises(nats.js.errors.BadRequestError):
        await until_answered(step, "creating stream X", log=log, sleep=fake.sleep, clock=fake.clock)
    assert len(calls) == 1 and fake.slept == []


async def test_a_step_never_answered_gives_up_at_the_deadline_naming_the_step_and_the_last_error():
    fake = FakeTime()
    step, calls = _failing([nats.errors.TimeoutError() for _ in range(1000)])
    with pytest.raises(JetStreamNotAnswering) as raised:
        await until_answered(step, "opening bucket DRAPLANE_RESERVATIONS", log=log, give_up_after=60,
                             sleep=fake.sleep, clock=fake.clock, draw=lambda: 0.0)
    message = str(raised.value)
    assert "opening bucket DRAPLANE_RESERVATIONS" in message and "60 s" in message and "TimeoutError" in message
    assert isinstance(raised.value.__cause__, nats.errors.TimeoutError)
    assert fake.now == pytest.approx(60)  # the last wait is cut to the deadline, not past it
    assert max(fake.slept) == LONGEST_WAIT_SECONDS
    assert len(calls) == len(fake.slept) + 1 < 30  # backed off, not a hot loop


def test_waits_double_up_to_the_longest_and_jitter_only_lengthens_them():
    waits, wait = [], None
    for _ in range(8):
        wait = next_wait(wait)
        waits.append(wait)
    assert waits[:4] == [0.5, 1.0, 2.0, 4.0] and set(waits[4:]) == {LONGEST_WAIT_SECONDS}
    assert next_wait(None, jitter=0.99) == pytest.approx(0.5 * 1.495)


@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_streams_and_bucket_made_while_the_cluster_has_no_quorum_wait_for_it(tmp_path: Path, caplog):
    """What a shard does first at start. Two of three servers down: no meta leader, so JetStream's
    API does not answer. Creating the R3 streams and bucket waits, then completes once the servers
    are back, instead of the service exiting on the first timeout (the chaos bench's CI failure)."""
    binaries.require(binaries.NATS_SERVER)
    subjects = Subjects(prefix="quorum")
    with NatsCluster(tmp_path) as cluster:
        nc = await nats.connect(servers=[cluster.urls[0]], max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                connect_timeout=2)
        try:
            cluster.kill(1)
            cluster.kill(2)
            js = nc.jetstream(timeout=1.0)

            async def set_up():
                await streams.ensure_streams(js, subjects, replicas=3)
                return await streams.reservation_bucket(js, subjects, replicas=3)

            with caplog.at_level(logging.WARNING, logger="draplane.jetstream.streams"):
                setup = asyncio.create_task(set_up())
                deadline = time.monotonic() + 30
                while not any("did not answer" in r.getMessage() for r in caplog.records):
                    assert time.monotonic() < deadline, "no warning that JetStream does not answer"
                    assert not setup.done(), f"set up without a quorum: {setup}"
                    await asyncio.sleep(0.1)
                assert not setup.done()
                assert f"creating stream {subjects.pending_stream}" in caplog.records[0].getMessage()
                for index in (1, 2):
                    cluster.restart(index)
                bucket = await asyncio.wait_for(setup, 120)
            # The bucket's R3 stream exists; its leader may still be being elected, and a put
            # meanwhile gets "no response from stream" (seen once in the full suite): asked again
            # as any service's first write would be.
            revision = await until_answered(lambda: bucket.put("node.a", b"held"), "the first put", log=log,
                                            give_up_after=60)
            assert (await bucket.get("node.a")).revision == revision
            for name in (subjects.pending_stream, subjects.results_stream, subjects.released_stream,
                         f"KV_{subjects.reservations_bucket}"):
                info = await js.stream_info(name)
                assert info.config.num_replicas == 3, name
        finally:
            await nc.close()

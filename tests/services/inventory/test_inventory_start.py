"""The inventory's start-up against a JetStream that is not serving yet (a NATS cluster electing
the stream's leader answers 503): it retries with backoff instead of exiting."""

from __future__ import annotations

import asyncio

import nats.js.errors
import pytest

from draplane_inventory.service import InventoryService


async def test_priming_rides_out_a_jetstream_that_is_not_serving_yet(monkeypatch):
    service = InventoryService.__new__(InventoryService)  # only the priming step is under test
    calls, sleeps = [], []

    async def prime():
        calls.append(1)
        if len(calls) < 3:
            raise nats.js.errors.ServiceUnavailableError()
        return {"node-1": "snapshot"}

    async def sleep(seconds):
        sleeps.append(seconds)

    service._prime_from_stream = prime
    monkeypatch.setattr(asyncio, "sleep", sleep)
    assert await service._prime_with_retries() == {"node-1": "snapshot"}
    assert sleeps == [0.5, 1.0]


async def test_priming_gives_up_after_its_attempts(monkeypatch):
    service = InventoryService.__new__(InventoryService)

    async def prime():
        raise nats.js.errors.ServiceUnavailableError()

    async def sleep(seconds):
        pass

    service._prime_from_stream = prime
    monkeypatch.setattr(asyncio, "sleep", sleep)
    with pytest.raises(nats.js.errors.ServiceUnavailableError):
        await service._prime_with_retries(attempts=3)

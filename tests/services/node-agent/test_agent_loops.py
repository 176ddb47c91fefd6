"""The node agents' loops survive an unexpected error: logged, started again, nothing left open."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from draplane.messages.inventory import InventoryNames
from draplane_node_agent.agent import AgentFleet, SimulatedAgent
from draplane_node_agent.state import AgentState

# Each test makes a loop fail on purpose: its traceback is logged, as it should be.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(60), pytest.mark.tracebacks_expected]


async def until(condition, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def fleet_of_one(control_plane, subject_prefix: str) -> tuple[AgentFleet, SimulatedAgent]:
    agent = SimulatedAgent(f"{subject_prefix}-loops", lambda: [])
    fleet = AgentFleet(control_plane.nats_url, [agent], names=InventoryNames(subject_prefix),
                       heartbeat_interval=0.2, rescan_interval=3600)
    return fleet, agent


async def test_a_heartbeat_loop_that_fails_is_logged_and_started_again(control_plane, subject_prefix, caplog):
    fleet, agent = fleet_of_one(control_plane, subject_prefix)
    calls = []

    class FailsOnce(AgentState):
        __slots__ = ()

        def heartbeat(self, now):
            calls.append(now)
            if len(calls) == 2:
                raise RuntimeError("a bad reading")
            return super().heartbeat(now)

    agent.state = FailsOnce(agent.state.node)
    with caplog.at_level(logging.ERROR, logger="draplane_node_agent.agent"):
        await fleet.start()
        try:
            await until(lambda: len(calls) >= 2)
            sent_at_crash = fleet.heartbeats_sent
            await until(lambda: fleet.heartbeats_sent >= sent_at_crash + 3)
            assert fleet.dead_tasks() == []
        finally:
            await fleet.stop()
    assert any("node agents: heartbeats crashed; restarting it" in r.getMessage() and "a bad reading" in r.exc_text
               for r in caplog.records if r.exc_text)


async def test_a_connection_loop_that_fails_after_connecting_closes_that_connection_and_connects_again(
        control_plane, subject_prefix, caplog):
    fleet, agent = fleet_of_one(control_plane, subject_prefix)
    seen = []

    class FailsFirst(AgentState):
        __slots__ = ()

        def reconnected(self, *args):
            seen.append(fleet.connection)
            if len(seen) == 1:
                raise RuntimeError("state refused the connection")
            return super().reconnected(*args)

    agent.state = FailsFirst(agent.state.node)
    with caplog.at_level(logging.ERROR, logger="draplane_node_agent.agent"):
        await fleet.start()
        try:
            await until(lambda: len(seen) >= 2 and fleet.connected.is_set())
            first, second = seen[0], seen[1]
            assert first is not second and first.is_closed and not second.is_closed
            sent = fleet.heartbeats_sent
            await until(lambda: fleet.heartbeats_sent >= sent + 3)
        finally:
            await fleet.stop()
    assert any("node agents: connection crashed; restarting it" in r.getMessage() for r in caplog.records)

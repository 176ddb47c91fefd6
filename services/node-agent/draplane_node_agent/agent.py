"""The node agent's asyncio shell: discovery in, NATS out.

One `AgentFleet` drives any number of agents over one NATS connection: one agent in production (a
DaemonSet pod with its node's credentials), a thousand simulated ones in a test or a benchmark.
The connection is re-established by the fleet itself, with exponential backoff and full jitter;
nats-py's own reconnect is off, so that every reconnect is seen here and triggers a fresh snapshot
from every agent.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable

import nats
import nats.errors
import nats.js.errors

from draplane.messages.inventory import DriverDevices, InventoryNames, encode
from draplane.tasks import guarded_task
from draplane.structured_logs import error_text, fields
from draplane_node_agent.state import AgentState, backoff_delay

log = logging.getLogger(__name__)

Discover = Callable[[], list[DriverDevices]]


class SimulatedAgent:
    """An agent's state plus the discovery it polls."""

    __slots__ = ("state", "discover")

    def __init__(self, node: str, discover: Discover):
        self.state = AgentState(node)
        self.discover = discover


class AgentFleet:
    def __init__(
        self,
        servers: str | list[str],
        agents: list[SimulatedAgent],
        *,
        names: InventoryNames = InventoryNames(),
        heartbeat_interval: float = 5.0,
        rescan_interval: float = 10.0,
        connect_options: dict | None = None,
        publish_concurrency: int = 64,
    ):
        self.servers = servers
        self.agents = agents
        self.names = names
        self.heartbeat_interval = heartbeat_interval
        self.rescan_interval = rescan_interval
        self.connect_options = connect_options or {}
        self.publish_concurrency = publish_concurrency
        self.connection: nats.NATS | None = None
        self.connected = asyncio.Event()
        self.lost = asyncio.Event()
        self.reconnects = 0
        self.snapshots_sent = 0
        self.snapshot_failures = 0
        self.heartbeats_sent = 0
        self._snapshot_wake = asyncio.Event()
        self._ever_connected = False
        # Loops also check this: nats-py swallows a cancellation that lands inside its flush().
        self._stopping = False
        self._tasks: list[asyncio.Task] = []

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        for agent, devices in zip(self.agents, await self._discover_all()):
            agent.state.observe(devices)
        # Guarded: an unexpected error in one loop (a bad device reading, a nats-py surprise) is
        # logged and the loop started again with backoff, instead of the task dying silently
        # while the others run on and only /healthz could tell.
        self._tasks = [
            guarded_task(self._connection_loop, "connection", log, owner="node agents"),
            guarded_task(self._snapshot_loop, "snapshots", log, owner="node agents"),
            guarded_task(self._heartbeat_loop, "heartbeats", log, owner="node agents"),
            guarded_task(self._rescan_loop, "rescan", log, owner="node agents"),
        ]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            _, hung = await asyncio.wait(self._tasks, timeout=10)
            for task in hung:
                log.error("node agent task %s did not stop within 10s of being cancelled", task.get_name())
        self._tasks = []
        if self.connection is not None and not self.connection.is_closed:
            try:
                await asyncio.wait_for(self.connection.close(), 5)
            except (asyncio.TimeoutError, nats.errors.Error):
                pass
        self.connection = None

    def dead_tasks(self) -> list[str]:
        return [t.get_name() for t in self._tasks if t.done()]

    async def wait_all_sent(self, timeout: float = 60.0) -> None:
        """Until every agent's current snapshot has been acknowledged by JetStream."""
        deadline = time.monotonic() + timeout
        while any(a.state.snapshot_due for a in self.agents):
            if time.monotonic() > deadline:
                due = sum(a.state.snapshot_due for a in self.agents)
                raise TimeoutError(f"{due} of {len(self.agents)} snapshots not acknowledged within {timeout}s")
            await asyncio.sleep(0.05)

    async def _discover_all(self) -> list:
        """Every agent's discovery, in a worker thread: it reads profile files or asks NVML, and
        the loop keeps the heartbeats of every agent it runs going meanwhile."""
        return await asyncio.to_thread(lambda: [agent.discover() for agent in self.agents])

    async def rescan(self) -> int:
        """Run discovery for every agent now; returns how many found a change."""
        found = await self._discover_all()
        changed = sum(agent.state.observe(devices) for agent, devices in zip(self.agents, found))
        if changed:
            self._snapshot_wake.set()
        return changed

    # --- loops ---------------------------------------------------------------------------------

    async def _connect(self) -> nats.NATS:
        lost = self.lost

        async def closed() -> None:
            lost.set()

        async def error(exc: Exception) -> None:
            log.debug("nats error: %s", exc)

        return await nats.connect(
            self.servers, allow_reconnect=False, connect_timeout=2, closed_cb=closed,
            disconnected_cb=closed, error_cb=error, max_reconnect_attempts=0, **self.connect_options,
        )

    async def _connection_loop(self) -> None:
        attempt = 0
        await self._close_connection()  # one a crashed run of this loop left open
        while not self._stopping:
            try:
                self.lost.clear()
                self.connection = await self._connect()
            except (OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
                delay = backoff_delay(attempt)
                attempt += 1
                log.info("node agents: NATS connect failed (%s); retrying in %.2fs", error_text(exc), delay)
                await asyncio.sleep(delay)
                continue
            if self._ever_connected:
                self.reconnects += 1
            self._ever_connected = True
            attempt = 0
            for agent in self.agents:
                agent.state.reconnected()
            self.connected.set()
            self._snapshot_wake.set()
            await self.lost.wait()
            log.info("node agents: NATS connection lost; reconnecting")
            await self._close_connection()
            await asyncio.sleep(backoff_delay(0))

    async def _close_connection(self) -> None:
        self.connected.clear()
        connection, self.connection = self.connection, None
        if connection is None or connection.is_closed:
            return
        try:
            await asyncio.wait_for(connection.close(), 5)
        except Exception:  # already closed or broken: nothing left to release
            pass

    async def _publish_snapshot(self, agent: SimulatedAgent, semaphore: asyncio.Semaphore) -> None:
        async with semaphore:
            connection = self.connection
            if connection is None or not self.connected.is_set():
                return
            snapshot = agent.state.snapshot(time.time())
            try:
                await connection.jetstream().publish(
                    self.names.snapshot_subject(agent.state.node), encode(snapshot), timeout=5
                )
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError, OSError) as exc:
                self.snapshot_failures += 1
                log.debug("snapshot of %s not acknowledged: %s", agent.state.node, exc,
                          extra=fields(node=agent.state.node))
                return
            agent.state.snapshot_acked(snapshot.sequence)
            self.snapshots_sent += 1

    async def _snapshot_loop(self) -> None:
        semaphore = asyncio.Semaphore(self.publish_concurrency)
        attempt = 0
        while not self._stopping:
            await self._snapshot_wake.wait()
            self._snapshot_wake.clear()
            await self.connected.wait()
            due = [a for a in self.agents if a.state.snapshot_due]
            await asyncio.gather(*(self._publish_snapshot(a, semaphore) for a in due))
            if any(a.state.snapshot_due for a in self.agents):
                # Not acknowledged (JetStream briefly unavailable, or the connection went): try again.
                await asyncio.sleep(backoff_delay(attempt))
                attempt += 1
                self._snapshot_wake.set()
            else:
                attempt = 0

    async def _heartbeat_loop(self) -> None:
        # Spread the fleet's heartbeats over the interval instead of sending them in one burst.
        while not self._stopping:
            start = time.monotonic()
            await self.connected.wait()
            step = self.heartbeat_interval / max(1, len(self.agents))
            for i, agent in enumerate(self.agents):
                connection = self.connection
                if connection is None or not self.connected.is_set() or self._stopping:
                    break
                try:
                    await connection.publish(self.names.heartbeat_subject(agent.state.node), encode(agent.state.heartbeat(time.time())))
                    self.heartbeats_sent += 1
                except (nats.errors.Error, OSError):
                    break
                target = start + (i + 1) * step
                delay = target - time.monotonic()
                if delay > 0.001:
                    await asyncio.sleep(delay)
            remaining = start + self.heartbeat_interval - time.monotonic()
            await asyncio.sleep(max(0.0, remaining) + random.uniform(0, self.heartbeat_interval * 0.05))

    async def _rescan_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.rescan_interval)
            try:
                await self.rescan()
            except Exception:
                log.exception("device discovery failed; keeping the last snapshot")

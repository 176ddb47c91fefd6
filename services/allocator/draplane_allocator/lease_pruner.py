"""Lapse pruning: reservations whose lease ran out before their placement reached Kubernetes are
released (or confirmed, where Kubernetes has their claim allocated: reservation_protocol.lapse).

Commits prune the node they write anyway; this covers nodes nobody commits to any more, where a
lapsed reservation would otherwise hold its device for ever."""

from __future__ import annotations

import asyncio
import logging

from draplane.scheduling import reservation_protocol as protocol
from draplane.scheduling import reservations as rv
from draplane.structured_logs import fields
from draplane_allocator.metrics import ShardMetrics
from draplane_allocator.view import ShardView

PRUNE_INTERVAL_SECONDS = 5.0
# How long the pruner waits for the shard's view to be ready before it starts.
READY_WAIT_SECONDS = 3600.0


class LeasePruner:
    def __init__(self, view: ShardView, *, index: int, metrics: ShardMetrics,
                 log: logging.LoggerAdapter | logging.Logger) -> None:
        self.view, self.index, self.m, self.log = view, index, metrics, log

    async def run(self) -> None:
        await self.view.wait_ready(timeout=READY_WAIT_SECONDS)
        while True:
            await asyncio.sleep(PRUNE_INTERVAL_SECONDS)
            await self.prune_once()

    async def prune_once(self) -> None:
        store, state = self.view.store, self.view.state
        now = self.view.lapse_clock()
        for node, (_, entry) in list(store.entries.items()):
            if not protocol.has_lapsed(entry, now):
                continue
            steps: list[protocol.Lapse] = []

            def edit(current: rv.NodeReservations) -> rv.NodeReservations | None:
                steps[:] = [protocol.lapse(current, self.view.lapse_clock(), state.claim_is_allocated)]
                return steps[0].entry

            if await store.change(node, edit):
                step = steps[0]
                self.m.lapses_released.inc(len(step.released))
                self.m.lapses_confirmed.inc(len(step.confirmed))
                # pod reservations lapse after every placement by design: not news
                self.log.log(logging.INFO if step.news else logging.DEBUG,
                             "shard %d: node %s: lapsed leases: %d claim reservations released, "
                             "%d confirmed (their claims are allocated), %d pod reservations dropped",
                             self.index, node, len(step.released), len(step.confirmed), step.pods_dropped,
                             extra=fields(node=node))

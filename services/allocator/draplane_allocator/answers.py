"""A shard's answers to the binder, on the results stream: Placements and Unschedulables,
published no faster than the binder takes them (back-pressure)."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from draplane.scheduling.messages import PendingPod, Preemption, Subjects, Unschedulable, encode_message
from draplane.scheduling.unschedulable import CLAIM_ERROR

# Placements published but not yet taken by the binder, above which shards wait.
MAX_BINDER_BACKLOG = 128
BACKLOG_RECHECK_SECONDS = 0.25
# How long a shard waits before it asks again about a backlog at the limit.
FULL_BACKLOG_WAIT_SECONDS = 0.2


class Answers:
    def __init__(self, js: JetStreamContext, subjects: Subjects, *, index: int) -> None:
        self.js, self.subjects, self.index = js, subjects, index
        # The binder's backlog as last read, and what this shard published after: until
        # _backlog_low_until (monotonic) that sum stands in for reading it again.
        self._backlog_low_until = 0.0
        self.backlog_seen = 0
        self.published_since_backlog = 0

    async def publish(self, message) -> None:
        await self.js.publish(self.subjects.results, encode_message(message))
        self.published_since_backlog += 1

    async def wait_for_binder(self) -> None:
        """Back-pressure: placements waiting for the binder hold devices under a lease; placing far
        ahead of what it writes would only let those leases lapse. Wait while its backlog is big.

        A backlog under half the limit is not asked again for BACKLOG_RECHECK_SECONDS, as long as
        it plus what this shard published since stays under half: pods trickle in when the binder
        is the slower side, so a shard's batches are of a few pods, and a stream-info round trip
        before each was a fifth of the NATS requests it made."""
        if time.monotonic() < self._backlog_low_until and \
                self.backlog_seen + self.published_since_backlog < MAX_BINDER_BACKLOG // 2:
            return
        while True:
            try:
                info = await self.js.stream_info(self.subjects.results_stream)
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
                return
            self.backlog_seen, self.published_since_backlog = info.state.messages, 0
            if info.state.messages < MAX_BINDER_BACKLOG:
                if info.state.messages < MAX_BINDER_BACKLOG // 2:
                    self._backlog_low_until = time.monotonic() + BACKLOG_RECHECK_SECONDS
                return
            await asyncio.sleep(FULL_BACKLOG_WAIT_SECONDS)

    async def refuse_all(self, members: list[PendingPod], message: str, *, label: str = "",
                         claim_error: bool = False, preemptions: dict[str, Preemption] | None = None) -> None:
        """The same Unschedulable for each pod (a gang's members): the binder records it on every pod."""
        await asyncio.gather(*(self.publish(Unschedulable(
            pod=pending.pod, shard=self.index, message=message, failures=[],
            claim_error=message if claim_error else "", label=CLAIM_ERROR if claim_error else label,
            preemption=(preemptions or {}).get(pending.pod.uid),
        )) for pending in members))

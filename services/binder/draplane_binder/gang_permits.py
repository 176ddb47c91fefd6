"""kube-scheduler's gang Permit, in the binder: the members a shard placed together by one commit
(their Placements carry the same GangCommit) wait after Permit until every one of them has passed
it, and only then go on to PreBind and Bind. One member that fails before that (its pod gone, its
lease lapsed) rejects the others, which are unreserved and tried again, so the gang is bound
whole or not at all, never in part. A member that fails later, in PreBind or Bind, fails alone,
as in kube-scheduler.

A barrier is kept a while after it opens or is rejected (bounded), so that a member whose
Placement comes late (redelivered) learns the outcome instead of waiting for members that have
gone on. A barrier that opens is also written to a small key-value bucket (`GangPermitMarks`)
before its members go on: a binder that restarts has no barriers in memory, and the members whose
Placements come again after the crash would otherwise wait for ones bound and acknowledged before
it, and be turned back after the timeout. With the mark they pass at once, as they had.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from draplane.scheduling.messages import GangCommit
from draplane.structured_logs import error_text

log = logging.getLogger(__name__)

# How long the members wait for each other before the gang is rejected (the others' Placements
# lost, or their binder gone): then all are unreserved and the shard places the gang again.
GANG_PERMIT_TIMEOUT_SECONDS = 60.0
# While they wait, their leases are renewed (and their results messages kept) this often.
KEEP_ALIVE_SECONDS = 5.0
# Barriers remembered after they open or are rejected, at most this many and this long.
MAX_BARRIERS = 10_000
RETAIN_SECONDS = 600.0


OPENED = b"opened"
# A mark is read or written within this; beyond it the barrier goes on without (as before marks).
MARK_TIMEOUT_SECONDS = 2.0


class GangPermitMarks:
    """The bucket of opened barriers (keyed by commit id, kept RETAIN_SECONDS): the NATS edge."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def opened(self, commit: str) -> bool:
        """Whether this commit's barrier opened (in this binder or one before it). An error is
        logged and read as no: the members wait for each other, as without marks."""
        try:
            entry = await asyncio.wait_for(self.kv.get(commit), MARK_TIMEOUT_SECONDS)
        except nats.js.errors.KeyNotFoundError:
            return False
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError, OSError) as exc:
            log.warning("gang commit %s: could not read whether its barrier opened (%s); its members wait for "
                        "each other", commit, error_text(exc))
            return False
        return entry.value == OPENED

    async def mark_opened(self, commit: str) -> None:
        """Write that the barrier opened; an error is logged, and only a binder restarting before
        its members are bound would miss it."""
        try:
            await asyncio.wait_for(self.kv.put(commit, OPENED), MARK_TIMEOUT_SECONDS)
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError, OSError) as exc:
            log.warning("gang commit %s: could not record that its barrier opened (%s)", commit, error_text(exc))


class _Barrier:
    __slots__ = ("members", "arrived", "rejected", "opened", "created", "all_arrived", "looked_up")

    def __init__(self, members: int, now: float) -> None:
        self.members = members
        self.arrived: set[str] = set()
        self.rejected: str | None = None
        self.opened = asyncio.Event()
        self.created = now
        # every member passed Permit: the barrier is as good as open (its mark being written)
        self.all_arrived = False
        self.looked_up = False  # its mark read, once per barrier in this process


class GangPermits:
    def __init__(self, *, timeout: float = GANG_PERMIT_TIMEOUT_SECONDS, marks: GangPermitMarks | None = None) -> None:
        self.timeout = timeout
        self.marks = marks  # set by the service once its bucket is open
        self._barriers: OrderedDict[str, _Barrier] = OrderedDict()
        # The most members that can wait at once: the results consumer's limit of messages
        # delivered and not acknowledged (draplane_binder.results sets it). A bigger gang could
        # never gather, as its last members would not be delivered while the first ones wait.
        self.max_members: int | None = None

    def can_gather(self, gang: GangCommit) -> bool:
        return self.max_members is None or gang.members <= self.max_members

    def _barrier(self, gang: GangCommit) -> _Barrier:
        now = time.monotonic()
        while self._barriers:
            oldest = next(iter(self._barriers.values()))
            if len(self._barriers) < MAX_BARRIERS and now - oldest.created < RETAIN_SECONDS:
                break
            self._barriers.popitem(last=False)
        barrier = self._barriers.get(gang.commit)
        if barrier is None:
            barrier = self._barriers[gang.commit] = _Barrier(gang.members, now)
        return barrier

    async def wait(self, gang: GangCommit, pod_uid: str, keep_alive: Callable[[], Awaitable[None]]) -> str | None:
        """This member passed Permit: wait for the others. None once all have; else why the gang
        was rejected."""
        barrier = self._barrier(gang)
        if self.marks is not None and not barrier.looked_up:
            barrier.looked_up = True
            if await self.marks.opened(gang.commit) and barrier.rejected is None:
                # opened before this binder started: the members bound then are not coming again
                barrier.all_arrived = True
                barrier.opened.set()
        if barrier.rejected is None and not barrier.opened.is_set():
            barrier.arrived.add(pod_uid)
            if len(barrier.arrived) >= barrier.members and not barrier.all_arrived:
                barrier.all_arrived = True
                if self.marks is not None:
                    await self.marks.mark_opened(gang.commit)
                barrier.opened.set()
        deadline = time.monotonic() + self.timeout
        while not barrier.opened.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                self.reject(gang, f"{len(barrier.arrived)} of its {barrier.members} members passed Permit within "
                                  f"{self.timeout:g} s")
                break
            try:
                await asyncio.wait_for(barrier.opened.wait(), min(left, KEEP_ALIVE_SECONDS))
            except asyncio.TimeoutError:
                await keep_alive()
        return barrier.rejected

    def reject(self, gang: GangCommit, why: str) -> None:
        """A member failed before the gang's barrier opened: every member is turned back. After it
        opened, nothing changes: the others are on their way to being bound."""
        barrier = self._barrier(gang)
        if (barrier.opened.is_set() or barrier.all_arrived) and barrier.rejected is None:
            return
        if barrier.rejected is None:
            barrier.rejected = why
        barrier.opened.set()

    def __len__(self) -> int:
        return len(self._barriers)

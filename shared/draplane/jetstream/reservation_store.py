"""The reservation bucket, mirrored in memory: a watch keeps `entries` current, and every write is
a compare-and-set on one node's key. The entries are draplane.scheduling.reservations; what each
write changes is decided by draplane.scheduling.reservation_protocol, and this module only reads,
writes and retries."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from draplane.scheduling import reservation_protocol as protocol
from draplane.scheduling import reservations as rv
from draplane.jetstream import streams

log = logging.getLogger(__name__)


class StaleRevision(Exception):
    """The node's entry changed since the view a placement was computed on."""


class ReservationStore:
    def __init__(self, kv: KeyValue, *, watch_kv: KeyValue | None = None,
                 on_change: Callable[[str], None] | None = None):
        """`watch_kv`: the same bucket through another connection, for the watch alone (a shard's
        paced following connection); writes and reads go through `kv`."""
        self._kv = kv
        self._watch_kv = watch_kv if watch_kv is not None else kv
        # node -> (revision, entry); revision 0 for a node never written
        self.entries: dict[str, tuple[int, rv.NodeReservations]] = {}
        self._on_change = on_change
        # what each node's entry read last holds, so a write's unchanged reservations are not decoded again
        self._decoder = rv.EntryDecoder()
        self._synced = asyncio.Event()
        self._changed = asyncio.Condition()
        # One writer per node entry within this process: concurrent writers in one process would
        # only make each other's compare-and-set fail.
        self._node_locks: dict[str, asyncio.Lock] = {}

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    async def wait_synced(self) -> None:
        await self._synced.wait()

    def entry(self, node: str) -> tuple[int, rv.NodeReservations]:
        return self.entries.get(node) or (0, rv.NodeReservations(node=node))

    def _apply(self, node: str, revision: int, value: bytes | None) -> None:
        if not self._is_news(node, revision):
            return  # a watch update older than what a write of ours already taught us
        try:
            entry = self._decoder.decode(value, node)
        except ValueError as exc:
            log.error("ignoring unreadable reservation entry: %s", exc)
            return
        self._take(node, revision, entry)

    def _is_news(self, node: str, revision: int) -> bool:
        current = self.entries.get(node)
        return current is None or current[0] < revision

    def _take(self, node: str, revision: int, entry: rv.NodeReservations) -> None:
        self.entries[node] = (revision, entry)
        if self._on_change is not None:
            self._on_change(node)

    async def watch(self) -> None:
        """Mirror the bucket forever (run as a task). Resumes after the watcher breaks. Synced at
        the end of the replay as streams.bucket_entries finds it (nats-py's own marker can come
        before the entries)."""
        while True:
            try:
                async with contextlib.aclosing(streams.bucket_entries(self._watch_kv)) as entries:
                    async for update in entries:
                        if update is None:
                            self._synced.set()
                            continue
                        self._apply(update.key, update.revision, streams.entry_value(update))
                        async with self._changed:
                            self._changed.notify_all()
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                log.warning("reservation watch broke (%s); restarting it", exc)
                await asyncio.sleep(0.5)

    async def refresh(self, node: str) -> tuple[int, rv.NodeReservations]:
        """Read the node's entry straight from the bucket (after a failed compare-and-set)."""
        try:
            got = await self._kv.get(rv.node_key(node))
            self._apply(node, got.revision, got.value)
        except nats.js.errors.KeyNotFoundError:
            pass
        return self.entry(node)

    async def write(self, node: str, entry: rv.NodeReservations, expected_revision: int) -> int:
        """Compare-and-set one node's entry; raises StaleRevision if someone wrote in between."""
        try:
            revision = await self._kv.update(rv.node_key(node), rv.encode_entry(entry), last=expected_revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise StaleRevision(node) from None
        except nats.js.errors.APIError as exc:
            # 10071 is "wrong last sequence" on servers that do not map it to the error above
            if getattr(exc, "err_code", None) in (10071, 10164):
                raise StaleRevision(node) from None
            raise
        # What was written, as written: not encoded and decoded again. The watch brings the same
        # revision later, and _apply skips it.
        if self._is_news(node, revision):
            self._take(node, revision, entry)
        return revision

    async def change(
        self, node: str, edit: Callable[[rv.NodeReservations], rv.NodeReservations | None], *, attempts: int = 50
    ) -> bool:
        """Read-modify-compare-and-set until it sticks. `edit` returns None for "nothing to write".

        Used for changes that cannot be wrong whatever else happened to the entry (confirm, extend,
        release); a new placement instead goes through `write` with the revision it was computed on.
        """
        lock = self._node_locks.setdefault(node, asyncio.Lock())
        async with lock:
            revision, entry = self.entry(node)
            for _ in range(attempts):
                new = edit(entry)
                if new is None:
                    return False
                try:
                    await self.write(node, new, revision)
                    return True
                except StaleRevision:
                    revision, entry = await self.refresh(node)
        raise RuntimeError(f"reservation entry of node {node}: {attempts} compare-and-set attempts all lost")

    async def confirm(self, node: str, claim_uids: Iterable[str]) -> None:
        uids = list(claim_uids)
        await self.change(node, lambda entry: protocol.confirm(entry, uids))

    async def release(self, node: str, claim_uids: Iterable[str]) -> bool:
        uids = list(claim_uids)
        return await self.change(node, lambda entry: protocol.release(entry, uids))

    async def release_matching(
        self, node: str, expected: dict[str, list[rv.ReservedDevice]], pods: Iterable[str] = ()
    ) -> bool:
        """protocol.abandon: release these claims' reservations where they still hold these
        devices, and the pods' reservations on this node."""
        pod_uids = list(pods)
        return await self.change(node, lambda entry: protocol.abandon(entry, expected, pod_uids))

    async def hold(
        self, node: str, expected: dict[str, list[rv.ReservedDevice]], seconds: float, pods: Iterable[str] = ()
    ) -> set[str]:
        """protocol.hold in one compare-and-set: the claims whose reservation on `node` is still
        the expected one, and the pods still reserved there, with their leases renewed.

        When no lease needs renewing nothing is written, and the check is against this process'
        mirror: safe, because only expired leases are pruned by others, and a lease with more
        than half left cannot have expired (clocks may differ by up to half a lease). This saves a
        bucket write per placement, since the binder renews a whole fetched batch per node just
        before writing its placements.
        """
        pod_uids = list(pods)
        matched: set[str] = set()

        def edit(entry: rv.NodeReservations) -> rv.NodeReservations | None:
            step = protocol.hold(entry, expected, pod_uids, time.time(), seconds)
            matched.clear()
            matched.update(step.held)
            return step.entry

        await self.change(node, edit)
        if len(matched) < len(expected) + len(pod_uids):
            # A shard's reservation reaches the binder as a placement, and may get here before
            # the bucket watch brings the write itself: a miss in the mirror is only believed
            # after reading the entry from the bucket.
            await self.refresh(node)
            await self.change(node, edit)
        return set(matched)

    def find_claim(self, claim_uid: str) -> tuple[str, rv.Reservation] | None:
        """The node and reservation of a claim, from the mirror."""
        for node, (_, entry) in self.entries.items():
            reservation = entry.claims.get(claim_uid)
            if reservation is not None:
                return node, reservation
        return None

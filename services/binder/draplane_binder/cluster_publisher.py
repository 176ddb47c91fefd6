"""Keep the cluster bucket (draplane.scheduling.cluster_feed) equal to what the binder's watches hold.

The binder's watch handlers `offer` every object they take in; a background task writes what
changed to the bucket, one put (or delete) per key and round, never two at once for one key, so
the bucket's order per key is the order of the offers. A value whose trimmed bytes equal what the
bucket already holds is not written: a node heartbeat or a claim's device status costs nothing
downstream.

Writes are gathered for a few milliseconds (`coalesce_seconds`) before each round starts (what is
offered while a round is written waits for the next gathering): every
shard follows the bucket, and nats-py takes a burst of messages for a fraction of what it spends
on each one that arrives alone (bench/nats_receive.py: 64-75 us a lone bucket message at 600/s,
9-11 in bursts). A key asked for by `revision_of` (a PendingPod waits on it) is written at once,
alone, so the gathering never lengthens a pod's path to its shard; the rest keep gathering.

A claim new to the bucket and not allocated is held back up to `new_claim_hold_seconds` (once the
bucket is synced): the binder has just made it for a pod whose PendingPod carries it, so no shard
waits for it, and its allocation usually comes within the hold and is the one value written. That
is one message fewer per pod for every shard. A claim held back has no devices, so leaving it out
cannot make a shard take devices as free that are not: it does not hold the heartbeat back. A key
asked for by `revision_of` is not held.

Each round is written once more, as one message (draplane.scheduling.cluster_changes): the
shards read those, not the keys one by one. A batch that fails to be written is not written again:
the shards find the sequences it would have named missing and read them from the stream.

After a restart the binder first reads the bucket back (`load`), so that objects unchanged since
are not written again. Each time a watch lists (at start, and again after it failed), keys of its
kind it did not offer are of objects gone while it did not watch, and are deleted (`listed`). Once
every watch has listed, SYNCED_KEY is written after every key offered before it: from then on a
shard that watches the bucket from its start holds the cluster. A heartbeat (HEARTBEAT_KEY) then says until
when the bucket is known to mirror Kubernetes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

from nats.js.api import Header
from nats.js.kv import KV_OP, KV_PURGE, MSG_ROLLUP_SUBJECT, KeyValue

from draplane.scheduling import cluster_changes
from draplane.scheduling import cluster_feed as feed
from draplane.jetstream import streams

log = logging.getLogger(__name__)

_MARKERS = (feed.SYNCED_KEY, feed.HEARTBEAT_KEY)

# Puts in flight at once per round: enough to fill a round trip, few enough not to flood NATS.
MAX_PUTS_IN_FLIGHT = 256
# A deleted object's key is purged with a marker that expires after this (NATS message TTL): the
# shards watching take the deletion from the marker, and a shard that starts later rebuilds from
# the bucket as it is and needs no marker for an object it never saw. Without the TTL the
# markers would pile up, one per pod that ever ran.
DELETE_MARKER_TTL_SECONDS = 600.0
# How long offers gather before a round of writes (see the module's doc); a measured choice, see
# bench/shard_model.py --feed-coalesce-ms.
COALESCE_SECONDS = 0.010
# How long a new claim that is not allocated waits for its allocation before it is written as it is
# (see the module's doc). Long: under a burst of pods the binder makes their claims well before the
# shards get to them (bench/e2e.py, 4,000 pods at once: 13 s from creation to binding at the
# median), and 2 s still wrote 797 of 2,698 claims twice. What reads a pending claim from the bucket
# meanwhile is the fragmentation gauge's demand shapes, which see a new shape that much later.
NEW_CLAIM_HOLD_SECONDS = 30.0
RETRY_INITIAL_SECONDS = 0.2
RETRY_MAX_SECONDS = 5.0


class ClusterPublisher:
    def __init__(self, *, instance: str, kinds: tuple[type, ...] = tuple(feed.PREFIXES),
                 coalesce_seconds: float = COALESCE_SECONDS, new_claim_hold_seconds: float = NEW_CLAIM_HOLD_SECONDS):
        self.coalesce_seconds = coalesce_seconds
        self.new_claim_hold_seconds = new_claim_hold_seconds
        # key -> (its value, when (monotonic) it is written at the latest): new claims not allocated,
        # kept out of `wanted` so that no round walks them; in the order held, which is the order
        # their holds end (each lasts new_claim_hold_seconds)
        self.held: dict[str, tuple[bytes, float]] = {}
        self.kv: KeyValue | None = None  # given by `load`; what is offered before waits for it
        self.instance = instance
        self.published: dict[str, bytes] = {}  # key -> the value the bucket holds
        self.revisions: dict[str, int] = {}  # key -> the bucket revision of that value
        self.highest_revision = 0  # the highest bucket revision a write of this binder was given
        self.wanted: dict[str, bytes | None] = {}  # key -> the value to write next (None: delete)
        self.writing: dict[str, bytes | None] = {}  # key -> the value of its write in flight
        self.unwritten_since: dict[str, float] = {}  # key -> when a value not yet written was offered
        # kind -> the keys offered since its watch began to list (the stale-key sweep at its end)
        self.listing: dict[type, set[str]] = {}
        # key prefix -> every key of it that is or may be in published, writing or wanted: the
        # sweep of one kind reads that kind's keys, not the whole bucket (a re-list of the few
        # DeviceClasses walked every pod's and claim's key)
        self.keys_by_prefix: dict[str, dict[str, None]] = {}
        self.unlisted = set(kinds)  # kinds whose watch has not listed yet
        self.synced = False  # SYNCED_KEY queued by this binder
        self._before_synced: set[str] = set()  # the keys SYNCED_KEY waits for (see _synced_due)
        self._work = asyncio.Event()
        self._urgent = asyncio.Event()  # someone waits on a key: it goes out without gathering
        self.urgent_keys: set[str] = set()
        self._retry_delay = RETRY_INITIAL_SECONDS
        self._progress = asyncio.Condition()
        # the change batches' keys: new for each binder start, numbered by round
        self._changes_token = secrets.token_hex(6)
        self._changes_written = 0

    # --- what the watches feed in (synchronous: called from the watch handlers) -------------------

    def offer(self, obj, deleted: bool = False) -> None:
        """The object as the binder's cache now holds it (or its deletion)."""
        try:
            key = feed.key_of(obj)
        except feed.FeedError as exc:
            log.warning("cluster feed: %s; not published", exc)
            return
        if deleted or (isinstance(obj, feed.Pod) and not feed.published_pod(obj)):
            self._want(key, None)
        else:
            listing = self.listing.get(type(obj))
            if listing is not None:
                listing.add(key)
            self._want(key, feed.encode(obj), hold=self._holds_back(key, obj))

    def listing_begins(self, kind: type) -> None:
        """A watch of `kind` (re)starts with a list: what it does not offer before `listed` went
        while it did not watch. Kinds the bucket does not hold (templates) are ignored."""
        if kind in feed.PREFIXES:
            self.listing[kind] = set()

    def listed(self, kind: type) -> None:
        """The watch of `kind` has listed (or the apiserver does not serve it): keys of that kind
        it did not offer are of objects gone while it did not watch, and are deleted. Once every
        kind has listed, the bucket is marked synced."""
        offered = self.listing.pop(kind, None)
        if offered is not None:
            # a new object's first write may be in flight still (in `writing` alone)
            stale = [k for k in self.keys_by_prefix.get(feed.PREFIXES[kind], ())
                     if k not in offered and (k in self.published or k in self.writing or k in self.wanted
                                              or k in self.held)]
            for key in dict.fromkeys(stale):
                self._want(key, None)
            log.info("cluster feed: %s listed: %d in the bucket, %d gone while not watched deleted",
                     kind.__name__, len(offered), len(stale))
        self.unlisted.discard(kind)
        if self.unlisted or self.synced:
            return
        # queued behind every value offered so far, and written only once they are (see run)
        self._before_synced = {k for k in (*self.wanted, *self.writing) if k != feed.SYNCED_KEY}
        self.wanted[feed.SYNCED_KEY] = feed.encode_synced(feed.Synced(binder=self.instance, at=time.time()))
        self.synced = True
        self._work.set()

    def heartbeat_value(self, now: float) -> bytes:
        """The heartbeat says the bucket mirrors Kubernetes until its time: no later than the
        oldest offer still unwritten (a failing write holds it back)."""
        return feed.encode_synced(feed.Synced(binder=self.instance, at=min([now, *self.unwritten_since.values()])))

    def _holds_back(self, key: str, obj) -> bool:
        """A claim new to the bucket and not allocated, once the bucket is synced (see the module's doc)."""
        return (self.new_claim_hold_seconds > 0 and self.synced and isinstance(obj, feed.ResourceClaim)
                and (obj.status is None or obj.status.allocation is None)
                and key not in self.published and key not in self.writing)

    def _want(self, key: str, value: bytes | None, *, hold: bool = False) -> None:
        if hold:
            # The first offer starts the hold; a later one of the same unallocated claim keeps it.
            # An allocation offered before and not written is superseded: it no longer holds the
            # heartbeat back (the bucket lacking an unallocated claim hides no devices in use).
            until = self.held[key][1] if key in self.held else time.monotonic() + self.new_claim_hold_seconds
            self.held[key] = (value, until)
            self.wanted.pop(key, None)
            self.unwritten_since.pop(key, None)
            self._index(key)
            self._work.set()  # the writer's wait ends with the first hold
            return
        if self.held.pop(key, None) is not None and value is None:
            self._unindex(key)  # deleted while held: the bucket never had it
            return
        if key not in self.wanted:
            # What the bucket holds once the write in flight lands (a failed one is queued again
            # in `_write_round`). An object's watch event usually comes while the binder's write of that
            # same object (a claim it created or allocated) is still being published: comparing
            # with `published` only wrote such a claim twice or three times.
            holds = self.writing[key] if key in self.writing else self.published.get(key)
            if holds == value:
                return  # the bucket holds it already (None == missing: a delete of what is not there)
        self.wanted[key] = value
        self._index(key)
        if key not in _MARKERS:
            self.unwritten_since.setdefault(key, time.time())
        self._work.set()

    def _index(self, key: str) -> None:
        self.keys_by_prefix.setdefault(key.split(".", 1)[0], {})[key] = None

    def _unindex(self, key: str) -> None:
        prefix = key.split(".", 1)[0]
        keys = self.keys_by_prefix.get(prefix)
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self.keys_by_prefix[prefix]

    # --- I/O ---------------------------------------------------------------------------------------

    async def load(self, kv: KeyValue) -> None:
        """What the bucket holds now (left by the binder before this one). Whole on each call: a
        start that asks again after a timeout does not keep what the first try half read."""
        self.published.clear()
        self.revisions.clear()
        async with contextlib.aclosing(streams.bucket_entries(kv)) as entries:
            async for entry in entries:
                if entry is None:
                    break
                if cluster_changes.is_changes_key(entry.key):
                    continue  # a round's batch (it expires): not an object the binder keeps
                if (value := streams.entry_value(entry)) is not None:
                    self.published[entry.key] = value
                    self.revisions[entry.key] = entry.revision
                    self._index(entry.key)
        self.kv = kv
        log.info("cluster feed: %d keys in the bucket at start", len(self.published))

    async def run(self) -> None:
        """Write what was offered, for ever; failures are retried with backoff, never dropped."""
        if self.kv is None:
            raise RuntimeError("ClusterPublisher.run before load")
        while True:
            try:
                await asyncio.wait_for(self._work.wait(), self._until_a_hold_ends())
            except asyncio.TimeoutError:
                pass  # a held claim is due
            await self._gather_offers()
            self._work.clear()
            self._release_ended_holds()
            # What gathered goes out now; what is offered meanwhile gathers for the next round, so
            # that under a steady load too the shards receive bursts, not one message at a time.
            keys = self._due_keys()
            for start in range(0, len(keys), MAX_PUTS_IN_FLIGHT):
                await self._write_round([k for k in keys[start:start + MAX_PUTS_IN_FLIGHT] if k in self.wanted])
            if self._synced_due():
                await self._write_round([feed.SYNCED_KEY])

    def _until_a_hold_ends(self) -> float | None:
        """Seconds until the first held claim is due; None when none is held."""
        if not self.held:
            return None
        return max(0.0, next(iter(self.held.values()))[1] - time.monotonic())

    def _release_ended_holds(self) -> None:
        """The held claims whose hold has ended join the wanted values (first held, first due)."""
        now = time.monotonic()
        while self.held:
            key, (value, until) = next(iter(self.held.items()))
            if until > now:
                return
            del self.held[key]
            self.wanted[key] = value

    def _due_keys(self) -> list[str]:
        """The wanted keys to write now, in the order offered. Never SYNCED_KEY (`_synced_due`)."""
        return [k for k in self.wanted if k != feed.SYNCED_KEY]

    def _synced_due(self) -> bool:
        """SYNCED_KEY goes once every key offered before it was queued is written: a shard that
        sees it must find the whole first listing before it. Later offers do not hold it back (a
        busy cluster offers something every round)."""
        if feed.SYNCED_KEY not in self.wanted:
            return False
        self._before_synced = {k for k in self._before_synced if k in self.wanted or k in self.writing}
        return not self._before_synced

    async def _gather_offers(self) -> None:
        """Let the offers of the next few ms join one round; keys waited on meanwhile go at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.coalesce_seconds
        while (left := deadline - loop.time()) > 0:
            if not self._urgent.is_set():
                try:
                    await asyncio.wait_for(self._urgent.wait(), left)
                except asyncio.TimeoutError:
                    return
            self._urgent.clear()
            urgent = [k for k in self.wanted if k in self.urgent_keys]  # in the order offered
            self.urgent_keys.clear()
            if urgent:
                await self._write_round(urgent)

    async def _write_round(self, keys: list[str]) -> None:
        """One round: these keys' wanted values written at once (their failures queued again,
        after a backoff)."""
        batch = {k: self.wanted[k] for k in keys}
        for key in batch:
            del self.wanted[key]
            self.urgent_keys.discard(key)  # written now, hurried or not
        self.writing.update(batch)
        results = await asyncio.gather(*(self._write(k, v) for k, v in batch.items()), return_exceptions=True)
        for key in batch:
            del self.writing[key]
        failed = 0
        changes: list[cluster_changes.Change] = []
        for (key, value), result in zip(batch.items(), results):
            if not isinstance(result, BaseException) and result:
                changes.append(cluster_changes.change(key, result, value))
                self.highest_revision = max(self.highest_revision, result)
            if isinstance(result, BaseException):
                failed += 1
                self.wanted.setdefault(key, value)  # unless something newer came meanwhile
                self._work.set()  # the next round takes it, after the backoff below
            else:
                if key not in self.wanted:
                    self.unwritten_since.pop(key, None)
                if value is None:
                    self.published.pop(key, None)
                    self.revisions.pop(key, None)
                    if key not in self.wanted:
                        self._unindex(key)
                else:
                    self.published[key] = value
                    self.revisions[key] = result
        if changes:
            await self._write_changes(changes)
        async with self._progress:
            self._progress.notify_all()
        if failed:
            error = next(r for r in results if isinstance(r, BaseException))
            log.warning("cluster feed: %d of %d writes failed (%r); retrying in %.1f s",
                        failed, len(batch), error, self._retry_delay)
            await asyncio.sleep(self._retry_delay)
            self._retry_delay = min(RETRY_MAX_SECONDS, self._retry_delay * 2)
        else:
            self._retry_delay = RETRY_INITIAL_SECONDS

    async def _write(self, key: str, value: bytes | None) -> int:
        """The write's revision (0: not known)."""
        if value is None:
            return await _purge(self.kv, key)
        return await self.kv.put(key, value)

    async def _write_changes(self, changes: list[cluster_changes.Change]) -> None:
        """The round's writes once more, as batches for the shards (see the module's doc)."""
        for batch in cluster_changes.encode_batches(self.instance, changes):
            self._changes_written += 1
            key = cluster_changes.changes_key(self._changes_token, self._changes_written)
            try:
                await self.kv.create(key, batch, msg_ttl=cluster_changes.CHANGES_TTL_SECONDS)
            except Exception as exc:  # noqa: BLE001 - the shards read what it would have named from the stream
                log.warning("cluster feed: the batch of %d changes was not written (%r); the shards read them "
                            "from the bucket's stream instead", len(changes), exc)

    async def heartbeat(self) -> None:
        """Every HEARTBEAT_SECONDS once synced, through the same writes as the rest: shards lapse
        leases only up to it (a binder gone quiet could have allocated a claim the bucket lacks)."""
        while True:
            await asyncio.sleep(feed.HEARTBEAT_SECONDS)
            if self.synced:
                self._want(feed.HEARTBEAT_KEY, self.heartbeat_value(time.time()))

    def settled_revision(self, key: str, value: bytes) -> int:
        """The bucket revision that holds `value` under `key`, when nothing newer is on its way
        there; 0 otherwise (its write not landed yet, or another value wanted after it)."""
        if key in self.wanted or key in self.writing or self.published.get(key) != value:
            return 0
        return self.revisions.get(key, 0)

    async def revision_of(self, keys: list[str], timeout: float = 10.0) -> int:
        """The bucket revision from which a shard sees `keys` as the binder does now (waits for
        their writes in flight). Raises TimeoutError when NATS does not take them in time."""
        # SYNCED_KEY is never hurried: it goes after the keys offered before it (_synced_due)
        for key in keys:
            if (held := self.held.pop(key, None)) is not None:  # not held any longer: written now
                self.wanted[key] = held[0]
                self.unwritten_since.setdefault(key, time.time())
                self._work.set()
        waited = [k for k in keys if k in self.wanted and k != feed.SYNCED_KEY]
        if waited and self.coalesce_seconds > 0:  # without gathering every key goes at once anyway
            self.urgent_keys.update(waited)
            self._urgent.set()

        await self._until_written(keys, timeout)
        return max((self.revisions.get(k, 0) for k in keys), default=0)

    async def written_through(self, keys: list[str], timeout: float = 10.0) -> int:
        """Once the writes of `keys` on their way have landed (not hurried: they go with their
        round), the highest revision this binder has written: a shard whose view reaches it holds
        them, a deleted key's purge included (whose own revision `revision_of` no longer knows).
        Raises TimeoutError when NATS does not take them in time."""
        await self._until_written(keys, timeout)
        return self.highest_revision

    async def _until_written(self, keys: list[str], timeout: float) -> None:
        """Until no write of `keys` is wanted or in flight (TimeoutError after `timeout`)."""
        async def written() -> None:
            async with self._progress:
                await self._progress.wait_for(lambda: not any(k in self.wanted or k in self.writing for k in keys))
        await asyncio.wait_for(written(), timeout)


async def _purge(kv: KeyValue, key: str) -> int:
    """A purge, not a delete: it also drops the key's earlier revision from the stream. Its marker
    expires after DELETE_MARKER_TTL_SECONDS. Returns the marker's revision: nats-py's own purge
    does not say it, and the change batches name every write's (so this publishes the same
    message nats-py's KeyValue.purge does, itself)."""
    js, prefix = getattr(kv, "_js", None), getattr(kv, "_pre", None)
    if js is None or prefix is None:  # not nats-py's KeyValue: its own purge
        await kv.purge(key, msg_ttl=DELETE_MARKER_TTL_SECONDS)
        return 0
    ack = await js.publish(f"{prefix}{key}", headers={KV_OP: KV_PURGE, Header.ROLLUP: MSG_ROLLUP_SUBJECT},
                           msg_ttl=DELETE_MARKER_TTL_SECONDS)
    return ack.seq

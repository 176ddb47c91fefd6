"""Keep the cluster bucket (draplane.scheduling.cluster_feed) equal to what the binder's watches hold.

The binder's watch handlers `offer` every object they take in; a background task writes what
changed to the bucket, one put (or delete) per key and round, never two at once for one key, so
the bucket's order per key is the order of the offers. A value whose trimmed bytes equal what the
bucket already holds is not written: a node heartbeat or a claim's device status costs nothing
downstream.

After a restart the binder first reads the bucket back (`load`), so that objects unchanged since
are not written again, and once every watch has listed (`listed`), keys of objects that went while
no binder watched are deleted, and then SYNCED_KEY is written: from then on a shard that watches
the bucket from its start holds the cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from draplane.scheduling import cluster_feed as feed

log = logging.getLogger(__name__)

# Puts in flight at once per round: enough to fill a round trip, few enough not to flood NATS.
MAX_PUTS_IN_FLIGHT = 256
# A deleted object's key is purged with a marker that expires after this (NATS message TTL): the
# shards watching take the deletion from the marker, and a shard that starts later rebuilds from
# the bucket as it is and needs no marker for an object it never saw. Without the TTL the
# markers would pile up, one per pod that ever ran.
DELETE_MARKER_TTL_SECONDS = 600.0
RETRY_INITIAL_SECONDS = 0.2
RETRY_MAX_SECONDS = 5.0


class ClusterPublisher:
    def __init__(self, *, instance: str, kinds: tuple[type, ...] = tuple(feed.PREFIXES)):
        self.kv: KeyValue | None = None  # given by `load`; what is offered before waits for it
        self.instance = instance
        self.published: dict[str, bytes] = {}  # key -> the value the bucket holds
        self.revisions: dict[str, int] = {}  # key -> the bucket revision of that value
        self.wanted: dict[str, bytes | None] = {}  # key -> the value to write next (None: delete)
        self.writing: set[str] = set()  # keys with a write in flight
        self.offered: set[str] = set()  # keys offered with a value since start (the stale-key sweep)
        self.unlisted = set(kinds)  # kinds whose watch has not listed yet
        self.synced = False  # SYNCED_KEY written by this binder
        self._work = asyncio.Event()
        self._progress = asyncio.Condition()

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
            self.offered.add(key)
            self._want(key, feed.encode(obj))

    def listed(self, kind: type) -> None:
        """The watch of `kind` has listed (or the apiserver does not serve it): once all have, keys
        of objects gone while no binder watched are deleted and the bucket is marked synced."""
        self.unlisted.discard(kind)
        if self.unlisted or self.synced:
            return
        stale = [k for k in self.published if k not in self.offered and k not in self.wanted
                 and feed.kind_of_key(k) is not None]
        for key in stale:
            self._want(key, None)
        log.info("cluster feed: every watch listed: %d objects in the bucket, %d stale ones deleted",
                 len(self.offered), len(stale))
        self.offered.clear()  # needed for the first sweep only
        self.wanted[feed.SYNCED_KEY] = feed.encode_synced(feed.Synced(binder=self.instance, at=time.time()))
        self.synced = True
        self._work.set()

    def _want(self, key: str, value: bytes | None) -> None:
        if key not in self.wanted and key not in self.writing and self.published.get(key) == value:
            return  # the bucket holds it already (None == missing: a delete of what is not there)
        self.wanted[key] = value
        self._work.set()

    # --- I/O ---------------------------------------------------------------------------------------

    async def load(self, kv: KeyValue) -> None:
        """What the bucket holds now (left by the binder before this one)."""
        watcher = await kv.watchall()
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=30.0)
                except nats.errors.TimeoutError:
                    continue
                if entry is None:
                    break
                if entry.operation in ("DEL", "PURGE") or entry.value is None:
                    continue
                self.published[entry.key] = entry.value
                self.revisions[entry.key] = entry.revision
        finally:
            await watcher.stop()
        self.kv = kv
        log.info("cluster feed: %d keys in the bucket at start", len(self.published))

    async def run(self) -> None:
        """Write what was offered, for ever; failures are retried with backoff, never dropped."""
        if self.kv is None:
            raise RuntimeError("ClusterPublisher.run before load")
        delay = RETRY_INITIAL_SECONDS
        while True:
            await self._work.wait()
            self._work.clear()
            while self.wanted:
                batch = dict(list(self.wanted.items())[:MAX_PUTS_IN_FLIGHT])
                for key in batch:
                    del self.wanted[key]
                self.writing.update(batch)
                results = await asyncio.gather(*(self._write(k, v) for k, v in batch.items()), return_exceptions=True)
                self.writing.difference_update(batch)
                failed = 0
                for (key, value), result in zip(batch.items(), results):
                    if isinstance(result, BaseException):
                        failed += 1
                        self.wanted.setdefault(key, value)  # unless something newer came meanwhile
                    elif value is None:
                        self.published.pop(key, None)
                        self.revisions.pop(key, None)
                    else:
                        self.published[key] = value
                        self.revisions[key] = result
                async with self._progress:
                    self._progress.notify_all()
                if failed:
                    error = next(r for r in results if isinstance(r, BaseException))
                    log.warning("cluster feed: %d of %d writes failed (%r); retrying in %.1f s",
                                failed, len(batch), error, delay)
                    await asyncio.sleep(delay)
                    delay = min(RETRY_MAX_SECONDS, delay * 2)
                else:
                    delay = RETRY_INITIAL_SECONDS

    async def _write(self, key: str, value: bytes | None) -> int:
        if value is None:
            # a purge, not a delete: it also drops the key's earlier revision from the stream
            await self.kv.purge(key, msg_ttl=DELETE_MARKER_TTL_SECONDS)
            return 0
        return await self.kv.put(key, value)

    async def revision_of(self, keys: list[str], timeout: float = 10.0) -> int:
        """The bucket revision from which a shard sees `keys` as the binder does now (waits for
        their writes in flight). Raises TimeoutError when NATS does not take them in time."""
        async def written() -> None:
            async with self._progress:
                await self._progress.wait_for(lambda: not any(k in self.wanted or k in self.writing for k in keys))
        await asyncio.wait_for(written(), timeout)
        return max((self.revisions.get(k, 0) for k in keys), default=0)

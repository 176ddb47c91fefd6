"""The devices as NATS tells them: the inventory feed bucket (slices, DeviceClasses), the
reservation bucket (what draplane allocated) and the DeviceTaintRules of the binder's cluster
bucket, for `draplane free`, the dashboard and the metrics subscriber.

`DeviceView` holds the decoded entries and turns them into `free_capacity`'s inputs;
`read_cluster` fills one from the buckets once, `follow_cluster` keeps one current. Neither asks
Kubernetes anything: a claim another scheduler allocated, which only the claim's status in
Kubernetes records, is not seen here (the shards read those from the binder's cluster bucket).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from draplane.allocation.free_capacity import FreeCapacity, free_capacity
from draplane.api.resource import AllocationResult, DeviceClass, DeviceTaintRule, ResourceSlice
from draplane.messages.inventory import FeedEntry, InventoryNames, decode_feed_entry
from draplane.scheduling import cluster_feed
from draplane.scheduling import reservations as rv
from draplane.jetstream import streams
from draplane.scheduling.messages import Subjects

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class DeviceView:
    feed: dict[str, FeedEntry] = dataclasses.field(default_factory=dict)
    reservations: dict[str, rv.NodeReservations] = dataclasses.field(default_factory=dict)
    # DeviceTaintRules, from the binder's cluster bucket: their taints are in no slice, yet a
    # device they taint is as closed to new claims as one whose slice says so
    taint_rules: dict[str, DeviceTaintRule] = dataclasses.field(default_factory=dict)
    unreadable: int = 0  # entries that did not decode (logged, skipped)

    def apply_feed(self, key: str, value: bytes | None) -> None:
        if not value:
            self.feed.pop(key, None)
            return
        try:
            self.feed[key] = decode_feed_entry(value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.unreadable += 1
            log.error("inventory feed entry %s is unreadable, skipped: %s", key, exc)

    def apply_reservations(self, node: str, value: bytes | None) -> None:
        if not value:
            self.reservations.pop(node, None)
            return
        try:
            self.reservations[node] = rv.decode_entry(value, node)
        except ValueError as exc:
            self.unreadable += 1
            log.error("reservation entry %s is unreadable, skipped: %s", node, exc)

    def apply_cluster(self, key: str, value: bytes | None) -> None:
        """An entry of the cluster bucket; only its DeviceTaintRules (TAINT_RULE_KEYS) are read."""
        if not key.startswith(TAINT_RULE_PREFIX):
            return
        if not value:
            self.taint_rules.pop(key, None)
            return
        try:
            self.taint_rules[key] = cluster_feed.decode(key, value)
        except cluster_feed.FeedError as exc:
            self.unreadable += 1
            log.error("cluster bucket entry is unreadable, skipped: %s", exc)

    def slices(self) -> list[ResourceSlice]:
        return [s for entry in self.feed.values() for s in entry.slices]

    def classes(self) -> list[DeviceClass]:
        return [e.device_class for e in self.feed.values() if e.device_class is not None]

    def allocations(self) -> dict[str, AllocationResult]:
        """Claim UID -> what its reservation holds, reserved under a lease or confirmed."""
        return {uid: r.allocation for entry in self.reservations.values() for uid, r in entry.claims.items()}

    def stale_nodes(self) -> list[str]:
        return sorted(e.node for e in self.feed.values() if e.stale and e.node)

    def free(self) -> FreeCapacity:
        return free_capacity(self.slices(), self.classes(), self.allocations(), self.taint_rules.values())


async def _bucket(js: JetStreamContext, name: str):
    try:
        return await js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        return None


# The keys of the cluster bucket read here: its DeviceTaintRules, and nothing of its claims and pods.
TAINT_RULE_PREFIX = f"{cluster_feed.PREFIXES[DeviceTaintRule]}."
TAINT_RULE_KEYS = f"{TAINT_RULE_PREFIX}>"


def _buckets(prefix: str, view: DeviceView) -> list[tuple[str, str, Callable[[str, bytes | None], None]]]:
    """(bucket, keys, apply) of what a view reads."""
    subjects = Subjects(prefix=prefix)
    return [(InventoryNames(prefix=prefix).feed_bucket, ">", view.apply_feed),
            (subjects.reservations_bucket, ">", view.apply_reservations),
            (subjects.cluster_bucket, TAINT_RULE_KEYS, view.apply_cluster)]


async def read_cluster(js: JetStreamContext, prefix: str, *, timeout: float = 10.0) -> DeviceView:
    """The buckets as they are now. A bucket not created yet is an empty one."""
    view = DeviceView()
    for name, keys, apply in _buckets(prefix, view):
        kv = await _bucket(js, name)
        if kv is not None:
            for entry in await streams.bucket_snapshot(kv, keys=keys, timeout=timeout):
                apply(entry.key, streams.entry_value(entry))
    return view


async def follow_cluster(js: JetStreamContext, prefix: str, view: DeviceView, on_change: Callable[[], None],
                         synced: asyncio.Event | None = None) -> None:
    """Keep `view` current from the buckets, forever; `synced` is set once each was read."""
    buckets = _buckets(prefix, view)
    initial = {name: asyncio.Event() for name, _, _ in buckets}

    async def follow(name: str, keys: str, apply) -> None:
        failures = 0
        while True:
            try:
                kv = await _bucket(js, name)
                if kv is None:
                    initial[name].set()  # nothing there yet: empty, and looked at again below
                    await asyncio.sleep(2.0)
                    continue
                async with contextlib.aclosing(streams.bucket_entries(kv, keys)) as entries:
                    async for update in entries:
                        failures = 0
                        if update is None:
                            initial[name].set()  # the replay's real end, not nats-py's early marker
                        else:
                            apply(update.key, streams.entry_value(update))
                        on_change()
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
                failures += 1
                delay = min(30.0, 0.5 * 2 ** (failures - 1))
                log.warning("watching bucket %s failed (%r); again in %.1f s", name, exc, delay)
                await asyncio.sleep(delay)

    async def all_synced() -> None:
        await asyncio.gather(*(e.wait() for e in initial.values()))
        if synced is not None:
            synced.set()

    await asyncio.gather(*(follow(name, keys, apply) for name, keys, apply in buckets), all_synced())

"""A shard's view of the cluster, rebuilt on start from NATS alone (a shard holds no Kubernetes
client): the inventory feed bucket, the cluster bucket the binder fills from its watches
(DeviceClasses, Nodes, DeviceTaintRules, PodGroups, PodDisruptionBudgets, every ResourceClaim and
the bound pods: draplane.scheduling.cluster_feed), and the reservation bucket, all kept in one
SchedulingState (draplane.scheduling.placing) that placing reads.

Read by the placer and the gangs, which write only through the reservation store; the gangs
learn of pods coming and going through `pod_listeners`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager

import nats.js.errors
from nats.js import JetStreamContext

from draplane.allocation.taintrules import rule_selects
from draplane.api.core import Node, Pod
from draplane.api.meta import ObjectMeta
from draplane.api.policy import PodDisruptionBudget
from draplane.api.resource import DeviceClass, DeviceTaintRule, ResourceClaim
from draplane.api.scheduling import PodGroup
from draplane.audit_publisher import AuditPublisher
from draplane.messages import audit
from draplane.messages.inventory import InventoryNames, decode_feed_entry
from draplane.messages.inventory import MessageError as InventoryMessageError
from draplane.jetstream import streams
from draplane.scheduling import cluster_changes, cluster_feed
from draplane.scheduling.gangs import pod_group_key
from draplane.scheduling.messages import PendingPod, Subjects
from draplane.scheduling.placing import SchedulingState
from draplane.jetstream.reservation_store import ReservationStore
from draplane.structured_logs import fields
from draplane_allocator.metrics import ShardMetrics
from draplane_allocator.records import PodToPlace

log = logging.getLogger(__name__)

# How long a pending pod waits for this shard's watch of the cluster bucket to reach the revision
# its PendingPod names (its claims in the bucket) before it goes back with backoff.
CLUSTER_CATCH_UP_SECONDS = 10.0
# How long a write the binder's change batches did not name waits before this shard reads it from
# the bucket's stream (a pending pod that waits for it asks at once).
CLUSTER_GAP_SECONDS = 1.0
# How often a bucket another service creates is looked for while it does not exist yet.
BUCKET_LOOKUP_SECONDS = 1.0

PodListener = Callable[[Pod, bool], None]  # (the pod, deleted)


class ShardView:
    def __init__(self, js: JetStreamContext, subjects: Subjects, feed_names: InventoryNames, *, index: int,
                 policy: str | None, stream_replicas: int, gang_scheduling: bool, audit_publisher: AuditPublisher,
                 metrics: ShardMetrics, log: logging.LoggerAdapter | logging.Logger,
                 follow_js: JetStreamContext | None = None,
                 unpaced_following: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> None:
        self.js, self.subjects, self.feed_names, self.index = js, subjects, feed_names, index
        # The watches (reservations, the cluster bucket and its change batches, the feed) read
        # through follow_js: a connection whose reads may be paced under load
        # (draplane.jetstream.paced_reading), while writes and requests go through js at once.
        self.follow_js = follow_js if follow_js is not None else js
        # while a pod waits for the cluster bucket's revision, that connection reads at once
        self._unpaced_following = unpaced_following
        self.stream_replicas = stream_replicas
        self.gang_scheduling = gang_scheduling
        self.audit, self.m, self.log = audit_publisher, metrics, log
        # Shards break ties between equal nodes each its own way: fewer races for one node.
        self.state = SchedulingState(policy=policy, tie_break=index)
        self._store: ReservationStore | None = None
        self.pods: dict[str, Pod] = {}  # uid -> pod
        self.pod_groups: dict[str, PodGroup] = {}  # namespace/name -> PodGroup
        self.pod_listeners: list[PodListener] = []
        self.synced = {k: asyncio.Event() for k in ("cluster", "feed")}
        # the cluster bucket: key -> the object it holds (what a delete marker deletes)
        self.bucket_objects: dict[str, object] = {}
        # claim uid -> the bucket revision of the value held (a PendingPod's snapshot of the claim
        # gives way to it when it is that revision or later: ClaimSnapshot)
        self.claim_revisions: dict[str, int] = {}
        self.cluster_revision = 0  # the last revision of the bucket taken in
        self._cluster_replayed = False  # past the entries the bucket held when the watch started
        self._cluster_filled_by: str | None = None  # the binder whose SYNCED_KEY is in the bucket
        # The binder's last heartbeat (its clock): the bucket holds what Kubernetes held until
        # about then. Leases are lapsed only up to it (see lapse_clock).
        self.binder_heard_at = 0.0
        self._cluster_moved = asyncio.Condition()
        self._revision_waiters = 0
        # following the binder's change batches (_follow_cluster_changes)
        self._cluster_taken = cluster_changes.Taken(0)
        self._cluster_lock = asyncio.Lock()
        self._cluster_gap_asked = asyncio.Event()
        self._batches_taken = 0  # change batches taken in so far (the gap reader asks the stream only without them)
        self._handlers = {DeviceClass: self._on_class, Node: self._on_node, DeviceTaintRule: self._on_taint_rule,
                          PodGroup: self._on_pod_group, PodDisruptionBudget: self._on_budget,
                          ResourceClaim: self._on_claim, Pod: self._on_pod}

    async def open(self) -> None:
        kv = await streams.reservation_bucket(self.js, self.subjects, replicas=self.stream_replicas)
        watched = kv if self.follow_js is self.js else await self.follow_js.key_value(self.subjects.reservations_bucket)
        self._store = ReservationStore(kv, watch_kv=watched, on_change=self.reservations_changed)

    @property
    def store(self) -> ReservationStore:
        if self._store is None:
            raise RuntimeError("the reservation bucket is not open yet (ShardView.open)")
        return self._store

    def loops(self) -> list[tuple[str, Callable[[], Awaitable]]]:
        return [("reservations watch", self.store.watch), ("inventory feed watch", self._watch_feed),
                ("cluster bucket watch", self._watch_cluster)]

    @property
    def ready(self) -> bool:
        return all(e.is_set() for e in self.synced.values()) and self._store is not None and self._store.synced

    async def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready:
            if time.monotonic() > deadline:
                missing = [k for k, e in self.synced.items() if not e.is_set()]
                raise TimeoutError(f"shard {self.index}: not synced: {missing}")
            await asyncio.sleep(0.05)

    # --- the cluster bucket ------------------------------------------------------------------------

    async def _watch_cluster(self) -> None:
        """Follow the cluster bucket the binder fills (draplane.scheduling.cluster_feed): replay it
        (the latest value of every key: the cluster as it is now), then follow the binder's
        change batches from there (draplane.scheduling.cluster_changes), reading from the
        bucket's stream whatever they did not name."""
        bucket = self.subjects.cluster_bucket
        kv = await self._bucket(bucket, lambda: self.log.info(
            "shard %d: no cluster bucket %s yet (the binder creates it); looking again in %.0f s",
            self.index, bucket, BUCKET_LOOKUP_SECONDS))
        replayed_to = await self._replay_cluster(kv)
        await self._follow_cluster_changes(bucket, cluster_changes.Taken(replayed_to))

    async def _replay_cluster(self, kv) -> int:
        """Take in every key the bucket holds; returns the stream sequence the replay reached
        (every message up to it is taken in, or was overwritten by one that is)."""
        # A watch restarted after a crash replays the bucket over the view it has: a key replayed
        # replaces its object, and those not replayed were deleted meanwhile (taken out at the end).
        # The view stays whole meanwhile, if older, rather than empty under a shard that places.
        replayed: set[str] = set()
        self._cluster_replayed = False
        async with contextlib.aclosing(streams.bucket_entries(kv)) as entries:
            async for update in entries:
                if update is None:
                    break
                replayed.add(update.key)
                self._take_cluster_update(update)
                if self._revision_waiters:
                    async with self._cluster_moved:
                        self._cluster_moved.notify_all()
        # past the replay first: what the sweep takes out was deleted while no watch ran, which is
        # news (a DeviceTaintRule's untainting is told)
        self._cluster_replayed = True
        for key in [k for k in self.bucket_objects if k not in replayed]:
            self.take_cluster_entry(key, None)
        self.log.info("shard %d: cluster bucket replayed: %d objects up to revision %d", self.index,
                      len(self.bucket_objects), self.cluster_revision)
        self._mark_cluster_synced()
        return self.cluster_revision

    def _take_cluster_update(self, update) -> None:
        self.take_cluster_entry(update.key, streams.entry_value(update), update.revision or 0)
        self.cluster_revision = max(self.cluster_revision, update.revision or 0)

    async def _follow_cluster_changes(self, bucket: str, taken: cluster_changes.Taken) -> None:
        """The binder's change batches from the replay's end on, and the sequences they did not
        name read from the stream (`_fill_cluster_gaps`, in a task of its own)."""
        self._cluster_taken = taken
        self._cluster_gap_asked.clear()
        batches = await streams.BucketFollower(self.follow_js, bucket, f"{cluster_changes.CHANGES_PREFIX}>",
                                               taken.upto + 1).start()
        gaps = asyncio.create_task(self._fill_cluster_gaps(bucket, batches), name=f"shard-{self.index} cluster gaps")
        try:
            await self._cluster_moved_to(taken.upto)
            async for message in batches:
                async with self._cluster_lock:  # never while a gap is read: a key's values land in order
                    await self._take_batch(bucket, message)
                self._batches_taken += 1
                await self._cluster_moved_to(taken.upto)
        finally:
            gaps.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await gaps
            await batches.stop()

    async def _take_batch(self, bucket: str, message) -> None:
        taken = self._cluster_taken
        if message.value and not taken.has(message.revision):
            try:
                batch = cluster_changes.decode_changes(message.key, message.value)
            except cluster_changes.ChangesError as exc:
                # what it named is read from the stream instead (_fill_cluster_gaps)
                self.m.errors.inc()
                self.log.error("shard %d: %s", self.index, exc)
            else:
                for change in batch.changes:
                    if taken.has(change.revision):
                        continue  # replayed already, or read from the stream
                    if change.omitted:  # too large for the batch: read from the stream now
                        await self._read_cluster_message(bucket, change.revision)
                        continue
                    self.take_cluster_entry(change.key, change.value, change.revision)
                    taken.take(change.revision)
        taken.take(message.revision)

    async def _cluster_moved_to(self, revision: int) -> None:
        self.cluster_revision = max(self.cluster_revision, revision)
        if self._revision_waiters:
            async with self._cluster_moved:
                self._cluster_moved.notify_all()

    async def _fill_cluster_gaps(self, bucket: str, batches: streams.BucketFollower) -> None:
        """Read from the bucket's stream the sequences no batch named: every CLUSTER_GAP_SECONDS
        those that were in the stream at the previous look (their batch had that long to come),
        at once those a pending pod waits for (`_caught_up`); never while a batch is on its way
        (it may name them).

        While batches come, the stream is not asked how far it reached: the batches say it (the
        highest sequence taken), and a write none of them named lies below a later one, a gap
        read a look later as before. Only a look with no batch since the one before asks the
        stream (a write after the last batch, the binder gone): under load that is one JetStream
        request a second fewer for every shard. Such a look reads what the stream holds at once
        when the look before did not ask it: no batch came for a whole look, so a write after
        the last one waits no longer than it did when every look asked (about 2 s)."""
        taken = self._cluster_taken
        seen_last = 0
        batches_seen = self._batches_taken
        asked_before = True  # whether the previous look asked the stream
        while True:
            waited = False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._cluster_gap_asked.wait(), CLUSTER_GAP_SECONDS)
                waited = True
            self._cluster_gap_asked.clear()
            try:
                asking = waited or self._batches_taken == batches_seen
                last = await streams.stream_last_sequence(self.js, f"KV_{bucket}") if asking else taken.highest()
                batches_seen = self._batches_taken
                target, seen_last = (last if waited or (asking and not asked_before) else seen_last), last
                asked_before = asking
                if target <= taken.upto or await batches.pending():
                    continue
                async with self._cluster_lock:
                    first = taken.upto + 1
                    read = await self._read_cluster_stream(bucket, first, target)
                if read:
                    self.log.info("shard %d: read %d cluster bucket changes that no batch of the binder named "
                                  "(revisions %d to %d) from its stream", self.index, read, first, target)
                await self._cluster_moved_to(taken.upto)
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
                self.log.warning("shard %d: reading the cluster bucket's stream failed (%s); trying again in "
                                 "%.0f s", self.index, exc, CLUSTER_GAP_SECONDS)

    async def _read_cluster_stream(self, bucket: str, first: int, last: int) -> int:
        """Take in the messages of the bucket's stream from `first` (the first not taken) to
        `last` that are not taken yet: every sequence up to `last` is taken after (one not found
        was overwritten or purged by a later one). The caller holds the cluster lock. Returns how
        many were applied."""
        taken = self._cluster_taken
        applied = 0
        sequence = first
        while sequence <= last:
            message = await streams.bucket_message_from(self.js, bucket, sequence)
            if message is None or message.revision > last:
                break
            if not taken.has(message.revision) and not cluster_changes.is_changes_key(message.key):
                # a batch met here named writes before it, which this read takes in one by one
                self.take_cluster_entry(message.key, streams.entry_value(message), message.revision)
                applied += 1
            taken.take(message.revision)
            sequence = message.revision + 1
        taken.take_through(last)
        return applied

    async def _read_cluster_message(self, bucket: str, revision: int) -> None:
        """Take in the message of the bucket's stream at `revision` (one a batch named without its
        value); when it is not there any more, a later write of its key replaced it."""
        message = await streams.bucket_message_from(self.js, bucket, revision)
        if message is not None and message.revision == revision:
            self.take_cluster_entry(message.key, streams.entry_value(message), message.revision)
        self._cluster_taken.take(revision)

    def _mark_cluster_synced(self) -> None:
        """Ready once the replay is over *and* a binder has filled the bucket: the marker comes
        early in the replay (written once per binder start), most claims and pods after it."""
        if self._cluster_replayed and self._cluster_filled_by is not None and not self.synced["cluster"].is_set():
            self.log.info("shard %d: the cluster bucket is complete (binder %s listed everything): %d objects",
                          self.index, self._cluster_filled_by, len(self.bucket_objects))
            self.synced["cluster"].set()

    def take_cluster_entry(self, key: str, value: bytes | None, revision: int = 0) -> None:
        if cluster_changes.is_changes_key(key):
            return  # a round's batch, met while replaying the bucket: what it names is replayed too
        if key in (cluster_feed.SYNCED_KEY, cluster_feed.HEARTBEAT_KEY):
            if value is None:
                return
            try:
                marker = cluster_feed.decode_synced(value, key)
            except cluster_feed.FeedError as exc:
                self.log.error("shard %d: %s", self.index, exc)
                return
            if key == cluster_feed.HEARTBEAT_KEY:
                self.binder_heard_at = max(self.binder_heard_at, marker.at)
            else:
                self._cluster_filled_by = marker.binder
                self._mark_cluster_synced()
            return
        if value is None:
            obj = self.bucket_objects.pop(key, None)
            if obj is not None:
                if type(obj) is ResourceClaim:
                    self.claim_revisions.pop(obj.metadata.uid or "", None)
                self._handlers[type(obj)](obj, True)
            return
        try:
            obj = cluster_feed.decode(key, value)
        except cluster_feed.FeedError as exc:  # malformed, or a newer binder's kind: skip it, say so
            self.m.errors.inc()
            self.log.error("shard %d: unreadable cluster bucket entry: %s", self.index, exc)
            return
        self.bucket_objects[key] = obj
        if type(obj) is ResourceClaim:
            self.claim_revisions[obj.metadata.uid or ""] = revision
        self._handlers[type(obj)](obj, False)

    async def _caught_up(self, revision: int) -> None:
        """Wait until this shard's view of the cluster bucket holds `revision`."""
        if self.cluster_revision >= revision:
            return
        self._cluster_gap_asked.set()  # no batch may name it (a binder that died after the write)
        self._revision_waiters += 1
        try:
            with self._unpaced_following():
                async with self._cluster_moved:
                    await asyncio.wait_for(self._cluster_moved.wait_for(lambda: self.cluster_revision >= revision),
                                           CLUSTER_CATCH_UP_SECONDS)
        finally:
            self._revision_waiters -= 1

    def _on_class(self, obj: DeviceClass, deleted: bool) -> None:
        self.state.set_class(obj, deleted)

    def _on_taint_rule(self, obj: DeviceTaintRule, deleted: bool) -> None:
        effect = obj.spec.taint.effect
        self.log.info("shard %d: devicetaintrule %s %s: taint %s=%s:%s", self.index, obj.metadata.name,
                      "deleted" if deleted else "applied", obj.spec.taint.key, obj.spec.taint.value or "", effect)
        self.state.set_taint_rule(obj, deleted)
        if self._cluster_replayed:
            # Every shard sees the rule; the event id (the rule's uid and generation) makes
            # their publishes one event. Rules the bucket held when this shard started are not
            # news: they were told when they changed.
            self.audit.publish(self._taint_rule_event(obj, deleted))

    def _taint_rule_event(self, rule: DeviceTaintRule, deleted: bool) -> audit.AuditEvent:
        taint = rule.spec.taint
        selected = [
            audit.DeviceRef(driver=s.spec.driver, pool=s.spec.pool.name, device=d.name)
            for s in self.state.devices.inventory.slices() for d in s.spec.devices or ()
            if rule_selects(rule, s.spec.driver, s.spec.pool.name, d.name)
        ]
        kind = "untainted" if deleted else "tainted"
        return audit.AuditEvent(
            # The generation, not the resourceVersion: a write to the rule's status is no news.
            id=audit.taint_rule_id(kind, rule.metadata.uid or rule.metadata.name or "", str(rule.metadata.generation or 0)),
            kind=kind, at=time.time(), by=[f"devicetaintrule {rule.metadata.name}", f"shard-{self.index}"],
            devices=selected[:audit.MAX_DEVICES_NAMED], device_count=len(selected),
            reason=f"devicetaintrule {rule.metadata.name} {'deleted' if deleted else 'applied'}: "
                   f"{taint.key}={taint.value or ''}:{taint.effect}",
        )

    def _on_node(self, obj: Node, deleted: bool) -> None:
        self.state.set_node(obj, deleted)

    def _on_pod(self, obj: Pod, deleted: bool) -> None:
        uid = obj.metadata.uid or ""
        if deleted:
            self.pods.pop(uid, None)
        else:
            self.pods[uid] = obj
        self.state.set_pod(obj, deleted)
        for listener in self.pod_listeners:
            listener(obj, deleted)

    def _on_pod_group(self, obj: PodGroup, deleted: bool) -> None:
        key = f"{obj.metadata.namespace or ''}/{obj.metadata.name or ''}"
        if deleted:
            self.pod_groups.pop(key, None)
        else:
            self.pod_groups[key] = obj

    def _on_claim(self, obj: ResourceClaim, deleted: bool) -> None:
        self.state.set_claim(obj, deleted)

    def _on_budget(self, obj: PodDisruptionBudget, deleted: bool) -> None:
        self.state.set_budget(obj, deleted)

    # --- the reservation bucket and the inventory feed ---------------------------------------------

    def reservations_changed(self, node: str) -> None:
        _, entry = self.store.entry(node)
        self.state.set_reservations(node, entry)

    async def refresh(self, nodes: Iterable[str]) -> None:
        """Read these nodes' entries again and rebuild the view of them from what was read."""
        for node in nodes:
            await self.store.refresh(node)
            self.reservations_changed(node)

    async def _bucket(self, name: str, while_missing: Callable[[], None]):
        """The bucket another service creates, to watch, looked for every BUCKET_LOOKUP_SECONDS
        until it exists."""
        while True:
            try:
                return await self.follow_js.key_value(name)
            except nats.js.errors.BucketNotFoundError:
                while_missing()
                await asyncio.sleep(BUCKET_LOOKUP_SECONDS)

    async def _watch_feed(self) -> None:
        # the inventory service creates it; until then there are no devices
        kv = await self._bucket(self.feed_names.feed_bucket, self.synced["feed"].set)
        async with contextlib.aclosing(streams.bucket_entries(kv)) as entries:
            async for update in entries:
                if update is None:
                    self.synced["feed"].set()
                    continue
                if streams.entry_value(update) is None:
                    self.state.set_feed_entry(update.key, [])
                    continue
                try:
                    entry = decode_feed_entry(update.value)
                except InventoryMessageError as exc:  # malformed, or another schema version
                    self.log.error("shard %d: unreadable inventory feed entry %s: %s", self.index, update.key, exc)
                    continue
                self.state.set_feed_entry(update.key, entry.slices)

    def lapse_clock(self) -> float:
        """The time up to which leases may be taken as lapsed: now, but no later than the bucket is
        known to mirror Kubernetes. A lapsed lease is released when its claim is not allocated;
        if the binder wrote the allocation and died before the bucket had it, releasing would
        give the devices twice. So while no binder is heard, nothing lapses."""
        return min(time.time(), self.binder_heard_at - cluster_feed.HEARTBEAT_MARGIN_SECONDS)

    # --- what a pending pod is placed with ---------------------------------------------------------

    def _pod(self, pending: PendingPod) -> Pod | None:
        """The pod to place, from its PendingPod (the bucket's copy of a pod is trimmed to what
        node fit counts). None when it is bound already, or is a gang member the bucket says is
        gone. A pod deleted while its PendingPod waited in the queue never gets here: the binder
        withdraws the message. One deleted after this shard took it is placed all the same, and
        the binder, which watches it, abandons that placement and its reservation."""
        stored = self.pods.get(pending.pod.uid)
        if stored is not None and stored.spec.node_name:
            return None
        if self.gang_scheduling and pod_group_key(pending.pod.namespace, pending.spec) is not None and (
                stored is None or stored.metadata.deletion_timestamp is not None):
            self.m.gone.inc()
            self.log.info("shard %d: gang member %s is gone or being deleted: not placed", self.index,
                          pending.pod.key(), extra=fields(pod=pending.pod.key()))
            return None
        return Pod(metadata=ObjectMeta(namespace=pending.pod.namespace, name=pending.pod.name, uid=pending.pod.uid,
                                       labels=pending.labels), spec=pending.spec)

    async def _claims(self, pending: PendingPod) -> list[ResourceClaim] | None:
        try:
            await self._caught_up(pending.cluster_revision)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the cluster bucket did not reach revision {pending.cluster_revision} (what the "
                               f"pod's placing reads there) within {CLUSTER_CATCH_UP_SECONDS:.0f} s; this shard is at "
                               f"{self.cluster_revision}") from None
        snapshots = {s.claim.metadata.uid: s for s in pending.claim_snapshots or ()}
        claims = []
        for ref in pending.claims:
            claim = self.state.claims.get(ref.uid)
            snapshot = snapshots.get(ref.uid)
            if snapshot is not None and (claim is None or self.claim_revisions.get(ref.uid, 0) < snapshot.revision
                                         or snapshot.revision == 0):
                # The binder's copy is newer than this shard's (or its write is still on its
                # way): this shard's copy is taken only from the snapshot's revision on.
                claim = snapshot.claim
            if claim is None:
                self.log.info("shard %d: pod %s: resourceclaim %s/%s (uid %s) is not in the cluster bucket: it was "
                              "deleted; the binder sends the pod again once its claims exist", self.index,
                              pending.pod.key(), ref.namespace, ref.name, ref.uid, extra=fields(pod=pending.pod.key()))
                return None
            claims.append(claim)
        return claims

    async def to_place(self, pending: PendingPod) -> PodToPlace | None:
        """The pod and its claims; None when there is nothing to place: the pod bound meanwhile, a
        gang member gone, or a claim vanished (the binder sends the pod again once its claims
        exist). Raises TimeoutError when the view does not catch up with the PendingPod."""
        claims = await self._claims(pending)  # first: it waits for the bucket to hold the pod's state
        pod = self._pod(pending)
        if pod is None or claims is None:
            return None
        return PodToPlace(pending, pod, claims)

    def bound_meanwhile(self, pending: PendingPod) -> bool:
        """The watch saw the pod bound while its inputs were read."""
        current = self.pods.get(pending.pod.uid)
        return current is not None and bool(current.spec.node_name)

"""One allocator shard: consume its partition of pending pods, place them, commit, publish.

State (all in memory, rebuilt on start from NATS alone; a shard holds no Kubernetes client): the
inventory feed bucket, the cluster bucket the binder fills from its watches (DeviceClasses, Nodes,
DeviceTaintRules, PodGroups, PodDisruptionBudgets, every ResourceClaim and the bound pods:
draplane.scheduling.cluster_feed), and the reservation bucket. Pending pods are fetched in
batches, and a batch is handled in four steps:
1. place its pods one after the other against the state (pure: draplane.scheduling.placing), each
   seeing the devices the ones before it took;
2. commit the new reservations with one compare-and-set per node, from the revision the state was
   built on (what the write holds is draplane.scheduling.reservation_protocol.commit's); a node
   that lost a race is read again and its pods go back to 1;
3. publish the Placements (and Unschedulables) for the binder;
4. acknowledge the pending messages. A crash anywhere before 4 means redelivery; the reservation
   already in the bucket makes the retry republish the same placement rather than make a new one.

The members of a gang (pods naming a PodGroup whose policy is `gang`) skip step 1 alone: they
wait in a waiting room until the gang has its minCount, are then placed together by the joint
search (draplane.scheduling.gang_placing), committed on every node involved
(reservation_protocol.commit_gang, undone with abandon_gang if one node's write fails) and
published only once every write held, so the binder never binds part of a gang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient

from draplane.allocation.errors import AllocationError
from draplane.allocation.gang import GangError, GangUnplaceable
from draplane.allocation.taintrules import rule_selects
from draplane.allocation.nodefit import pod_host_ports, pod_requests
from draplane.scheduling.inter_pod_affinity import required_anti_affinity
from draplane.api.core import Node, Pod
from draplane.api.meta import ObjectMeta
from draplane.api.policy import PodDisruptionBudget
from draplane.api.resource import DeviceClass, DeviceTaintRule, ResourceClaim
from draplane.api.scheduling import PodGroup
from draplane.audit_publisher import AuditPublisher
from draplane.messages import audit
from draplane.messages.inventory import InventoryNames, decode_feed_entry
from draplane.messages.inventory import MessageError as InventoryMessageError
from draplane.metrics import counter_value
from draplane.scheduling import cluster_feed
from draplane.scheduling import reservation_protocol as protocol
from draplane.scheduling import reservations as rv
from draplane.scheduling import preemption, streams
from draplane.scheduling.messages import (
    ClaimPlacement,
    MessageError,
    PendingPod,
    Placement,
    PodRef,
    Preemption,
    Subjects,
    Unschedulable,
    decode_message,
    encode_message,
)
from draplane.scheduling.gang_placing import GangPlaced, gang_preemption_for, place_gang_members
from draplane.scheduling.gangs import GangSpec, GangSpecError, GangWaitingRoom, gang_spec, pod_group_key
from draplane.scheduling.reservation_store import ReservationStore, StaleRevision
from draplane.scheduling.placing import ClusterState, NotPlaced, Placed
from draplane.scheduling.unschedulable import CLAIM_ERROR, GANG_UNPLACEABLE, GANG_WAITING
from draplane.structured_logs import fields, with_fields
from draplane.tasks import cancel_all
from draplane_allocator.metrics import AllocatorMetrics

log = logging.getLogger(__name__)

COMMIT_ATTEMPTS = 20
PRUNE_INTERVAL_SECONDS = 5.0
# A preemption's hold lasts the shard's lease plus the victims' longest grace period plus this,
# so that it outlives their eviction and the resourceclaim controller's deallocation.
PREEMPTION_HOLD_MARGIN_SECONDS = 30.0
# Placements published but not yet taken by the binder, above which shards wait.
MAX_BINDER_BACKLOG = 128
BACKLOG_RECHECK_SECONDS = 0.25
# A test failpoint (the way etcd's gofail works): with this value in DRAPLANE_FAILPOINT, a shard
# writes the first node of a gang commit that spans several, then SIGKILLs itself before the
# others, so a test can check what a crash in the middle of that commit leaves behind.
FAILPOINT_ENV = "DRAPLANE_FAILPOINT"
GANG_COMMIT_FAILPOINT = "kill-after-first-gang-node-write"
_TERMINAL_PHASES = ("Succeeded", "Failed")
# How long a pending pod waits for this shard's watch of the cluster bucket to reach the revision
# its PendingPod names (its claims in the bucket) before it goes back with backoff.
CLUSTER_CATCH_UP_SECONDS = 10.0


class Shard:
    def __init__(
        self,
        nc: NatsClient,
        *,
        index: int,
        prefix: str,
        policy: str | None = None,
        lease_seconds: float = rv.DEFAULT_LEASE_SECONDS,
        stream_replicas: int = 1,
        metrics: AllocatorMetrics | None = None,
        gang_scheduling: bool = True,
    ):
        self.nc = nc
        self.js = nc.jetstream()
        self.index = index
        self.subjects = Subjects(prefix=prefix)
        self.feed_names = InventoryNames(prefix=prefix)
        self.lease_seconds = lease_seconds
        self.stream_replicas = stream_replicas
        # Shards break ties between equal nodes each its own way: fewer races for one node.
        self.state = ClusterState(policy=policy, tie_break=index)
        self.store: ReservationStore | None = None
        self.pods: dict[str, Pod] = {}  # uid -> pod
        # Gangs: off, every pod is placed alone as it comes (as kube-scheduler without the
        # Workload API does), whatever PodGroup it names.
        self.gang_scheduling = gang_scheduling
        self.pod_groups: dict[str, PodGroup] = {}  # namespace/name -> PodGroup
        self.gang_bound: dict[str, set[str]] = {}  # PodGroup key -> uids of its bound, running members
        self.waiting = GangWaitingRoom()
        self.synced = {k: asyncio.Event() for k in ("cluster", "feed")}
        # the cluster bucket: key -> the object it holds (what a delete marker deletes)
        self.cluster: dict[str, object] = {}
        self.cluster_revision = 0  # the last revision of the bucket taken in
        self._cluster_replayed = False  # past the entries the bucket held when the watch started
        self._cluster_filled_by: str | None = None  # the binder whose SYNCED_KEY is in the bucket
        # The binder's last heartbeat (its clock): the bucket holds what Kubernetes held until
        # about then. Leases are lapsed only up to it (see _lapse_clock).
        self.binder_heard_at = 0.0
        self._cluster_moved = asyncio.Condition()
        self._revision_waiters = 0
        # The binder's backlog as last read, and what this shard published after: until
        # _backlog_low_until (monotonic) that sum stands in for reading it again.
        self._backlog_low_until = 0.0
        self._backlog_seen = 0
        self._published_since_backlog = 0
        self._handlers = {DeviceClass: self._on_class, Node: self._on_node, DeviceTaintRule: self._on_taint_rule,
                          PodGroup: self._on_pod_group, PodDisruptionBudget: self._on_budget,
                          ResourceClaim: self._on_claim, Pod: self._on_pod}
        self._tasks: list[asyncio.Task] = []
        self.audit = AuditPublisher(self.js, prefix)
        # The process' metrics (several shards may share them, each with its shard label); a
        # shard made alone (tests) gets a registry of its own.
        self.metrics = metrics if metrics is not None else AllocatorMetrics()
        self.m = self.metrics.shard(index)
        if index == 0:
            self.metrics.export_fragmentation(self.state)
        self.log = with_fields(log, shard=index)

    @property
    def counters(self) -> dict[str, int]:
        """This shard's counts, read back from its metrics (diagnostics and tests)."""
        m, shard = self.metrics, str(self.index)

        def count(counter, **labels: str) -> int:
            return int(counter_value(counter, shard=shard, **labels))

        return {"placed": count(m.placements), "unschedulable": count(m.unschedulable),
                "commit_conflicts": count(m.conflicts, kind="compare_and_set"),
                "republished": count(m.republished), "errors": count(m.errors), "gone": count(m.pods_gone)}

    # --- service lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await streams.ensure_streams(self.js, self.subjects, replicas=self.stream_replicas)
        await self.audit.start(replicas=self.stream_replicas)
        kv = await streams.reservation_bucket(self.js, self.subjects, replicas=self.stream_replicas)
        self.store = ReservationStore(kv, on_change=self._on_reservations)
        self._spawn(self.store.watch, "reservations watch")
        self._spawn(self._watch_feed, "inventory feed watch")
        self._spawn(self._watch_cluster, "cluster bucket watch")
        self._spawn(self._consume, "pending consumer")
        self._spawn(self._prune_expired, "lease reconciler")
        self._spawn(lambda: self.metrics.consumer_lag.poll_forever(
            self.js, [(self.subjects.pending_stream, f"shard-{self.index}")]), "consumer lag")

    @property
    def ready(self) -> bool:
        return all(e.is_set() for e in self.synced.values()) and self.store is not None and self.store.synced

    async def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready:
            if time.monotonic() > deadline:
                missing = [k for k, e in self.synced.items() if not e.is_set()]
                raise TimeoutError(f"shard {self.index}: not synced: {missing}")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        pending = await cancel_all(self._tasks, timeout=10)
        if pending:
            self.log.error("shard %d: tasks did not stop: %s", self.index, [t.get_name() for t in pending])
        self._tasks.clear()

    def _spawn(self, loop, name: str) -> None:
        async def guarded():
            while True:
                try:
                    await loop()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - logged and restarted, never silently lost
                    self.log.exception("shard %d: %s crashed; restarting it in 1 s", self.index, name)
                    await asyncio.sleep(1.0)

        self._tasks.append(asyncio.create_task(guarded(), name=f"shard-{self.index} {name}"))

    # --- state -------------------------------------------------------------------------------------

    async def _watch_cluster(self) -> None:
        """Follow the cluster bucket the binder fills (draplane.scheduling.cluster_feed). The
        bucket keeps the latest value per key, so watching it from the start replays the cluster
        as it is now, then every change."""
        bucket = self.subjects.cluster_bucket
        while True:
            try:
                kv = await self.js.key_value(bucket)
                break
            except nats.js.errors.BucketNotFoundError:
                self.log.info("shard %d: no cluster bucket %s yet (the binder creates it); looking again in 1 s",
                              self.index, bucket)
                await asyncio.sleep(1.0)
        # A watch restarted after a crash replays the bucket over the view it has: a key replayed
        # replaces its object, and those not replayed were deleted meanwhile (taken out at the end).
        # The view stays whole meanwhile, if older, rather than empty under a shard that places.
        replayed: set[str] | None = set()
        self._cluster_replayed = False
        async with contextlib.aclosing(streams.bucket_entries(kv)) as entries:
            async for update in entries:
                if update is None:
                    for key in [k for k in self.cluster if k not in replayed]:
                        self._take_cluster_entry(key, None)
                    replayed = None
                    self._cluster_replayed = True
                    self.log.info("shard %d: cluster bucket replayed: %d objects up to revision %d", self.index,
                                  len(self.cluster), self.cluster_revision)
                    self._mark_cluster_synced()
                    continue
                if replayed is not None:
                    replayed.add(update.key)
                self._take_cluster_entry(update.key, streams.entry_value(update))
                self.cluster_revision = max(self.cluster_revision, update.revision or 0)
                if self._waiting_for_revision:
                    async with self._cluster_moved:
                        self._cluster_moved.notify_all()

    def _mark_cluster_synced(self) -> None:
        """Ready once the replay is over *and* a binder has filled the bucket: the marker comes
        early in the replay (written once per binder start), most claims and pods after it."""
        if self._cluster_replayed and self._cluster_filled_by is not None and not self.synced["cluster"].is_set():
            self.log.info("shard %d: the cluster bucket is complete (binder %s listed everything): %d objects",
                          self.index, self._cluster_filled_by, len(self.cluster))
            self.synced["cluster"].set()

    def _take_cluster_entry(self, key: str, value: bytes | None) -> None:
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
            obj = self.cluster.pop(key, None)
            if obj is not None:
                self._handlers[type(obj)](obj, True)
            return
        try:
            obj = cluster_feed.decode(key, value)
        except cluster_feed.FeedError as exc:  # malformed, or a newer binder's kind: skip it, say so
            self.m.errors.inc()
            self.log.error("shard %d: unreadable cluster bucket entry: %s", self.index, exc)
            return
        self.cluster[key] = obj
        self._handlers[type(obj)](obj, False)

    @property
    def _waiting_for_revision(self) -> bool:
        return bool(self._revision_waiters)

    async def _caught_up(self, revision: int) -> None:
        """Wait until this shard's view of the cluster bucket holds `revision`."""
        if self.cluster_revision >= revision:
            return
        self._revision_waiters += 1
        try:
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
            for s in self.state.cluster.inventory.slices() for d in s.spec.devices or ()
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
        gang = pod_group_key(obj.metadata.namespace or "", obj.spec)
        if gang is not None:
            # the bucket holds a gang's pending members too (cluster_feed.published_pod)
            alive = not deleted and obj.metadata.deletion_timestamp is None and \
                (obj.status is None or obj.status.phase not in _TERMINAL_PHASES)
            members = self.gang_bound.setdefault(gang, set())
            if alive and obj.spec.node_name:
                members.add(uid)
                self.waiting.leave(uid)
            else:
                members.discard(uid)
                if not alive:
                    self.waiting.leave(uid)
                if not members:
                    del self.gang_bound[gang]

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

    def _on_reservations(self, node: str) -> None:
        _, entry = self.store.entry(node)
        self.state.set_reservations(node, entry)

    async def _watch_feed(self) -> None:
        bucket = self.feed_names.feed_bucket
        while True:
            try:
                kv = await self.js.key_value(bucket)
                break
            except nats.js.errors.BucketNotFoundError:
                # the inventory service creates it; until then there are no devices
                self.synced["feed"].set()
                await asyncio.sleep(1.0)
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

    def _lapse_clock(self) -> float:
        """The time up to which leases may be taken as lapsed: now, but no later than the bucket is
        known to mirror Kubernetes. A lapsed lease is released when its claim is not allocated;
        if the binder wrote the allocation and died before the bucket had it, releasing would
        give the devices twice. So while no binder is heard, nothing lapses."""
        return min(time.time(), self.binder_heard_at - cluster_feed.HEARTBEAT_MARGIN_SECONDS)

    async def _prune_expired(self) -> None:
        """Release reservations whose lease ran out before their placement reached Kubernetes.

        Commits prune the node they write anyway; this covers nodes nobody commits to any more,
        where a lapsed reservation would otherwise hold its device for ever."""
        await self.wait_ready(timeout=3600)
        while True:
            await asyncio.sleep(PRUNE_INTERVAL_SECONDS)
            now = self._lapse_clock()
            for node, (_, entry) in list(self.store.entries.items()):
                if protocol.has_lapsed(entry, now):
                    steps: list[protocol.Lapse] = []

                    def edit(current: rv.NodeReservations) -> rv.NodeReservations | None:
                        steps[:] = [protocol.lapse(current, self._lapse_clock(), self.state.claim_is_allocated)]
                        return steps[0].entry

                    if await self.store.change(node, edit):
                        step = steps[0]
                        self.m.lapses_released.inc(len(step.released))
                        self.m.lapses_confirmed.inc(len(step.confirmed))
                        # pod reservations lapse after every placement by design: not news
                        self.log.log(logging.INFO if step.news else logging.DEBUG,
                                     "shard %d: node %s: lapsed leases: %d claim reservations released, "
                                     "%d confirmed (their claims are allocated), %d pod reservations dropped",
                                     self.index, node, len(step.released), len(step.confirmed), step.pods_dropped,
                                     extra=fields(node=node))

    # --- pending pods ------------------------------------------------------------------------------

    async def _consume(self) -> None:
        await self.wait_ready(timeout=3600)
        durable = f"shard-{self.index}"
        config = streams.work_consumer(durable)
        config.filter_subject = self.subjects.pending(self.index)
        sub = await self.js.pull_subscribe(
            self.subjects.pending(self.index), durable=durable, stream=self.subjects.pending_stream, config=config
        )
        try:
            while True:
                await self._wait_for_binder()
                try:
                    messages = await sub.fetch(32, timeout=1.0)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    continue
                fetched_at = time.monotonic()
                decoded = []
                for msg in messages:
                    try:
                        pending = decode_message(msg.data)
                        if not isinstance(pending, PendingPod):
                            raise MessageError(f"{type(pending).__name__} on a pending subject")
                        if pending.spec is None:
                            raise MessageError(f"pod {pending.pod.key()}: a PendingPod without the pod's spec "
                                               f"(from a binder older than this shard)")
                    except MessageError as exc:
                        self.log.error("shard %d: dropping a pending message: %s", self.index, exc)
                        await msg.term()
                        continue
                    decoded.append((msg, pending))
                fetched = await asyncio.gather(*(self._inputs(p) for _, p in decoded), return_exceptions=True)
                batch = []
                for (msg, pending), inputs in zip(decoded, fetched):
                    if isinstance(inputs, BaseException):
                        delay = streams.redelivery_delay(streams.deliveries(msg))
                        self.m.errors.inc()
                        self.log.error("shard %d: pod %s: its claims are not known yet (%s); redelivering in "
                                       "%.0f s", self.index, pending.pod.key(), inputs, delay,
                                       extra=fields(pod=pending.pod.key()))
                        await msg.nak(delay=delay)
                    else:
                        batch.append((msg, pending, inputs))
                try:
                    await self.handle_batch([(pending, inputs) for _, pending, inputs in batch], started=fetched_at)
                except Exception:
                    # Placements already committed are published again on redelivery (their
                    # reservations are in the bucket); the binder writes a placement once.
                    # Errors of one pod are answered in handle_batch; what reaches here is NATS
                    # failing under the whole batch.
                    self.m.errors.inc()
                    self.log.exception("shard %d: a batch of %d pods failed; redelivering it with backoff",
                                  self.index, len(batch))
                    await asyncio.gather(*(msg.nak(delay=streams.redelivery_delay(streams.deliveries(msg))) for msg, _, _ in batch),
                                         return_exceptions=True)
                    continue
                await asyncio.gather(*(msg.ack() for msg, _, _ in batch))
        finally:
            try:
                await asyncio.wait_for(sub.unsubscribe(), 2.0)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the connection may be gone
                pass

    async def _wait_for_binder(self) -> None:
        """Back-pressure: placements waiting for the binder hold devices under a lease; placing far
        ahead of what it writes would only let those leases lapse. Wait while its backlog is big.

        A backlog under half the limit is not asked again for BACKLOG_RECHECK_SECONDS, as long as
        it plus what this shard published since stays under half: pods trickle in when the binder
        is the slower side, so a shard's batches are of a few pods, and a stream-info round trip
        before each was a fifth of the NATS requests it made."""
        if time.monotonic() < self._backlog_low_until and \
                self._backlog_seen + self._published_since_backlog < MAX_BINDER_BACKLOG // 2:
            return
        while True:
            try:
                info = await self.js.stream_info(self.subjects.results_stream)
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
                return
            self._backlog_seen, self._published_since_backlog = info.state.messages, 0
            if info.state.messages < MAX_BINDER_BACKLOG:
                if info.state.messages < MAX_BINDER_BACKLOG // 2:
                    self._backlog_low_until = time.monotonic() + BACKLOG_RECHECK_SECONDS
                return
            await asyncio.sleep(0.2)

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
            raise TimeoutError(f"the cluster bucket did not reach revision {pending.cluster_revision} (the pod's "
                               f"claims) within {CLUSTER_CATCH_UP_SECONDS:.0f} s; this shard is at "
                               f"{self.cluster_revision}") from None
        claims = []
        for ref in pending.claims:
            claim = self.state.claims.get(ref.uid)
            if claim is None:
                self.log.info("shard %d: pod %s: resourceclaim %s/%s (uid %s) is not in the cluster bucket: it was "
                              "deleted; the binder sends the pod again once its claims exist", self.index,
                              pending.pod.key(), ref.namespace, ref.name, ref.uid, extra=fields(pod=pending.pod.key()))
                return None
            claims.append(claim)
        return claims

    async def _inputs(self, pending: PendingPod) -> tuple[Pod, list[ResourceClaim]] | None:
        claims = await self._claims(pending)  # first: it waits for the bucket to hold the pod's state
        pod = self._pod(pending)
        if pod is None:
            return None  # bound meanwhile, or a gang member gone: nothing to place
        if claims is None:
            return None  # a claim vanished; the binder sends the pod again once its claims exist
        return pod, claims

    async def handle(self, pending: PendingPod, inputs: tuple[Pod, list[ResourceClaim]] | None = None) -> None:
        if inputs is None:
            inputs = await self._inputs(pending)
        await self.handle_batch([(pending, inputs)])

    async def handle_batch(self, batch: list[tuple[PendingPod, tuple[Pod, list[ResourceClaim]] | None]], *,
                           started: float | None = None) -> None:
        """Place a fetched batch of pods, commit it with one compare-and-set per node, publish.

        Placing stays one pod at a time and each pod sees the devices the pods before it took; the
        round trips to NATS (one bucket write per node, then the placements) are made together.
        One at a time, those round trips, not placing, were what limited a shard.
        A node whose write loses a race is read again and its pods are placed again; so are pods
        found unschedulable in that round, since the devices they missed may not be taken after all.
        `started` (monotonic, default now) is when the batch was fetched: placement latency counts
        from there.
        """
        started = time.monotonic() if started is None else started
        todo: list[tuple[PendingPod, Pod, list[ResourceClaim]]] = []
        gangs: dict[str, list[tuple[PendingPod, Pod, list[ResourceClaim]]]] = {}
        seen: set[str] = set()
        for pending, inputs in batch:
            if inputs is None or pending.pod.uid in seen:
                continue  # gone, a claim vanished, or the same pod twice in one batch
            seen.add(pending.pod.uid)
            pod, claims = inputs
            # the watch may have seen the pod bound while the inputs were read
            current = self.pods.get(pending.pod.uid)
            if current is not None and current.spec.node_name:
                continue
            gang = pod_group_key(pending.pod.namespace, pod.spec) if self.gang_scheduling else None
            if gang is not None:
                gangs.setdefault(gang, []).append((pending, pod, claims))
            else:
                todo.append((pending, pod, claims))
        for gang, arrivals in gangs.items():
            todo.extend(await self._handle_gang(gang, arrivals, started))
        for _ in range(COMMIT_ATTEMPTS):
            if not todo:
                return
            todo = await self._place_and_commit(todo, started)
        # The view and the bucket kept disagreeing about these pods' nodes. Not a hot loop: each
        # pod is answered as unschedulable with why, so the binder records it on the pod and
        # retries it with its backoff.
        self.m.errors.inc(len(todo))
        message = (f"draplane shard {self.index}: the placement lost {COMMIT_ATTEMPTS} reservation races in a "
                   f"row (the nodes' reservations kept changing); retrying")
        self.log.error("shard %d: %d pods lost %d reservation races in a row: %s", self.index, len(todo),
                  COMMIT_ATTEMPTS, ", ".join(pending.pod.key() for pending, _, _ in todo))
        await asyncio.gather(*(self._publish(Unschedulable(pod=pending.pod, shard=self.index, message=message,
                                                            failures=[], claim_error=message))
                               for pending, _, _ in todo))

    async def _place_and_commit(self, todo, started: float):
        """One round of handle_batch; returns the pods to place again."""
        now = time.time()
        expires_at = now + self.lease_seconds
        # node -> (the revision the view was built on, the entry with this round's reservations)
        views: dict[str, tuple[int, rv.NodeReservations]] = {}
        commits: dict[str, protocol.Commit] = {}  # node -> the first commit there (what it prunes)
        staged: dict[str, list] = {}  # node -> [(pending, pod, claims, Placed)]
        republish: list = []  # (pending, pod, claims, Placed): nothing new to reserve
        unschedulable: list = []  # (pending, pod, claims, NotPlaced)
        lost: set[str] = set()  # nodes whose entry must be read again
        again: list = []
        for item in todo:
            pending, pod, claims = item
            try:
                outcome = self.state.place_pod(pod, claims, volumes=pending.volumes,
                                               dra_extended_resources=pending.dra_extended_resources or ())
            except Exception as exc:  # noqa: BLE001 - a bug met by one pod must not hold up the batch
                self.m.errors.inc()
                self.log.exception("shard %d: pod %s: placing it failed", self.index, pending.pod.key(),
                                   extra=fields(pod=pending.pod.key()))
                message = f"draplane shard {self.index}: internal error while placing the pod: {exc!r}"
                outcome = NotPlaced(message=message, failures=[], claim_error=message)
            if isinstance(outcome, NotPlaced):
                unschedulable.append((*item, outcome))
                continue
            node = outcome.node
            pod_reservation = rv.PodReservation(
                pod_uid=pending.pod.uid, pod_namespace=pending.pod.namespace, pod_name=pending.pod.name,
                requests=outcome.requests, reserved_at=now, expires_at=expires_at, shard=self.index,
                host_ports=list(pod_host_ports(pod.spec)), labels=pod.metadata.labels,
                anti_affinity=list(required_anti_affinity(pod.spec)) or None,
            )
            reservations = self._reservations(pending, outcome, now, expires_at)
            try:
                if node not in commits:
                    revision, entry = self.store.entry(node)
                    step = protocol.commit(entry, reservations, pod_reservation, self._lapse_clock(),
                                           self.state.claim_is_allocated, self.state.pod_is_gone)
                    commits[node] = step
                    # what this node's write will hold before this pod: its entry, pruned
                    views[node] = (revision, step.lapsed.entry or entry)
                else:
                    step = protocol.recommit(commits[node], views[node][1], reservations, pod_reservation)
            except rv.ReservationConflict as exc:
                # our view missed a reservation: the mirror lags the bucket; read it, place again
                self.m.conflicts_in_view.inc()
                self.log.debug("shard %d: %s", self.index, exc, extra=fields(pod=pending.pod.key(), node=node))
                lost.add(node)
                again.append(item)
                continue
            if step.entry is None:
                # its claims and the pod are reserved there already (a redelivery, or the binder
                # asking again after a restart): send the same placement, nothing to write
                republish.append((*item, outcome))
                continue
            views[node] = (views[node][0], step.entry)
            staged.setdefault(node, []).append((*item, outcome))
            # the pods after this one in the batch must see these devices and this pod's CPU and
            # memory taken; the view is the node's entry as it will be written
            self.state.set_reservations(node, step.entry)
        for node, step in commits.items():
            if step.lapsed.released and node in staged:
                self.log.info("shard %d: node %s: released %d reservations whose lease ran out",
                              self.index, node, len(step.lapsed.released), extra=fields(node=node))

        nodes = list(staged)
        written = await asyncio.gather(
            *(self.store.write(node, views[node][1], views[node][0]) for node in nodes), return_exceptions=True
        )
        placements = []
        failure: BaseException | None = None
        for node, result in zip(nodes, written):
            if isinstance(result, BaseException):
                if not isinstance(result, StaleRevision):
                    failure = result
                lost.add(node)
                for pending, pod, claims, _ in staged[node]:
                    again.append((pending, pod, claims))
                if isinstance(result, StaleRevision):
                    self.m.conflicts_on_write.inc()
                    self.log.debug("shard %d: node %s: the reservation of %d pods lost a compare-and-set race; "
                                  "placing them again", self.index, node, len(staged[node]), extra=fields(node=node))
            else:
                lapsed = commits[node].lapsed
                self.m.lapses_released.inc(len(lapsed.released))
                self.m.lapses_confirmed.inc(len(lapsed.confirmed))
                placements.extend((pending, claims, placed, expires_at) for pending, _, claims, placed in staged[node])
        # drop this round's reservations from the view, even where the refresh saw no news
        await self._refresh(lost)
        for pending, pod, claims, placed in republish:
            if placed.node in lost:
                again.append((pending, pod, claims))  # it leaned on a reservation that did not stick
            else:
                placements.append((pending, claims, placed, self._lease_of(placed, expires_at)))
                if placed.allocations:
                    self.m.republished.inc()
        if lost:
            again.extend((pending, pod, claims) for pending, pod, claims, _ in unschedulable)
            unschedulable = []

        messages = [self._placement(pending, claims, placed, lease) for pending, claims, placed, lease in placements]
        messages += [await self._unschedulable(pending, pod, claims, outcome)
                     for pending, pod, claims, outcome in unschedulable]
        await asyncio.gather(*(self._publish(m) for m in messages))
        self.m.placed.inc(len(placements))
        self.m.unschedulable.inc(len(unschedulable))
        elapsed = time.monotonic() - started
        for pending, claims, placed, _ in placements:
            self.m.placement_seconds.observe(elapsed)
            self.log.info("shard %d: pod %s placed on node %s (%s)", self.index, pending.pod.key(), placed.node,
                          f"{len(placed.new_claims)} claims newly reserved" if placed.new_claims
                          else "claims already allocated or reserved there: placement sent again",
                          extra=fields(pod=pending.pod.key(), node=placed.node))
        for pending, _, _, outcome in unschedulable:
            self.log.info("shard %d: pod %s unschedulable: %s", self.index, pending.pod.key(), outcome.message,
                          extra=fields(pod=pending.pod.key()))
        if failure is not None:
            raise failure
        return again

    # --- gangs -------------------------------------------------------------------------------------

    async def _handle_gang(self, key: str, arrivals: list, started: float) -> list:
        """The arriving members of gang `key`: wait for the gang's minimum count, then place and
        commit all members together, or answer every member with the gang's one explanation.
        Returns the arrivals to place alone (a PodGroup whose policy is `basic`)."""
        group = self.pod_groups.get(key)
        if group is None:
            await self._answer_members([p for p, _, _ in arrivals], (
                f"PodGroup {key} not found: the pod names it in spec.schedulingGroup.podGroupName and waits "
                f"until it exists"), label=GANG_WAITING)
            return []
        try:
            spec = gang_spec(group)
        except GangSpecError as exc:
            await self._answer_members([p for p, _, _ in arrivals], str(exc), claim_error=True)
            return []
        if spec is None:
            return arrivals
        inputs: dict[str, tuple[PendingPod, tuple[Pod, list[ResourceClaim]]]] = {}
        for pending, pod, claims in arrivals:
            self.waiting.join(key, pending.pod.uid, pending, spec.min_count)
            inputs[pending.pod.uid] = (pending, (pod, claims))
        while True:
            bound = len(self.gang_bound.get(key, ()))
            ready = self.waiting.ready(spec, bound)
            if ready is None:
                message = self.waiting.waiting_for(spec, bound)
                self.log.info("shard %d: gang %s: %s", self.index, key, message, extra=fields(gang=key))
                await self._answer_members([p for p, _, _ in arrivals], message, label=GANG_WAITING)
                return []
            # Members that arrived before this batch are looked at again: their pods may be gone since.
            earlier = [m for m in ready if m.pod.uid not in inputs]
            read = await asyncio.gather(*(self._inputs(m) for m in earlier))
            for member, got in zip(earlier, read):
                if got is None:
                    self.waiting.leave(member.pod.uid)  # gone, bound, or a claim vanished
                else:
                    inputs[member.pod.uid] = (member, got)
            if all(got is not None for got in read):
                break
        members = [inputs[m.pod.uid] for m in ready]
        # minCount must fit together; pods beyond it follow when they can (a Job whose parallelism
        # exceeds minCount): if all do not fit, the first ones up to minCount are placed alone
        needed = max(spec.min_count - len(self.gang_bound.get(key, ())), 1)
        await self._place_gang(spec, members, started, needed=needed)
        return []

    async def _place_gang(self, spec: GangSpec, members: list, started: float, needed: int | None = None) -> None:
        """`needed`: how many of `members` (in arrival order) must fit together at the least; more
        are placed when they all fit."""
        pendings = [pending for pending, _ in members]
        for pending, (_, claims) in members:
            # held for it by a preemption whose victims still hold the devices: wait, or Kubernetes
            # would see two claims on one device
            held = self.state.held_elsewhere(claims)
            if held is not None:
                await self._answer_members(pendings, f"gang {spec.key}: member {pending.pod.key()} is {held.message}",
                                           label=GANG_WAITING)
                return
        for _ in range(COMMIT_ATTEMPTS):
            try:
                outcome = place_gang_members(self.state, spec, [got for _, got in members],
                                             volumes=_member_volumes(members))
            except (GangError, AllocationError) as exc:
                await self._answer_members(pendings, f"gang {spec.key}: {exc}", claim_error=True)
                return
            except Exception as exc:  # noqa: BLE001 - a bug met by one gang must not hold up the batch
                self.m.errors.inc()
                self.log.exception("shard %d: gang %s: placing it failed", self.index, spec.key,
                                   extra=fields(gang=spec.key))
                await self._answer_members(pendings, f"draplane shard {self.index}: internal error while placing "
                                           f"gang {spec.key}: {exc!r}", claim_error=True)
                return
            if isinstance(outcome, GangUnplaceable) and needed is not None and needed < len(members):
                first = place_gang_members(self.state, spec, [got for _, got in members[:needed]],
                                           volumes=_member_volumes(members))
                if isinstance(first, GangPlaced):
                    self.log.info("shard %d: gang %s: %d pods do not fit together, the first %d (its minCount "
                                  "less those running) do; the others wait", self.index, spec.key, len(members),
                                  needed, extra=fields(gang=spec.key))
                    later = [pending for pending, _ in members[needed:]]
                    members, pendings, outcome = members[:needed], pendings[:needed], first
                    await self._answer_members(later, f"gang {spec.key}: waiting for room beside the {needed} "
                                               f"members placed now: {len(later) + needed} pods do not fit together",
                                               label=GANG_UNPLACEABLE)
            if isinstance(outcome, GangUnplaceable):
                # the core's explanation names the gang, the members and where each fits alone
                message = f"the gang's {len(members)} pods do not fit together: {outcome.message}"
                # room is made for minCount's worth, not for every pod beyond it
                said, preemptions = await self._preempt_for_gang(spec, members[:needed] if needed else members)
                message += said
                self.log.info("shard %d: %s", self.index, message, extra=fields(gang=spec.key))
                await self._answer_members(pendings, message, label=GANG_UNPLACEABLE, preemptions=preemptions)
                self.m.unschedulable.inc(len(members))
                return
            expires_at = await self._commit_gang(members, outcome)
            if expires_at is None:
                continue  # a node's entry changed under us: read again, place again
            placements = []
            for pending, (_, claims) in members:
                placed = outcome.members[pending.pod.uid]
                lease = expires_at if placed.new_claims else self._lease_of(placed, expires_at)
                placements.append(self._placement(pending, claims, placed, lease))
            await asyncio.gather(*(self._publish(m) for m in placements))
            for pending in pendings:
                self.waiting.leave(pending.pod.uid)
            self.m.placed.inc(len(placements))
            elapsed = time.monotonic() - started
            for _ in placements:
                self.m.placement_seconds.observe(elapsed)
            nodes = sorted({p.node for p in placements})
            self.log.info("shard %d: gang %s: %d pods placed together on %d nodes (%s)", self.index, spec.key,
                          len(placements), len(nodes), ", ".join(nodes), extra=fields(gang=spec.key))
            return
        self.m.errors.inc(len(members))
        message = (f"draplane shard {self.index}: gang {spec.key}: the commit lost {COMMIT_ATTEMPTS} reservation "
                   f"races in a row (its nodes' reservations kept changing); retrying")
        self.log.error("shard %d: %s", self.index, message, extra=fields(gang=spec.key))
        await self._answer_members(pendings, message, claim_error=True)

    async def _commit_gang(self, members: list, outcome: GangPlaced) -> float | None:
        """Every member's reservations, one compare-and-set per node involved. The lease's end when
        all held; None when one node lost a race (what was written on the others is taken back
        first)."""
        now = time.time()
        expires_at = now + self.lease_seconds
        per_node: dict[str, list] = {}
        for pending, _ in members:
            placed = outcome.members[pending.pod.uid]
            pod_reservation = rv.PodReservation(
                pod_uid=pending.pod.uid, pod_namespace=pending.pod.namespace, pod_name=pending.pod.name,
                requests=placed.requests, reserved_at=now, expires_at=expires_at, shard=self.index,
                host_ports=list(pod_host_ports(pending.spec)) if pending.spec is not None else [],
                labels=pending.labels,
                anti_affinity=(list(required_anti_affinity(pending.spec)) or None) if pending.spec is not None else None,
            )
            per_node.setdefault(placed.node, []).append(
                (self._reservations(pending, placed, now, expires_at), pod_reservation))
        revisions = {node: self.store.entry(node) for node in per_node}
        try:
            step = protocol.commit_gang({node: entry for node, (_, entry) in revisions.items()}, per_node,
                                        self._lapse_clock(), self.state.claim_is_allocated,
                                        self.state.pod_is_gone)
        except rv.ReservationConflict as exc:
            self.m.conflicts_in_view.inc()
            self.log.debug("shard %d: gang %s: %s", self.index, outcome.gang, exc, extra=fields(gang=outcome.gang))
            await self._refresh(per_node)
            return None
        nodes = list(step.entries)
        if len(nodes) > 1 and os.environ.get(FAILPOINT_ENV) == GANG_COMMIT_FAILPOINT:
            await self.store.write(nodes[0], step.entries[nodes[0]], revisions[nodes[0]][0])
            self.log.warning("shard %d: failpoint %s: killing this process after node %s's write, before the "
                             "other %d", self.index, GANG_COMMIT_FAILPOINT, nodes[0], len(nodes) - 1)
            os.kill(os.getpid(), signal.SIGKILL)
        results = await asyncio.gather(
            *(self.store.write(node, step.entries[node], revisions[node][0]) for node in nodes),
            return_exceptions=True,
        )
        written = [node for node, result in zip(nodes, results) if not isinstance(result, BaseException)]
        failed = [result for result in results if isinstance(result, BaseException)]
        if not failed:
            for node in nodes:
                self.m.lapses_released.inc(len(step.lapsed[node].released))
                self.m.lapses_confirmed.inc(len(step.lapsed[node].confirmed))
            return expires_at
        # The undo, beside the step: what the gang reserved on the nodes already written goes back
        # before anything is published, so no other pod finds those devices held by half a gang.
        undone = await asyncio.gather(
            *(self.store.change(node, lambda entry, node=node: protocol.abandon_gang(entry, step.reserved[node]))
              for node in written),
            return_exceptions=True,
        )
        for node, result in zip(written, undone):
            if isinstance(result, BaseException):
                # its lease lapses; until then the devices stay held, but nothing was published
                self.log.error("shard %d: gang %s: node %s: taking back its reservations failed (%r); they lapse "
                               "with their lease", self.index, outcome.gang, node, result, extra=fields(node=node))
        self.m.conflicts_on_write.inc(sum(isinstance(r, StaleRevision) for r in failed))
        self.log.info("shard %d: gang %s: the commit failed on %d of %d nodes (%s); took back the %d written",
                      self.index, outcome.gang, len(failed), len(nodes), ", ".join(repr(r) for r in failed[:3]),
                      len(written), extra=fields(gang=outcome.gang))
        await self._refresh(per_node)
        errors = [r for r in failed if not isinstance(r, StaleRevision)]
        if errors:
            raise errors[0]  # NATS failing: the batch is redelivered with backoff
        return None

    async def _refresh(self, nodes) -> None:
        """Read these nodes' entries again and rebuild the view of them from what was read."""
        for node in nodes:
            await self.store.refresh(node)
            self._on_reservations(node)

    async def _preempt_for_gang(self, spec: GangSpec, members: list) -> tuple[str, dict[str, Preemption]]:
        """What preemption says for a gang that does not fit (appended to its message), and per
        member uid what the binder is to evict and nominate. Each member's claims are held on the
        devices its node's victims free first (as for one pod); without every hold nobody is
        evicted. The victims of a node go with the first member placed there."""
        try:
            plan = gang_preemption_for(self.state, spec, [got for _, got in members],
                                       volumes=_member_volumes(members))
        except Exception:  # noqa: BLE001 - preemption is an extra; the gang's own answer must still go
            self.log.exception("shard %d: gang %s: preemption search failed", self.index, spec.key,
                               extra=fields(gang=spec.key))
            return "", {}
        if plan is None:
            return "", {}
        if isinstance(plan, preemption.NoPreemption):
            return f" {plan.reason}", {}
        explanation = plan.explain()
        preemptions: dict[str, Preemption] = {}
        nominated: set[str] = set()
        held: list[tuple[str, dict, str]] = []  # (node, claim uid -> devices, pod uid): the undo's arguments
        for pending, (pod, claims) in members:
            placed = plan.placement.members[pending.pod.uid]
            victims = plan.victims_on(placed.node)
            if not await self._hold_for_preemption(pending, pod, claims, placed.node, placed.allocations, victims):
                # the undo, beside the step: the members held so far are let go, so the next
                # attempt plans afresh instead of waiting on holds that lead nowhere; nobody is evicted
                for node, expected, pod_uid in held:
                    try:
                        await self.store.change(node, lambda e, x=expected, u=pod_uid: protocol.abandon(e, x, [u]))
                    except Exception as exc:  # noqa: BLE001 - the hold then lapses with its lease
                        self.log.warning("shard %d: gang %s: node %s: letting a preemption hold go failed (%r); it "
                                         "lapses with its lease", self.index, spec.key, node, exc,
                                         extra=fields(gang=spec.key, node=node))
                return (f" preemption: postponed, node {placed.node}'s reservations changed while it was planned; "
                        f"planning again at the next attempt"), {}
            held.append((placed.node, {uid: rv.devices_of(a) for uid, a in placed.allocations.items()},
                         pending.pod.uid))
            preemptions[pending.pod.uid] = Preemption(
                node=placed.node, explanation=explanation,
                victims=[] if placed.node in nominated else [PodRef(namespace=v.namespace, name=v.name, uid=v.uid)
                                                             for v in victims])
            nominated.add(placed.node)
        self.log.info("shard %d: gang %s: %s", self.index, spec.key, explanation, extra=fields(gang=spec.key))
        return f" {explanation}", preemptions

    async def _answer_members(self, members: list[PendingPod], message: str, *, label: str = "",
                              claim_error: bool = False, preemptions: dict[str, Preemption] | None = None) -> None:
        """The same answer for each of a gang's members: the binder records it on every pod."""
        await asyncio.gather(*(self._publish(Unschedulable(
            pod=pending.pod, shard=self.index, message=message, failures=[],
            claim_error=message if claim_error else "", label=CLAIM_ERROR if claim_error else label,
            preemption=(preemptions or {}).get(pending.pod.uid),
        )) for pending in members))

    async def _unschedulable(self, pending: PendingPod, pod: Pod, claims: list[ResourceClaim],
                             outcome: NotPlaced) -> Unschedulable:
        """The answer for a pod that fits nowhere, with the preemption that would make room for it
        where its priority allows one (kube-scheduler appends preemption's verdict to the message).
        What the preemption frees is held for the pod in the reservation bucket first; without
        that hold nobody is evicted (the next attempt plans again)."""
        message, plan = outcome.message, None
        if not outcome.claim_error:
            try:
                plan = self.state.preemption_for(pod, claims, volumes=pending.volumes)
            except Exception:  # noqa: BLE001 - preemption is an extra; the pod's own answer must still go
                self.log.exception("shard %d: pod %s: preemption search failed", self.index, pending.pod.key(),
                                   extra=fields(pod=pending.pod.key()))
        preempt = None
        if isinstance(plan, preemption.PreemptionPlan):
            allocations = {c.metadata.uid or "": a for c, a in zip(claims, plan.placement.allocations)}
            if await self._hold_for_preemption(pending, pod, claims, plan.node, allocations, plan.victims):
                preempt = Preemption(node=plan.node, explanation=plan.explain(), victims=[
                    PodRef(namespace=v.namespace, name=v.name, uid=v.uid) for v in plan.victims])
                message = f"{message} {plan.explain()}"
                self.log.info("shard %d: pod %s: %s", self.index, pending.pod.key(), plan.explain(),
                              extra=fields(pod=pending.pod.key(), node=plan.node))
            else:
                message = (f"{message} preemption: postponed, node {plan.node}'s reservations changed while it "
                           f"was planned; planning again at the next attempt")
        elif isinstance(plan, preemption.AwaitingVictims):
            if plan.placement is not None:
                allocations = {c.metadata.uid or "": a for c, a in zip(claims, plan.placement.allocations)}
                await self._hold_for_preemption(pending, pod, claims, plan.node, allocations, plan.going)
            message = f"{message} preemption: {plan.explain()}"
        elif isinstance(plan, preemption.NoPreemption):
            message = f"{message} {plan.reason}"
        return Unschedulable(pod=pending.pod, shard=self.index, message=message, failures=outcome.failures,
                             claim_error=outcome.claim_error, preemption=preempt, error=outcome.scheduler_error)

    async def _hold_for_preemption(self, pending: PendingPod, pod: Pod, claims: list[ResourceClaim], node: str,
                                   allocations: dict, victims) -> bool:
        """protocol.nominate on the node: the preemptor's claims reserved on what its victims free,
        with its CPU and memory, for a lease that outlasts the victims' grace periods. True when it
        is in the bucket (already, or now); False when the compare-and-set lost a race."""
        now = time.time()
        grace = max((v.grace_seconds for v in victims), default=30)
        expires_at = now + self.lease_seconds + grace + PREEMPTION_HOLD_MARGIN_SECONDS
        placed = Placed(node=node, allocations=allocations, new_claims=list(allocations), requests=pod_requests(pod))
        victim_keys = {key for v in victims for key in v.claims}
        victim_claims = {uid for uid, c in self.state.claims.items()
                         if f"{c.metadata.namespace}/{c.metadata.name}" in victim_keys}
        pod_reservation = rv.PodReservation(
            pod_uid=pending.pod.uid, pod_namespace=pending.pod.namespace, pod_name=pending.pod.name,
            requests=placed.requests, reserved_at=now, expires_at=expires_at, shard=self.index,
            host_ports=list(pod_host_ports(pod.spec)), labels=pod.metadata.labels,
            anti_affinity=list(required_anti_affinity(pod.spec)) or None,
        )
        revision, entry = self.store.entry(node)
        try:
            step = protocol.nominate(entry, self._reservations(pending, placed, now, expires_at), pod_reservation,
                                     victim_claims, self._lapse_clock(), self.state.claim_is_allocated,
                                     self.state.pod_is_gone)
        except rv.ReservationConflict as exc:
            self.log.info("shard %d: pod %s: no hold on node %s for its preemption: %s", self.index,
                          pending.pod.key(), node, exc, extra=fields(pod=pending.pod.key(), node=node))
            await self._refresh([node])
            return False
        if step.entry is None:
            return True
        try:
            await self.store.write(node, step.entry, revision)
        except StaleRevision:
            await self._refresh([node])
            return False
        self.state.set_reservations(node, step.entry)
        self.log.info("shard %d: pod %s: node %s's devices held for it until its %d victim(s) go (lease %.0f s)",
                      self.index, pending.pod.key(), node, len(victims), expires_at - now,
                      extra=fields(pod=pending.pod.key(), node=node))
        return True

    def _reservations(self, pending: PendingPod, placed: Placed, now: float, expires_at: float) -> list[rv.Reservation]:
        claims = {c.uid: c for c in pending.claims}
        return [
            rv.Reservation(
                claim_uid=uid,
                claim_namespace=claims[uid].namespace,
                claim_name=claims[uid].name,
                pod_uid=pending.pod.uid,
                devices=rv.devices_of(placed.allocations[uid]),
                allocation=placed.allocations[uid],
                reserved_at=now,
                expires_at=expires_at,
                shard=self.index,
            )
            for uid in placed.new_claims
        ]

    def _lease_of(self, placed: Placed, default: float) -> float:
        _, entry = self.store.entry(placed.node)
        return protocol.republished_lease(entry, placed.allocations, default)

    def _placement(self, pending: PendingPod, claims: list[ResourceClaim], placed: Placed, expires_at: float) -> Placement:
        claim_uids = {c.metadata.uid for c in claims}
        return Placement(
            pod=pending.pod,
            node=placed.node,
            claims=[
                ClaimPlacement(claim=ref, allocation=placed.allocations[ref.uid])
                for ref in pending.claims
                if ref.uid in claim_uids
            ],
            shard=self.index,
            first_seen=pending.first_seen,
            expires_at=expires_at,
            policy=self.state.cluster.policy.name if placed.new_claims else None,
            score=placed.score if placed.new_claims else None,
        )

    async def _publish(self, message) -> None:
        await self.js.publish(self.subjects.results, encode_message(message))
        self._published_since_backlog += 1


def _member_volumes(members) -> dict:
    """Per gang member's pod uid, its PendingPod's volumes (VolumeBinding's PreFilter in the binder)."""
    return {pending.pod.uid: pending.volumes for pending, _ in members if pending.volumes is not None}

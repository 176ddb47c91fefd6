"""One allocator shard: consume its partition of pending pods, place them, commit, publish.

State (all in memory, rebuilt on start): the inventory feed bucket, DeviceClasses, Nodes, Pods and
every ResourceClaim from Kubernetes, and the reservation bucket. A pending pod is handled in four
steps, one pod at a time per shard:
1. place it against the state (pure: draplane_allocator.placing);
2. commit its new claims' reservations with a compare-and-set on the node's entry, computed from
   the revision the state was built on; a lost race refreshes that entry and starts over at 1;
3. publish the Placement (or an Unschedulable) for the binder;
4. acknowledge the pending message. A crash anywhere before 4 means redelivery; the reservation
   already in the bucket makes the retry republish the same placement rather than make a new one.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient

from draplane.allocation.nodefit import pod_requests
from draplane.api.core import Node, Pod
from draplane.api.resource import DeviceClass, ResourceClaim
from draplane.kube import KubeApiError, KubeClient, watch_objects
from draplane.messages.inventory import InventoryNames, decode_feed_entry
from draplane.scheduling import reservations as rv
from draplane.scheduling import streams
from draplane.scheduling.messages import (
    ClaimPlacement,
    MessageError,
    PendingPod,
    Placement,
    Subjects,
    Unschedulable,
    decode_message,
    encode_message,
)
from draplane.scheduling.reservation_store import ReservationStore, StaleRevision
from draplane.scheduling.placing import ClusterState, NotPlaced, Placed

log = logging.getLogger(__name__)

COMMIT_ATTEMPTS = 20
PRUNE_INTERVAL_SECONDS = 5.0
# Placements published but not yet taken by the binder, above which shards wait.
MAX_BINDER_BACKLOG = 128


class Shard:
    def __init__(
        self,
        kube: KubeClient,
        nc: NatsClient,
        *,
        index: int,
        prefix: str,
        policy: str | None = None,
        lease_seconds: float = rv.DEFAULT_LEASE_SECONDS,
        stream_replicas: int = 1,
    ):
        self.kube = kube
        self.nc = nc
        self.js = nc.jetstream()
        self.index = index
        self.subjects = Subjects(prefix=prefix)
        self.feed_names = InventoryNames(prefix=prefix)
        self.lease_seconds = lease_seconds
        self.stream_replicas = stream_replicas
        self.state = ClusterState(policy=policy)
        self.store: ReservationStore | None = None
        self.pods: dict[str, Pod] = {}  # uid -> pod
        self.synced = {k: asyncio.Event() for k in ("classes", "nodes", "pods", "claims", "feed")}
        self._tasks: list[asyncio.Task] = []
        self.counters = {"placed": 0, "unschedulable": 0, "commit_conflicts": 0, "republished": 0}

    # --- service lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await streams.ensure_streams(self.js, self.subjects, replicas=self.stream_replicas)
        kv = await streams.reservation_bucket(self.js, self.subjects, replicas=self.stream_replicas)
        self.store = ReservationStore(kv, on_change=self._on_reservations)
        self._spawn(self.store.watch, "reservations watch")
        self._spawn(self._watch_feed, "inventory feed watch")
        self._spawn(lambda: self._watch(DeviceClass, "classes", self._on_class), "classes watch")
        self._spawn(lambda: self._watch(Node, "nodes", self._on_node), "nodes watch")
        self._spawn(lambda: self._watch(Pod, "pods", self._on_pod), "pods watch")
        self._spawn(lambda: self._watch(ResourceClaim, "claims", self._on_claim), "claims watch")
        self._spawn(self._consume, "pending consumer")
        self._spawn(self._prune_expired, "lease reconciler")

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
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=10)
            if pending:
                log.error("shard %d: tasks did not stop: %s", self.index, [t.get_name() for t in pending])
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
                    log.exception("shard %d: %s crashed; restarting it in 1 s", self.index, name)
                    await asyncio.sleep(1.0)

        self._tasks.append(asyncio.create_task(guarded(), name=f"shard-{self.index} {name}"))

    # --- state -------------------------------------------------------------------------------------

    async def _watch(self, model, what: str, handle) -> None:
        async for event in watch_objects(self.kube, model):
            if event.type == "SYNCED":
                self.synced[what].set()
                continue
            handle(event.object, event.type == "DELETED")

    def _on_class(self, obj: DeviceClass, deleted: bool) -> None:
        self.state.set_class(obj, deleted)

    def _on_node(self, obj: Node, deleted: bool) -> None:
        self.state.set_node(obj, deleted)

    def _on_pod(self, obj: Pod, deleted: bool) -> None:
        uid = obj.metadata.uid or ""
        if deleted:
            self.pods.pop(uid, None)
        else:
            self.pods[uid] = obj
        self.state.set_pod(obj, deleted)

    def _on_claim(self, obj: ResourceClaim, deleted: bool) -> None:
        self.state.set_claim(obj, deleted)

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
        watcher = await kv.watchall()
        try:
            while True:
                try:
                    update = await watcher.updates(timeout=30.0)
                except nats.errors.TimeoutError:
                    continue
                if update is None:
                    self.synced["feed"].set()
                    continue
                if update.operation in ("DEL", "PURGE") or not update.value:
                    self.state.set_feed_entry(update.key, [])
                    continue
                try:
                    entry = decode_feed_entry(update.value)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.error("shard %d: unreadable inventory feed entry %s: %s", self.index, update.key, exc)
                    continue
                self.state.set_feed_entry(update.key, entry.slices)
        finally:
            try:
                await asyncio.wait_for(watcher.stop(), 2.0)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the connection may be gone already
                pass

    async def _prune_expired(self) -> None:
        """Release reservations whose lease ran out before their placement reached Kubernetes.

        Commits prune the node they write anyway; this covers nodes nobody commits to any more,
        where a lapsed reservation would otherwise hold its device for ever."""
        await self.wait_ready(timeout=3600)
        while True:
            await asyncio.sleep(PRUNE_INTERVAL_SECONDS)
            now = time.time()
            for node, (_, entry) in list(self.store.entries.items()):
                if any(r.expires_at is not None and r.expires_at <= now for r in entry.claims.values()):
                    def edit(current: rv.NodeReservations) -> rv.NodeReservations | None:
                        pruned, dropped = rv.prune(current, time.time(), self.state.claim_is_allocated)
                        confirmed = sum(1 for u, r in current.claims.items()
                                        if r.expires_at is not None and u in pruned.claims and pruned.claims[u].confirmed)
                        return pruned if dropped or confirmed else None

                    if await self.store.change(node, edit):
                        log.info("shard %d: node %s: lapsed reservations released or confirmed", self.index, node)

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
                decoded = []
                for msg in messages:
                    try:
                        pending = decode_message(msg.data)
                        if not isinstance(pending, PendingPod):
                            raise MessageError(f"{type(pending).__name__} on a pending subject")
                    except MessageError as exc:
                        log.error("shard %d: dropping a pending message: %s", self.index, exc)
                        await msg.term()
                        continue
                    decoded.append((msg, pending))
                # Reads of pods and claims the watches have not delivered yet go out together; the
                # placing and committing that follow stay one pod at a time.
                fetched = await asyncio.gather(*(self._inputs(p) for _, p in decoded), return_exceptions=True)
                for (msg, pending), inputs in zip(decoded, fetched):
                    try:
                        if isinstance(inputs, BaseException):
                            raise inputs
                        await self.handle(pending, inputs)
                    except Exception:
                        log.exception("shard %d: pod %s: handling failed; redelivering", self.index, pending.pod.key())
                        await msg.nak(delay=1.0)
                        continue
                    await msg.ack()
        finally:
            try:
                await asyncio.wait_for(sub.unsubscribe(), 2.0)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - the connection may be gone
                pass

    async def _wait_for_binder(self) -> None:
        """Back-pressure: placements waiting for the binder hold devices under a lease; placing far
        ahead of what it writes would only let those leases lapse. Wait while its backlog is big."""
        while True:
            try:
                info = await self.js.stream_info(self.subjects.results_stream)
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
                return
            if info.state.messages < MAX_BINDER_BACKLOG:
                return
            await asyncio.sleep(0.2)

    async def _pod(self, pending: PendingPod) -> Pod | None:
        pod = self.pods.get(pending.pod.uid)
        if pod is None:
            try:
                pod = await self.kube.get(Pod, pending.pod.name, pending.pod.namespace)
            except KubeApiError as exc:
                if exc.is_not_found:
                    return None
                raise
            if pod.metadata.uid != pending.pod.uid:
                return None
        return pod

    async def _claims(self, pending: PendingPod) -> list[ResourceClaim] | None:
        claims = []
        for ref in pending.claims:
            claim = self.state.claims.get(ref.uid)
            if claim is None:
                # the binder made it a moment ago and our watch has not caught up
                try:
                    claim = await self.kube.get(ResourceClaim, ref.name, ref.namespace)
                except KubeApiError as exc:
                    if exc.is_not_found:
                        return None
                    raise
                if claim.metadata.uid != ref.uid:
                    return None
                self.state.set_claim(claim)
            claims.append(claim)
        return claims

    async def _inputs(self, pending: PendingPod) -> tuple[Pod, list[ResourceClaim]] | None:
        pod = await self._pod(pending)
        if pod is None or pod.spec.node_name:
            return None  # gone, or bound meanwhile: nothing to place
        claims = await self._claims(pending)
        if claims is None:
            return None  # a claim vanished; the binder sends the pod again once its claims exist
        return pod, claims

    async def handle(self, pending: PendingPod, inputs: tuple[Pod, list[ResourceClaim]] | None = None) -> None:
        if inputs is None:
            inputs = await self._inputs(pending)
            if inputs is None:
                return
        pod, claims = inputs
        # the watch may have seen the pod bound while the inputs were read
        current = self.pods.get(pending.pod.uid)
        if current is not None and current.spec.node_name:
            return
        for _ in range(COMMIT_ATTEMPTS):
            outcome = self.state.place_pod(pod, claims)
            if isinstance(outcome, NotPlaced):
                await self._publish(
                    Unschedulable(pod=pending.pod, shard=self.index, message=outcome.message,
                                  failures=outcome.failures, claim_error=outcome.claim_error)
                )
                self.counters["unschedulable"] += 1
                log.info("shard %d: pod %s unschedulable: %s", self.index, pending.pod.key(), outcome.message)
                return
            expires_at = await self._commit(pending, outcome)
            if expires_at is None:
                self.counters["commit_conflicts"] += 1
                continue
            claim_by_uid = {c.metadata.uid: c for c in claims}
            placement = Placement(
                pod=pending.pod,
                node=outcome.node,
                claims=[
                    ClaimPlacement(claim=ref, allocation=outcome.allocations[ref.uid])
                    for ref in pending.claims
                    if ref.uid in claim_by_uid
                ],
                shard=self.index,
                first_seen=pending.first_seen,
                expires_at=expires_at,
            )
            # the pod now counts on that node for node fit, until the pod watch says otherwise
            self.state.assume_pod(pending.pod.uid, outcome.node, pod_requests(pod))
            await self._publish(placement)
            self.counters["placed"] += 1
            log.info("shard %d: pod %s placed on node %s (%s)", self.index, pending.pod.key(), outcome.node,
                     f"{len(outcome.new_claims)} claims newly reserved" if outcome.new_claims
                     else "claims already allocated or reserved there: placement sent again")
            return
        raise RuntimeError(f"pod {pending.pod.key()}: lost {COMMIT_ATTEMPTS} reservation races in a row")

    async def _commit(self, pending: PendingPod, placed: Placed) -> float | None:
        """Reserve the new claims on the node; the lease's end, or None after a lost race."""
        now = time.time()
        revision, entry = self.store.entry(placed.node)
        expires_at = now + self.lease_seconds
        if not placed.new_claims:
            # nothing new (all claims already allocated or reserved: a redelivery, a restarted
            # binder asking again, or a shared claim): publish the same placement, keep the lease
            if placed.allocations:
                self.counters["republished"] += 1
            leases = [entry.claims[u].expires_at for u in placed.allocations if u in entry.claims]
            live = [t for t in leases if t is not None]
            return min(live) if live else expires_at
        pruned, dropped = rv.prune(entry, now, self.state.claim_is_allocated)
        if dropped:
            log.info("shard %d: node %s: released %d reservations whose lease ran out",
                     self.index, placed.node, len(dropped))
        claims = {c.uid: c for c in pending.claims}
        reservations = [
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
        try:
            new_entry = rv.add(pruned, reservations)
        except rv.ReservationConflict as exc:
            # our view missed a reservation: the mirror lags the bucket; read it and place again
            log.debug("shard %d: %s", self.index, exc)
            await self.store.refresh(placed.node)
            return None
        try:
            await self.store.write(placed.node, new_entry, revision)
        except StaleRevision:
            await self.store.refresh(placed.node)
            return None
        return expires_at

    async def _publish(self, message) -> None:
        await self.js.publish(self.subjects.results, encode_message(message))

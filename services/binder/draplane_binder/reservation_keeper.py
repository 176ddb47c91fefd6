"""The reservation keeper: the binder's side of the reservation bucket, after a placement is
written. It confirms written placements (their leases cleared, batched per node), releases the
reservation of a claim whose allocation went and tells the shards and the audit, and at start
reconciles what changed while no binder ran.

The decisions are draplane.scheduling.reservation_protocol's; this module does the I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from draplane.api.resource import ResourceClaim
from draplane.audit_publisher import AuditPublisher
from draplane.kube import KubeApiError, KubeClient
from draplane.messages import audit
from draplane.scheduling import cluster_feed
from draplane.scheduling import reservation_protocol as protocol
from draplane.scheduling import reservations as rv
from draplane.jetstream import streams
from draplane.scheduling.messages import ClaimRef, ClaimReleased, Subjects, encode_message
from draplane.scheduling.framework.plugins.dynamic_resources import allocation_node
from draplane.jetstream.reservation_store import ReservationStore
from draplane.structured_logs import fields
from draplane_binder.cache import ClusterCache
from draplane_binder.metrics import BinderMetrics
from draplane_binder.objects import key_of
from draplane_binder.settings import BinderSettings

log = logging.getLogger(__name__)

# How long a burst of written placements gathers before its confirmations are written. Every shard
# reads and decodes each write of a node's entry (all its reservations, ~0.7 KB each), and packing
# puts consecutive pods on one node: at 1 s a burst of 4,000 pods on 400 nodes took 0.41 entry
# writes per pod, at 0.05 s 0.57. Safe at any value below half a lease: the lease of a written
# placement has at least that much left, and a lapsed one whose claim is allocated is confirmed by
# the shards' pruning anyway.
CONFIRM_GATHER_SECONDS = 1.0
# How long a ClaimReleased publish is tried again (see _tell_released).
RELEASE_PUBLISH_RETRY_SECONDS = 10.0
# A release that fails on NATS is tried again, this far apart at first, doubling up to the most.
RELEASE_RETRY_FIRST_SECONDS = 0.25
RELEASE_RETRY_MAX_SECONDS = 5.0


class ReservationKeeper:
    def __init__(self, settings: BinderSettings, kube: KubeClient, js: JetStreamContext, subjects: Subjects, *,
                 cache: ClusterCache, audit_publisher: AuditPublisher, metrics: BinderMetrics, instance: str,
                 spawn_once: Callable[[Awaitable, str], None], devices_freed: Callable[[str], None]) -> None:
        self.settings, self.kube, self.js, self.subjects = settings, kube, js, subjects
        self.cache, self.audit, self.metrics, self.instance = cache, audit_publisher, metrics, instance
        self._spawn_once = spawn_once
        # given the released claim's bucket key: the pods waiting out a backoff are tried again soon
        self._devices_freed = devices_freed
        self._store: ReservationStore | None = None
        # node -> claim uids written to Kubernetes whose reservation is still under a lease
        self.to_confirm: dict[str, set[str]] = {}
        self._confirm_wanted = asyncio.Event()
        cache.claim_listeners.append(self._claim_changed)
        cache.sync_listeners.append(self._listed)

    async def open(self) -> None:
        kv = await streams.reservation_bucket(self.js, self.subjects, replicas=self.settings.stream_replicas)
        self._store = ReservationStore(kv)

    @property
    def store(self) -> ReservationStore:
        if self._store is None:
            raise RuntimeError("the reservation bucket is not open yet (ReservationKeeper.open)")
        return self._store

    @property
    def ready(self) -> bool:
        return self._store is not None and self._store.synced

    def loops(self) -> list[tuple[str, Callable[[], Awaitable]]]:
        return [("reservations watch", self.store.watch), ("confirm loop", self._confirm_loop)]

    # --- what starts a release or a reconcile ------------------------------------------------------

    def _claim_changed(self, kind: str, old: ResourceClaim | None, claim: ResourceClaim) -> None:
        if kind == "DELETED":
            if claim.status and claim.status.allocation:
                self._spawn_once(self.release(claim), f"release {key_of(claim)}")
            return
        had = old is not None and old.status is not None and old.status.allocation is not None
        has = claim.status is not None and claim.status.allocation is not None
        if had and not has and old.metadata.uid == claim.metadata.uid:
            self._spawn_once(self.release(old), f"release {key_of(claim)}")

    def _listed(self, what: str) -> None:
        if what == "claims":
            # what happened to claims while no binder watched (deleted, deallocated) left their
            # confirmed reservations behind; a re-list may have missed some too
            self._spawn_once(self.reconcile_reservations(), "reconcile reservations")

    # --- confirming --------------------------------------------------------------------------------

    def confirm(self, node: str, claim_uids: list[str]) -> None:
        """These claims are written to Kubernetes: their leases are cleared soon, with others."""
        self.to_confirm.setdefault(node, set()).update(claim_uids)
        self._confirm_wanted.set()

    async def _confirm_loop(self) -> None:
        """Clear the leases of written placements, one bucket write per node for all of them.

        Batched because placements land on the same busy nodes in bursts, and every bucket write
        is read and decoded by every shard. A crash before the flush loses nothing: a lapsed lease
        whose claim is allocated in Kubernetes is confirmed by the shards' pruning instead.
        """
        while True:
            await self._confirm_wanted.wait()
            self._confirm_wanted.clear()
            await asyncio.sleep(CONFIRM_GATHER_SECONDS)  # let a burst gather
            batch, self.to_confirm = self.to_confirm, {}
            for node, uids in batch.items():
                try:
                    await self.store.confirm(node, uids)
                except Exception:  # noqa: BLE001 - the lease then lapses into a confirmation
                    log.warning("could not confirm %d reservations on node %s", len(uids), node, exc_info=True)

    # --- releasing ---------------------------------------------------------------------------------

    async def release(self, claim: ResourceClaim) -> None:
        """A claim's allocation is gone (cleared or deleted): free its reservation, tell everyone.

        Tried again until it is done: while a killed NATS server's streams and buckets elect new
        leaders, the bucket write or the publishes fail for a few seconds, and a release given up
        then would leave the reservation, or the audit's release event, missing (the chaos run saw
        both). Each step is idempotent."""
        delay = RELEASE_RETRY_FIRST_SECONDS
        while True:
            try:
                await self._release_once(claim)
                return
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
                log.warning("resourceclaim %s/%s: release not done (%r); trying again in %.2f s",
                            claim.metadata.namespace, claim.metadata.name, exc, delay,
                            extra=fields(claim=f"{claim.metadata.namespace}/{claim.metadata.name}"))
                await asyncio.sleep(delay)
                delay = min(delay * 2, RELEASE_RETRY_MAX_SECONDS)

    async def _release_once(self, claim: ResourceClaim) -> None:
        uid = claim.metadata.uid or ""
        found = self._store.find_claim(uid) if self._store else None
        node = found[0] if found else allocation_node(claim.status.allocation if claim.status else None)
        if found:
            await self.store.release(found[0], [uid])
        log.info("resourceclaim %s/%s: allocation gone (%s); reservation %s, release published",
                 claim.metadata.namespace, claim.metadata.name,
                 "claim deleted" if claim.metadata.deletion_timestamp else "cleared",
                 f"on node {found[0]} released" if found else "already gone",
                 extra=fields(claim=f"{claim.metadata.namespace}/{claim.metadata.name}", node=node))
        await self._tell_released(
            claim.metadata.namespace or "", claim.metadata.name or "", uid, node,
            claim.status.allocation if claim.status else None, claim.metadata.resource_version or "",
            "claim deleted" if claim.metadata.deletion_timestamp else "allocation cleared: no pod reserves the claim")

    async def _tell_released(self, namespace: str, name: str, uid: str, node: str | None, allocation,
                             version: str, why: str) -> None:
        """A claim's devices are free again: the shards' and our retries, the audit log."""
        released = ClaimReleased(claim=ClaimRef(namespace=namespace, name=name, uid=uid), node=node)
        # A NATS server dying makes the stream elect a new leader, and publishes get no answer for
        # a few seconds: try again for a while, as the audit publisher does. The release is a
        # hint (shards also see the claim change in their watch), so giving up logs and goes on
        # to the audit event: the chaos run lost 12 release events when this publish raised.
        deadline = time.monotonic() + RELEASE_PUBLISH_RETRY_SECONDS
        delay = RELEASE_RETRY_FIRST_SECONDS
        while True:
            try:
                await self.js.publish(self.subjects.released, encode_message(released))
                break
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                if time.monotonic() + delay >= deadline:
                    log.warning("resourceclaim %s/%s: ClaimReleased not published (%r); the shards see the "
                                "claim change in their watch", namespace, name, exc,
                                extra=fields(claim=f"{namespace}/{name}", node=node))
                    break
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self.metrics.claims_released.inc()
        await self.audit.publish_and_wait(audit.AuditEvent(
            id=audit.released_id(uid, version), kind="released", at=time.time(), by=[self.instance], node=node,
            claims=[audit.ClaimDevices(namespace=namespace, name=name, uid=uid, devices=audit.devices_of(allocation))],
            reason=why,
        ))
        self._devices_freed(cluster_feed.claim_key(uid))

    async def reconcile_reservations(self) -> int:
        """protocol.stale_confirmations over every node's entry: release the confirmed reservations
        whose claim is gone or no longer allocated with those devices. Returns how many.

        The claims cache may lag (a claim written a moment ago by this binder is in it, but one
        re-listed is as old as the list): a reservation is only released after a live read of its
        claim agrees, and then only where it still holds the same devices."""
        await self.store.wait_synced()
        by_uid = {c.metadata.uid: c for c in list(self.cache.claims.values())}
        released = 0
        for node, (_, entry) in list(self.store.entries.items()):
            stale = protocol.stale_confirmations(entry, lambda r: _allocated_devices(by_uid.get(r.claim_uid), r.claim_uid))
            really: dict[str, list] = {}
            gone: dict[str, rv.Reservation] = {}
            for uid, devices in stale.items():
                reservation = entry.claims[uid]
                try:
                    live = await self.kube.get(ResourceClaim, reservation.claim_name, reservation.claim_namespace)
                except KubeApiError as exc:
                    if not exc.is_not_found:
                        raise
                    live = None
                if protocol.stale_confirmations(
                        rv.NodeReservations(node=node, claims={uid: reservation}),
                        lambda r: _allocated_devices(live, r.claim_uid)):
                    really[uid] = devices
                    gone[uid] = reservation
            if not really or not await self.store.release_matching(node, really):
                continue
            released += len(really)
            for uid, reservation in gone.items():
                log.info("resourceclaim %s/%s: its reservation on node %s was confirmed but the claim is gone or "
                         "allocated otherwise (changed while no binder ran): released",
                         reservation.claim_namespace, reservation.claim_name, node,
                         extra=fields(claim=f"{reservation.claim_namespace}/{reservation.claim_name}", node=node))
                await self._tell_released(reservation.claim_namespace, reservation.claim_name, uid, node,
                                          reservation.allocation, f"reconciled-{reservation.reserved_at}",
                                          "its claim was deleted or deallocated while no binder ran")
        return released


def _allocated_devices(claim: ResourceClaim | None, uid: str) -> list[rv.ReservedDevice] | None:
    """The devices a claim (the one of this uid) is allocated with in Kubernetes; None if not."""
    if claim is None or claim.metadata.uid != uid or claim.status is None or claim.status.allocation is None:
        return None
    return rv.devices_of(claim.status.allocation)

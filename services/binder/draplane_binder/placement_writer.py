"""The placement writer: a shard's Placement written to Kubernetes as kube-scheduler's binding
cycle writes one, each extension point a named step:

- Permit: the reservations are held again in the bucket (their leases renewed in the same
  compare-and-set), and a claim whose reservation lapsed is checked against Kubernetes; a gang's
  members then wait for each other (draplane_binder.gang_permits);
- PreBind: VolumeBinding (the pod's claims bound or provisioned on the node), then
  DynamicResources (each claim's delete-protection finalizer and status: the allocation and the
  pod in reservedFor), then its wait for the devices' binding conditions;
- Bind: the pod's binding.

A step that fails raises PlacementFailed, and `_unreserve`, the one failure path, undoes what was
done: the pod taken out of the claims written, the reservations released, the pod retried (after
its backoff, where a PreBind plugin failed, with the error on the pod as kube-scheduler's
SchedulerError). Every step is idempotent: a placement delivered again finds its work done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone

import msgspec

from draplane.api.core import Pod
from draplane.api.resource import ResourceClaim
from draplane.kube import KubeApiError, KubeClient
from draplane.scheduling import reservation_protocol as protocol
from draplane.scheduling import reservations as rv
from draplane.scheduling.messages import ClaimRef, Placement
from draplane.jetstream.reservation_store import ReservationStore
from draplane.scheduling.framework.plugins.volume_binding import pod_claim_names
from draplane.structured_logs import fields
from draplane_binder import lifecycle as lc
from draplane_binder.cache import ClusterCache
from draplane_binder.events import EventRecorder
from draplane_binder.gang_permits import GangPermits
from draplane_binder.metrics import BinderMetrics, seconds_since
from draplane_binder.objects import now_rfc3339
from draplane_binder.pending import PendingQueue
from draplane_binder.reservation_keeper import ReservationKeeper
from draplane_binder.settings import BinderSettings
from draplane_binder.volumes import VolumeBinder

log = logging.getLogger(__name__)

# A claim's allocation is not written later than this before its reservation's lease ends
# (see _write_deadline): room for the request in flight and for clocks a little apart.
WRITE_DEADLINE_MARGIN_SECONDS = 3.0
# How often PreBind looks at claims whose devices' binding conditions it waits for (the watch
# updates the cache; kube-scheduler polls every 5 s), and renews the placement's leases meanwhile.
BINDING_POLL_SECONDS = 0.5
BINDING_LEASE_RENEW_SECONDS = 5.0
# A claim's write is given up after this many conflicting updates in a row.
MAX_WRITE_CONFLICTS = 20


class PlacementFailed(Exception):
    """A step of the binding cycle failed: the placement is undone (`_unreserve`).

    `backoff`: the pod waits that long before it is tried again (a PreBind plugin failed),
    instead of the quick retry of a placement whose lease lapsed; `error`: what the pod is told,
    as kube-scheduler's SchedulerError condition."""

    def __init__(self, why: str, *, backoff: float | None = None, error: str | None = None) -> None:
        super().__init__(why)
        self.why, self.backoff, self.error = why, backoff, error


class PlacementWriter:
    def __init__(self, settings: BinderSettings, kube: KubeClient, *, cache: ClusterCache,
                 reservations: ReservationKeeper, pending: PendingQueue, volumes: VolumeBinder,
                 events: EventRecorder, metrics: BinderMetrics, gang_permits: GangPermits | None = None) -> None:
        self.settings, self.kube, self.cache, self.reservations = settings, kube, cache, reservations
        self.pending, self.volumes, self.events, self.metrics = pending, volumes, events, metrics
        self.gang_permits = gang_permits if gang_permits is not None else GangPermits()

    @property
    def store(self) -> ReservationStore:
        return self.reservations.store

    async def write_placement(self, placement: Placement, *,
                              in_progress: Callable[[], Awaitable] | None = None,
                              slot: PlacementSlot | None = None) -> bool:
        """Write the placement; True when the pod is bound there. `in_progress` tells the results
        stream that it is still being worked on (PreBind may wait for minutes); `slot` is given up
        meanwhile."""
        pod = await self._current_pod(placement)
        written: list[ClaimRef] = []
        try:
            self._check_pod_still_wants(placement, pod)
            await self._permit(placement, pod)
            if placement.gang is not None and not pod.spec.node_name:
                await self._wait_for_gang(placement, in_progress, slot)
            if not pod.spec.node_name:
                await self._pre_bind_volumes(placement, pod, in_progress, slot)
            await self._pre_bind_claims(placement, pod, written)
            if not pod.spec.node_name:
                await self._pre_bind_binding_conditions(placement, pod, written, in_progress, slot)
                await self._bind(placement, pod)
        except PlacementFailed as failure:
            await self._unreserve(placement, pod, written, failure)
            return False
        except BaseException:
            # an error the results consumer retries (the apiserver, NATS) or a cancel: the hold
            # PreBind took on the node's attach capacity goes too, or it outlives the attempt
            self.volumes.forget_attachments(placement.pod.uid)
            raise
        self._bound(placement, pod)
        return True

    # --- the steps ---------------------------------------------------------------------------------

    async def _current_pod(self, placement: Placement) -> Pod | None:
        pod = self.cache.pods_by_uid.get(placement.pod.uid)
        if pod is not None:
            return pod
        try:
            return await self.kube.get(Pod, placement.pod.name, placement.pod.namespace)
        except KubeApiError as exc:
            if not exc.is_not_found:
                raise
            return None

    @staticmethod
    def _check_pod_still_wants(placement: Placement, pod: Pod | None) -> None:
        if pod is None or pod.metadata.uid != placement.pod.uid or lc.pod_is_done(pod) or \
                pod.metadata.deletion_timestamp:
            raise PlacementFailed("the pod is gone")
        if pod.spec.node_name and pod.spec.node_name != placement.node:
            raise PlacementFailed(f"the pod is already bound to node {pod.spec.node_name}")

    async def _permit(self, placement: Placement, pod: Pod) -> None:
        """Only devices the bucket still reserves for these claims are written: a lapsed
        reservation may have been given to another claim, and a claim placed again after a
        restart may hold other devices now. Holding renews the leases in the same compare-and-set."""
        held = await self.store.hold(
            placement.node, {c.claim.uid: rv.devices_of(c.allocation) for c in placement.claims},
            self.settings.lease_seconds, pods=[placement.pod.uid],
        )
        plan = protocol.plan_write([c.claim.uid for c in placement.claims], placement.pod.uid, held,
                                   node=placement.node, pod_bound_here=pod.spec.node_name == placement.node)
        if isinstance(plan, protocol.Abandon):
            self.metrics.lease_lapses.inc()
            raise PlacementFailed(plan.why)
        for item in placement.claims:
            if item.claim.uid in plan.verify and not await self._written_already(item.claim, item.allocation):
                self.metrics.lease_lapses.inc()
                raise PlacementFailed(f"resourceclaim {item.claim.key()}: its reservation is no longer held")

    async def _wait_for_gang(self, placement: Placement, in_progress: Callable[[], Awaitable] | None,
                             slot: PlacementSlot | None) -> None:
        """kube-scheduler's gang Permit: this member waits until every member its shard placed
        with it has passed Permit too, its leases (and its results message) kept alive; one that
        failed turns it back."""
        if not self.gang_permits.can_gather(placement.gang):
            log.warning("pod %s: its gang %s placed %d members together, more than the binder can hold at "
                        "once (%d): it is bound without waiting for them", placement.pod.key(), placement.gang.key,
                        placement.gang.members, self.gang_permits.max_members,
                        extra=fields(pod=placement.pod.key(), gang=placement.gang.key))
            return
        keeper = LeaseKeeper(self.store, self.settings.lease_seconds, placement, in_progress,
                             "its gang's other members pass Permit")
        async with _aside(slot):  # a gang may be bigger than the binder's placement slots
            why = await self.gang_permits.wait(placement.gang, placement.pod.uid, keeper.keep)
        if why is None and keeper.failures:
            why = f"the reservation of pod {placement.pod.key()} on node {placement.node} lapsed while it waited"
        if why is not None:
            raise PlacementFailed(f"gang {placement.gang.key}: {why}")

    async def _written_already(self, ref: ClaimRef, allocation) -> bool:
        try:
            current = await self.kube.get(ResourceClaim, ref.name, ref.namespace)
        except KubeApiError as exc:
            if not exc.is_not_found:
                raise
            return False
        return (current.metadata.uid == ref.uid and current.status is not None
                and lc.same_allocation(current.status.allocation, allocation))

    async def _pre_bind_volumes(self, placement: Placement, pod: Pod, in_progress: Callable[[], Awaitable] | None,
                                slot: PlacementSlot | None) -> None:
        """VolumeBinding's PreBind: the pod's claims bound or provisioned on the node, waited for
        with the placement's leases (and its results message) kept alive."""
        if not pod_claim_names(pod):
            return
        keeper = LeaseKeeper(self.store, self.settings.lease_seconds, placement, in_progress,
                             "its volumes are bound")
        async with _aside(slot):  # binding or provisioning can take minutes
            why = await self.volumes.pre_bind(pod, placement.node, keeper.keep)
        if why is None:
            # a lease may have lapsed meanwhile (a renewal failed, or taking the slot back was
            # slow), and its devices gone to another pod: checked once more before writing
            held = await self.store.hold(placement.node, keeper.expected, self.settings.lease_seconds,
                                         pods=[placement.pod.uid])
            plan = protocol.plan_write(list(keeper.expected), placement.pod.uid, held, node=placement.node,
                                       pod_bound_here=False)
            if isinstance(plan, protocol.Abandon):
                why = plan.why
            elif plan.verify:
                why = f"the reservation of {len(plan.verify)} claim(s) lapsed while the volumes were bound"
        if why is not None:
            raise PlacementFailed(why if why.startswith("binding volumes") else f"binding volumes: {why}",
                                  backoff=self.pending.backoff.next_backoff(placement.pod.uid),
                                  error=f'running PreBind plugin "VolumeBinding": {why}')

    async def _pre_bind_claims(self, placement: Placement, pod: Pod, written: list[ClaimRef]) -> None:
        """DynamicResources' PreBind: each claim's finalizer and status written; `written` says
        which, for the undo."""
        deadline = self._write_deadline(placement.node, [c.claim.uid for c in placement.claims])
        for item in placement.claims:
            why = await self._write_claim(item.claim, item.allocation, pod, deadline=deadline)
            if why is not None:
                raise PlacementFailed(why)
            written.append(item.claim)

    def _write_deadline(self, node: str, claim_uids: list[str]) -> float:
        """When (monotonic) the last attempt at writing these claims' allocation may start: the
        soonest lease of their reservations, just held, less WRITE_DEADLINE_MARGIN_SECONDS. After
        it a shard may prune the reservation and give the devices to another claim, so a write
        that the client retried past it (the apiserver restarting, say) could allocate one device
        twice; the chaos run saw exactly that with a write that landed 10 s after its lease."""
        _, entry = self.store.entry(node)
        leases = [entry.claims[u].expires_at for u in claim_uids
                  if u in entry.claims and entry.claims[u].expires_at is not None]
        left = (min(leases) - time.time()) if leases else self.settings.lease_seconds / 2
        return time.monotonic() + max(0.0, left - WRITE_DEADLINE_MARGIN_SECONDS)

    async def _write_claim(self, ref: ClaimRef, allocation, pod: Pod, *, deadline: float | None = None) -> str | None:
        """One claim's finalizer and status, retried on conflict. None on success, else why it failed."""
        cached = self.cache.claims.get((ref.namespace, ref.name))
        for attempt in range(MAX_WRITE_CONFLICTS):
            from_cache = attempt == 0 and cached is not None and cached.metadata.uid == ref.uid
            if from_cache:
                # Saves a read per claim. A copy: the cache keeps the old state for release
                # detection. A stale copy fails the write with a conflict and is read afresh.
                claim = msgspec.structs.replace(cached, metadata=msgspec.structs.replace(cached.metadata))
            else:
                try:
                    claim = await self.kube.get(ResourceClaim, ref.name, ref.namespace)
                except KubeApiError as exc:
                    if exc.is_not_found:
                        return f"resourceclaim {ref.key()} is gone"
                    raise
            if claim.metadata.uid != ref.uid:
                return f"resourceclaim {ref.key()} was replaced"
            if claim.metadata.deletion_timestamp:
                return f"resourceclaim {ref.key()} is being deleted"
            try:
                finalizers = claim.metadata.finalizers or []
                if lc.DELETE_PROTECTION_FINALIZER not in finalizers:
                    claim.metadata.finalizers = [*finalizers, lc.DELETE_PROTECTION_FINALIZER]
                    claim = await self.kube.update(claim, deadline=deadline)
                plan = lc.plan_claim_write(claim, allocation, pod, now=now_rfc3339())
                if from_cache and not isinstance(plan, lc.WriteStatus):
                    continue  # "done" or "taken" is only believed from a fresh read
                if isinstance(plan, lc.AllocatedElsewhere):
                    return plan.message
                if isinstance(plan, lc.WriteStatus):
                    newly_allocated = claim.status is None or claim.status.allocation is None
                    claim.status = plan.status
                    claim = await self.kube.update_status(claim, deadline=deadline)
                    if newly_allocated:
                        self.metrics.claims_allocated.inc()
                self.cache.apply_claim("MODIFIED", claim)
                return None
            except KubeApiError as exc:
                if exc.is_conflict:
                    continue
                if exc.is_not_found:
                    return f"resourceclaim {ref.key()} is gone"
                if exc.past_deadline:
                    self.metrics.lease_lapses.inc()
                    return (f"resourceclaim {ref.key()}: not written before its reservation's lease could run out "
                            f"({exc.reason}: {exc.message})")
                raise
        return f"resourceclaim {ref.key()}: {MAX_WRITE_CONFLICTS} conflicting updates in a row"

    async def _pre_bind_binding_conditions(self, placement: Placement, pod: Pod, written: list[ClaimRef],
                                           in_progress: Callable[[], Awaitable] | None,
                                           slot: PlacementSlot | None) -> None:
        """DynamicResources' PreBind wait: a device allocated with binding conditions (a device
        that must be attached first) keeps the pod unbound until every condition is True in the
        claim's status.devices. It fails on a binding failure condition, or when none of it came
        within `binding_timeout_seconds` of the allocation; the claims are then deallocated (no
        other pod shares them), so the next attempt may pick other devices, as kube-scheduler's
        PostFilter deallocates them."""
        waiting = [ref for ref in written if lc.has_binding_conditions(
            next(c.allocation for c in placement.claims if c.claim.uid == ref.uid))]
        if not waiting:
            return
        self.events.queue_pod_event(pod, "BindingConditionsPending",
                                    f"waiting for binding conditions for device on node {placement.node}",
                                    type_="Normal")
        log.info("pod %s: waiting for the binding conditions of %s on node %s", placement.pod.key(),
                 ", ".join(f"resourceclaim {r.name}" for r in waiting), placement.node,
                 extra=fields(pod=placement.pod.key(), node=placement.node))
        keeper = LeaseKeeper(self.store, self.settings.lease_seconds, placement, in_progress,
                             "its devices' binding conditions are awaited", claims_written=True)
        async with _aside(slot):  # attaching a device can take minutes
            why = await self._poll_binding_conditions(placement, waiting, keeper)
        if why is None and keeper.failures:
            why = f"the reservation of pod {placement.pod.key()} on node {placement.node} lapsed while its devices " \
                  f"were attached"
        if why is not None:
            raise PlacementFailed(f"binding conditions: {why}",
                                  backoff=self.pending.backoff.next_backoff(placement.pod.uid),
                                  error=f'running PreBind plugin "DynamicResources": {why}')

    async def _poll_binding_conditions(self, placement: Placement, waiting: list[ClaimRef],
                                       keeper: LeaseKeeper) -> str | None:
        renewed = time.monotonic()
        # As kube-scheduler's poll, the wait itself is bounded too: a claim whose allocation
        # went, or that has no timestamp, must not hold the placement (and its message) for ever.
        deadline = renewed + self.settings.binding_timeout_seconds
        allocations = {c.claim.uid: c.allocation for c in placement.claims}
        while True:
            if time.monotonic() >= deadline:
                return f"{lc.BINDING_TIMEOUT}: claim={', '.join(r.name for r in waiting)}"
            pod = self.cache.pods_by_uid.get(placement.pod.uid)
            if pod is None or lc.pod_is_done(pod) or pod.metadata.deletion_timestamp:
                return "the pod is gone"
            pending = []
            for ref in waiting:
                claim = self.cache.claims.get((ref.namespace, ref.name))
                if claim is None or claim.metadata.uid != ref.uid:
                    return f"resourceclaim {ref.key()} is gone"
                if claim.status is None or not lc.same_allocation(claim.status.allocation, allocations[ref.uid]):
                    return f"resourceclaim {ref.key()} was deallocated while its devices were attached"
                state = lc.binding_readiness(claim, datetime.now(timezone.utc), self.settings.binding_timeout_seconds)
                if state.error:
                    return state.error
                if not state.ready:
                    pending.append(ref)
            if not pending:
                return None
            if time.monotonic() - renewed >= BINDING_LEASE_RENEW_SECONDS:
                await keeper.keep()
                renewed = time.monotonic()
            await asyncio.sleep(BINDING_POLL_SECONDS)

    async def _bind(self, placement: Placement, pod: Pod) -> None:
        try:
            await self.kube.bind_pod(placement.pod.namespace, placement.pod.name, placement.node, placement.pod.uid)
        except KubeApiError as exc:
            if exc.status == 409:
                current = await self.kube.get(Pod, placement.pod.name, placement.pod.namespace)
                if current.spec.node_name != placement.node:
                    raise PlacementFailed(f"binding failed: {exc.message}") from exc
                return  # bound there already: an earlier attempt's binding landed
            if exc.is_not_found:
                raise PlacementFailed("the pod is gone") from exc
            raise
        self.metrics.pods_bound.inc()
        waited = seconds_since(pod.metadata.creation_timestamp, datetime.now(timezone.utc))
        if waited is not None:
            self.metrics.create_to_bound.observe(waited)

    def _bound(self, placement: Placement, pod: Pod) -> None:
        """The placement is written: its reservations confirmed (batched), the pod told."""
        self.reservations.confirm(placement.node, [c.claim.uid for c in placement.claims])
        self.pending.placement_written(placement.pod.uid)
        if pod.spec.node_name:
            # A placement delivered again (a restarted shard republishes what its reservations
            # hold): the claims were checked and the leases renewed, nothing was bound again.
            log.info("pod %s was already bound to node %s: placement from shard %d delivered again, nothing "
                     "rebound", placement.pod.key(), placement.node, placement.shard,
                     extra=fields(pod=placement.pod.key(), node=placement.node, shard=placement.shard))
            return
        # kube-scheduler's Normal event for a binding; written aside, it never holds up the next one
        self.events.queue_pod_event(pod, "Scheduled", f"Successfully assigned {placement.pod.key()} to {placement.node}",
                                    type_="Normal")
        log.info("pod %s bound to node %s with %s (shard %d, %.0f ms after it was first seen)",
                 placement.pod.key(), placement.node,
                 "; ".join(f"resourceclaim {c.claim.name}: {_devices_text(c.allocation)}" for c in placement.claims)
                 or "no claims",
                 placement.shard, max(0.0, time.time() - placement.first_seen) * 1000 if placement.first_seen else 0.0,
                 extra=fields(pod=placement.pod.key(), node=placement.node, shard=placement.shard,
                              claim=placement.claims[0].claim.key() if len(placement.claims) == 1 else None))

    # --- the undo ----------------------------------------------------------------------------------

    async def _unreserve(self, placement: Placement, pod: Pod | None, written: list[ClaimRef],
                         failure: PlacementFailed) -> None:
        """The one failure path: the pod out of the claims written, the reservations released,
        the pod retried (after `failure.backoff`) and told (`failure.error`). A gang member that
        fails before its gang passed Permit turns the other members back."""
        if placement.gang is not None:
            self.gang_permits.reject(placement.gang, f"member {placement.pod.key()} failed: {failure.why}")
        self.volumes.forget_attachments(placement.pod.uid)  # the undo of PreBind's attach-limit hold
        await self._take_pod_out_of(placement, written, failure.why)
        await self.abandon(placement, pod, failure.why)
        if failure.backoff is not None:
            self.pending.backoff.back_off(placement.pod.uid, failure.backoff, time.monotonic())
        if failure.error is not None:
            await self.pending.report_error(placement.pod.uid, failure.error)

    async def _take_pod_out_of(self, placement: Placement, written: list[ClaimRef], why: str) -> None:
        """The undo of _pre_bind_claims: the pod out of the reservedFor of the claims written
        (a claim nobody else reserves is then deallocated by its reconcile)."""
        if not written:
            return
        log.info("pod %s: taking it out of the reservedFor of %s: %s", placement.pod.key(),
                 ", ".join(f"resourceclaim {r.name}" for r in written), why)
        for ref in written:
            for _ in range(MAX_WRITE_CONFLICTS):
                try:
                    claim = await self.kube.get(ResourceClaim, ref.name, ref.namespace)
                    status = lc.status_without_pod(claim, placement.pod.uid)
                    if status is None:
                        break
                    claim.status = status
                    self.cache.apply_claim("MODIFIED", await self.kube.update_status(claim))
                    break
                except KubeApiError as exc:
                    if exc.is_not_found:
                        break
                    if not exc.is_conflict:
                        raise

    async def abandon(self, placement: Placement, pod: Pod | None, why: str) -> None:
        """The undo of Permit: release the reservations of claims that did not end up allocated,
        and retry the pod."""
        self.metrics.placements_abandoned.inc()
        log.info("placement of pod %s on %s abandoned: %s", placement.pod.key(), placement.node, why,
                 extra=fields(pod=placement.pod.key(), node=placement.node, shard=placement.shard))

        def allocated_here(uid: str) -> bool:
            item = next(c for c in placement.claims if c.claim.uid == uid)
            claim = self.cache.claims.get((item.claim.namespace, item.claim.name))
            return (claim is not None and claim.metadata.uid == uid and claim.status is not None
                    and lc.same_allocation(claim.status.allocation, item.allocation))

        give_back = protocol.what_to_abandon(
            {c.claim.uid: rv.devices_of(c.allocation) for c in placement.claims}, allocated_here,
            placement.pod.uid, pod_bound_here=pod is not None and pod.spec.node_name == placement.node)
        if not give_back.empty:
            await self.store.release_matching(placement.node, give_back.claims, pods=give_back.pods)
        self.pending.placement_abandoned(placement.pod.uid, pod)


def _devices_text(allocation) -> str:
    results = allocation.devices.results if allocation.devices and allocation.devices.results else []
    return ", ".join(f"{r.pool}/{r.device}" + (f" (share {r.share_id})" if r.share_id else "") for r in results) or "no devices"


class LeaseKeeper:
    """Keeps a placement alive while PreBind waits (volumes being bound, devices being
    attached): its reservations' leases renewed in the bucket, its results message marked in
    progress. `failures` counts renewals that did not land; the caller checks the leases again."""

    def __init__(self, store: ReservationStore, lease_seconds: float, placement: Placement,
                 in_progress: Callable[[], Awaitable] | None, while_what: str, *,
                 claims_written: bool = False) -> None:
        self.store, self.lease_seconds = store, lease_seconds
        self.placement, self.in_progress, self.while_what = placement, in_progress, while_what
        self.claims_written = claims_written
        self.expected = {c.claim.uid: rv.devices_of(c.allocation) for c in placement.claims}
        self.failures = 0

    async def keep(self) -> None:
        placement = self.placement
        if self.in_progress is not None:
            try:
                await self.in_progress()
            except Exception:  # noqa: BLE001 - redelivery is the worst case, and writing is idempotent
                log.debug("pod %s: could not tell the results stream it is in progress", placement.pod.key())
        try:
            held = await self.store.hold(placement.node, self.expected, self.lease_seconds, pods=[placement.pod.uid])
        except Exception:  # noqa: BLE001 - checked again once the wait is over
            self.failures += 1
            log.warning("pod %s: could not renew its leases on node %s while %s", placement.pod.key(),
                        placement.node, self.while_what, exc_info=True)
            return
        claims_lost = not self.claims_written and any(uid not in held for uid in self.expected)
        if placement.pod.uid not in held or claims_lost:
            # a lease lapsed and was pruned: its devices (or the pod's CPU and memory) may be
            # another's by now. Once the claims are written, Kubernetes holds their devices.
            self.failures += 1
            log.warning("pod %s: its reservation on node %s lapsed while %s", placement.pod.key(), placement.node,
                        self.while_what)


class PlacementSlot:
    """One of the binder's `concurrency` placement slots, held by a placement being written,
    and given up while PreBind waits for volumes to be bound or devices to be attached: a wait
    of minutes must not keep the other placements from being written."""

    def __init__(self, semaphore: asyncio.Semaphore) -> None:
        self.semaphore = semaphore
        self.held = False

    async def take(self) -> None:
        await self.semaphore.acquire()
        self.held = True

    def give_up(self) -> None:
        if self.held:
            self.held = False
            self.semaphore.release()


@contextlib.asynccontextmanager
async def _aside(slot: PlacementSlot | None):
    """The slot given up for the block, taken again after it (a placement called without one,
    from a test, waits holding nothing)."""
    if slot is None:
        yield
        return
    slot.give_up()
    try:
        yield
    finally:
        await slot.take()

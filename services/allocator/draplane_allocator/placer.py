"""Placing and committing a batch of pending pods (those placed alone; gangs are
draplane_allocator.gangs'), in rounds:
1. place the pods one after the other against the view (pure: draplane.scheduling.placing),
   each seeing the devices the ones before it took;
2. commit the new reservations with one compare-and-set per node, from the revision the view was
   built on (what the write holds is draplane.scheduling.reservation_protocol.commit's); a node
   that lost a race is read again and its pods go back to 1;
3. publish the Placements (and Unschedulables, with the preemption that would make room) for the
   binder.
The shard acknowledges the pending messages after; a crash before that means redelivery, and the
reservation already in the bucket makes the retry republish the same placement.
"""

from __future__ import annotations

import asyncio
import logging
import time

from draplane.component_helpers.resource import pod_requests
from draplane.api.core import Pod
from draplane.api.resource import ResourceClaim
from draplane.scheduling import preemption
from draplane.scheduling import reservation_protocol as protocol
from draplane.scheduling import reservations as rv
from draplane.scheduling.messages import GangCommit, PendingPod, PodRef, Preemption, Unschedulable
from draplane.scheduling.placing import NotPlaced, Placed
from draplane.jetstream.reservation_store import StaleRevision
from draplane.structured_logs import fields
from draplane_allocator.answers import Answers
from draplane_allocator.metrics import ShardMetrics
from draplane_allocator.records import (
    NodeRound, PlacedPod, PlacementToSend, PodToPlace, RefusedPod, claim_reservations, placement_message,
    pod_reservation,
)
from draplane_allocator.view import ShardView

# A batch's pods are placed again at most this many times when their nodes' writes lose races.
COMMIT_ATTEMPTS = 20
# A preemption's hold lasts the shard's lease plus the victims' longest grace period plus this,
# so that it outlives their eviction and the resourceclaim controller's deallocation.
PREEMPTION_HOLD_MARGIN_SECONDS = 30.0
# The grace period assumed for victims that name none.
DEFAULT_GRACE_SECONDS = 30


class PreemptionHolds:
    """What a preemption frees, held for its preemptor in the reservation bucket before anyone is
    evicted (reservation_protocol.nominate), for one pod or for each member of a gang."""

    def __init__(self, view: ShardView, *, index: int, lease_seconds: float,
                 log: logging.LoggerAdapter | logging.Logger) -> None:
        self.view, self.index, self.lease_seconds, self.log = view, index, lease_seconds, log

    async def hold(self, pending: PendingPod, pod: Pod, node: str, allocations: dict, victims) -> bool:
        """The preemptor's claims reserved on what its victims free, with its CPU and memory, for a
        lease that outlasts the victims' grace periods. True when it is in the bucket (already, or
        now); False when the compare-and-set lost a race."""
        store, state = self.view.store, self.view.state
        now = time.time()
        grace = max((v.grace_seconds for v in victims), default=DEFAULT_GRACE_SECONDS)
        expires_at = now + self.lease_seconds + grace + PREEMPTION_HOLD_MARGIN_SECONDS
        placed = Placed(node=node, allocations=allocations, new_claims=list(allocations), requests=pod_requests(pod))
        victim_keys = {key for v in victims for key in v.claims}
        victim_claims = {uid for uid, c in state.claims.items()
                         if f"{c.metadata.namespace}/{c.metadata.name}" in victim_keys}
        revision, entry = store.entry(node)
        try:
            step = protocol.nominate(entry, claim_reservations(pending, placed, now, expires_at, self.index),
                                     pod_reservation(pending, placed.requests, now, expires_at, self.index),
                                     victim_claims, self.view.lapse_clock(), state.claim_is_allocated,
                                     state.pod_is_gone, victim_pods={v.uid for v in victims})
        except rv.ReservationConflict as exc:
            self.log.info("shard %d: pod %s: no hold on node %s for its preemption: %s", self.index,
                          pending.pod.key(), node, exc, extra=fields(pod=pending.pod.key(), node=node))
            await self.view.refresh([node])
            return False
        if step.entry is None:
            return True
        try:
            await store.write(node, step.entry, revision)
        except StaleRevision:
            await self.view.refresh([node])
            return False
        state.set_reservations(node, step.entry)
        self.log.info("shard %d: pod %s: node %s's devices held for it until its %d victim(s) go (lease %.0f s)",
                      self.index, pending.pod.key(), node, len(victims), expires_at - now,
                      extra=fields(pod=pending.pod.key(), node=node))
        return True

    async def let_go(self, node: str, claim_devices: dict, pod_uid: str) -> None:
        """The undo of `hold`: the preemptor's hold on the node taken back."""
        await self.view.store.change(node, lambda entry: protocol.abandon(entry, claim_devices, [pod_uid]))


class BatchPlacer:
    def __init__(self, view: ShardView, answers: Answers, holds: PreemptionHolds, *, index: int,
                 lease_seconds: float, metrics: ShardMetrics, log: logging.LoggerAdapter | logging.Logger) -> None:
        self.view, self.answers, self.holds = view, answers, holds
        self.index, self.lease_seconds, self.m, self.log = index, lease_seconds, metrics, log

    async def place(self, todo: list[PodToPlace], started: float) -> None:
        """Place, commit and answer the pods, in rounds until none is left to place again."""
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
                       COMMIT_ATTEMPTS, ", ".join(item.pending.pod.key() for item in todo))
        await asyncio.gather(*(self.answers.publish(Unschedulable(
            pod=item.pending.pod, shard=self.index, message=message, failures=[], claim_error=message))
            for item in todo))

    def _place_one(self, item: PodToPlace) -> Placed | NotPlaced:
        try:
            return self.view.state.place_pod(item.pod, item.claims, volumes=item.pending.volumes,
                                             dra_extended_resources=item.pending.dra_extended_resources or (),
                                             default_spread=item.pending.default_spread)
        except Exception as exc:  # noqa: BLE001 - a bug met by one pod must not hold up the batch
            self.m.errors.inc()
            self.log.exception("shard %d: pod %s: placing it failed", self.index, item.pending.pod.key(),
                               extra=fields(pod=item.pending.pod.key()))
            message = f"draplane shard {self.index}: internal error while placing the pod: {exc!r}"
            return NotPlaced(message=message, failures=[], claim_error=message)

    async def _place_and_commit(self, todo: list[PodToPlace], started: float) -> list[PodToPlace]:
        """One round; returns the pods to place again."""
        store, state = self.view.store, self.view.state
        now = time.time()
        expires_at = now + self.lease_seconds
        rounds: dict[str, NodeRound] = {}
        republish: list[PlacedPod] = []  # nothing new to reserve
        refused: list[RefusedPod] = []
        lost: set[str] = set()  # nodes whose entry must be read again
        again: list[PodToPlace] = []
        for item in todo:
            outcome = self._place_one(item)
            if isinstance(outcome, NotPlaced):
                refused.append(RefusedPod(item, outcome))
                continue
            node = outcome.node
            reservations = claim_reservations(item.pending, outcome, now, expires_at, self.index)
            pod_held = pod_reservation(item.pending, outcome.requests, now, expires_at, self.index)
            try:
                node_round = rounds.get(node)
                if node_round is None:
                    revision, entry = store.entry(node)
                    step = protocol.commit(entry, reservations, pod_held, self.view.lapse_clock(),
                                           state.claim_is_allocated, state.pod_is_gone)
                    # what this node's write will hold before this pod: its entry, pruned
                    rounds[node] = node_round = NodeRound(revision=revision, first_commit=step,
                                                          entry=step.lapsed.entry or entry)
                else:
                    step = protocol.recommit(node_round.first_commit, node_round.entry, reservations, pod_held)
            except rv.ReservationConflict as exc:
                # our view missed a reservation: the mirror lags the bucket; read it, place again
                self.m.conflicts_in_view.inc()
                self.log.debug("shard %d: %s", self.index, exc, extra=fields(pod=item.pending.pod.key(), node=node))
                lost.add(node)
                again.append(item)
                continue
            if step.entry is None:
                # its claims and the pod are reserved there already (a redelivery, or the binder
                # asking again after a restart): send the same placement, nothing to write
                republish.append(PlacedPod(item, outcome))
                continue
            node_round.entry = step.entry
            node_round.staged.append(PlacedPod(item, outcome))
            # the pods after this one in the batch must see these devices and this pod's CPU and
            # memory taken; the view is the node's entry as it will be written
            state.set_reservations(node, step.entry)
        staged = {node: r for node, r in rounds.items() if r.staged}
        for node, node_round in staged.items():
            if node_round.first_commit.lapsed.released:
                self.log.info("shard %d: node %s: released %d reservations whose lease ran out",
                              self.index, node, len(node_round.first_commit.lapsed.released), extra=fields(node=node))

        written = await asyncio.gather(
            *(store.write(node, r.entry, r.revision) for node, r in staged.items()), return_exceptions=True
        )
        to_send: list[PlacementToSend] = []
        failure: BaseException | None = None
        for (node, node_round), result in zip(staged.items(), written):
            if isinstance(result, BaseException):
                if not isinstance(result, StaleRevision):
                    failure = result
                lost.add(node)
                again.extend(p.item for p in node_round.staged)
                if isinstance(result, StaleRevision):
                    self.m.conflicts_on_write.inc()
                    self.log.debug("shard %d: node %s: the reservation of %d pods lost a compare-and-set race; "
                                   "placing them again", self.index, node, len(node_round.staged),
                                   extra=fields(node=node))
            else:
                lapsed = node_round.first_commit.lapsed
                self.m.lapses_released.inc(len(lapsed.released))
                self.m.lapses_confirmed.inc(len(lapsed.confirmed))
                to_send.extend(PlacementToSend(p.item, p.placed, expires_at) for p in node_round.staged)
        # drop this round's reservations from the view, even where the refresh saw no news
        await self.view.refresh(lost)
        for p in republish:
            if p.placed.node in lost:
                again.append(p.item)  # it leaned on a reservation that did not stick
            else:
                to_send.append(PlacementToSend(p.item, p.placed, self.lease_of(p.placed, expires_at)))
                if p.placed.allocations:
                    self.m.republished.inc()
        if lost:
            # the devices they missed may not be taken after all
            again.extend(r.item for r in refused)
            refused = []

        messages = [self.placement(p.item, p.placed, p.lease_ends) for p in to_send]
        messages += [await self._unschedulable(r.item, r.outcome) for r in refused]
        await asyncio.gather(*(self.answers.publish(m) for m in messages))
        self.m.placed.inc(len(to_send))
        self.m.unschedulable.inc(len(refused))
        elapsed = time.monotonic() - started
        for p in to_send:
            self.m.placement_seconds.observe(elapsed)
            self.log.info("shard %d: pod %s placed on node %s (%s)", self.index, p.item.pending.pod.key(),
                          p.placed.node, f"{len(p.placed.new_claims)} claims newly reserved" if p.placed.new_claims
                          else "claims already allocated or reserved there: placement sent again",
                          extra=fields(pod=p.item.pending.pod.key(), node=p.placed.node))
        for r in refused:
            self.log.info("shard %d: pod %s unschedulable: %s", self.index, r.item.pending.pod.key(),
                          r.outcome.message, extra=fields(pod=r.item.pending.pod.key()))
        if failure is not None:
            raise failure
        return again

    def placement(self, item: PodToPlace, placed: Placed, lease_ends: float, gang: GangCommit | None = None):
        return placement_message(item.pending, item.claims, placed, lease_ends, shard=self.index,
                                 policy=self.view.state.devices.policy.name, gang=gang)

    def lease_of(self, placed: Placed, default: float) -> float:
        """The lease of a placement republished from what the bucket holds already."""
        _, entry = self.view.store.entry(placed.node)
        return protocol.republished_lease(entry, placed.allocations, default)

    async def _unschedulable(self, item: PodToPlace, outcome: NotPlaced) -> Unschedulable:
        """The answer for a pod that fits nowhere, with the preemption that would make room for it
        where its priority allows one (kube-scheduler appends preemption's verdict to the message).
        What the preemption frees is held for the pod in the reservation bucket first; without
        that hold nobody is evicted (the next attempt plans again)."""
        pending, pod, claims = item.pending, item.pod, item.claims
        message, plan = outcome.message, None
        if not outcome.claim_error:
            try:
                plan = self.view.state.preemption_for(pod, claims, volumes=pending.volumes)
            except Exception:  # noqa: BLE001 - preemption is an extra; the pod's own answer must still go
                self.log.exception("shard %d: pod %s: preemption search failed", self.index, pending.pod.key(),
                                   extra=fields(pod=pending.pod.key()))
        preempt = None
        if isinstance(plan, preemption.PreemptionPlan):
            allocations = _allocations_by_claim(claims, plan.placement.allocations)
            if await self.holds.hold(pending, pod, plan.node, allocations, plan.victims):
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
                allocations = _allocations_by_claim(claims, plan.placement.allocations)
                await self.holds.hold(pending, pod, plan.node, allocations, plan.going)
            message = f"{message} preemption: {plan.explain()}"
        elif isinstance(plan, preemption.NoPreemption):
            message = f"{message} {plan.reason}"
        return Unschedulable(pod=pending.pod, shard=self.index, message=message, failures=outcome.failures,
                             claim_error=outcome.claim_error, preemption=preempt, error=outcome.scheduler_error)


def _allocations_by_claim(claims: list[ResourceClaim], allocations) -> dict:
    return {c.metadata.uid or "": a for c, a in zip(claims, allocations)}

"""Gangs in a shard: the members of a gang (pods naming a PodGroup whose policy is `gang`) wait
in a waiting room until the gang has its minCount, are then placed together by the joint search
(draplane.scheduling.gang_placing), committed on every node involved
(reservation_protocol.commit_gang, undone with abandon_gang if one node's write fails) and
published only once every write held, so the binder never binds part of a gang."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid

from draplane.allocation.errors import AllocationError
from draplane.allocation.gang import GangError, GangUnplaceable
from draplane.api.core import Pod
from draplane.scheduling import preemption
from draplane.scheduling import reservation_protocol as protocol
from draplane.scheduling import reservations as rv
from draplane.scheduling.gang_placing import GangPlaced, gang_preemption_for, place_gang_members
from draplane.scheduling.gangs import GangSpec, GangSpecError, GangWaitingRoom, gang_spec, pod_group_key
from draplane.scheduling.messages import GangCommit, PodRef, Preemption
from draplane.jetstream.reservation_store import StaleRevision
from draplane.scheduling.unschedulable import GANG_UNPLACEABLE, GANG_WAITING
from draplane.structured_logs import fields
from draplane_allocator.answers import Answers
from draplane_allocator.metrics import ShardMetrics
from draplane_allocator.placer import COMMIT_ATTEMPTS, BatchPlacer, PreemptionHolds
from draplane_allocator.records import PodToPlace, claim_reservations, pod_reservation
from draplane_allocator.view import ShardView

# A test failpoint (the way etcd's gofail works): with this value in DRAPLANE_FAILPOINT, a shard
# writes the first node of a gang commit that spans several, then SIGKILLs itself before the
# others, so a test can check what a crash in the middle of that commit leaves behind.
FAILPOINT_ENV = "DRAPLANE_FAILPOINT"
GANG_COMMIT_FAILPOINT = "kill-after-first-gang-node-write"
_TERMINAL_PHASES = ("Succeeded", "Failed")


class GangPlacer:
    def __init__(self, view: ShardView, answers: Answers, holds: PreemptionHolds, placer: BatchPlacer, *,
                 index: int, lease_seconds: float, metrics: ShardMetrics,
                 log: logging.LoggerAdapter | logging.Logger) -> None:
        self.view, self.answers, self.holds, self.placer = view, answers, holds, placer
        self.index, self.lease_seconds, self.m, self.log = index, lease_seconds, metrics, log
        self.waiting = GangWaitingRoom()
        self.bound: dict[str, set[str]] = {}  # PodGroup key -> uids of its bound, running members
        view.pod_listeners.append(self._pod_changed)

    def _pod_changed(self, pod: Pod, deleted: bool) -> None:
        gang = pod_group_key(pod.metadata.namespace or "", pod.spec)
        if gang is None:
            return
        # the bucket holds a gang's pending members too (cluster_feed.published_pod)
        uid = pod.metadata.uid or ""
        alive = not deleted and pod.metadata.deletion_timestamp is None and \
            (pod.status is None or pod.status.phase not in _TERMINAL_PHASES)
        members = self.bound.setdefault(gang, set())
        if alive and pod.spec.node_name:
            members.add(uid)
            self.waiting.leave(uid)
        else:
            members.discard(uid)
            if not alive:
                self.waiting.leave(uid)
            if not members:
                del self.bound[gang]

    async def arrive(self, key: str, arrivals: list[PodToPlace], started: float) -> list[PodToPlace]:
        """The arriving members of gang `key`: wait for the gang's minimum count, then place and
        commit all members together, or answer every member with the gang's one explanation.
        Returns the arrivals to place alone (a PodGroup whose policy is `basic`)."""
        group = self.view.pod_groups.get(key)
        if group is None:
            await self.answers.refuse_all([a.pending for a in arrivals], (
                f"PodGroup {key} not found: the pod names it in spec.schedulingGroup.podGroupName and waits "
                f"until it exists"), label=GANG_WAITING)
            return []
        try:
            spec = gang_spec(group)
        except GangSpecError as exc:
            await self.answers.refuse_all([a.pending for a in arrivals], str(exc), claim_error=True)
            return []
        if spec is None:
            return arrivals
        inputs: dict[str, PodToPlace] = {}
        for arrival in arrivals:
            self.waiting.join(key, arrival.pending.pod.uid, arrival.pending, spec.min_count)
            inputs[arrival.pending.pod.uid] = arrival
        while True:
            bound = len(self.bound.get(key, ()))
            ready = self.waiting.ready(spec, bound)
            if ready is None:
                message = self.waiting.waiting_for(spec, bound)
                self.log.info("shard %d: gang %s: %s", self.index, key, message, extra=fields(gang=key))
                await self.answers.refuse_all([a.pending for a in arrivals], message, label=GANG_WAITING)
                return []
            # Members that arrived before this batch are looked at again: their pods may be gone since.
            earlier = [m for m in ready if m.pod.uid not in inputs]
            read = await asyncio.gather(*(self.view.to_place(m) for m in earlier))
            for member, got in zip(earlier, read):
                if got is None:
                    self.waiting.leave(member.pod.uid)  # gone, bound, or a claim vanished
                else:
                    inputs[member.pod.uid] = got
            if all(got is not None for got in read):
                break
        members = [inputs[m.pod.uid] for m in ready]
        # minCount must fit together; pods beyond it follow when they can (a Job whose parallelism
        # exceeds minCount): if all do not fit, the first ones up to minCount are placed alone
        needed = max(spec.min_count - len(self.bound.get(key, ())), 1)
        await self._place(spec, members, started, needed=needed)
        return []

    async def _place(self, spec: GangSpec, members: list[PodToPlace], started: float,
                     needed: int | None = None) -> None:
        """`needed`: how many of `members` (in arrival order) must fit together at the least; more
        are placed when they all fit."""
        state = self.view.state
        pendings = [m.pending for m in members]
        for member in members:
            # held for it by a preemption whose victims still hold the devices: wait, or Kubernetes
            # would see two claims on one device
            held = state.held_elsewhere(member.claims)
            if held is not None:
                await self.answers.refuse_all(
                    pendings, f"gang {spec.key}: member {member.pending.pod.key()} is {held.message}",
                    label=GANG_WAITING)
                return
        for _ in range(COMMIT_ATTEMPTS):
            try:
                outcome = place_gang_members(state, spec, _pods_and_claims(members), volumes=_member_volumes(members))
            except (GangError, AllocationError) as exc:
                await self.answers.refuse_all(pendings, f"gang {spec.key}: {exc}", claim_error=True)
                return
            except Exception as exc:  # noqa: BLE001 - a bug met by one gang must not hold up the batch
                self.m.errors.inc()
                self.log.exception("shard %d: gang %s: placing it failed", self.index, spec.key,
                                   extra=fields(gang=spec.key))
                await self.answers.refuse_all(pendings, f"draplane shard {self.index}: internal error while "
                                              f"placing gang {spec.key}: {exc!r}", claim_error=True)
                return
            if isinstance(outcome, GangUnplaceable) and needed is not None and needed < len(members):
                first = place_gang_members(state, spec, _pods_and_claims(members[:needed]),
                                           volumes=_member_volumes(members))
                if isinstance(first, GangPlaced):
                    self.log.info("shard %d: gang %s: %d pods do not fit together, the first %d (its minCount "
                                  "less those running) do; the others wait", self.index, spec.key, len(members),
                                  needed, extra=fields(gang=spec.key))
                    later = pendings[needed:]
                    members, pendings, outcome = members[:needed], pendings[:needed], first
                    await self.answers.refuse_all(
                        later, f"gang {spec.key}: waiting for room beside the {needed} members placed now: "
                        f"{len(later) + needed} pods do not fit together", label=GANG_UNPLACEABLE)
            if isinstance(outcome, GangUnplaceable):
                # the core's explanation names the gang, the members and where each fits alone
                message = f"the gang's {len(members)} pods do not fit together: {outcome.message}"
                # room is made for minCount's worth, not for every pod beyond it
                said, preemptions = await self._preempt(spec, members[:needed] if needed else members)
                message += said
                self.log.info("shard %d: %s", self.index, message, extra=fields(gang=spec.key))
                await self.answers.refuse_all(pendings, message, label=GANG_UNPLACEABLE, preemptions=preemptions)
                self.m.unschedulable.inc(len(members))
                return
            expires_at = await self._commit(members, outcome)
            if expires_at is None:
                continue  # a node's entry changed under us: read again, place again
            # the binder binds none of them until each has passed Permit (draplane_binder.gang_permits)
            commit = GangCommit(key=spec.key, commit=uuid.uuid4().hex, members=len(members))
            placements = []
            for member in members:
                placed = outcome.members[member.pending.pod.uid]
                lease = expires_at if placed.new_claims else self.placer.lease_of(placed, expires_at)
                placements.append(self.placer.placement(member, placed, lease, gang=commit))
            await asyncio.gather(*(self.answers.publish(m) for m in placements))
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
        await self.answers.refuse_all(pendings, message, claim_error=True)

    async def _commit(self, members: list[PodToPlace], outcome: GangPlaced) -> float | None:
        """Every member's reservations, one compare-and-set per node involved. The lease's end when
        all held; None when one node lost a race (what was written on the others is taken back
        first)."""
        store, state = self.view.store, self.view.state
        now = time.time()
        expires_at = now + self.lease_seconds
        per_node: dict[str, list] = {}
        for member in members:
            pending = member.pending
            placed = outcome.members[pending.pod.uid]
            per_node.setdefault(placed.node, []).append(
                (claim_reservations(pending, placed, now, expires_at, self.index),
                 pod_reservation(pending, placed.requests, now, expires_at, self.index)))
        revisions = {node: store.entry(node) for node in per_node}
        try:
            step = protocol.commit_gang({node: entry for node, (_, entry) in revisions.items()}, per_node,
                                        self.view.lapse_clock(), state.claim_is_allocated, state.pod_is_gone)
        except rv.ReservationConflict as exc:
            self.m.conflicts_in_view.inc()
            self.log.debug("shard %d: gang %s: %s", self.index, outcome.gang, exc, extra=fields(gang=outcome.gang))
            await self.view.refresh(per_node)
            return None
        nodes = list(step.entries)
        if len(nodes) > 1 and os.environ.get(FAILPOINT_ENV) == GANG_COMMIT_FAILPOINT:
            await store.write(nodes[0], step.entries[nodes[0]], revisions[nodes[0]][0])
            self.log.warning("shard %d: failpoint %s: killing this process after node %s's write, before the "
                             "other %d", self.index, GANG_COMMIT_FAILPOINT, nodes[0], len(nodes) - 1)
            os.kill(os.getpid(), signal.SIGKILL)
        results = await asyncio.gather(
            *(store.write(node, step.entries[node], revisions[node][0]) for node in nodes),
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
            *(store.change(node, lambda entry, node=node: protocol.abandon_gang(entry, step.reserved[node]))
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
        await self.view.refresh(per_node)
        errors = [r for r in failed if not isinstance(r, StaleRevision)]
        if errors:
            raise errors[0]  # NATS failing: the batch is redelivered with backoff
        return None

    async def _preempt(self, spec: GangSpec, members: list[PodToPlace]) -> tuple[str, dict[str, Preemption]]:
        """What preemption says for a gang that does not fit (appended to its message), and per
        member uid what the binder is to evict and nominate. Each member's claims are held on the
        devices its node's victims free first (as for one pod); without every hold nobody is
        evicted. The victims of a node go with the first member placed there."""
        try:
            plan = gang_preemption_for(self.view.state, spec, _pods_and_claims(members),
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
        for member in members:
            pending = member.pending
            placed = plan.placement.members[pending.pod.uid]
            victims = plan.victims_on(placed.node)
            if not await self.holds.hold(pending, member.pod, placed.node, placed.allocations, victims):
                # the undo, beside the step: the members held so far are let go, so the next
                # attempt plans afresh instead of waiting on holds that lead nowhere; nobody is evicted
                for node, expected, pod_uid in held:
                    try:
                        await self.holds.let_go(node, expected, pod_uid)
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


def _pods_and_claims(members: list[PodToPlace]) -> list[tuple]:
    return [(m.pod, m.claims) for m in members]


def _member_volumes(members: list[PodToPlace]) -> dict:
    """Per gang member's pod uid, its PendingPod's volumes (VolumeBinding's PreFilter in the binder)."""
    return {m.pending.pod.uid: m.pending.volumes for m in members if m.pending.volumes is not None}

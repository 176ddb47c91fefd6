"""The reservation protocol (draplane.scheduling.reservation_protocol) driven through crashes, lapses
and redeliveries by a hypothesis state machine.

The world around the protocol is modelled as the services see it, and each protocol step is the
very function the shard and the binder call:

- the bucket: one entry per node, written by compare-and-set on its revision;
- Kubernetes: claims (allocation, reservedFor) and pods (bound or not); a claim is deleted with
  its pod, and the binder hears of it through its watch, later, or never if it is down then;
- N shards, each with a work queue of pending pods (redelivered until acknowledged), a mirror of
  the bucket that lags until it is watched or refreshed, and a claims view that lags Kubernetes by
  up to CLAIM_WATCH_LAG (less than half a lease): it decides both placing and `lapse`;
- the binder, with a work queue of placements handled concurrently (an unacknowledged one is
  delivered again), a set of written claims to confirm, and a pending-pod retry.

A shard places its pods one at a time, or two on one node in one write (`commit`, then
`recommit`: a batch), and a gang's two members together (`commit_gang` on each node involved, one
compare-and-set after the other, `abandon_gang` on the nodes written when one fails; a shard that
crashes between the writes leaves leases to lapse). A gang's members wait in the shard's waiting
room (in memory) until both are there, or the other is bound. A pod of priority 1 that finds no
room may preempt a bound pod of priority 0 (`nominate`: its claim reserved on the victim's
devices, which only a victim's devices may share, under a lease); the binder evicts the victim
(its pods stream is durable, so an eviction outlives a binder crash), and the preemptor, placed
again, waits while any other claim still holds those devices (`SchedulingState.held_elsewhere`).

Placing itself is a small stand-in for the allocator core, which sees what the real one sees: a
claim's devices are its allocation, else its reservation (lapsed or not). Two nodes each have two
GPUs and one device that allows two shares (consumable capacity); adminAccess claims take gpu-0 of
n0 whatever holds it.

One timing assumption is the lease's own: every shard sees a claim's write before the lease it
was written under ends (the binder renews to a full lease right before writing; a write that would
start later than that allows holds again first). A binder paused mid-write for longer than that is the split-brain no lease can
fence, since kube-apiserver cannot check the bucket.

Invariants after every step: no device is given twice in Kubernetes beyond what adminAccess and
the shared device's capacity allow; no device is reserved twice in the bucket, but for a
preemptor's hold on its own victims' devices; a bound pod's claim
is allocated on its node. At the end, under fair scheduling (every component up, every enabled step
taken in turn, time moving on only when nothing else can): every placement ends bound or released
(the bucket holds exactly the allocated claims, confirmed), and every pod still pending has no room
anywhere (no livelock).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import event as hypothesis_event
from hypothesis.errors import InvalidArgument
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from draplane.api.resource import AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult
from draplane.scheduling import reservation_protocol as protocol
from draplane.scheduling import reservations as rv
from fuzzing import LONG_RUN_EXAMPLES

NODES = ("n0", "n1")
GPUS = ("gpu-0", "gpu-1")
SHARED = "shared-0"
SHARES_PER_DEVICE = 2
LEASE = 10.0
# A shard's claim watch is at most this far behind Kubernetes; less than half a lease, the least a
# lease has left when the binder writes (it renews below half).
CLAIM_WATCH_LAG = LEASE / 2 - 1
DRIVER = "gpu.example.com"
MAX_PODS = 7
# A pending pod is sent again by the binder's retry while one is queued (a timeout, or a
# redelivery): at most this many copies of it wait at once, to keep the state small.
MAX_COPIES = 2
KINDS = ("whole", "shared", "admin")


@dataclasses.dataclass
class Claim:
    uid: str
    kind: str
    allocation: list[rv.ReservedDevice] | None = None
    node: str | None = None
    reserved_for: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Pod:
    uid: str
    claim: str
    node: str | None = None
    gang: str | None = None  # the gang of two it belongs to
    priority: int = 0  # 1 may preempt a bound pod of 0


@dataclasses.dataclass
class Message:
    id: int
    body: object
    delivered: bool = False  # to a consumer that has not acknowledged it yet


@dataclasses.dataclass(frozen=True)
class Placement:
    pod: str
    claim: str
    node: str
    devices: tuple[rv.ReservedDevice, ...]


@dataclasses.dataclass
class Staged:
    """A shard's placement between `commit` and `publish`."""

    message: Message
    placement: Placement
    node: str
    revision: int
    entry: rv.NodeReservations | None  # None: already reserved, only publish
    written: bool = False
    batched: list[tuple[Message, Placement]] = dataclasses.field(default_factory=list)  # recommit

    def messages(self) -> list[Message]:
        return [self.message, *(m for m, _ in self.batched)]

    def placements(self) -> list[Placement]:
        return [self.placement, *(p for _, p in self.batched)]


@dataclasses.dataclass
class GangStaged:
    """A shard's gang placement between `commit_gang` and publishing: its nodes' writes, in order,
    one compare-and-set each."""

    gang: str
    gang_placements: list[Placement]
    writes: list[tuple[str, rv.NodeReservations, int]]  # (node, entry, revision)
    reserved: dict[str, tuple]  # node -> what its write reserved (abandon_gang's argument)
    done: list[str] = dataclasses.field(default_factory=list)  # nodes written

    @property
    def written(self) -> bool:
        return len(self.done) == len(self.writes)

    def messages(self) -> list[Message]:
        return []  # the members' messages were acknowledged when they joined the waiting room

    def placements(self) -> list[Placement]:
        return self.gang_placements


@dataclasses.dataclass
class Handler:
    """One of the binder's concurrent handlings of a placement message."""

    message: Message
    placement: Placement
    lease_until: float | None = None  # the claim's lease after hold; None once confirmed
    written: bool = False


# Rules choose among what is enabled by an index (modulo the choices) rather than st.data(), so that
# a failing interleaving prints as plain calls that a regression test can replay.
WHICH = st.integers(0, 5)


def pick(which: int, choices):
    choices = list(choices)
    return choices[which % len(choices)]


def event(what: str) -> None:
    """Counted for --hypothesis-show-statistics; the regression tests replay steps outside hypothesis."""
    try:
        hypothesis_event(what)
    except InvalidArgument:
        pass


def allocation_of(node: str, devices: tuple[rv.ReservedDevice, ...]) -> AllocationResult:
    return AllocationResult(devices=DeviceAllocationResult(results=[
        DeviceRequestAllocationResult(request="r", driver=d.driver, pool=d.pool, device=d.device, share_id=d.share_id,
                                      admin_access=d.admin_access or None) for d in devices]))


class ReservationProtocol(RuleBasedStateMachine):
    # The fix for the leak (a claim deleted while the binder was down): off only to show that the
    # model finds the leak without it (test_the_model_finds_the_leak_without_reconcile).
    reconcile_on_start = True

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.bucket: dict[str, tuple[int, rv.NodeReservations]] = {n: (0, rv.NodeReservations(node=n)) for n in NODES}
        self.claims: dict[str, Claim] = {}
        self.pods: dict[str, Pod] = {}
        self.ids = itertools.count(1)
        self.shards: list[dict] = []
        self.binder_alive = True
        self.placements: list[Message] = []
        self.handlers: list[Handler] = []
        self.to_confirm: dict[str, set[str]] = {}
        self.claim_events: list[Claim] = []  # deleted claims the binder's watch has yet to deliver
        # every change of a claim's allocation, in order: (time, claim, devices or None, node);
        # a shard's claims view is a prefix of it (its watch lags)
        self.claim_log: list[tuple[float, str, list[rv.ReservedDevice] | None, str | None]] = []
        self.placed_ever: set[tuple[str, str]] = set()  # (claim, node) ever committed
        self.nominated: dict[str, set[str]] = {}  # preemptor claim -> the victims' claims it may share with
        self.evictions: list[str] = []  # victim pods the binder is told to evict (a durable stream)

    @initialize(shards=st.integers(2, 3), bound=st.integers(0, 4))
    def start(self, shards: int, bound: int = 0) -> None:
        # `bound` pods of priority 0 already run, each on a whole GPU (confirmed in the bucket):
        # a cluster that starts near full makes room for preemption to be tried
        for k in range(bound):
            node, gpu = NODES[k // len(GPUS)], GPUS[k % len(GPUS)]
            n = next(self.ids)
            devices = [rv.ReservedDevice(DRIVER, node, gpu)]
            claim = Claim(uid=f"c{n}", kind="whole", allocation=devices, node=node, reserved_for={f"p{n}"})
            self.claims[claim.uid] = claim
            self.pods[f"p{n}"] = Pod(uid=f"p{n}", claim=claim.uid, node=node)
            self.record(claim)
            revision, entry = self.bucket[node]
            reservation = rv.Reservation(claim_uid=claim.uid, claim_namespace="ns", claim_name=claim.uid,
                                         pod_uid=f"p{n}", devices=devices, allocation=allocation_of(node, tuple(devices)),
                                         reserved_at=0.0, expires_at=None)
            self.bucket[node] = (revision + 1, rv.add(entry, [reservation]))
        for _ in range(shards):
            self.shards.append({"alive": True, "queue": [], "mirror": dict(self.bucket), "staged": None,
                                "seen": len(self.claim_log), "waiting": {}})

    # --- the world ---------------------------------------------------------------------------------

    def cas(self, node: str, entry: rv.NodeReservations, revision: int) -> bool:
        current, _ = self.bucket[node]
        if current != revision:
            return False
        self.bucket[node] = (current + 1, entry)
        return True

    def change(self, node: str, edit) -> bool:
        """ReservationStore.change: read, edit, compare-and-set; here nothing writes in between."""
        revision, entry = self.bucket[node]
        new = edit(entry)
        return new is not None and self.cas(node, new, revision)

    def shard_of(self, pod_uid: str) -> int:
        pod = self.pods.get(pod_uid)
        key = pod.gang if pod is not None and pod.gang else pod_uid  # a gang's members go to one shard
        return int(key[1:]) % len(self.shards)

    def partner(self, pod: Pod) -> Pod | None:
        return next((p for p in self.pods.values() if p.gang == pod.gang and p.uid != pod.uid), None)

    def pending_pods(self) -> list[Pod]:
        return [p for p in self.pods.values() if p.node is None]

    def copies_queued(self, pod_uid: str) -> int:
        queued = sum(1 for s in self.shards for m in s["queue"] if m.body == pod_uid)
        return queued + sum(1 for m in self.placements if m.body.pod == pod_uid)

    def record(self, claim: Claim, deleted: bool = False) -> None:
        allocation = None if deleted or claim.allocation is None else list(claim.allocation)
        self.claim_log.append((self.now, claim.uid, allocation, claim.node))

    def shard_claims(self, i: int) -> dict[str, tuple[str, list[rv.ReservedDevice]]]:
        """claim -> (node, devices) allocated, as shard i's claim watch has told it so far."""
        allocated: dict[str, tuple[str, list[rv.ReservedDevice]]] = {}
        for _, uid, devices, node in self.claim_log[:self.shards[i]["seen"]]:
            if devices is None:
                allocated.pop(uid, None)
            else:
                allocated[uid] = (node, devices)
        return allocated

    def kube_claims(self) -> dict[str, tuple[str, list[rv.ReservedDevice]]]:
        return {c.uid: (c.node, c.allocation) for c in self.claims.values() if c.allocation is not None}

    def advance(self, seconds: float) -> None:
        """Time moves on; every shard's claim watch keeps within CLAIM_WATCH_LAG of Kubernetes."""
        self.now += seconds
        caught_up = sum(1 for t, *_ in self.claim_log if t <= self.now - CLAIM_WATCH_LAG)
        for s in self.shards:
            s["seen"] = max(s["seen"], caught_up)

    # --- placing (the allocator core's stand-in) ----------------------------------------------------

    def view(self, mirror, allocated) -> dict[str, tuple[str, list[rv.ReservedDevice]]]:
        """claim -> (node, devices) as a shard sees them: the allocation, else the reservation."""
        held = dict(allocated)
        for node, (_, entry) in mirror.items():
            for uid, reservation in entry.claims.items():
                held.setdefault(uid, (node, reservation.devices))
        return held

    def choose(self, claim: Claim, held) -> tuple[str, tuple[rv.ReservedDevice, ...]] | None:
        if claim.uid in held:
            node, devices = held[claim.uid]
            return node, tuple(devices)
        if claim.kind == "admin":
            return "n0", (rv.ReservedDevice(DRIVER, "n0", "gpu-0", admin_access=True),)
        for node in NODES:
            here = [d for uid, (n, devices) in held.items() if n == node and uid != claim.uid for d in devices]
            if claim.kind == "whole":
                taken = {d.device for d in here if d.exclusive}
                free = [g for g in GPUS if g not in taken]
                if free:
                    return node, (rv.ReservedDevice(DRIVER, node, free[0]),)
            else:
                shares = sum(1 for d in here if d.device == SHARED and d.share_id)
                if shares < SHARES_PER_DEVICE:
                    return node, (rv.ReservedDevice(DRIVER, node, SHARED, share_id=f"share-{claim.uid}"),)
        return None

    def held_elsewhere(self, claim: Claim, devices, held) -> bool:
        """SchedulingState.held_elsewhere: the claim's devices, reserved for it, are still held by
        another claim (a victim on its way out)."""
        mine = {d.device for d in devices if d.exclusive}
        node = devices[0].pool if devices else None
        return any(n == node and uid != claim.uid and any(d.exclusive and d.device in mine for d in other)
                   for uid, (n, other) in held.items())

    def placeable(self, claim: Claim) -> bool:
        """Whether Kubernetes' allocations leave room for this claim (the liveness check's oracle)."""
        return self.choose(claim, self.view({}, self.kube_claims())) is not None

    def gang_could_run(self, pod: Pod, mirror=None) -> bool:
        """A gang member pending: whether it could be placed now, with its partner where that is
        pending too (both must fit), alone where its partner is bound, not at all where its
        partner is gone (the gang waits for its minimum count). `mirror`: reservations to count
        as taken besides Kubernetes' allocations."""
        partner = self.partner(pod)
        if partner is None:
            return False
        members = [pod] if partner.node is not None else [pod, partner]
        held = self.view(mirror or {}, self.kube_claims())
        for member in members:
            claim = self.claims[member.claim]
            chosen = self.choose(claim, held)
            if chosen is None:
                return False
            held[claim.uid] = (chosen[0], list(chosen[1]))
        return True

    def could_run(self, pod: Pod) -> bool:
        return self.gang_could_run(pod) if pod.gang else self.placeable(self.claims[pod.claim])

    # --- pods come and go ----------------------------------------------------------------------------

    @precondition(lambda self: len(self.pods) < MAX_PODS)
    @rule(kind=st.sampled_from(KINDS))
    def create_pod(self, kind: str) -> None:
        n = next(self.ids)
        claim = Claim(uid=f"c{n}", kind=kind)
        self.claims[claim.uid] = claim
        self.pods[f"p{n}"] = Pod(uid=f"p{n}", claim=claim.uid)
        if self.binder_alive:
            self.send_pending(f"p{n}")

    @precondition(lambda self: len(self.pods) <= MAX_PODS - 2)
    @rule()
    def create_gang(self) -> None:
        """A PodGroup of two, minCount 2, each member with a whole GPU."""
        gang = f"g{next(self.ids)}"
        for _ in range(2):
            n = next(self.ids)
            claim = Claim(uid=f"c{n}", kind="whole")
            self.claims[claim.uid] = claim
            self.pods[f"p{n}"] = Pod(uid=f"p{n}", claim=claim.uid, gang=gang)
            if self.binder_alive:
                self.send_pending(f"p{n}")

    @precondition(lambda self: len(self.pods) < MAX_PODS)
    @rule()
    def create_urgent_pod(self) -> None:
        """A pod of priority 1 with a whole GPU's claim: it may preempt."""
        n = next(self.ids)
        claim = Claim(uid=f"c{n}", kind="whole")
        self.claims[claim.uid] = claim
        self.pods[f"p{n}"] = Pod(uid=f"p{n}", claim=claim.uid, priority=1)
        if self.binder_alive:
            self.send_pending(f"p{n}")

    def send_pending(self, pod_uid: str) -> None:
        self.shards[self.shard_of(pod_uid)]["queue"].append(Message(next(self.ids), pod_uid))

    # --- what happens meanwhile: one rule, so that it does not crowd out the steps of the work ------

    @rule(what=st.sampled_from(("delete a pod", "the binder retries a pending pod", "a shard's bucket watch",
                                "a shard prunes lapsed leases", "a shard's claim watch")), which=WHICH)
    def meanwhile(self, what: str, which: int) -> None:
        if what == "delete a pod" and self.pods:
            # the user deletes a pod; its claim (a template's) goes with it
            self.delete_pod_named(pick(which, sorted(self.pods)))
        elif what == "the binder retries a pending pod" and self.binder_alive and self.pending_pods():
            pod = pick(which, self.pending_pods())
            if self.copies_queued(pod.uid) < MAX_COPIES:
                self.send_pending(pod.uid)
        elif what == "a shard's bucket watch" and self.live_shards():
            i = pick(which, self.live_shards())
            node = pick(which // 3, NODES)
            self.shards[i]["mirror"][node] = self.bucket[node]
        elif what == "a shard prunes lapsed leases" and self.live_shards():
            # LeasePruner.prune_once: freed, or confirmed where the claim is allocated in its view
            self.lapse_all(pick(which, self.live_shards()))
        elif what == "a shard's claim watch" and self.live_shards():
            self.shards[pick(which, self.live_shards())]["seen"] = len(self.claim_log)

    def delete_pod_named(self, uid: str) -> None:
        event(f"a {'bound' if self.pods[uid].node else 'pending'} pod deleted, binder {'up' if self.binder_alive else 'down'}")
        pod = self.pods.pop(uid)
        claim = self.claims.pop(pod.claim)
        self.record(claim, deleted=True)
        if self.binder_alive and claim.allocation is not None:
            self.claim_events.append(claim)

    @precondition(lambda self: self.binder_alive and self.claim_events)
    @rule()
    def binder_sees_claim_deleted(self) -> None:
        """ReservationKeeper.release: an allocated claim is gone, so is its reservation."""
        claim = self.claim_events.pop(0)
        for node in NODES:
            self.change(node, lambda entry: protocol.release(entry, [claim.uid]))

    # --- faults, and time: one rule, so that together they come as often as one step of the work --

    @rule(fault=st.sampled_from(("tick 1", "tick half a lease", "tick a lease", "crash a shard", "crash the binder",
                                 "redeliver a pending pod", "redeliver a placement")), which=WHICH)
    def fault(self, fault: str, which: int) -> None:
        if fault.startswith("tick"):
            self.advance({"tick 1": 1.0, "tick half a lease": LEASE / 2, "tick a lease": LEASE + 1}[fault])
        elif fault == "crash a shard" and self.live_shards():
            self.crash_shard(pick(which, self.live_shards()))
        elif fault == "crash the binder" and self.binder_alive:
            self.crash_binder()
        elif fault == "redeliver a pending pod":
            delivered = [m for s in self.shards for m in s["queue"] if m.delivered]
            if delivered:
                self.pending_redelivered(pick(which, delivered))
        elif fault == "redeliver a placement":
            delivered = [m for m in self.placements if m.delivered]
            if delivered:
                # its ack wait ran out while a handler still has it: a second handler gets it
                pick(which, delivered).delivered = False

    # --- shards --------------------------------------------------------------------------------------

    def live_shards(self) -> list[int]:
        return [i for i, s in enumerate(self.shards) if s["alive"]]

    def can_place(self, i: int) -> bool:
        s = self.shards[i]
        return s["alive"] and s["staged"] is None and (
            any(not m.delivered for m in s["queue"]) or self.ready_gang(i) is not None)

    def ready_gang(self, i: int) -> str | None:
        """A gang in shard i's waiting room with its minimum count (2): its members waiting, and
        those bound. Members gone or bound meanwhile leave the room."""
        waiting = self.shards[i]["waiting"]
        for gang, members in sorted(waiting.items()):
            members.intersection_update(uid for uid, p in self.pods.items() if p.node is None)
            bound = sum(1 for p in self.pods.values() if p.gang == gang and p.node is not None)
            if members and len(members) + bound >= 2:
                return gang
        return None

    @precondition(lambda self: any(self.can_place(i) for i in range(len(self.shards))))
    @rule(which=WHICH)
    def shard_places_a_batch(self, which: int) -> None:
        """As shard_places, and a second pod that lands on the same node joins the same write."""
        i = pick(which, [i for i in range(len(self.shards)) if self.can_place(i)])
        self.place(i, batch=True)

    @precondition(lambda self: any(self.can_place(i) for i in range(len(self.shards))))
    @rule(which=WHICH)
    def shard_places(self, which: int) -> None:
        """Fetch a pending pod, place it on the shard's view, and stage the commit."""
        i = pick(which, [i for i in range(len(self.shards)) if self.can_place(i)])
        self.place(i)

    def reservations_of(self, i: int, pod: Pod, claim: Claim, node: str, devices, allocated
                        ) -> tuple[list[rv.Reservation], rv.PodReservation]:
        reservation = rv.Reservation(
            claim_uid=claim.uid, claim_namespace="ns", claim_name=claim.uid, pod_uid=pod.uid, devices=list(devices),
            allocation=allocation_of(node, devices), reserved_at=self.now, expires_at=self.now + LEASE, shard=i)
        pod_reservation = rv.PodReservation(pod_uid=pod.uid, pod_namespace="ns", pod_name=pod.uid, requests={},
                                            reserved_at=self.now, expires_at=self.now + LEASE, shard=i)
        # a claim allocated already is not reserved again (placing.py gives its allocation)
        return ([] if claim.uid in allocated else [reservation]), pod_reservation

    def place(self, i: int, batch: bool = False) -> None:
        s = self.shards[i]
        gang = self.ready_gang(i)
        if gang is not None:
            return self.place_gang(i, gang)
        message = next(m for m in s["queue"] if not m.delivered)
        message.delivered = True
        pod = self.pods.get(message.body)
        if pod is None or pod.node is not None:
            s["queue"].remove(message)  # gone, or bound meanwhile: acknowledged, nothing to place
            return
        if pod.gang:
            # into the waiting room (answered "waiting for the gang's minimum count", acknowledged)
            s["waiting"].setdefault(pod.gang, set()).add(pod.uid)
            s["queue"].remove(message)
            return
        claim = self.claims[pod.claim]
        allocated = self.shard_claims(i)
        chosen = self.choose(claim, self.view(s["mirror"], allocated))
        if chosen is None:
            s["queue"].remove(message)  # unschedulable: the binder retries the pod later
            return
        node, devices = chosen
        if self.held_elsewhere(claim, devices, self.view(s["mirror"], allocated)):
            event("a preemptor waits for its victims to go")
            s["queue"].remove(message)  # answered "waiting"; the binder sends it again later
            return
        revision, entry = s["mirror"][node]
        reservations, pod_reservation = self.reservations_of(i, pod, claim, node, devices, allocated)
        try:
            step = protocol.commit(entry, reservations, pod_reservation, self.now, allocated.__contains__)
        except rv.ReservationConflict:
            s["mirror"][node] = self.bucket[node]  # the view missed a reservation: read it, place again
            message.delivered = False
            return
        s["staged"] = staged = Staged(message, Placement(pod.uid, claim.uid, node, devices), node, revision, step.entry)
        if batch and step.entry is not None:
            self.batch_another(i, staged, step, allocated)

    def batch_another(self, i: int, staged: Staged, first: protocol.Commit, allocated) -> None:
        """The next pod of the batch that lands on the same node: `recommit` into the same write."""
        s = self.shards[i]
        mirror = {**s["mirror"], staged.node: (staged.revision, staged.entry)}
        for message in s["queue"]:
            pod = self.pods.get(message.body)
            if message.delivered or pod is None or pod.node is not None or pod.gang or pod.uid == staged.placement.pod:
                continue
            claim = self.claims[pod.claim]
            held = self.view(mirror, allocated)
            chosen = self.choose(claim, held)
            if chosen is None or chosen[0] != staged.node or self.held_elsewhere(claim, chosen[1], held):
                continue
            reservations, pod_reservation = self.reservations_of(i, pod, claim, staged.node, chosen[1], allocated)
            try:
                step = protocol.recommit(first, staged.entry, reservations, pod_reservation)
            except rv.ReservationConflict:
                continue
            if step.entry is None:
                continue
            event("two pods placed in one write (recommit)")
            message.delivered = True
            staged.entry = step.entry
            staged.batched.append((message, Placement(pod.uid, claim.uid, staged.node, chosen[1])))
            return

    def place_gang(self, i: int, gang: str) -> None:
        """The waiting members placed together, each node's part committed with `commit_gang`."""
        s = self.shards[i]
        members = [self.pods[uid] for uid in sorted(s["waiting"][gang])]
        allocated = self.shard_claims(i)
        held = self.view(s["mirror"], allocated)
        per_node: dict[str, list] = {}
        placements = []
        for pod in members:
            claim = self.claims[pod.claim]
            chosen = self.choose(claim, held)
            if chosen is None:
                del s["waiting"][gang]  # unschedulable, all of it: the binder retries the members later
                return
            node, devices = chosen
            held[claim.uid] = (node, list(devices))
            per_node.setdefault(node, []).append(self.reservations_of(i, pod, claim, node, devices, allocated))
            placements.append(Placement(pod.uid, claim.uid, node, devices))
        try:
            step = protocol.commit_gang({node: s["mirror"][node][1] for node in per_node}, per_node, self.now,
                                        allocated.__contains__)
        except rv.ReservationConflict:
            for node in per_node:
                s["mirror"][node] = self.bucket[node]  # read again; placed again at the next step
            return
        writes = [(node, step.entries[node], s["mirror"][node][0]) for node in step.entries]
        event(f"a gang placed on {len(per_node)} node(s)")
        s["staged"] = GangStaged(gang, placements, writes, step.reserved)

    @precondition(lambda self: any(s["alive"] and s["staged"] and not s["staged"].written for s in self.shards))
    @rule(which=WHICH)
    def shard_commits(self, which: int) -> None:
        """One compare-and-set of the staged entry; a lost race reads the entry and places again."""
        i = pick(which, [i for i, s in enumerate(self.shards)
                      if s["alive"] and s["staged"] and not s["staged"].written])
        self.commit(i)

    def commit(self, i: int) -> None:
        s = self.shards[i]
        if isinstance(s["staged"], GangStaged):
            return self.commit_gang_node(i)
        staged: Staged = s["staged"]
        if staged.entry is None:
            event("a placement published again (already reserved)")
            staged.written = True  # already reserved there: nothing to write, publish again
            return
        if self.cas(staged.node, staged.entry, staged.revision):
            s["mirror"][staged.node] = self.bucket[staged.node]
            staged.written = True
            self.placed_ever.update((p.claim, staged.node) for p in staged.placements())
        else:
            s["mirror"][staged.node] = self.bucket[staged.node]
            for message in staged.messages():
                message.delivered = False
            s["staged"] = None

    def commit_gang_node(self, i: int) -> None:
        """The next node of a gang's commit; a lost race takes back the nodes written (abandon_gang)."""
        s = self.shards[i]
        staged: GangStaged = s["staged"]
        node, entry, revision = staged.writes[len(staged.done)]
        if self.cas(node, entry, revision):
            s["mirror"][node] = self.bucket[node]
            staged.done.append(node)
            self.placed_ever.update((p.claim, p.node) for p in staged.gang_placements if p.node == node)
            return
        event(f"a gang's commit lost a race after {len(staged.done)} node(s): taken back")
        for written in staged.done:
            self.change(written, lambda e, n=written: protocol.abandon_gang(e, staged.reserved[n]))
        for n in NODES:
            s["mirror"][n] = self.bucket[n]
        s["staged"] = None  # the members stay in the waiting room: placed again

    @precondition(lambda self: any(s["alive"] and s["staged"] and s["staged"].written for s in self.shards))
    @rule(which=WHICH)
    def shard_publishes(self, which: int) -> None:
        """Publish the placement for the binder, then acknowledge the pending pod."""
        i = pick(which, [i for i, s in enumerate(self.shards)
                      if s["alive"] and s["staged"] and s["staged"].written])
        self.publish(i)

    def publish(self, i: int) -> None:
        s = self.shards[i]
        staged = s["staged"]
        for placement in staged.placements():
            self.placements.append(Message(next(self.ids), placement))
        for message in staged.messages():
            s["queue"].remove(message)
        if isinstance(staged, GangStaged):
            s["waiting"].pop(staged.gang, None)
        s["staged"] = None

    def lapse_all(self, i: int) -> None:
        allocated = self.shard_claims(i)
        for node in NODES:
            if protocol.has_lapsed(self.bucket[node][1], self.now):
                step = protocol.lapse(self.bucket[node][1], self.now, allocated.__contains__)
                event(f"lapse: {'released' if step.released else ''} {'confirmed' if step.confirmed else ''}")
                self.change(node, lambda entry: protocol.lapse(entry, self.now, allocated.__contains__).entry)

    def crash_shard(self, i: int) -> None:
        s = self.shards[i]
        s.update(alive=False, staged=None, mirror={}, waiting={})
        for m in s["queue"]:
            m.delivered = False  # unacknowledged: delivered again to the next consumer

    @precondition(lambda self: len(self.live_shards()) < len(self.shards))
    @rule(which=WHICH)
    def restart_shard(self, which: int) -> None:
        i = pick(which, [i for i, s in enumerate(self.shards) if not s["alive"]])
        self.shards[i].update(alive=True, mirror=dict(self.bucket), seen=len(self.claim_log))  # once synced

    def pending_redelivered(self, message: Message) -> None:
        """A pending pod's ack wait ran out while its shard still works on it: delivered again."""
        for s in self.shards:
            if s["staged"] is not None and message in s["staged"].messages():
                # the shard goes on with its copy, the next fetch gets another: model both as a copy
                copy = Message(next(self.ids), message.body)
                s["queue"].append(copy)
                return
        message.delivered = False

    # --- preemption ----------------------------------------------------------------------------------

    def preemptors(self, i: int) -> list[Message]:
        s = self.shards[i]
        if not s["alive"] or s["staged"] is not None:
            return []
        found = []
        for message in s["queue"]:
            pod = self.pods.get(message.body)
            if message.delivered or pod is None or pod.node is not None or pod.priority < 1 or pod.gang:
                continue
            if self.choose(self.claims[pod.claim], self.view(s["mirror"], self.shard_claims(i))) is None:
                found.append(message)
        return found

    def victims(self, i: int, preemptor: Pod) -> list[tuple[Pod, str, list[rv.ReservedDevice]]]:
        """Bound pods of lower priority with a whole GPU, as shard i's claim view has them."""
        allocated = self.shard_claims(i)
        return [(p, *allocated[p.claim]) for p in sorted(self.pods.values(), key=lambda p: p.uid)
                if p.node is not None and p.priority < preemptor.priority and not p.gang
                and p.claim in allocated and any(d.exclusive for d in allocated[p.claim][1])]

    @precondition(lambda self: any(self.preemptors(i) for i in range(len(self.shards))))
    @rule(which=WHICH)
    def shard_preempts(self, which: int) -> None:
        """A pod with no room: hold a victim's devices for it (`nominate`, one compare-and-set) and
        tell the binder to evict the victim; the pod is answered and placed again later."""
        i = pick(which, [i for i in range(len(self.shards)) if self.preemptors(i)])
        self.preempt(i, which)

    def preempt(self, i: int, which: int = 0) -> None:
        s = self.shards[i]
        message = self.preemptors(i)[0]
        pod = self.pods[message.body]
        claim = self.claims[pod.claim]
        victims = self.victims(i, pod)
        if not victims:
            s["queue"].remove(message)  # unschedulable, no victim helps: the binder retries it later
            return
        victim, node, victim_devices = pick(which, victims)
        devices = tuple(d for d in victim_devices if d.exclusive)[:1]
        allocated = self.shard_claims(i)
        revision, entry = s["mirror"][node]
        reservations, pod_reservation = self.reservations_of(i, pod, claim, node, devices, allocated)
        try:
            step = protocol.nominate(entry, reservations, pod_reservation, [victim.claim], self.now,
                                     allocated.__contains__)
        except rv.ReservationConflict:
            s["mirror"][node] = self.bucket[node]  # the view missed a reservation: read it
            return
        if step.entry is not None and not self.cas(node, step.entry, revision):
            s["mirror"][node] = self.bucket[node]
            return
        s["mirror"][node] = self.bucket[node]
        event("a victim's devices held for a preemptor (nominate)")
        self.nominated.setdefault(claim.uid, set()).add(victim.claim)
        self.evictions.append(victim.uid)
        message.delivered = False  # answered "nominated"; the binder sends it again (modelled: at once)

    @precondition(lambda self: self.binder_alive and self.evictions)
    @rule()
    def binder_evicts(self) -> None:
        """The binder evicts a victim: its pod goes, and its claim with it."""
        uid = self.evictions.pop(0)
        if uid in self.pods:
            self.delete_pod_named(uid)

    # --- the binder ----------------------------------------------------------------------------------

    @precondition(lambda self: self.binder_alive and any(not m.delivered for m in self.placements))
    @rule()
    def binder_holds(self) -> None:
        """Fetch a placement, hold its reservation (renewing the lease), and decide."""
        message = next(m for m in self.placements if not m.delivered)
        message.delivered = True
        self.hold(Handler(message, message.body))

    def hold(self, handler: Handler) -> None:
        placement = handler.placement
        pod = self.pods.get(placement.pod)
        if pod is None:
            return self.abandon(handler, pod, "the pod is gone")
        if pod.node is not None and pod.node != placement.node:
            return self.abandon(handler, pod, "the pod is bound elsewhere")
        revision, entry = self.bucket[placement.node]
        step = protocol.hold(entry, {placement.claim: list(placement.devices)}, [placement.pod], self.now, LEASE)
        if step.entry is not None:
            assert self.cas(placement.node, step.entry, revision)
        plan = protocol.plan_write([placement.claim], placement.pod, step.held, node=placement.node,
                                   pod_bound_here=pod.node == placement.node)
        if isinstance(plan, protocol.Abandon):
            return self.abandon(handler, pod, "its pod reservation lapsed")
        claim = self.claims.get(placement.claim)
        if placement.claim in plan.verify:
            if claim is None or not rv.same_devices(claim.allocation or [], placement.devices):
                return self.abandon(handler, pod, "its claim reservation is no longer held")
            handler.lease_until = None  # allocated already: nothing left to lapse
        else:
            held = self.bucket[placement.node][1].claims[placement.claim]
            handler.lease_until = held.expires_at
        if handler not in self.handlers:
            self.handlers.append(handler)

    def abandon(self, handler: Handler, pod: Pod | None, why: str) -> None:
        event(f"placement abandoned: {why}")
        placement = handler.placement
        claim = self.claims.get(placement.claim)
        give_back = protocol.what_to_abandon(
            {placement.claim: list(placement.devices)},
            lambda uid: claim is not None and claim.allocation is not None
            and rv.same_devices(claim.allocation, placement.devices),
            placement.pod, pod_bound_here=pod is not None and pod.node == placement.node)
        if not give_back.empty:
            self.change(placement.node, lambda entry: protocol.abandon(entry, give_back.claims, give_back.pods))
        self.ack(handler)

    def ack(self, handler: Handler) -> None:
        if handler.message in self.placements:
            self.placements.remove(handler.message)
        if handler in self.handlers:
            self.handlers.remove(handler)

    @precondition(lambda self: self.binder_alive and any(not h.written for h in self.handlers))
    @rule(which=WHICH)
    def binder_writes(self, which: int) -> None:
        """Claim status (allocation + reservedFor), then the binding; undone if either fails."""
        self.write(pick(which, [h for h in self.handlers if not h.written]))

    def write(self, handler: Handler) -> None:
        placement = handler.placement
        if handler.lease_until is not None and handler.lease_until - self.now <= CLAIM_WATCH_LAG:
            # The timing assumption (module docstring): every shard sees a write before the lease
            # it was made under ends. The binder renews below half a lease right before writing;
            # a handler that waited since, here, holds again first.
            return self.hold(handler)
        claim = self.claims.get(placement.claim)
        pod = self.pods.get(placement.pod)
        if claim is None or pod is None:
            return self.abandon(handler, pod, "the pod is gone")  # nothing was written (one claim per pod)
        if claim.allocation is not None and not rv.same_devices(claim.allocation, placement.devices):
            return self.abandon(handler, pod, "its claim is allocated elsewhere")
        claim.allocation, claim.node = list(placement.devices), placement.node
        self.record(claim)
        claim.reserved_for.add(pod.uid)
        if pod.node is None:
            pod.node = placement.node
            event("a pod bound")
        handler.written = True
        self.to_confirm.setdefault(placement.node, set()).add(claim.uid)

    @precondition(lambda self: self.binder_alive and self.to_confirm)
    @rule()
    def binder_confirms(self) -> None:
        batch, self.to_confirm = self.to_confirm, {}
        for node, uids in batch.items():
            self.change(node, lambda entry: protocol.confirm(entry, uids))

    @precondition(lambda self: self.binder_alive and any(h.written for h in self.handlers))
    @rule(which=WHICH)
    def binder_acks(self, which: int) -> None:
        self.ack(pick(which, [h for h in self.handlers if h.written]))

    def crash_binder(self) -> None:
        confirmed = sum(1 for _, e in self.bucket.values() for r in e.claims.values() if r.confirmed)
        event(f"binder crashed with {min(confirmed, 2)}{'+' if confirmed > 2 else ''} confirmed reservations")
        self.binder_alive = False
        self.handlers.clear()
        self.to_confirm.clear()  # the confirm loop's batch: lost, the leases lapse into confirmations
        self.claim_events.clear()  # events not yet handled: a re-list shows only what exists
        for m in self.placements:
            m.delivered = False

    @precondition(lambda self: not self.binder_alive)
    @rule()
    def restart_binder(self) -> None:
        self.restart_the_binder()

    def restart_the_binder(self) -> None:
        self.binder_alive = True
        if self.reconcile_on_start:
            self.reconcile()
        for pod in self.pending_pods():
            if self.copies_queued(pod.uid) < MAX_COPIES:
                self.send_pending(pod.uid)

    def reconcile(self) -> None:
        """ReservationKeeper.reconcile_reservations, with Kubernetes as its live read."""
        for node in NODES:
            def allocated(reservation: rv.Reservation):
                claim = self.claims.get(reservation.claim_uid)
                return None if claim is None or claim.node != node else claim.allocation

            stale = protocol.stale_confirmations(self.bucket[node][1], allocated)
            if stale:
                event("reconcile released a confirmed reservation")
                self.change(node, lambda entry: protocol.abandon(entry, stale))

    # --- invariants ----------------------------------------------------------------------------------

    @invariant()
    def no_device_given_twice(self) -> None:
        holders: dict[tuple[str, str], list[tuple[str, rv.ReservedDevice]]] = {}
        for claim in self.claims.values():
            for d in claim.allocation or ():
                holders.setdefault((d.pool, d.device), []).append((claim.uid, d))
        for (pool, device), held in holders.items():
            exclusive = [uid for uid, d in held if d.exclusive]
            shares = [uid for uid, d in held if d.share_id]
            assert len(exclusive) <= 1, f"{pool}/{device} allocated whole to {exclusive}"
            assert not (exclusive and shares), f"{pool}/{device} whole to {exclusive} and shared by {shares}"
            assert len(shares) <= SHARES_PER_DEVICE, f"{pool}/{device} shared by {shares}"

    @invariant()
    def no_device_reserved_twice(self) -> None:
        for node, (_, entry) in self.bucket.items():
            holders: dict[str, list[str]] = {}
            for uid, r in entry.claims.items():
                for d in r.devices:
                    if d.exclusive:
                        holders.setdefault(d.device, []).append(uid)
            for device, uids in holders.items():
                if len(uids) == 1:
                    continue
                # a preemptor's hold may share its victims' devices, and nothing else may
                preemptors = [u for u in uids if u in self.nominated]
                assert len(preemptors) == 1 and set(uids) - set(preemptors) <= self.nominated[preemptors[0]], \
                    f"node {node}: {device} reserved to {uids}"

    @invariant()
    def a_bound_pod_has_its_claim_there(self) -> None:
        for pod in self.pods.values():
            if pod.node is not None:
                claim = self.claims[pod.claim]
                assert claim.allocation is not None and claim.node == pod.node, f"pod {pod.uid} on {pod.node}: {claim}"

    # --- the end: fair scheduling --------------------------------------------------------------------

    def fair_step(self) -> bool:
        """Every enabled step once, in a fixed order; False when none was."""
        progressed = False
        for i, s in enumerate(self.shards):
            s["seen"] = len(self.claim_log)
            for node in NODES:
                if s["mirror"].get(node) != self.bucket[node]:
                    s["mirror"][node] = self.bucket[node]
            if s["staged"] is not None:
                if not s["staged"].written:
                    self.commit(i)
                if s["staged"] is not None and s["staged"].written:
                    self.publish(i)
                progressed = True
            elif self.can_place(i):
                self.place(i)
                progressed = True
        while self.evictions:
            self.binder_evicts()
            progressed = True
        while self.claim_events:
            self.binder_sees_claim_deleted()
            progressed = True
        for handler in list(self.handlers):
            if handler.written:
                self.ack(handler)
            else:
                self.write(handler)
            progressed = True
        if any(not m.delivered for m in self.placements):
            self.binder_holds()
            progressed = True
        if self.to_confirm:
            self.binder_confirms()
            progressed = True
        if not progressed:
            # the binder's retry: pending pods with nothing queued are sent again
            for pod in self.pending_pods():
                if pod.gang:
                    room = self.gang_could_run(pod, self.bucket) and not any(pod.uid in s["waiting"].get(pod.gang, ())
                                                                for s in self.shards)
                else:
                    room = self.choose(self.claims[pod.claim], self.view(self.bucket, self.kube_claims()))
                if self.copies_queued(pod.uid) == 0 and room:
                    self.send_pending(pod.uid)
                    progressed = True
        return progressed

    def settle(self) -> None:
        for s in self.shards:
            if not s["alive"]:
                s.update(alive=True, mirror=dict(self.bucket))
            s["seen"] = len(self.claim_log)
            for m in s["queue"]:
                m.delivered = s["staged"] is not None and m in s["staged"].messages()
        if not self.binder_alive:
            self.restart_the_binder()
        for _ in range(400):
            if self.fair_step():
                continue
            leased = any(r.expires_at is not None for _, e in self.bucket.values() for r in e.claims.values())
            if not leased:
                return
            self.advance(LEASE + 1)
            self.lapse_all(0)
        raise AssertionError("no quiescence after 400 fair rounds (livelock)")

    def teardown(self) -> None:
        if not self.shards:
            return
        self.settle()
        reserved = {uid: (node, r) for node, (_, e) in self.bucket.items() for uid, r in e.claims.items()}
        for uid, (node, reservation) in reserved.items():
            claim = self.claims.get(uid)
            assert reservation.confirmed, f"claim {uid}: still leased on {node} at the end"
            assert claim is not None, f"claim {uid} is gone but its reservation on {node} stays (leaked)"
            assert claim.node == node and rv.same_devices(claim.allocation or [], reservation.devices), \
                f"claim {uid}: reserved on {node} as {reservation.devices}, allocated {claim.node} {claim.allocation}"
        for claim in self.claims.values():
            if claim.allocation is not None:
                assert claim.uid in reserved, f"claim {claim.uid} allocated without its reservation"
        for pod in self.pending_pods():
            claim = self.claims[pod.claim]
            assert not self.could_run(pod), \
                f"pod {pod.uid} ({'gang ' + pod.gang if pod.gang else claim.kind}) is placeable but still pending"


ReservationProtocol.TestCase.settings = settings(
    max_examples=LONG_RUN_EXAMPLES or 100,
    stateful_step_count=100,
    deadline=None,
    derandomize=LONG_RUN_EXAMPLES is None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_reservation_protocol = ReservationProtocol.TestCase


class WithoutReconcile(ReservationProtocol):
    reconcile_on_start = False


def test_the_model_finds_the_leak_without_reconcile():
    """A claim deleted while the binder is down keeps its confirmed reservation for ever unless the
    binder reconciles when it starts (the interleaving, shrunk, is in the next test)."""
    machine = WithoutReconcile()
    replay_binder_down_when_claim_deleted(machine)
    with pytest.raises(AssertionError, match="leaked"):
        machine.teardown()


def replay_binder_down_when_claim_deleted(machine: ReservationProtocol) -> None:
    machine.start(shards=2)
    machine.create_pod(kind="whole")
    machine.place(machine.shard_of("p1"))
    machine.commit(machine.shard_of("p1"))
    machine.publish(machine.shard_of("p1"))
    machine.binder_holds()
    machine.write(machine.handlers[0])
    machine.binder_confirms()
    machine.ack(machine.handlers[0])
    machine.crash_binder()
    machine.delete_pod_named("p1")
    machine.restart_binder()


def test_the_model_catches_a_lapse_that_frees_a_lease_whatever_kubernetes_says(monkeypatch):
    """The model can fail: with `lapse` told that no claim is allocated, a lease that ran out after
    the binder wrote the claim and died before confirming is freed, and the claim ends allocated
    without its reservation. The interleaving hypothesis found for this mutant (300 examples),
    shrunk by it, replayed."""
    real_lapse = protocol.lapse
    monkeypatch.setattr(protocol, "lapse", lambda entry, now, allocated, gone=None: real_lapse(entry, now, lambda uid: False, gone))
    machine = ReservationProtocol()
    replay_binder_dies_after_writing(machine)
    with pytest.raises(AssertionError, match="allocated without its reservation"):
        machine.teardown()


def test_a_lease_that_lapses_after_the_claim_was_written_is_confirmed():
    machine = ReservationProtocol()
    replay_binder_dies_after_writing(machine)
    machine.teardown()


def replay_binder_dies_after_writing(machine: ReservationProtocol) -> None:
    machine.start(shards=2)
    for _ in range(7):
        machine.create_pod(kind="whole")
    machine.shard_places(which=0)
    machine.fault(fault="tick 1", which=0)
    machine.shard_commits(which=0)
    machine.fault(fault="crash the binder", which=0)
    machine.fault(fault="tick 1", which=0)
    machine.restart_binder()
    machine.shard_publishes(which=0)
    machine.fault(fault="crash the binder", which=0)
    machine.shard_places(which=0)
    machine.restart_binder()
    machine.shard_commits(which=0)
    machine.binder_holds()
    machine.shard_publishes(which=0)
    machine.binder_writes(which=0)
    machine.binder_holds()
    machine.binder_writes(which=0)
    machine.shard_places(which=0)
    machine.fault(fault="tick 1", which=0)
    machine.binder_acks(which=0)
    machine.fault(fault="crash the binder", which=0)
    machine.restart_binder()
    machine.shard_commits(which=0)
    machine.binder_holds()


def test_a_claim_deleted_while_the_binder_is_down_is_released_at_its_start():
    machine = ReservationProtocol()
    replay_binder_down_when_claim_deleted(machine)
    assert not machine.bucket["n0"][1].claims
    machine.teardown()



# --- the steps one by one ----------------------------------------------------------------------------


def reservation(claim: str, device: str, *, expires: float | None, node: str = "n0") -> rv.Reservation:
    devices = (rv.ReservedDevice(DRIVER, node, device),)
    return rv.Reservation(claim_uid=claim, claim_namespace="ns", claim_name=claim, pod_uid=f"pod-{claim}",
                          devices=list(devices), allocation=allocation_of(node, devices), reserved_at=0.0,
                          expires_at=expires)


def test_commit_prunes_a_lapsed_lease_and_gives_its_device_in_the_same_write():
    entry = rv.add(rv.NodeReservations(node="n0"), [reservation("old", "gpu-0", expires=5.0)])
    step = protocol.commit(entry, [reservation("new", "gpu-0", expires=40.0)], None, 10.0, lambda uid: False)
    assert [r.claim_uid for r in step.lapsed.released] == ["old"]
    assert set(step.entry.claims) == {"new"}
    # the same placement again (a redelivery): nothing to write
    again = protocol.commit(step.entry, [reservation("new", "gpu-0", expires=40.0)], None, 11.0, lambda uid: False)
    assert again.entry is None


def test_commit_keeps_a_lapsed_lease_whose_claim_is_allocated_and_conflicts_on_its_device():
    entry = rv.add(rv.NodeReservations(node="n0"), [reservation("written", "gpu-0", expires=5.0)])
    with pytest.raises(rv.ReservationConflict):
        protocol.commit(entry, [reservation("new", "gpu-0", expires=40.0)], None, 10.0, lambda uid: uid == "written")
    lapsed = protocol.lapse(entry, 10.0, lambda uid: uid == "written")
    assert lapsed.confirmed == ["written"] and lapsed.entry.claims["written"].confirmed


def test_hold_renews_only_leases_with_less_than_half_left_and_names_what_is_still_held():
    entry = rv.add(rv.NodeReservations(node="n0"), [reservation("a", "gpu-0", expires=18.0),
                                                     reservation("b", "gpu-1", expires=12.0)])
    mine = {"a": entry.claims["a"].devices, "b": entry.claims["b"].devices,
            "gone": [rv.ReservedDevice(DRIVER, "n0", "gpu-9")]}
    step = protocol.hold(entry, mine, [], now=10.0, lease_seconds=10.0)
    assert step.held == {"a", "b"}
    assert step.entry.claims["a"].expires_at == 18.0  # 8 s left of 10: not renewed
    assert step.entry.claims["b"].expires_at == 20.0
    assert protocol.hold(entry, {"a": mine["a"]}, [], now=10.0, lease_seconds=10.0).entry is None


def test_plan_write_abandons_a_pod_whose_cpu_and_memory_lapsed_unless_it_is_bound_there():
    assert isinstance(protocol.plan_write(["c"], "p", {"c"}, pod_bound_here=False, node="n0"), protocol.Abandon)
    assert protocol.plan_write(["c"], "p", {"c"}, pod_bound_here=True, node="n0") == protocol.Write()
    assert protocol.plan_write(["c", "d"], "p", {"p", "c"}, pod_bound_here=False, node="n0") == protocol.Write(("d",))


def test_abandon_gives_back_only_what_still_holds_the_placements_devices():
    entry = rv.add(rv.NodeReservations(node="n0"), [reservation("a", "gpu-0", expires=30.0),
                                                     reservation("b", "gpu-1", expires=30.0)])
    give_back = protocol.what_to_abandon(
        {"a": entry.claims["a"].devices, "b": [rv.ReservedDevice(DRIVER, "n0", "gpu-0")]},
        lambda uid: False, "p", pod_bound_here=False)
    assert give_back.pods == ["p"]
    # b is reserved again since, with other devices: it keeps them
    assert set(protocol.abandon(entry, give_back.claims, give_back.pods).claims) == {"b"}
    written = protocol.what_to_abandon({"a": entry.claims["a"].devices}, lambda uid: True, "p", pod_bound_here=True)
    assert written.empty


def test_stale_confirmations_are_confirmed_reservations_whose_claim_is_gone_or_allocated_otherwise():
    entry = rv.add(rv.NodeReservations(node="n0"), [
        reservation("gone", "gpu-0", expires=None), reservation("moved", "gpu-1", expires=None),
        reservation("fine", "gpu-2", expires=None), reservation("leased", "gpu-3", expires=30.0)])
    allocated = {"moved": [rv.ReservedDevice(DRIVER, "n0", "gpu-7")], "fine": entry.claims["fine"].devices}
    stale = protocol.stale_confirmations(entry, lambda r: allocated.get(r.claim_uid))
    assert set(stale) == {"gone", "moved"}
    assert set(protocol.abandon(entry, stale).claims) == {"fine", "leased"}


def test_a_placement_sent_again_keeps_the_lease_its_claims_have():
    entry = rv.add(rv.NodeReservations(node="n0"), [reservation("a", "gpu-0", expires=25.0),
                                                     reservation("b", "gpu-1", expires=15.0),
                                                     reservation("c", "gpu-2", expires=None)])
    assert protocol.republished_lease(entry, ["a", "b", "c"], 40.0) == 15.0
    assert protocol.republished_lease(entry, ["c", "elsewhere"], 40.0) == 40.0


def pod_reservation(uid: str, *, expires: float = 40.0) -> rv.PodReservation:
    return rv.PodReservation(pod_uid=uid, pod_namespace="ns", pod_name=uid, requests={"cpu": 1000}, reserved_at=0.0,
                             expires_at=expires)


def test_commit_gang_reserves_every_member_on_every_node_and_its_undo_takes_back_only_the_gangs():
    n0 = rv.add(rv.NodeReservations(node="n0"), [reservation("other", "gpu-1", expires=40.0)])
    n1 = rv.NodeReservations(node="n1")
    members = {
        "n0": [([reservation("a", "gpu-0", expires=40.0)], pod_reservation("pa"))],
        "n1": [([reservation("b", "gpu-0", expires=40.0, node="n1")], pod_reservation("pb")),
               ([reservation("c", "gpu-1", expires=40.0, node="n1")], pod_reservation("pc"))],
    }
    step = protocol.commit_gang({"n0": n0, "n1": n1}, members, 10.0, lambda uid: False)
    assert set(step.entries) == {"n0", "n1"}
    assert set(step.entries["n0"].claims) == {"other", "a"} and set(step.entries["n1"].claims) == {"b", "c"}
    assert set(step.entries["n1"].pods) == {"pb", "pc"}
    assert step.reserved["n1"][1] == ["pb", "pc"] and set(step.reserved["n1"][0]) == {"b", "c"}
    # n1's write failed: n0's is taken back, and only the gang's part of it
    undone = protocol.abandon_gang(step.entries["n0"], step.reserved["n0"])
    assert set(undone.claims) == {"other"} and undone.pods == {}
    # what n0's entry holds again after the undo is written: undoing twice finds nothing
    assert protocol.abandon_gang(undone, step.reserved["n0"]) is None


def test_commit_gang_writes_nothing_anywhere_when_one_members_device_is_taken():
    n1 = rv.add(rv.NodeReservations(node="n1"), [reservation("someone", "gpu-0", expires=40.0, node="n1")])
    members = {
        "n0": [([reservation("a", "gpu-0", expires=40.0)], pod_reservation("pa"))],
        "n1": [([reservation("b", "gpu-0", expires=40.0, node="n1")], pod_reservation("pb"))],
    }
    with pytest.raises(rv.ReservationConflict, match="gpu-0 on node n1"):
        protocol.commit_gang({"n0": rv.NodeReservations(node="n0"), "n1": n1}, members, 10.0, lambda uid: False)


def test_commit_gang_leaves_out_nodes_where_the_gang_is_reserved_already_and_reserves_a_shared_claim_once():
    first = protocol.commit_gang(
        {"n0": rv.NodeReservations(node="n0")},
        {"n0": [([reservation("shared", "gpu-0", expires=40.0)], pod_reservation("pa")),
                ([reservation("shared", "gpu-0", expires=40.0)], pod_reservation("pb"))]},
        10.0, lambda uid: False)
    assert list(first.entries["n0"].claims) == ["shared"] and set(first.entries["n0"].pods) == {"pa", "pb"}
    # a redelivery after a crash that wrote n0: nothing new on n0, only n1 is written
    again = protocol.commit_gang(
        {"n0": first.entries["n0"], "n1": rv.NodeReservations(node="n1")},
        {"n0": [([reservation("shared", "gpu-0", expires=40.0)], pod_reservation("pa"))],
         "n1": [([reservation("c", "gpu-0", expires=40.0, node="n1")], pod_reservation("pc"))]},
        11.0, lambda uid: False)
    assert set(again.entries) == {"n1"}


def test_a_commit_drops_the_reservation_of_a_pod_that_is_gone_and_its_host_port_with_it():
    import time

    now = time.time()

    def pod(uid: str) -> rv.PodReservation:
        return rv.PodReservation(pod_uid=uid, pod_namespace="ns", pod_name=uid, requests={"cpu": 1000},
                                 reserved_at=now, expires_at=now + 30, host_ports=[rv.HostPort("TCP", "0.0.0.0", 8080)])

    entry = rv.add(rv.NodeReservations(node="n"), [], pod("web-0"))
    with pytest.raises(rv.ReservationConflict):
        protocol.commit(entry, [], pod("web-1"), now, lambda uid: False)  # web-0 still holds 8080
    step = protocol.commit(entry, [], pod("web-1"), now, lambda uid: False, lambda uid: uid == "web-0")
    assert set(step.entry.pods) == {"web-1"} and step.lapsed.pods_dropped == 1


def test_a_gang_commit_that_loses_a_race_on_its_second_node_takes_back_the_first():
    """commit_gang's writes are one compare-and-set per node: when the second loses a race, what the
    first wrote is taken back (abandon_gang) before anything is published, and the gang is placed
    again. The model's random runs reach this in under 1 % of examples; replayed here."""
    machine = ReservationProtocol()
    machine.start(shards=2)
    machine.create_pod(kind="whole")  # takes gpu-0 of n0
    lone = machine.shard_of("p1")
    machine.place(lone)
    machine.commit(lone)
    machine.publish(lone)
    machine.create_gang()
    members = sorted(uid for uid, pod in machine.pods.items() if pod.gang)
    shard = machine.shard_of(members[0])
    machine.shards[shard]["mirror"]["n0"] = machine.bucket["n0"]  # its bucket watch
    machine.place(shard)
    machine.place(shard)  # both members in the waiting room
    machine.place(shard)  # placed together: gpu-1 of n0 and gpu-0 of n1
    staged = machine.shards[shard]["staged"]
    assert [node for node, _, _ in staged.writes] == ["n0", "n1"]
    machine.commit(shard)  # n0 written
    assert len(machine.bucket["n0"][1].claims) == 2
    machine.cas("n1", machine.bucket["n1"][1], machine.bucket["n1"][0])  # another write to n1 lands first
    machine.commit(shard)  # n1 loses the race: n0's part is taken back
    assert machine.shards[shard]["staged"] is None and not machine.placements[1:]
    assert set(machine.bucket["n0"][1].claims) == {machine.pods["p1"].claim}
    assert machine.shards[shard]["waiting"] == {machine.pods[members[0]].gang: set(members)}
    machine.teardown()  # placed again, bound, every reservation confirmed
    assert all(machine.pods[uid].node for uid in members)


# --- preemption: nominate, and the preemptor's wait ---------------------------------------------------


class PlacesBeforeTheVictimGoes(ReservationProtocol):
    """A mutant whose placing does not wait for a preemptor's victims (SchedulingState.held_elsewhere)."""

    def held_elsewhere(self, claim, devices, held) -> bool:
        return False


def replay_preemptor_placed_again_at_once(machine: ReservationProtocol) -> str:
    """Four pods of priority 0 fill both nodes' GPUs; a pod of priority 1 comes, its shard holds
    the first victim's GPU for it (nominate) and places it again before the binder has evicted
    anyone. Returns the preemptor's pod uid."""
    machine.start(shards=2, bound=4)
    machine.create_urgent_pod()
    (preemptor,) = [p.uid for p in machine.pods.values() if p.priority]
    shard = machine.shard_of(preemptor)
    machine.preempt(shard)
    machine.place(shard)
    return preemptor


def test_the_model_catches_a_preemptor_placed_while_its_victim_holds_the_device():
    machine = PlacesBeforeTheVictimGoes()
    preemptor = replay_preemptor_placed_again_at_once(machine)
    shard = machine.shard_of(preemptor)
    machine.commit(shard)
    machine.publish(shard)
    machine.binder_holds()
    machine.write(machine.handlers[0])
    with pytest.raises(AssertionError, match="allocated whole to"):
        machine.no_device_given_twice()


def test_a_preemptor_waits_for_its_victim_then_binds_on_the_device_held_for_it():
    machine = ReservationProtocol()
    preemptor = replay_preemptor_placed_again_at_once(machine)
    shard = machine.shard_of(preemptor)
    assert machine.shards[shard]["staged"] is None, "placed while the victim still holds the GPU"
    held = machine.bucket["n0"][1].claims[machine.pods[preemptor].claim]
    (victim,) = machine.evictions
    victim_claim = machine.pods[victim].claim
    assert [d.device for d in held.devices] == ["gpu-0"] and held.expires_at is not None
    machine.no_device_reserved_twice()  # shared with its victim only, which the invariant allows
    machine.binder_evicts()
    machine.binder_sees_claim_deleted()
    assert victim not in machine.pods and victim_claim not in machine.bucket["n0"][1].claims
    machine.teardown()
    assert machine.pods[preemptor].node == "n0"
    assert [d.device for d in machine.claims[machine.pods[preemptor].claim].allocation] == ["gpu-0"]


def test_nominate_shares_only_the_victims_devices():
    entry = rv.add(rv.NodeReservations(node="n0"), [reservation("victim", "gpu-0", expires=None),
                                                     reservation("other", "gpu-1", expires=None)])
    step = protocol.nominate(entry, [reservation("preemptor", "gpu-0", expires=30.0)], None, ["victim"], 10.0,
                             lambda uid: True)
    assert set(step.entry.claims) == {"victim", "other", "preemptor"}
    with pytest.raises(rv.ReservationConflict):
        protocol.nominate(entry, [reservation("preemptor", "gpu-1", expires=30.0)], None, ["victim"], 10.0,
                          lambda uid: True)

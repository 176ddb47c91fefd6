"""The reservation protocol between the shards and the binder, as a pure state machine.

Why a module of its own: both double allocations and both livelocks found so far came from this
protocol while it was spread over the shard's commit, the binder's hold, confirm, abandon and undo,
and the store. Like etcd's raft, the protocol here does no I/O: each step takes a node's entry
(`NodeReservations`, the state) and what the caller knows (the time, what Kubernetes says), and
returns the entry to write with compare-and-set (None: nothing to write) and what happened, for
the shell to act on. The shells (`draplane_allocator.shard`, `draplane_binder.service`,
`draplane.jetstream.reservation_store`) only read, write and retry; every decision is here, so
`tests/shared/scheduling/test_reservation_protocol.py` drives the very functions the services
call through crashes, lapses and redeliveries.

One placement's life, the steps in order and each undo beside its step:

  shard   commit    reserve the claims' devices and the pod's CPU and memory under a lease,
                    lapsed leases of the node pruned in the same write    undo: abandon
          nominate  (preemption) the same, on devices its victims' claims still hold
                                                                          undo: abandon
          commit_gang  every member of a gang, one commit per node involved; the
                    placements are published only once every node's write held
                                                                          undo: abandon_gang
  binder  hold      check the reservation is still the placement's, renew its lease
                    (`plan_write` says what to do with the answer)        undo: abandon
          write     claim status and binding, in Kubernetes (draplane_binder.lifecycle;
                    its undo, `status_without_pod`, is there too)
          confirm   clear the lease: the reservation now mirrors the claim's allocation
                                                                          undo: release
  any     lapse     a lease ran out: freed if the claim is not allocated in Kubernetes,
                    confirmed if it is (the binder wrote it and died before confirming)
  binder  release   the claim was deleted or its allocation cleared
          reconcile on (re)start and after a re-list of claims: confirmed reservations
                    whose claim is gone or allocated otherwise, released (a claim deleted
                    while no binder ran would otherwise hold its devices for ever)

Kubernetes stays the source of truth: a reservation is only ever a promise that Kubernetes will
soon say the same, or a mirror of what it says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import msgspec

from draplane.scheduling import reservations as rv
from draplane.scheduling.reservations import NodeReservations, PodReservation, Reservation, ReservedDevice

# claim uid -> the devices a placement reserved for it
Expected = Mapping[str, list[ReservedDevice]]


# --- lapse: a lease ran out ------------------------------------------------------------------------


class Lapse(msgspec.Struct, kw_only=True):
    """What pruning a node's lapsed leases did. `entry` is None when there was nothing to change."""

    entry: NodeReservations | None
    released: list[Reservation] = msgspec.field(default_factory=list)
    confirmed: list[str] = msgspec.field(default_factory=list)
    pods_dropped: int = 0

    @property
    def news(self) -> bool:
        """Claims freed or confirmed; a pod reservation lapsing is what happens after every placement."""
        return bool(self.released or self.confirmed)


def has_lapsed(entry: NodeReservations, now: float) -> bool:
    """Whether `lapse` would free or confirm a claim here (a lapsed pod reservation alone is not
    worth a write: node fit ignores it already, and the next commit drops it)."""
    return rv.has_lapsed_claims(entry, now)


def lapse(entry: NodeReservations, now: float, claim_is_allocated: Callable[[str], bool],
          pod_is_gone: Callable[[str], bool] | None = None) -> Lapse:
    """Drop the reservations whose lease ran out before their placement reached Kubernetes, and
    confirm those whose claim is allocated after all. Any writer may take this step; it has no undo
    (a freed claim is simply placed again)."""
    pruned, dropped = rv.prune(entry, now, claim_is_allocated, pod_is_gone)
    confirmed = [uid for uid, r in entry.claims.items()
                 if not r.confirmed and uid in pruned.claims and pruned.claims[uid].confirmed]
    pods_dropped = len(entry.pods) - len(pruned.pods)
    changed = dropped or confirmed or pods_dropped
    return Lapse(entry=pruned if changed else None, released=dropped, confirmed=confirmed, pods_dropped=pods_dropped)


# --- commit (shard) and its undo, abandon (binder) ---------------------------------------------------


class Commit(msgspec.Struct, kw_only=True):
    """A shard's commit of one placement on a node, against the entry its view was built on.

    `entry` None: the claims and the pod are reserved there already with these devices (a
    redelivered pending pod, or the binder asking again after a restart): publish the same
    placement again, nothing to write. `lapsed` is what the write prunes on the way (its `entry`
    is the node's entry without them, what the placement was added to)."""

    entry: NodeReservations | None
    lapsed: Lapse


def commit(
    entry: NodeReservations,
    reservations: Iterable[Reservation],
    pod: PodReservation | None,
    now: float,
    claim_is_allocated: Callable[[str], bool],
    pod_is_gone: Callable[[str], bool] | None = None,
) -> Commit:
    """Reserve a placement's devices and its pod's CPU and memory. Raises ReservationConflict when
    a device is taken in `entry` (the shard's view missed a reservation: refresh, place again).

    Lapsed leases are pruned first, so a device whose lease ran out can be given in this very
    write, and never while its old reservation is still in the entry."""
    lapsed = lapse(entry, now, claim_is_allocated, pod_is_gone)
    base = lapsed.entry if lapsed.entry is not None else entry
    added = rv.add(base, reservations, pod)
    return Commit(entry=None if added is base else added, lapsed=lapsed)


class GangCommit(msgspec.Struct, kw_only=True):
    """A gang's commit: per node, what to write (`entries`; nodes where every member's claims and
    pod are reserved already are left out) and what each write reserves (`reserved`, the
    arguments of `abandon` there), so the nodes written before one that failed can be taken back.
    `lapsed`: per node, what the write prunes."""

    entries: dict[str, NodeReservations]
    reserved: dict[str, tuple[dict[str, list[ReservedDevice]], list[str]]]
    lapsed: dict[str, Lapse]


def commit_gang(
    entries: Mapping[str, NodeReservations],
    members: Mapping[str, Iterable[tuple[Iterable[Reservation], PodReservation | None]]],
    now: float,
    claim_is_allocated: Callable[[str], bool],
    pod_is_gone: Callable[[str], bool] | None = None,
) -> GangCommit:
    """`commit` for all of a gang's members: `members` gives, per node, each member's reservations
    and pod there; `entries` each node's entry as the gang was placed on it. Raises
    ReservationConflict (its text names the node) if any member's device is taken: nothing of the gang is
    written then. A claim two members share is reserved once, by the first.

    The writes that follow are one compare-and-set per node and cannot be atomic across nodes:
    the atomicity is that the binder binds nothing until the shard publishes the placements, after
    every write held. A write that fails is answered with `abandon_gang` on the nodes written; a
    crash between writes leaves reservations with no placement, whose leases lapse."""
    written: dict[str, NodeReservations] = {}
    reserved: dict[str, tuple[dict[str, list[ReservedDevice]], list[str]]] = {}
    lapsed: dict[str, Lapse] = {}
    seen_claims: set[str] = set()
    for node, items in members.items():
        step = lapse(entries[node], now, claim_is_allocated, pod_is_gone)
        base = step.entry if step.entry is not None else entries[node]
        current = base
        claims: dict[str, list[ReservedDevice]] = {}
        pods: list[str] = []
        for reservations, pod in items:
            fresh = [r for r in reservations if r.claim_uid not in seen_claims]
            seen_claims.update(r.claim_uid for r in fresh)
            after = rv.add(current, fresh, pod)
            if after is not current:
                claims.update({r.claim_uid: list(r.devices) for r in fresh if r.claim_uid not in current.claims})
                if pod is not None and pod.pod_uid not in current.pods:
                    pods.append(pod.pod_uid)
            current = after
        lapsed[node] = step
        if current is not base:
            written[node] = current
            reserved[node] = (claims, pods)
    return GangCommit(entries=written, reserved=reserved, lapsed=lapsed)


def abandon_gang(entry: NodeReservations, reserved: tuple[Mapping[str, list[ReservedDevice]], Iterable[str]]
                 ) -> NodeReservations | None:
    """Undo of commit_gang on one node it wrote: `abandon` of what it reserved there."""
    claims, pods = reserved
    return abandon(entry, claims, pods)


def nominate(
    entry: NodeReservations,
    reservations: Iterable[Reservation],
    pod: PodReservation | None,
    victims: Iterable[str],
    now: float,
    claim_is_allocated: Callable[[str], bool],
    pod_is_gone: Callable[[str], bool] | None = None,
    victim_pods: Iterable[str] = (),
) -> Commit:
    """Hold what a preemption frees for its preemptor: its claims reserved on the devices the
    victims' claims (`victims`, claim uids) still hold, and its CPU and memory, under a lease long
    enough for the victims to go. Only the victims' devices may be shared this way; any other
    reserved device is a ReservationConflict, as in `commit`. The host ports and anti-affinity of
    the victim pods (`victim_pods`, pod uids) do not refuse the preemptor: they go for it. Every other shard then sees the
    devices taken, so none gives them away when the victims go; the preemptor's own placement,
    later, finds its claims reserved and waits until no other claim holds their devices
    (`SchedulingState.place_pod`). Undo: `abandon` (or the lease lapses)."""
    lapsed = lapse(entry, now, claim_is_allocated, pod_is_gone)
    base = lapsed.entry if lapsed.entry is not None else entry
    added = rv.add(base, reservations, pod, displacing=set(victims), displacing_pods=set(victim_pods))
    return Commit(entry=None if added is base else added, lapsed=lapsed)


def republished_lease(entry: NodeReservations, claim_uids: Iterable[str], default: float) -> float:
    """The lease a placement sent again (`commit` gave no entry) carries: the one its claims have
    already, the soonest to end, not a fresh one, as nothing renewed it; `default` when all of them
    are confirmed or not here (allocated in Kubernetes)."""
    leases = [entry.claims[uid].expires_at for uid in claim_uids if uid in entry.claims]
    leases = [t for t in leases if t is not None]
    return min(leases) if leases else default


def recommit(commit: Commit, entry: NodeReservations, reservations: Iterable[Reservation],
             pod: PodReservation | None) -> Commit:
    """The next placement of a batch on the same node, added to `entry` (what `commit` made so far;
    lapsed leases were pruned by the first). `entry` None in the result: nothing new."""
    added = rv.add(entry, reservations, pod)
    return Commit(entry=None if added is entry else added, lapsed=commit.lapsed)


class Abandonment(msgspec.Struct, kw_only=True):
    """What an abandoned placement gives back (the arguments of `abandon`)."""

    claims: dict[str, list[ReservedDevice]]
    pods: list[str]

    @property
    def empty(self) -> bool:
        return not self.claims and not self.pods


def what_to_abandon(placed: Expected, allocated_here: Callable[[str], bool], pod_uid: str, *,
                    pod_bound_here: bool) -> Abandonment:
    """What a placement gives back when the binder gives it up: the claims that Kubernetes does not
    show allocated with these devices (one that is was written by an earlier delivery of this
    placement, or is a shared claim: its reservation mirrors the truth), and the pod's CPU and
    memory unless the pod is bound there."""
    return Abandonment(claims={uid: list(devices) for uid, devices in placed.items() if not allocated_here(uid)},
                       pods=[] if pod_bound_here else [pod_uid])


def abandon(entry: NodeReservations, claims: Expected, pods: Iterable[str] = ()) -> NodeReservations | None:
    """Undo of commit (and of hold): release these claims, but only where they still hold these
    devices (a claim reserved again since, with others, keeps its new reservation), and these pods'
    CPU and memory. None when nothing of it is here."""
    gone = [uid for uid, devices in claims.items()
            if uid in entry.claims and rv.same_devices(entry.claims[uid].devices, devices)]
    return rv.release(entry, gone, pods)


# --- hold (binder) and what to do with it -------------------------------------------------------------


class Hold(msgspec.Struct, kw_only=True):
    """`held`: the claims whose reservation is still the placement's, and the pods still reserved,
    leases renewed by `entry` (None: every lease had more than half left, nothing to write)."""

    entry: NodeReservations | None
    held: set[str]


def hold(entry: NodeReservations, claims: Expected, pods: Iterable[str], now: float, lease_seconds: float) -> Hold:
    """Renew the leases of a placement about to be written, and say which are still its own.

    Atomic with the check (one compare-and-set), so a reservation found here cannot lapse and be
    given away for `lease_seconds`. A lapsed reservation still in the entry is held too: nobody
    can have given its devices away, as that takes a write that prunes it first.

    Leases with more than half of `lease_seconds` left are not renewed (clocks may differ by up to
    half a lease), and when none needs renewing nothing is written."""
    until = now + lease_seconds
    fresh_enough = now + lease_seconds / 2
    held: set[str] = set()
    reserved = dict(entry.claims)
    held_pods = dict(entry.pods)
    changed = False
    for uid, devices in claims.items():
        reservation = reserved.get(uid)
        if reservation is None or not rv.same_devices(reservation.devices, devices):
            continue
        held.add(uid)
        if reservation.expires_at is not None and reservation.expires_at < fresh_enough:
            reserved[uid] = msgspec.structs.replace(reservation, expires_at=until)
            changed = True
    for uid in pods:
        pod = held_pods.get(uid)
        if pod is None:
            continue
        held.add(uid)
        if pod.expires_at < fresh_enough:
            held_pods[uid] = msgspec.structs.replace(pod, expires_at=until)
            changed = True
    new = NodeReservations(node=entry.node, claims=reserved, pods=held_pods) if changed else None
    return Hold(entry=new, held=held)


class Write(msgspec.Struct, frozen=True):
    """Write the placement. `verify`: claims not held here, written only if Kubernetes already
    shows each allocated with the placement's devices (by an earlier delivery); else abandon."""

    verify: tuple[str, ...] = ()


class Abandon(msgspec.Struct, frozen=True):
    why: str


WritePlan = Write | Abandon


def plan_write(claims: Iterable[str], pod_uid: str, held: set[str], *, pod_bound_here: bool, node: str) -> WritePlan:
    """What the binder does after `hold`: write, verify some claims first, or abandon.

    The pod's CPU and memory must still be held unless it is bound there already: counted under a
    lease that lapsed, another shard may have placed pods in that room since."""
    if pod_uid not in held and not pod_bound_here:
        return Abandon(f"its reservation of CPU and memory on node {node} lapsed")
    return Write(verify=tuple(uid for uid in claims if uid not in held))


# --- confirm (binder) and its undo, release ------------------------------------------------------------


def confirm(entry: NodeReservations, claim_uids: Iterable[str]) -> NodeReservations | None:
    """Clear the leases of claims written to Kubernetes: the reservation now mirrors the claim's
    allocation, until `release`. None when none of them is leased here."""
    changed = entry
    for uid in claim_uids:
        changed = rv.confirm(changed, uid) or changed
    return None if changed is entry else changed


def release(entry: NodeReservations, claim_uids: Iterable[str]) -> NodeReservations | None:
    """Undo of confirm: the claim was deleted or its allocation cleared. None when not here."""
    return rv.release(entry, claim_uids)


# --- reconcile (binder, at start and after a re-list) ----------------------------------------------------


def stale_confirmations(
    entry: NodeReservations, allocated: Callable[[Reservation], list[ReservedDevice] | None]
) -> dict[str, list[ReservedDevice]]:
    """Confirmed reservations that no longer mirror Kubernetes: `allocated(reservation)` gives the
    devices its claim (by uid) is allocated with, or None when the claim is gone or not allocated.

    Leased reservations are not judged here: they are promises still being kept, and lapse on
    their own. The result goes to `abandon`, which releases only what still holds these devices."""
    stale: dict[str, list[ReservedDevice]] = {}
    for uid, reservation in entry.claims.items():
        if not reservation.confirmed:
            continue
        devices = allocated(reservation)
        if devices is None or not rv.same_devices(devices, reservation.devices):
            stale[uid] = list(reservation.devices)
    return stale

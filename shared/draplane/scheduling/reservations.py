"""The reservation protocol: one JetStream key-value entry per node, changed only by compare-and-set.

Why: N shards allocate from the same devices. Each computes a placement against its in-memory view
(every claim's status in the cluster, plus this bucket), then commits it by writing the node's entry
with the revision its view was built on. Two shards placing on one node therefore serialise: the
loser's write fails, it refreshes and recomputes. A device is given to a claim only once it is in the
node's entry, and the placement is published only after that write succeeded.

Lifecycle of one claim's reservation in a node entry:
  reserved (lease `expires_at`) --binder wrote the claim status--> confirmed (no lease)
  reserved, lease expired, and the claim is not allocated in Kubernetes --> pruned by any writer
  any --claim deleted or its allocation cleared--> removed by the binder (release)
Kubernetes claim status stays the source of truth: a restarted shard rebuilds from the claims and
from this bucket, and a lease-expired reservation whose claim *is* allocated is kept (confirmed).

The entry also reserves the placed pod's CPU and memory (`pods`), so that node fit, like devices,
is decided once across shards: two shards placing on one node serialise on the same write. A pod
reservation is never confirmed; it lapses with its lease, by when the pod watch of every shard
shows the pod bound there (the binder renews the lease while it writes, so at least half a lease
is left when the binding is made). Node fit ignores a lapsed one, and the next write to the node
removes it.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Collection, Iterable

import msgspec

from draplane.scheduling.framework.interface import HostPort
from draplane.scheduling.framework.plugins.node_ports import ports_conflict
from draplane.api.core import PodAffinityTerm
from draplane.api.resource import AllocationResult
from draplane.scheduling.framework.plugins.inter_pod_affinity import PlacedPod, conflicts_on_one_node
from draplane.shared_instances import SharedInstances

SCHEMA_VERSION = 1
DEFAULT_LEASE_SECONDS = 30.0


class ReservationConflict(Exception):
    """The node entry already gives one of these devices to another claim."""


# The entries' structs are untracked by the cycle collector, as the API's (draplane.api.meta.Base):
# trees of values, held for every node by every shard and the binder.
class ReservedDevice(msgspec.Struct, frozen=True, array_like=True, gc=False):
    driver: str
    pool: str
    device: str
    # Set for a share of a device that allows multiple allocations; such shares never conflict
    # here (their capacity accounting is the allocator's, against the same revision).
    share_id: str | None = None
    # An adminAccess result neither takes the device nor is kept from one in use, as in
    # Kubernetes' allocator. Last, with a default, so entries written before it decode.
    admin_access: bool = False

    @property
    def exclusive(self) -> bool:
        """Whether this result holds the device whole: no other claim may get it meanwhile."""
        return self.share_id is None and not self.admin_access


def same_devices(a: Iterable[ReservedDevice], b: Iterable[ReservedDevice]) -> bool:
    """Whether two reservations hold the same devices, in any order (a multiset: one claim can
    hold two shares, or two adminAccess results, of one device)."""
    return Counter(a) == Counter(b)


class Reservation(msgspec.Struct, kw_only=True, gc=False):
    claim_uid: str
    claim_namespace: str
    claim_name: str
    pod_uid: str
    devices: list[ReservedDevice]
    # The allocation as it will be written, so a confirmed entry fully describes what is in use
    # even before a shard's claim watch has caught up.
    allocation: AllocationResult
    reserved_at: float
    expires_at: float | None  # None once confirmed
    shard: int = 0

    @property
    def confirmed(self) -> bool:
        return self.expires_at is None


class PodReservation(msgspec.Struct, kw_only=True, gc=False):
    pod_uid: str
    pod_namespace: str
    pod_name: str
    # resource name -> amount, as draplane.component_helpers.resource.pod_requests gives them
    requests: dict[str, int]
    reserved_at: float
    expires_at: float
    shard: int = 0
    # The host ports the pod holds (draplane.scheduling.framework.plugins.node_ports.pod_host_ports): in the node's
    # entry, a compare-and-set keeps two shards from giving one port twice. Last, with a default,
    # so entries written before it decode.
    host_ports: list[HostPort] = msgspec.field(default_factory=list)
    # Its labels and required anti-affinity terms (InterPodAffinity): in the entry, a commit
    # refuses a pod that would break a hostname-scoped anti-affinity rule on the node, either way.
    labels: dict[str, str] | None = None
    anti_affinity: list[PodAffinityTerm] | None = None


class NodeReservations(msgspec.Struct, kw_only=True, gc=False):
    version: int = SCHEMA_VERSION
    node: str
    claims: dict[str, Reservation] = msgspec.field(default_factory=dict)
    # Added after version 1 without a bump: a reader that does not know it ignores it, and is no
    # worse off than before (node fit per shard).
    pods: dict[str, PodReservation] = msgspec.field(default_factory=dict)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(NodeReservations)
# Every shard and the binder hold every node's entry, decoded anew at each write of it: the parts
# many reservations hold alike (a node's selector, an adminAccess result on a monitored GPU, a
# device) are kept once. At 50,000 reservations on 5,000 nodes they came to 3 KB each.
SHARED_PARTS = SharedInstances(limit=16_384)


def encode_entry(entry: NodeReservations) -> bytes:
    return _encoder.encode(entry)


def _shared_allocation(allocation: AllocationResult) -> AllocationResult:
    """The one instance of an allocation equal to this one (by its encoding)."""
    def first_of_its_kind(_key) -> AllocationResult:
        # its parts may still be shared with other allocations
        if allocation.node_selector is not None:
            selector = allocation.node_selector
            allocation.node_selector = SHARED_PARTS.get(("node selector", _encoder.encode(selector)), lambda _: selector)
        if allocation.devices is not None and allocation.devices.results:
            allocation.devices.results = [SHARED_PARTS.get(("result", _encoder.encode(r)), lambda _, r=r: r)
                                          for r in allocation.devices.results]
        return allocation

    return SHARED_PARTS.get(("allocation", _encoder.encode(allocation)), first_of_its_kind)


def _share_claim_parts(uid: str, reservation: Reservation, pod_uids: dict[str, str]) -> Reservation:
    """A decoded claim reservation, its parts made the ones other reservations hold alike: the
    allocation (whole, by its encoding), each device, names. `pod_uids`: the entry's pod keys."""
    if reservation.claim_uid == uid:
        reservation.claim_uid = uid
    reservation.pod_uid = pod_uids.get(reservation.pod_uid, reservation.pod_uid)
    reservation.devices = [SHARED_PARTS.get(d) for d in reservation.devices]
    reservation.allocation = _shared_allocation(reservation.allocation)
    reservation.claim_namespace = sys.intern(reservation.claim_namespace)
    return reservation


def _share_pod_parts(uid: str, pod: PodReservation) -> PodReservation:
    if pod.pod_uid == uid:
        pod.pod_uid = uid
    pod.pod_namespace = sys.intern(pod.pod_namespace)
    requests = pod.requests
    pod.requests = SHARED_PARTS.get(("requests", *requests.items()), lambda _: requests)
    return pod


def _share_alike_parts(entry: NodeReservations) -> NodeReservations:
    """Nothing changes a decoded entry's reservations (each protocol step makes new ones), so
    equal parts can be one object."""
    pod_uids = {uid: uid for uid in entry.pods}  # the key's string, for the fields that repeat it
    for uid, reservation in entry.claims.items():
        _share_claim_parts(uid, reservation, pod_uids)
    for uid, pod in entry.pods.items():
        _share_pod_parts(uid, pod)
    return entry


def _check_entry(version: int, named: str, node: str) -> None:
    if version != SCHEMA_VERSION:
        raise ValueError(f"reservation entry for node {node}: field version is {version}, expected {SCHEMA_VERSION}")
    if named != node:
        raise ValueError(f"reservation entry under key {node} names node {named}")


def decode_entry(data: bytes | None, node: str) -> NodeReservations:
    """An empty or deleted key is an empty entry."""
    if not data:
        return NodeReservations(node=node)
    try:
        entry = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"reservation entry for node {node}: {exc}") from None
    _check_entry(entry.version, entry.node, node)
    return _share_alike_parts(entry)


class _UndecodedEntry(msgspec.Struct, kw_only=True):
    """A node's entry with each reservation left as the bytes it was written as."""
    version: int = SCHEMA_VERSION
    node: str
    claims: dict[str, msgspec.Raw] = msgspec.field(default_factory=dict)
    pods: dict[str, msgspec.Raw] = msgspec.field(default_factory=dict)


_undecoded = msgspec.json.Decoder(_UndecodedEntry)
_claim_decoder = msgspec.json.Decoder(Reservation)
_pod_decoder = msgspec.json.Decoder(PodReservation)


class EntryDecoder:
    """Decodes the entries of a watch of the bucket, each reservation only when it is new to its
    node or written differently from the node's previous entry.

    Why: a write changes one or two reservations of a node's entry (a claim reserved, a lease
    renewed or confirmed) and carries all the others as they were, and every shard and the binder
    decode every write (in bench/e2e.py 1200x120, a follower read 0.26 writes per pod at 1 shard
    and 0.33 at 4, of 15-17 reservations each). A reservation whose bytes are those it had in the
    node's previous entry is the object decoded then: what `decode_entry` would give, as nothing
    changes a decoded reservation. bench/reservation_entries.py (40 reservations, 8.7 KB a write):
    41 us a write decoded whole, 19 us so.

    The bytes are compared by Python's hash of them (SipHash, 64 bits, keyed at random per
    process): 0.2 us a reservation, where a BLAKE2 digest took 1 us. What this holds per
    reservation (the hash, the pair, a dict slot) is about 140 bytes besides the 820 of the
    decoded reservation itself (`tracemalloc`, 500 entries of 40); holding the bytes instead
    would have added about 350 more, in every shard, at bench/scale.py's 100,000 claim and pod
    reservations. A changed reservation read as unchanged needs two of its writes to collide:
    about one in 10^19 per change. Pure, no I/O; one per reader, as it holds each node's last
    entry read.

    A reader's own writes are not recorded: the next entry read is compared with the one read
    before them, which differs only in what those writes changed, while hashing every write's
    reservations cost the placing shard a scan of its whole entry each time.
    """

    def __init__(self) -> None:
        # node -> ({claim uid: (hash of its bytes, reservation)}, {pod uid: (the same, pod reservation)})
        self._known: dict[str, tuple[dict[str, tuple[int, Reservation]], dict[str, tuple[int, PodReservation]]]] = {}

    def __len__(self) -> int:
        return len(self._known)

    def decode(self, data: bytes | None, node: str) -> NodeReservations:
        """As `decode_entry`; raises ValueError naming the node (and the reservation) when unreadable."""
        if not data:
            self._known.pop(node, None)
            return NodeReservations(node=node)
        undecoded = self._undecoded(data, node)
        known_claims, known_pods = self._known.get(node, ({}, {}))
        pods, pods_seen = _reuse_or_decode(undecoded.pods, known_pods, lambda uid, item: _share_pod_parts(
            uid, _decode_item(_pod_decoder, item, node, "pod", uid)))
        pod_uids = {uid: uid for uid in pods}
        claims, claims_seen = _reuse_or_decode(undecoded.claims, known_claims, lambda uid, item: _share_claim_parts(
            uid, _decode_item(_claim_decoder, item, node, "claim", uid), pod_uids))
        self._known[node] = (claims_seen, pods_seen)
        return NodeReservations(version=undecoded.version, node=node, claims=claims, pods=pods)

    @staticmethod
    def _undecoded(data: bytes, node: str) -> _UndecodedEntry:
        try:
            undecoded = _undecoded.decode(data)
        except msgspec.DecodeError as exc:
            raise ValueError(f"reservation entry for node {node}: {exc}") from None
        _check_entry(undecoded.version, undecoded.node, node)
        return undecoded


def _reuse_or_decode(items: dict[str, msgspec.Raw], known: dict[str, tuple[int, object]],
                     decode: Callable[[str, msgspec.Raw], object]) -> tuple[dict[str, object], dict[str, tuple[int, object]]]:
    """uid -> reservation, each the known one when its bytes hash as before, else `decode`d; and
    what to know of them for the next entry."""
    decoded: dict[str, object] = {}
    seen: dict[str, tuple[int, object]] = {}
    for uid, item in items.items():
        digest = hash(bytes(item))
        was = known.get(uid)
        if was is None or was[0] != digest:
            was = (digest, decode(uid, item))
        seen[uid] = was
        decoded[uid] = was[1]
    return decoded, seen


def _decode_item(decoder: msgspec.json.Decoder, item: msgspec.Raw, node: str, kind: str, uid: str):
    try:
        return decoder.decode(item)
    except msgspec.DecodeError as exc:
        raise ValueError(f"reservation entry for node {node}: {kind} {uid}: {exc}") from None


def node_key(node: str) -> str:
    # KV keys allow [-/_=.a-zA-Z0-9]; node names are DNS subdomains, which fit.
    return node


def devices_of(allocation: AllocationResult) -> list[ReservedDevice]:
    results = allocation.devices.results if allocation.devices and allocation.devices.results else []
    return [ReservedDevice(r.driver, r.pool, r.device, r.share_id, bool(r.admin_access)) for r in results]


def exclusive_devices(entry: NodeReservations, *, except_claim: str | None = None,
                      except_claims: Collection[str] = ()) -> set[tuple[str, str, str]]:
    """(driver, pool, device) held whole by some reservation in the entry."""
    held: set[tuple[str, str, str]] = set()
    for claim_uid, reservation in entry.claims.items():
        if claim_uid == except_claim or claim_uid in except_claims:
            continue
        for d in reservation.devices:
            if d.exclusive:
                held.add((d.driver, d.pool, d.device))
    return held


def prune(
    entry: NodeReservations,
    now: float,
    claim_is_allocated: Callable[[str], bool],
    pod_is_gone: Callable[[str], bool] | None = None,
) -> tuple[NodeReservations, list[Reservation]]:
    """Drop reservations whose lease ran out before their placement reached Kubernetes.

    A lapsed lease whose claim *is* allocated (the binder wrote the status but died before
    confirming) is confirmed instead: Kubernetes is the source of truth. A pod's reservation (its
    CPU, memory and host ports) is dropped too once `pod_is_gone` says the pod was deleted or
    finished: it holds nothing any more, though its lease runs on.
    """
    kept: dict[str, Reservation] = {}
    dropped: list[Reservation] = []
    for claim_uid, reservation in entry.claims.items():
        if reservation.expires_at is not None and reservation.expires_at <= now:
            if claim_is_allocated(claim_uid):
                kept[claim_uid] = msgspec.structs.replace(reservation, expires_at=None)
            else:
                dropped.append(reservation)
            continue
        kept[claim_uid] = reservation
    pods = {uid: p for uid, p in entry.pods.items()
            if p.expires_at > now and not (pod_is_gone is not None and pod_is_gone(uid))}
    return NodeReservations(node=entry.node, claims=kept, pods=pods), dropped


def has_lapsed_claims(entry: NodeReservations, now: float) -> bool:
    """Whether a claim's lease ran out, so that `prune` would free or confirm it.

    Lapsed pod reservations alone are not worth a write: node fit ignores them already, and the
    next placement on the node prunes them with its own write."""
    return any(r.expires_at is not None and r.expires_at <= now for r in entry.claims.values())


def add(
    entry: NodeReservations, reservations: Iterable[Reservation], pod: PodReservation | None = None,
    *, displacing: Collection[str] = (), displacing_pods: Collection[str] = (),
) -> NodeReservations:
    """The entry with these reservations (and the pod's) added; raises ReservationConflict if a
    device is taken. The same entry object when there was nothing new to add. The devices of the
    claims in `displacing` (preemption's victims, on their way out) do not count as taken, nor do
    the host ports and anti-affinity of the pods in `displacing_pods` (the victims themselves).

    Re-adding a claim's identical reservation, or a pod already reserved here, is a no-op so a
    redelivered commit stays idempotent; a *different* reservation for a claim already reserved
    here is a conflict, and so is a host port of the pod that a pod of this entry holds. Whether the
    pod's CPU and memory fit is the caller's node fit, computed with the pods of this entry.
    """
    claims = dict(entry.claims)
    held = exclusive_devices(entry, except_claims=displacing)
    added = False
    for reservation in reservations:
        existing = claims.get(reservation.claim_uid)
        if existing is not None:
            if same_devices(existing.devices, reservation.devices):
                continue
            raise ReservationConflict(
                f"claim {reservation.claim_namespace}/{reservation.claim_name} is already reserved on node "
                f"{entry.node} with other devices"
            )
        for d in reservation.devices:
            if d.exclusive:
                key = (d.driver, d.pool, d.device)
                if key in held:
                    raise ReservationConflict(
                        f"device {d.driver}/{d.pool}/{d.device} on node {entry.node} is already reserved"
                    )
                held.add(key)
        claims[reservation.claim_uid] = reservation
        added = True
    pods = entry.pods
    if pod is not None and pod.pod_uid not in pods:
        staying = [other for uid, other in pods.items() if uid not in displacing_pods]
        if pod.host_ports:
            held = [port for other in staying for port in other.host_ports]
            if ports_conflict(pod.host_ports, held):
                raise ReservationConflict(
                    f"pod {pod.pod_namespace}/{pod.pod_name}: a host port it asks for is already reserved on node "
                    f"{entry.node}")
        if pod.anti_affinity or any(other.anti_affinity for other in staying):
            others = [PlacedPod(uid=o.pod_uid, namespace=o.pod_namespace, labels=o.labels or {}, node=entry.node,
                                anti_affinity=tuple(o.anti_affinity or ())) for o in staying]
            if conflicts_on_one_node(pod.pod_namespace, pod.labels or {}, pod.anti_affinity or (), others):
                raise ReservationConflict(
                    f"pod {pod.pod_namespace}/{pod.pod_name}: a pod reserved on node {entry.node} breaks a "
                    "pod anti-affinity rule with it")
        pods = {**pods, pod.pod_uid: pod}
        added = True
    if not added:
        return entry
    return NodeReservations(node=entry.node, claims=claims, pods=pods)


def confirm(entry: NodeReservations, claim_uid: str) -> NodeReservations | None:
    """The entry with the claim's lease cleared; None when it is not reserved here (nothing to do)."""
    reservation = entry.claims.get(claim_uid)
    if reservation is None or reservation.confirmed:
        return None
    claims = dict(entry.claims)
    claims[claim_uid] = msgspec.structs.replace(reservation, expires_at=None)
    return NodeReservations(node=entry.node, claims=claims, pods=entry.pods)


def extend(entry: NodeReservations, claim_uid: str, expires_at: float) -> NodeReservations | None:
    reservation = entry.claims.get(claim_uid)
    if reservation is None or reservation.confirmed:
        return None
    claims = dict(entry.claims)
    claims[claim_uid] = msgspec.structs.replace(reservation, expires_at=max(expires_at, reservation.expires_at))
    return NodeReservations(node=entry.node, claims=claims, pods=entry.pods)


def release(entry: NodeReservations, claim_uids: Iterable[str], pod_uids: Iterable[str] = ()) -> NodeReservations | None:
    """The entry without these claims and pods; None when none of them is here (nothing to write)."""
    uids = set(claim_uids)
    pods = set(pod_uids)
    if not uids & entry.claims.keys() and not pods & entry.pods.keys():
        return None
    return NodeReservations(
        node=entry.node,
        claims={k: v for k, v in entry.claims.items() if k not in uids},
        pods={k: v for k, v in entry.pods.items() if k not in pods},
    )

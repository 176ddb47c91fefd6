"""The device map: each node a row, each device a cell with its state and who holds it. Pure.

Its inputs are what NATS holds: the inventory feed's entries (each node's ResourceSlices, and the
pools not local to one node), the reservation bucket (which claim of which pod holds which device),
and `SchedulingFacts` (pod names, the policy's score of each placement, the pods still pending).

A device's state is the allocator core's, the same that `draplane free` and the cluster metrics
count (draplane.allocation.free_capacity.device_state): allocated (held whole), shared (a share of
a device that allows multiple allocations is held), tainted (NoSchedule or NoExecute), blocked
(a MIG placement or whole GPU whose counters other partitions of the GPU use) or free. Claims that
another scheduler allocated are recorded only in Kubernetes, so the map, reading NATS alone,
shows their devices free.

`DeviceMapBuilder.build` keeps the states of each row between calls and computes them again only
for rows whose feed entry or holding reservations changed (the objects are replaced on every update
of their key, so identity tells); holders, names and scores are looked up again every time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec

from draplane.allocation.device_allocator import DeviceAllocator
from draplane.allocation.free_capacity import DEVICE_STATES, FREE, TAINTED, device_state
from draplane.allocation.inventory import DeviceRecord, Pool
from draplane.allocation.scoring import FIRST_FIT
from draplane.api.core import Node
from draplane.api.meta import ObjectMeta
from draplane.api.resource import Device, ResourceClaim, ResourceClaimStatus, ResourceSlice
from draplane.dashboard.scheduling_facts import PendingList, SchedulingFacts
from draplane.messages.audit import AuditEvent
from draplane.messages.inventory import FeedEntry
from draplane.scheduling.reservations import NodeReservations, Reservation

DeviceKey = tuple[str, str, str]  # driver, pool, device


class Holder(msgspec.Struct, kw_only=True, omit_defaults=True):
    claim: str  # namespace/name
    pod: str  # namespace/name, or the uid where no message named the pod
    node: str = ""  # the reservation entry it is in
    policy: str | None = None
    score: float | None = None
    lease: bool = False  # reserved under a lease, not yet confirmed written to the claim
    share: str | None = None  # the share id, for a share of a device


class Cell(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str  # driver/pool/device, unique in the cluster
    device: str
    group: str  # the counter set (one physical GPU) it consumes, else its driver
    state: str  # one of DEVICE_STATES
    detail: str = ""
    taints: list[str] = msgspec.field(default_factory=list)
    holders: list[Holder] = msgspec.field(default_factory=list)


class Row(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str  # the node, or driver/pool for a pool not local to one node
    kind: Literal["node", "pool"] = "node"
    stale: bool = False  # the node's agent missed its heartbeats
    note: str = ""  # pools that cannot be used, and why
    cells: list[Cell] = msgspec.field(default_factory=list)


class DeviceMap(msgspec.Struct, kw_only=True):
    rows: list[Row]
    totals: dict[str, int]  # DEVICE_STATES -> devices
    pending: PendingList
    at: float  # unix seconds


@dataclass(slots=True)
class _DeviceState:
    key: DeviceKey
    device: str
    group: str
    state: str
    detail: str
    taints: list[str]


@dataclass(slots=True)
class _RowStates:
    entry: FeedEntry
    reservations: tuple[Reservation, ...]
    devices: list[_DeviceState]
    note: str


class DeviceMapBuilder:
    def __init__(self) -> None:
        self._rows: dict[str, _RowStates] = {}

    def refresh(self, feed: Mapping[str, FeedEntry], reservations: Mapping[str, NodeReservations]) -> int:
        """Compute the device states of the rows that changed (the costly part of `build`, which
        a shell may run in a thread on copies of the two mappings). Returns how many rows."""
        by_pool = _by_pool(_holdings(reservations))
        changed = 0
        for key, entry in feed.items():
            if entry.slices and self._states(key, entry, by_pool) is None:
                self._rows[key] = _row_states(entry, _holding(entry, by_pool))
                changed += 1
        for gone in set(self._rows) - {k for k, e in feed.items() if e.slices}:
            del self._rows[gone]
        return changed

    def _states(self, key: str, entry: FeedEntry, by_pool: _ByPool) -> _RowStates | None:
        """The row's cached states, if still right."""
        states = self._rows.get(key)
        if states is None or states.entry is not entry:
            return None
        current = _holding(entry, by_pool)
        if len(states.reservations) != len(current) or any(a is not b for a, b in zip(states.reservations, current)):
            return None
        return states

    def build(self, feed: Mapping[str, FeedEntry], reservations: Mapping[str, NodeReservations],
              facts: SchedulingFacts, now: float, rule_taints: RuleTaints | None = None) -> DeviceMap:
        self.refresh(feed, reservations)
        held = _holdings(reservations)
        rows: list[Row] = []
        totals = {s: 0 for s in DEVICE_STATES}
        for key in sorted(self._rows, key=_row_order):
            entry, states = feed[key], self._rows[key]
            row = Row(name=entry.node or _pool_row_name(entry), kind="node" if entry.node else "pool",
                      stale=entry.stale, note=states.note)
            for d in states.devices:
                state, taints = d.state, d.taints
                by_rules = rule_taints.of(d.key) if rule_taints is not None else ()
                if by_rules:
                    taints = taints + [f"{taint} (devicetaintrule {rule})" for rule, taint in by_rules]
                    if state == FREE and any(_blocks(taint) for _, taint in by_rules):
                        state = TAINTED
                totals[state] += 1
                row.cells.append(Cell(id="/".join(d.key), device=d.device, group=d.group, state=state,
                                      detail=d.detail, taints=taints,
                                      holders=[_holder(r, node, facts, reservations) for r, node in held.get(d.key, ())]))
            rows.append(row)
        return DeviceMap(rows=rows, totals=totals, pending=facts.pending(now), at=now)


# How the shards' audit events name a DeviceTaintRule in `by`.
RULE_PREFIX = "devicetaintrule "
MAX_RULES = 1000


class RuleTaints:
    """The taints of DeviceTaintRules, from the shards' ``tainted`` / ``untainted`` audit events.

    The inventory feed carries a slice's own taints (a node whose agent went silent), not the
    rules': the shards watch the rules in Kubernetes and tell the audit stream which devices a
    rule selects (the first `MAX_DEVICES_NAMED` of them) and its taint, in the event's reason
    (``devicetaintrule r applied: key=value:Effect``). A newer event of a rule replaces the older.
    """

    def __init__(self) -> None:
        self._rules: dict[str, tuple[str, frozenset[DeviceKey]]] = {}
        self._by_device: dict[DeviceKey, list[tuple[str, str]]] | None = {}
        self.version = 0

    def apply_audit(self, event: AuditEvent) -> None:
        if event.kind not in ("tainted", "untainted") or not event.by or not event.by[0].startswith(RULE_PREFIX):
            return  # the inventory's taints of a silent node are in the feed already
        rule = event.by[0][len(RULE_PREFIX):]
        if event.kind == "untainted":
            if self._rules.pop(rule, None) is None:
                return
        else:
            self._rules.pop(rule, None)
            if len(self._rules) >= MAX_RULES:
                self._rules.pop(next(iter(self._rules)))
            taint = event.reason.rpartition(": ")[2]
            self._rules[rule] = (taint, frozenset((d.driver, d.pool, d.device) for d in event.devices))
        self._by_device = None
        self.version += 1

    def of(self, key: DeviceKey) -> list[tuple[str, str]]:
        """(rule, taint) of the rules that taint the device."""
        if self._by_device is None:
            self._by_device = {}
            for rule in sorted(self._rules):
                taint, devices = self._rules[rule]
                for device in devices:
                    self._by_device.setdefault(device, []).append((rule, taint))
        return self._by_device.get(key, [])


def _blocks(taint: str) -> bool:
    return taint.rpartition(":")[2] in ("NoSchedule", "NoExecute")


def _row_order(key: str) -> tuple[int, str]:
    return (0 if key.startswith("node.") else 1, key)


def _pool_row_name(entry: FeedEntry) -> str:
    first = entry.slices[0].spec
    return f"{first.driver}/{first.pool.name}"


_Held = dict[DeviceKey, list[tuple[Reservation, str]]]  # device -> (reservation, its node entry)


def _holdings(reservations: Mapping[str, NodeReservations]) -> _Held:
    held: _Held = {}
    for node in sorted(reservations):
        for uid in sorted(reservations[node].claims):
            reservation = reservations[node].claims[uid]
            for d in reservation.devices:
                holders = held.setdefault((d.driver, d.pool, d.device), [])
                if not any(r is reservation for r, _ in holders):  # two shares of one device, one claim
                    holders.append((reservation, node))
    return held


_ByPool = dict[tuple[str, str], dict[str, Reservation]]  # (driver, pool) -> claim uid -> reservation


def _by_pool(held: _Held) -> _ByPool:
    by_pool: _ByPool = {}
    for key, holders in held.items():
        for reservation, _ in holders:
            by_pool.setdefault(key[:2], {})[reservation.claim_uid] = reservation
    return by_pool


def _holding(entry: FeedEntry, by_pool: _ByPool) -> tuple[Reservation, ...]:
    """The reservations holding a device of the entry's pools, in a stable order."""
    holding: dict[str, Reservation] = {}
    for pool in {(s.spec.driver, s.spec.pool.name) for s in entry.slices}:
        holding.update(by_pool.get(pool, {}))
    return tuple(holding[uid] for uid in sorted(holding))


def _holder(reservation: Reservation, node: str, facts: SchedulingFacts,
            reservations: Mapping[str, NodeReservations]) -> Holder:
    pod = facts.pod(reservation.pod_uid)
    name = pod.name if pod is not None and pod.name else ""
    if not name:
        # The pod's own reservation names it while its lease lasts.
        entry = reservations.get(node)
        placed = entry.pods.get(reservation.pod_uid) if entry is not None else None
        name = f"{placed.pod_namespace}/{placed.pod_name}" if placed is not None else f"uid {reservation.pod_uid}"
    shares = sorted({d.share_id for d in reservation.devices if d.share_id})
    return Holder(claim=f"{reservation.claim_namespace}/{reservation.claim_name}", pod=name, node=node,
                  policy=pod.policy if pod is not None else None, score=pod.score if pod is not None else None,
                  lease=not reservation.confirmed, share=", ".join(shares) or None)


def _held_claim(reservation: Reservation) -> ResourceClaim:
    return ResourceClaim(metadata=ObjectMeta(namespace="reserved", name=reservation.claim_uid, uid=reservation.claim_uid),
                         status=ResourceClaimStatus(allocation=reservation.allocation))


def _row_states(entry: FeedEntry, reservations: tuple[Reservation, ...]) -> _RowStates:
    cluster = DeviceAllocator(slices=entry.slices, policy=FIRST_FIT)
    for reservation in reservations:
        cluster.add_allocated_claim(_held_claim(reservation))
    # The node's view of its pools: the current generation, complete and valid, with counters.
    node = Node(metadata=ObjectMeta(name=entry.node or ""))
    gathered = {p.id: p for p in cluster.inventory.pools_for_node(node)}
    devices: list[_DeviceState] = []
    notes: list[str] = []
    for pool_id in sorted({(s.spec.driver, s.spec.pool.name) for s in entry.slices}):
        pool = gathered.get(pool_id)
        if pool is not None and pool.usable:
            records: list[tuple[DeviceRecord, Pool | None]] = [(r, pool) for r in pool.devices]
        else:
            # Shown as published, for they are there, but nothing can be allocated from them.
            if pool is not None and pool.incomplete:
                notes.append(f"pool {pool.describe()} is incomplete (slices are being written)")
            elif pool is not None:
                notes.append(f"pool {pool.describe()} is invalid: {pool.invalid_reason}")
            records = [(DeviceRecord(s, d), None) for s in _newest_slices(entry.slices, pool_id)
                       for d in s.spec.devices or ()]
        used_sets = _counter_sets_in_use(cluster, pool) if pool is not None and pool.usable else set()
        for record, in_pool in records:
            # Counters no allocated device draws on are whole, and every device the node agent or
            # a driver publishes fits its own GPU's whole counter set: only the sets in use need
            # the allocator's check, which is most of the cost of a MIG node's row.
            if not any(name in used_sets for name, _ in record.consumes):
                in_pool = None
            devices.append(_DeviceState(key=record.id, device=record.name, group=_group(record.driver, record.device),
                                        state=device_state(cluster, record, in_pool),
                                        detail=_detail(record.device), taints=_taints(record)))
    return _RowStates(entry=entry, reservations=reservations, devices=devices, note="; ".join(notes))


def _counter_sets_in_use(cluster: DeviceAllocator, pool: Pool) -> set[str]:
    state = cluster.state
    return {name for device, consumes in pool.counter_consumers.items() if state.is_allocated((*pool.id, device))
            for name, _ in consumes}


def _newest_slices(slices: list[ResourceSlice], pool_id: tuple[str, str]) -> list[ResourceSlice]:
    mine = [s for s in slices if (s.spec.driver, s.spec.pool.name) == pool_id]
    newest = max(s.spec.pool.generation for s in mine)
    return sorted((s for s in mine if s.spec.pool.generation == newest), key=lambda s: s.metadata.name or "")


def _group(driver: str, device: Device) -> str:
    """A partitionable GPU's whole device and MIG placements are grouped by its counter set, the
    other devices by their driver (the GPUs together, the NICs together)."""
    for consumption in device.consumes_counters or ():
        return consumption.counter_set
    return driver


def _attribute(device: Device, name: str):
    for key, attribute in (device.attributes or {}).items():
        if key == name or key.endswith(f"/{name}"):
            return attribute.value()
    return None


def _detail(device: Device) -> str:
    """What a person recognises the device by: its product or MIG profile, and its memory."""
    parts = []
    profile = _attribute(device, "profile")
    if profile is not None:
        parts.append(f"MIG {profile}")
    else:
        product = _attribute(device, "productName")
        kind = _attribute(device, "type")
        if product is not None or kind is not None:
            parts.append(str(product if product is not None else kind))
    memory = (device.capacity or {}).get("memory")
    if memory is not None:
        parts.append(f"memory {memory.value}")
    if device.allow_multiple_allocations:
        parts.append("shareable")
    return ", ".join(parts)


def _taints(record: DeviceRecord) -> list[str]:
    return [f"{t.key}{'=' + t.value if t.value else ''}:{t.effect}" for t in record.taints or ()]

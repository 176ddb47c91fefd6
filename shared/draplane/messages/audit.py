"""Audit events: what happened to devices, claims and pods, told by the component that knows it.

Subjects (under the prefix, default ``draplane.``), all captured by one JetStream stream
(`AuditNames.stream`, limits retention, kept `AUDIT_MAX_AGE_SECONDS`):

``{prefix}audit.placed``
    A pod's placement was written to Kubernetes (claim status, then pods/binding). Published by
    the binder once the pod is bound; says which shard chose the node and the policy's score.
``{prefix}audit.rejected``
    A pod was found unschedulable: by a shard (no node fits), or by the binder (its claims are not
    there). Published by the binder when it records the reason on the pod, so a pod retried with
    the same reason is one event, as it is one Kubernetes Event.
``{prefix}audit.released``
    A claim's devices were freed (the claim deleted, or its allocation cleared). The binder.
``{prefix}audit.preempted``
    A pod was evicted so that a higher-priority one fits: `pod` is the victim, `node` its node,
    `reason` names the preemptor and why these victims. Published by the binder once the Eviction
    API took it.
``{prefix}audit.conflict``
    A device is allocated to two claims beyond what adminAccess and shares allow: another
    scheduler allocated from the same slices. `claims` are the two, each with the device. The
    binder, which watches every claim.
``{prefix}audit.tainted`` / ``{prefix}audit.untainted``
    Devices got or lost a taint: a DeviceTaintRule (the shards, which watch them), or a node
    whose agent stopped heartbeating (the inventory, which taints its devices; `removed` follows
    when it withdraws them).

Every event carries an `id` naming the fact it records (e.g. ``placed/<pod uid>``), sent as the
`Nats-Msg-Id` header: JetStream drops a second publish of the same fact within its duplicate
window (a binder that crashed after binding and before acknowledging publishes it again), and the
audit subscriber drops one it has seen recently after that.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Literal

import msgspec

from draplane.messages.refs import ObjectRef

SCHEMA_VERSION = 1
DEFAULT_PREFIX = "draplane."

# A week of history to resume from: the audit subscriber may be down that long and lose nothing.
AUDIT_MAX_AGE_SECONDS = 7 * 24 * 3600.0
# JetStream's memory of message ids; a publisher's retry after a crash lands well within it.
AUDIT_DUPLICATE_WINDOW_SECONDS = 600.0
# An event is a few hundred bytes; one near this is a bug, not a placement.
MAX_EVENT_BYTES = 256 * 1024
# A DeviceTaintRule can select thousands of devices; the event names this many and counts the rest.
MAX_DEVICES_NAMED = 256

# "unreadable" is never published: the audit subscriber writes it for a message it could not read.
Kind = Literal["placed", "rejected", "released", "preempted", "tainted", "untainted", "removed", "conflict",
               "unreadable"]
KINDS: tuple[str, ...] = ("placed", "rejected", "released", "preempted", "tainted", "untainted", "removed", "conflict")


class MessageError(ValueError):
    """Not an audit event of this version. The text says what is wrong."""


class DeviceRef(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    driver: str
    pool: str
    device: str
    request: str = ""  # the claim's request (`req/sub` for a subrequest), for placed/released
    share_id: str | None = None
    admin_access: bool = False
    consumed: dict[str, str] | None = None  # consumed capacity of a share

    def text(self) -> str:
        return f"{self.pool}/{self.device}" + (f" (share {self.share_id})" if self.share_id else "")


class ClaimDevices(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    namespace: str
    name: str
    uid: str
    devices: list[DeviceRef] = msgspec.field(default_factory=list)

    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


# A pod, as the audit names it: the same reference as the scheduling messages'.
PodName = ObjectRef


class AuditEvent(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One fact. `by` lists who took part, the one that decided first ("shard-1", "binder-…",
    "inventory", "taint rule x"); `reason` is why, in the words the user sees elsewhere."""

    version: int = SCHEMA_VERSION
    id: str
    kind: Kind
    at: float  # unix seconds, the publisher's clock
    by: list[str]
    node: str | None = None
    pod: PodName | None = None
    claims: list[ClaimDevices] = msgspec.field(default_factory=list)
    # Devices not tied to a claim: what a taint covers.
    devices: list[DeviceRef] = msgspec.field(default_factory=list)
    # How many devices the event is about when `devices` names only the first MAX_DEVICES_NAMED.
    device_count: int | None = None
    reason: str = ""
    policy: str | None = None
    score: float | None = None
    # Seconds from the pod first seen pending to this event (placed, rejected).
    latency: float | None = None

    def all_devices(self) -> list[DeviceRef]:
        return [d for c in self.claims for d in c.devices] + list(self.devices)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AuditEvent)


def devices_of(allocation) -> list[DeviceRef]:
    """The devices of an AllocationResult, as the audit names them."""
    results = allocation.devices.results if allocation is not None and allocation.devices else None
    return [
        DeviceRef(driver=r.driver, pool=r.pool, device=r.device, request=r.request, share_id=r.share_id,
                  admin_access=bool(r.admin_access), consumed=dict(r.consumed_capacity) if r.consumed_capacity else None)
        for r in results or ()
    ]


def encode_event(event: AuditEvent) -> bytes:
    return _encoder.encode(event)


def decode_event(data: bytes) -> AuditEvent:
    """The event, or MessageError naming what is wrong (size, shape, version)."""
    if len(data) > MAX_EVENT_BYTES:
        raise MessageError(f"audit event of {len(data)} bytes exceeds the limit of {MAX_EVENT_BYTES}")
    try:
        event = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(f"not an audit event: {exc}") from None
    if event.version != SCHEMA_VERSION:
        raise MessageError(f"audit event {event.id!r} has version {event.version}; this build reads {SCHEMA_VERSION}")
    return event


# --- the ids of facts: the same fact always gets the same id ---------------------------------------


def placed_id(pod_uid: str) -> str:
    # A pod is bound once, so its uid names its placement.
    return f"placed/{pod_uid}"


def rejected_id(pod_uid: str, message: str, answer: str = "") -> str:
    """`answer` names the shard's answer (its results-stream sequence): a redelivered answer is the
    same fact. The binder's own verdicts have none; the message then tells them apart."""
    if answer:
        return f"rejected/{pod_uid}/{answer}"
    return f"rejected/{pod_uid}/{_digest(message)}"


def preempted_id(victim_uid: str) -> str:
    # A pod is evicted once: its uid names the fact.
    return f"preempted/{victim_uid}"


def released_id(claim_uid: str, allocated_version: str) -> str:
    """`allocated_version`: the claim's resourceVersion while it held the devices; a claim
    allocated again and released again is another fact."""
    return f"released/{claim_uid}/{allocated_version}"


def double_allocation_id(pair: str) -> str:
    """`pair`: the device and the two claims' uids; the pair on that device is one fact."""
    return f"conflict/{pair}"


def taint_rule_id(kind: str, rule_uid: str, generation: str) -> str:
    """`generation`: the rule's metadata.generation, which only a change of its spec moves."""
    return f"{kind}/rule/{rule_uid}/{generation}"


def stale_node_id(kind: str, node: str, since: str) -> str:
    return f"{kind}/node/{node}/{since}"


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


# --- names -----------------------------------------------------------------------------------------

_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


@dataclasses.dataclass(frozen=True, slots=True)
class AuditNames:
    prefix: str = DEFAULT_PREFIX

    def subject(self, kind: str) -> str:
        return f"{self.prefix}audit.{kind}"

    @property
    def wildcard(self) -> str:
        return f"{self.prefix}audit.>"

    @property
    def stream(self) -> str:
        return _NAME_UNSAFE.sub("_", self.prefix.rstrip(".")).upper() + "_AUDIT"

    @property
    def consumer(self) -> str:
        return "audit"

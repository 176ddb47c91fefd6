"""Inventory messages: node agents -> inventory service -> allocators (the inventory feed).

Subjects (`prefix` defaults to ``draplane.``; node names may contain dots, so the node is everything
after the fixed part of the subject, never one token):

``{prefix}inventory.snapshot.<node>``
    `NodeSnapshot`, published by the node's agent through JetStream at start, after every change
    and after every reconnect. Captured by the stream `InventoryNames.stream` (file storage,
    ``max_msgs_per_subject=1``: the latest snapshot of each node survives restarts of NATS and of
    the inventory service, which reads it with the durable consumer `InventoryNames.consumer`).
``{prefix}inventory.heartbeat.<node>``
    `Heartbeat`, core NATS, every few seconds. Only "now" matters for liveness, so it is not stored.
``{prefix}inventory.changes.<key>``
    `FeedChange`, core NATS, published by the inventory service after every feed update.

The inventory feed is the JetStream key-value bucket `InventoryNames.feed_bucket`. Keys:
``node.<nodeName>`` holds a `FeedEntry` with every ResourceSlice of that node, whatever driver
wrote it; ``pool.<driver>.<pool>`` holds the slices of a pool that is not local to one node
(``allNodes``, ``nodeSelector``, ``perDeviceNodeSelection``); ``class.<name>`` holds a DeviceClass
(`FeedEntry.device_class`, no slices), so that a reader of NATS alone knows the classes. A deleted
key means the node, pool or class is gone. Allocators watch the bucket (history 1, so a new watcher gets the current state, then every
change) and never list ResourceSlices from Kubernetes.

Node agents may publish only on their own two subjects (NATS permissions, see
`draplane.nats_roles.node_agent_permissions`); the inventory service still checks that the body names the subject's node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Literal

import msgspec

from draplane.api.resource import CounterSet, Device, DeviceClass, ResourceSlice

SCHEMA_VERSION = 1
DEFAULT_PREFIX = "draplane."

# A snapshot of a node with 8 MIG-capable GPUs is ~40 KiB; anything near NATS' default 1 MiB payload
# limit is a bug or an attack, and is rejected before decoding.
MAX_MESSAGE_BYTES = 512 * 1024


class MessageError(ValueError):
    """A message that is not acceptable. `reason` is a short metric label, the text says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# --- messages ----------------------------------------------------------------------------------


class Message(msgspec.Struct, rename="camel", omit_defaults=True, kw_only=True):
    pass


class DriverDevices(Message, kw_only=True):
    """The devices one DRA driver publishes for the node: one pool, named after the node."""

    driver: str
    devices: list[Device] = msgspec.field(default_factory=list)
    # Partitionable devices: each GPU's counter set; the devices' consumesCounters refer to them.
    counter_sets: list[CounterSet] = msgspec.field(default_factory=list)


class NodeSnapshot(Message, tag="snapshot", kw_only=True):
    schema_version: int
    node: str
    agent_id: str  # random per agent process: sequences restart with it
    sequence: int  # per agent, +1 for every message it sends
    sent_at: float  # unix seconds
    drivers: list[DriverDevices]

    def digest(self) -> str:
        return drivers_digest(self.drivers)


class Heartbeat(Message, tag="heartbeat", kw_only=True):
    schema_version: int
    node: str
    agent_id: str
    sequence: int
    sent_at: float
    snapshot_sequence: int  # the sequence of the last snapshot the agent sent
    snapshot_digest: str  # `drivers_digest` of that snapshot


AgentMessage = NodeSnapshot | Heartbeat


class FeedEntry(Message, kw_only=True):
    """The value of one key of the inventory feed bucket."""

    schema_version: int
    key: str
    node: str | None = None  # set for ``node.<name>`` keys
    stale: bool = False  # the node's agent missed its heartbeats: its devices are tainted
    slices: list[ResourceSlice] = msgspec.field(default_factory=list)
    # set for ``class.<name>`` keys (which have no slices); readers that predate it ignore it
    device_class: DeviceClass | None = None


class FeedChange(Message, kw_only=True):
    schema_version: int
    key: str
    kind: Literal["put", "delete"]
    revision: int  # the bucket revision of the put or delete; 0 when unknown
    device_count: int = 0


class _Envelope(msgspec.Struct, rename="camel", kw_only=True):
    # Read first, with nothing else, so a message from a newer agent is reported as a version
    # mismatch rather than as a confusing field error.
    type: str | None = None
    schema_version: int | None = None
    node: str | None = None


# --- encoding ----------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_agent_decoder = msgspec.msgpack.Decoder(AgentMessage)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_feed_decoder = msgspec.msgpack.Decoder(FeedEntry)
_change_decoder = msgspec.msgpack.Decoder(FeedChange)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def drivers_digest(drivers: list[DriverDevices]) -> str:
    return hashlib.sha256(_encoder.encode(drivers)).hexdigest()[:32]


def decode_agent_message(data: bytes) -> NodeSnapshot | Heartbeat:
    """Decode what an agent sent, or raise MessageError(reason in oversized|malformed|version)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError("oversized", f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    try:
        envelope = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError("malformed", f"not an inventory message: {exc}") from None
    if envelope.schema_version != SCHEMA_VERSION:
        raise MessageError(
            "version",
            f"{envelope.type or 'message'} from node {envelope.node!r} has schemaVersion "
            f"{envelope.schema_version!r}; this service reads version {SCHEMA_VERSION}",
        )
    try:
        return _agent_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError("malformed", f"{envelope.type or 'message'} from node {envelope.node!r}: {exc}") from None


def decode_feed_entry(data: bytes) -> FeedEntry:
    """A value of the inventory feed bucket, or raise MessageError(reason in malformed|version)."""
    return _decode_feed(_feed_decoder, data, "inventory feed entry")


def decode_feed_change(data: bytes) -> FeedChange:
    """A feed change announcement, or raise MessageError(reason in malformed|version)."""
    return _decode_feed(_change_decoder, data, "inventory feed change")


def _decode_feed(decoder: msgspec.msgpack.Decoder, data: bytes, what: str):
    # No size limit: a node's entry grows with its slices and the bucket is written by the
    # inventory service alone. The version is read first, as for agent messages.
    try:
        envelope = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError("malformed", f"not an {what}: {exc}") from None
    if envelope.schema_version != SCHEMA_VERSION:
        raise MessageError("version", f"{what} has schemaVersion {envelope.schema_version!r}; "
                           f"this service reads version {SCHEMA_VERSION}")
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError("malformed", f"{what}: {exc}") from None


# --- names -------------------------------------------------------------------------------------

_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


@dataclasses.dataclass(frozen=True, slots=True)
class InventoryNames:
    """Every subject, stream, consumer and bucket name of the inventory flow, for one prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix.endswith(".") or ".." in self.prefix or self.prefix.startswith("."):
            raise ValueError(f"subject prefix {self.prefix!r} must be dot-separated tokens ending in '.'")

    @property
    def _token(self) -> str:
        # Stream, consumer and bucket names cannot contain dots.
        return _NAME_UNSAFE.sub("_", self.prefix.rstrip("."))

    def snapshot_subject(self, node: str) -> str:
        return f"{self.prefix}inventory.snapshot.{node}"

    def heartbeat_subject(self, node: str) -> str:
        return f"{self.prefix}inventory.heartbeat.{node}"

    @property
    def snapshot_wildcard(self) -> str:
        return f"{self.prefix}inventory.snapshot.>"

    @property
    def heartbeat_wildcard(self) -> str:
        return f"{self.prefix}inventory.heartbeat.>"

    def change_subject(self, key: str) -> str:
        return f"{self.prefix}inventory.changes.{key}"

    @property
    def change_wildcard(self) -> str:
        return f"{self.prefix}inventory.changes.>"

    @property
    def stream(self) -> str:
        return f"{self._token.upper()}_INVENTORY"

    @property
    def consumer(self) -> str:
        return f"{self._token}-inventory"

    @property
    def feed_bucket(self) -> str:
        return f"{self._token}-inventory-feed"

    def node_from_subject(self, subject: str) -> tuple[str, str]:
        """(kind, node) of an agent subject: kind is 'snapshot' or 'heartbeat'."""
        for kind in ("snapshot", "heartbeat"):
            head = f"{self.prefix}inventory.{kind}."
            if subject.startswith(head) and len(subject) > len(head):
                return kind, subject[len(head):]
        raise MessageError("subject", f"subject {subject!r} is not an inventory agent subject under {self.prefix!r}")

    @staticmethod
    def node_key(node: str) -> str:
        return f"node.{node}"

    @staticmethod
    def class_key(name: str) -> str:
        return f"class.{name}"

    @staticmethod
    def pool_key(driver: str, pool: str) -> str:
        return f"pool.{driver}.{_NAME_UNSAFE.sub('_', pool)}"

    def agent_inbox_prefix(self, node: str) -> str:
        return f"_INBOX_{_NAME_UNSAFE.sub('_', node)}"

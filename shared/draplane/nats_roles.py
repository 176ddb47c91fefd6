"""What each draplane identity may do on NATS: the one definition of every permission set.

Each process authenticates as one role and gets the least it needs: the subjects it publishes
and subscribes to, and, for JetStream, the API subjects (`$JS.API...`) of the streams, consumers
and key-value buckets it uses, and the `$KV.<bucket>.>` subjects of the buckets it may write.
Both `draplane up` (`draplane.localenv.natsauth_local`) and deploy/'s rendered auth config
(`draplane.natsauth`) take their permissions from here, so the two cannot drift apart.

Who writes what:

| role | publishes | key-value buckets written |
| --- | --- | --- |
| node agent | its own nodes' snapshot and heartbeat subjects | none |
| inventory | feed change events, audit (node stale) events | the inventory feed |
| allocator (every shard) | placements, audit (taint rule) events | reservations (compare-and-set) |
| binder | pending pods (to the shards), releases, audit (placed, released, rejected, preempted, conflict) events | reservations (leases), the cluster bucket |

| audit | nothing but acknowledgements of its own consumer | none |
| reader (`draplane free`, `draplane dashboard`) | nothing | none |

Shards read the cluster bucket (the binder's view of Kubernetes) and hold no Kubernetes client.
The audit service's metrics and the reader read its DeviceTaintRules (the `taintrule.>` keys)
for the devices' states; NATS grants reading a bucket whole, so they may read the rest of it too.

Every role reads replies only under an inbox prefix of its own (`inbox_prefix`): a client must
connect with it (`nats.connect(inbox_prefix=...)`), and no other identity can read its replies.
Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import re

from draplane.messages.audit import AuditNames
from draplane.messages.inventory import InventoryNames
from draplane.scheduling.messages import Subjects

JS_API = "$JS.API"

# The roles a service process takes; node agents are a role of their own, keyed by their nodes.
SERVICE_ROLES = ("inventory", "allocator", "binder", "audit", "reader")

# The audit event kinds each publisher sends (draplane.messages.audit): nobody may forge another's.
_AUDIT_KINDS = {
    "inventory": ("tainted", "untainted", "removed"),
    "allocator": ("tainted", "untainted"),
    "binder": ("placed", "released", "rejected", "preempted", "conflict"),
}

_INBOX_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


@dataclasses.dataclass(frozen=True, slots=True)
class Permissions:
    """A nats-server `permissions` block, and the inbox prefix its client must connect with."""

    role: str
    inbox_prefix: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...] = ()

    def config(self) -> dict:
        """The block as nats-server reads it (its config accepts JSON)."""
        publish: dict = {"allow": list(self.publish)}
        if self.deny_publish:
            publish["deny"] = list(self.deny_publish)
        return {"publish": publish, "subscribe": {"allow": list(self.subscribe)}}


def service_inbox_prefix(role: str) -> str:
    return f"_INBOX_{role}"


def fleet_inbox_prefix(node_prefix: str) -> str:
    """The inbox of a process simulating many nodes (`draplane-node-agent --nodes N`). Node names
    have no underscore, so `_INBOX_fleet_x` is never a single node's `_INBOX_<node>`."""
    return f"_INBOX_fleet_{_INBOX_UNSAFE.sub('_', node_prefix)}"


# --- JetStream building blocks ---------------------------------------------------------------------


def _stream_owner(stream: str) -> list[str]:
    """Create (idempotently, at start), update and inspect a stream: a service that ensures it exists."""
    return [f"{JS_API}.STREAM.CREATE.{stream}", f"{JS_API}.STREAM.UPDATE.{stream}", f"{JS_API}.STREAM.INFO.{stream}"]


def _message_reader(stream: str) -> list[str]:
    """Read single messages of a stream (the latest of a subject, by sequence)."""
    return [f"{JS_API}.STREAM.MSG.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}.>"]


def _durable_consumer(stream: str, durable: str) -> list[str]:
    """Create, inspect, pull from and acknowledge one durable consumer (and delete it, which the
    audit subscriber does to resume right after its log)."""
    api = f"{JS_API}.CONSUMER"
    return [
        f"{api}.CREATE.{stream}.{durable}", f"{api}.CREATE.{stream}.{durable}.>",
        f"{api}.DURABLE.CREATE.{stream}.{durable}", f"{api}.INFO.{stream}.{durable}",
        f"{api}.DELETE.{stream}.{durable}", f"{api}.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    ]


def _ephemeral_consumers(stream: str) -> list[str]:
    """Read a stream through consumers named by the client library (ordered key-value watchers,
    unacknowledged pull consumers), and flow-control replies to the ordered ones."""
    api = f"{JS_API}.CONSUMER"
    return [
        f"{api}.CREATE.{stream}", f"{api}.CREATE.{stream}.>", f"{api}.INFO.{stream}.*",
        f"{api}.DELETE.{stream}.*", f"{api}.MSG.NEXT.{stream}.*", f"$JS.FC.{stream}.>",
    ]


def _bucket_reader(bucket: str) -> list[str]:
    stream = f"KV_{bucket}"
    return [f"{JS_API}.STREAM.INFO.{stream}", *_message_reader(stream), *_ephemeral_consumers(stream)]


def _bucket_writer(bucket: str) -> list[str]:
    """Read the bucket, create it if missing, and put, compare-and-set or delete its keys."""
    return [*_bucket_reader(bucket), f"{JS_API}.STREAM.CREATE.KV_{bucket}", f"$KV.{bucket}.>"]


def _audit_publisher(audit: AuditNames, role: str) -> list[str]:
    return [*_stream_owner(audit.stream), *(audit.subject(kind) for kind in _AUDIT_KINDS[role])]


def _denied_durables(stream: str, durables: list[str]) -> list[str]:
    # A reader's ephemeral-consumer rights use wildcards over consumer names; without these a
    # reader could pull from (and so delay) a service's durable consumer of the same stream.
    api = f"{JS_API}.CONSUMER"
    return [s for d in durables for s in (f"{api}.MSG.NEXT.{stream}.{d}", f"{api}.DELETE.{stream}.{d}",
                                          f"{api}.CREATE.{stream}.{d}", f"{api}.CREATE.{stream}.{d}.>",
                                          f"{api}.DURABLE.CREATE.{stream}.{d}")]


# --- the roles -------------------------------------------------------------------------------------


def node_agent_permissions(nodes: list[str], names: InventoryNames, *, inbox_prefix: str | None = None) -> Permissions:
    """The agent of `nodes` (one node, or a simulated fleet): publish those nodes' snapshots
    (through JetStream, whose acknowledgement comes to its inbox) and heartbeats, nothing else:
    no other node's subjects, no JetStream API, no other inbox."""
    if not nodes:
        raise ValueError("a node agent's permissions need at least one node")
    inbox = inbox_prefix or names.agent_inbox_prefix(nodes[0])
    publish = [s for node in nodes for s in (names.snapshot_subject(node), names.heartbeat_subject(node))]
    return Permissions("node-agent", inbox, tuple(publish), (f"{inbox}.>",))


def service_permissions(role: str, prefix: str) -> Permissions:
    """The permissions of one service role (SERVICE_ROLES) under a subject prefix."""
    inventory, scheduling, audit = InventoryNames(prefix), Subjects(prefix=prefix), AuditNames(prefix)
    inbox = service_inbox_prefix(role)
    feed, reservations, cluster = inventory.feed_bucket, scheduling.reservations_bucket, scheduling.cluster_bucket
    scheduling_streams = [scheduling.pending_stream, scheduling.results_stream, scheduling.released_stream]
    account_info = f"{JS_API}.INFO"
    deny: list[str] = []
    if role == "inventory":
        publish = [
            account_info, *_stream_owner(inventory.stream),
            *_durable_consumer(inventory.stream, inventory.consumer),
            *_ephemeral_consumers(inventory.stream),  # the snapshot stream read once at start
            *_message_reader(inventory.stream),
            *_bucket_writer(feed), inventory.change_wildcard,
            *_audit_publisher(audit, role),
        ]
        subscribe = [inventory.heartbeat_wildcard]
    elif role == "allocator":
        # Shard i's durable consumer is shard-<i>; the pending stream has no other consumer, so
        # every shard may use any of its consumers (the shards share one identity).
        shard_consumers = _durable_consumer(scheduling.pending_stream, "*")
        publish = [
            account_info, *(s for stream in scheduling_streams for s in _stream_owner(stream)),
            *shard_consumers, scheduling.results,
            *_bucket_writer(reservations), *_bucket_reader(feed), *_bucket_reader(cluster),
            *_audit_publisher(audit, role),
        ]
        subscribe = []
    elif role == "binder":
        publish = [
            account_info, *(s for stream in scheduling_streams for s in _stream_owner(stream)),
            *_durable_consumer(scheduling.results_stream, "binder"),
            scheduling.pending_all, scheduling.released,
            # a pod deleted while its PendingPod waits: the message is withdrawn from the queue
            f"{JS_API}.STREAM.MSG.DELETE.{scheduling.pending_stream}",
            *_bucket_writer(reservations), *_bucket_writer(cluster), *_bucket_writer(scheduling.gang_permits_bucket),
            *_audit_publisher(audit, role),
        ]
        subscribe = []
    elif role == "audit":
        publish = [
            account_info, *_stream_owner(audit.stream), *_durable_consumer(audit.stream, audit.consumer),
            *_bucket_reader(feed), *_bucket_reader(reservations), *_bucket_reader(cluster),
        ]
        subscribe = []
    elif role == "reader":
        publish = [
            account_info, f"{JS_API}.STREAM.INFO.{audit.stream}", *_ephemeral_consumers(audit.stream),
            *_bucket_reader(feed), *_bucket_reader(reservations), *_bucket_reader(cluster),
        ]
        deny = _denied_durables(audit.stream, [audit.consumer])
        # The dashboard sees pending pods and placements as they are published, without taking
        # part in the work queues (plain subscriptions, not consumers).
        subscribe = [scheduling.pending_all, scheduling.results]
    else:
        raise ValueError(f"unknown NATS role {role!r}; roles are {list(SERVICE_ROLES)} and node agents")
    return Permissions(role, inbox, tuple(publish), (*subscribe, f"{inbox}.>"), tuple(deny))

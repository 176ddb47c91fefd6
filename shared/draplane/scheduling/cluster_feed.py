"""The cluster as the shards see it: what the binder publishes from its watches, one key per object.

Shards hold no Kubernetes client. Everything they need besides the inventory feed and the
reservations comes from one JetStream key-value bucket that the binder (the one component watching
Kubernetes) fills from its list-and-watch:

| key | value |
| --- | --- |
| `class.<name>` | a DeviceClass |
| `node.<name>` | a Node: labels, taints, unschedulable, capacity, allocatable and declared features (no conditions) |
| `taintrule.<name>` | a DeviceTaintRule |
| `podgroup.<namespace>.<name>` | a PodGroup |
| `pdb.<namespace>.<name>` | a PodDisruptionBudget |
| `claim.<uid>` | a ResourceClaim: spec, allocation and reservedFor (every claim, whoever allocated it) |
| `pod.<uid>` | a pod bound to a node, or a gang member, and not finished: what node fit, preemption and gangs read |
| `meta.synced` | written once every watch above has listed: the bucket holds the whole cluster |
| `meta.binder` | the binder's heartbeat, every HEARTBEAT_SECONDS: the bucket mirrors Kubernetes until about then |

Values are the API structs of draplane.api encoded as msgpack, trimmed to what scheduling reads:
no managedFields, annotations (but a PodGroup's), resourceVersion, conditions or container images.
So a write that changes nothing the shards read (a node's heartbeat, a claim's device status, a
pod's conditions) trims to the same bytes, and the binder does not publish it: the bucket carries
deltas only. The bucket keeps one revision per key, so a restarted shard that watches it from the
start gets the current cluster and nothing older.

Pure: no I/O. The binder's publisher is draplane_binder.cluster_publisher, the shards' reader is
in draplane_allocator.shard.
"""

from __future__ import annotations

import msgspec

from draplane.api.core import Affinity, Container, Node, NodeStatus, Pod, PodSpec, PodStatus
from draplane.api.meta import ObjectMeta
from draplane.api.policy import PodDisruptionBudget
from draplane.api.resource import DeviceClass, DeviceTaintRule, ResourceClaim, ResourceClaimStatus
from draplane.api.scheduling import PodGroup

SYNCED_KEY = "meta.synced"
HEARTBEAT_KEY = "meta.binder"
HEARTBEAT_SECONDS = 2.0
# A heartbeat at time t says: what the binder's watches took in until t - this is in the bucket
# (the watch's own delay, and puts of one round landing in any order).
HEARTBEAT_MARGIN_SECONDS = 5.0

# kind -> key prefix; the order is the order a fresh shard most wants them (none depends on another)
PREFIXES: dict[type, str] = {
    DeviceClass: "class", Node: "node", DeviceTaintRule: "taintrule", PodGroup: "podgroup",
    PodDisruptionBudget: "pdb", ResourceClaim: "claim", Pod: "pod",
}
_BY_PREFIX = {prefix: kind for kind, prefix in PREFIXES.items()}
_NAMESPACED_BY_NAME = (PodGroup, PodDisruptionBudget)
_BY_UID = (ResourceClaim, Pod)
_DECODERS = {kind: msgspec.msgpack.Decoder(kind) for kind in PREFIXES}
_ENCODER = msgspec.msgpack.Encoder()


class FeedError(ValueError):
    """A key or value in the cluster bucket that cannot be read (another schema, corruption)."""


class Synced(msgspec.Struct, kw_only=True):
    """The value of SYNCED_KEY (who filled the bucket, and when) and of HEARTBEAT_KEY (who
    keeps it, and when it last said so)."""

    binder: str
    at: float


def key_of(obj) -> str:
    """The object's key in the bucket. Kubernetes names ([a-z0-9.-]) and uids are valid key tokens."""
    kind = type(obj)
    meta = obj.metadata
    if kind in _BY_UID:
        token = meta.uid
    elif kind in _NAMESPACED_BY_NAME:
        token = f"{meta.namespace}.{meta.name}" if meta.namespace and meta.name else None
    else:
        token = meta.name
    if not token:
        raise FeedError(f"{kind.__name__} {meta.namespace or ''}/{meta.name or ''}: no "
                        f"{'uid' if kind in _BY_UID else 'name'} to key it by")
    return f"{PREFIXES[kind]}.{token}"


def claim_key(uid: str) -> str:
    """The key of the ResourceClaim with this uid (`key_of` for a claim known by its uid alone)."""
    return f"{PREFIXES[ResourceClaim]}.{uid}"


def kind_of_key(key: str) -> type | None:
    """The kind a key holds; None for SYNCED_KEY and for keys of a newer binder."""
    return _BY_PREFIX.get(key.split(".", 1)[0])


def published_pod(pod: Pod) -> bool:
    """Shards count bound pods until they finish. Pending ones reach them in their PendingPods,
    but a gang's pending members are published too: a gang waits for its members, and a shard must
    see one that is deleted while it waits, or the gang is placed with a hole in it."""
    phase = pod.status.phase if pod.status else None
    in_a_group = pod.spec.scheduling_group is not None and bool(pod.spec.scheduling_group.pod_group_name)
    return (bool(pod.spec.node_name) or in_a_group) and phase not in ("Succeeded", "Failed")


def _meta(meta: ObjectMeta, *, annotations: bool = False) -> ObjectMeta:
    return ObjectMeta(name=meta.name, namespace=meta.namespace, uid=meta.uid, generation=meta.generation,
                      deletion_timestamp=meta.deletion_timestamp, labels=meta.labels,
                      annotations=meta.annotations if annotations else None,
                      owner_references=meta.owner_references)


def _container(container: Container) -> Container:
    # of its ports, only those that hold a host port (NodePorts); restartPolicy tells a sidecar
    host_ports = [p for p in container.ports or () if (p.host_port or 0) > 0]
    return Container(name=container.name, resources=container.resources, ports=host_ports or None,
                     restart_policy=container.restart_policy)


def _pod_affinity_only(affinity: Affinity | None) -> Affinity | None:
    """Of a bound pod's affinity, what other pods' placement reads: its pod affinity and
    anti-affinity terms (required anti-affinity filters them; the others score their nodes). Its
    node affinity concerns itself only."""
    if affinity is None or (affinity.pod_affinity is None and affinity.pod_anti_affinity is None):
        return None
    return Affinity(pod_affinity=affinity.pod_affinity, pod_anti_affinity=affinity.pod_anti_affinity)


def trimmed(obj):
    """The object as far as scheduling reads it."""
    replace = msgspec.structs.replace
    if isinstance(obj, Pod):
        spec = obj.spec
        status = obj.status
        return Pod(
            metadata=_meta(obj.metadata),
            spec=PodSpec(containers=[_container(c) for c in spec.containers],
                         init_containers=[_container(c) for c in spec.init_containers] if spec.init_containers else None,
                         node_name=spec.node_name, resource_claims=spec.resource_claims, overhead=spec.overhead,
                         priority=spec.priority, priority_class_name=spec.priority_class_name,
                         preemption_policy=spec.preemption_policy,
                         termination_grace_period_seconds=spec.termination_grace_period_seconds,
                         scheduling_group=spec.scheduling_group, affinity=_pod_affinity_only(spec.affinity)),
            status=PodStatus(phase=status.phase, resource_claim_statuses=status.resource_claim_statuses,
                             start_time=status.start_time) if status else None,
        )
    if isinstance(obj, Node):
        status = obj.status
        return Node(metadata=_meta(obj.metadata), spec=obj.spec,
                    status=NodeStatus(capacity=status.capacity, allocatable=status.allocatable,
                                      declared_features=status.declared_features) if status else None)
    if isinstance(obj, ResourceClaim):
        status = obj.status
        return replace(obj, metadata=_meta(obj.metadata),
                       status=ResourceClaimStatus(allocation=status.allocation, reserved_for=status.reserved_for)
                       if status else None)
    if isinstance(obj, PodGroup):
        return replace(obj, metadata=_meta(obj.metadata, annotations=True))
    if isinstance(obj, (DeviceClass, DeviceTaintRule, PodDisruptionBudget)):
        return replace(obj, metadata=_meta(obj.metadata))
    raise FeedError(f"{type(obj).__name__} is not a kind of the cluster feed")


def encode(obj) -> bytes:
    """The bucket value of an object (trimmed)."""
    return _ENCODER.encode(trimmed(obj))


def decode(key: str, value: bytes):
    """The object a bucket entry holds. Raises FeedError, naming the key, for anything unreadable."""
    kind = kind_of_key(key)
    if kind is None:
        raise FeedError(f"cluster feed key {key!r}: not a kind this shard knows")
    try:
        obj = _DECODERS[kind].decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FeedError(f"cluster feed key {key!r}: not a {kind.__name__}: {exc}") from None
    if key_of(obj) != key:
        raise FeedError(f"cluster feed key {key!r} holds {kind.__name__} {key_of(obj)!r}")
    return obj


def encode_synced(synced: Synced) -> bytes:
    return _ENCODER.encode(synced)


def decode_synced(value: bytes, key: str = SYNCED_KEY) -> Synced:
    try:
        return msgspec.msgpack.decode(value, type=Synced)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FeedError(f"cluster feed key {key!r}: {exc}") from None

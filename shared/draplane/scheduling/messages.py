"""Versioned messages between the binder and the allocator shards, and their NATS subjects.

Flow: binder --PendingPod--> shard (partitioned) --Placement | Unschedulable--> binder;
binder --ClaimReleased--> every shard (and any audit subscriber).

The wire types are decoded once at the edge with `decode_message`; a message with another schema
version or a malformed body is rejected with a `MessageError` naming what is wrong.
"""

from __future__ import annotations

import hashlib
import re

import msgspec

from draplane.api.core import PodSpec
from draplane.api.policy import LabelSelector
from draplane.api.resource import AllocationResult, ResourceClaim
from draplane.messages.refs import ObjectRef
from draplane.scheduling.framework.plugins.volume_binding import PodVolumes

SCHEMA_VERSION = 1
DEFAULT_PREFIX = "draplane."


class MessageError(ValueError):
    """A message that is not one of ours: wrong version, wrong shape. The text names the field."""


# A pod and a claim, as the messages name them (draplane.messages.refs: one struct for both).
PodRef = ObjectRef
ClaimRef = ObjectRef


class ClaimSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One of a pending pod's claims as the binder's cache held it when it sent the pod, trimmed as
    the cluster bucket trims it (cluster_feed.trimmed), with the bucket revision that holds this
    very value: 0 when its write had not landed yet. A shard whose own copy of the claim comes from
    that revision or a later one takes its own (it may be newer); otherwise the snapshot."""

    claim: ResourceClaim
    revision: int = 0


# The claim snapshots a PendingPod carries at most, encoded: a pod with more (dozens of claims, or
# claims with long CEL selectors) is sent with references alone, and the shard waits for its
# claims in the cluster bucket instead (`cluster_revision`).
MAX_CLAIM_SNAPSHOT_BYTES = 64 * 1024


class PendingPod(msgspec.Struct, tag="pending", kw_only=True):
    """A pod whose claims all exist and which needs a node and devices.

    The claims travel by reference (`claims`) and, unless they are large, as snapshots too
    (`claim_snapshots`): the shard places the pod at once, rather than waiting for the cluster
    bucket to hold claims the binder has just created (each shard follows every claim there, and a
    write hurried for one pod reaches every shard alone, at several times the cost of one in a
    gathered round: bench/nats_receive.py).
    """

    version: int = SCHEMA_VERSION
    pod: PodRef
    claims: list[ClaimRef]
    # Wall-clock seconds when the binder first saw the pod pending; carried for latency figures.
    first_seen: float
    attempt: int = 0
    # The pod's spec as far as scheduling reads it (requests, node selector, affinity,
    # tolerations; immutable while the pod is pending). With it a shard needs to watch only
    # bound pods, not every change of every pending one. None from a binder that predates it:
    # the shard then reads the pod.
    spec: PodSpec | None = None
    # The pod's labels: other pods' (anti-)affinity terms select it by them. None from an older binder.
    labels: dict[str, str] | None = None
    # The cluster bucket's revision once what the shard must read from it was in it
    # (draplane.scheduling.cluster_feed): the pod's claims when they travel by reference alone, a
    # gang member's own pod. A shard whose watch of the bucket is behind that waits for it, rather
    # than take an object it has not heard of yet for one that does not exist. 0: nothing to wait for.
    cluster_revision: int = 0
    # The pod's claims (`claims`' order); None when they travel by reference alone (too large for
    # the message, or an older binder).
    claim_snapshots: list[ClaimSnapshot] | None = None
    # What the binder's VolumeBinding PreFilter found of the pod's PersistentVolumeClaims: the
    # shard's Filter reads it per node (draplane.scheduling.framework.plugins.volume_binding). None: no claims, or
    # an older binder.
    volumes: PodVolumes | None = None
    # The pod's extended resources that DRA serves through the claim made for it (KEP-5004, its
    # ClaimRef is among `claims`): node fit does not count them against allocatable.
    dra_extended_resources: list[str] | None = None
    # kube-scheduler's default spreading, for a pod without topologySpreadConstraints: the selector
    # of the pods its Services and controller select (pod_topology_spread.default_selector). None:
    # none selects it, or an older binder.
    default_spread: LabelSelector | None = None


class ClaimPlacement(msgspec.Struct, kw_only=True):
    claim: ClaimRef
    allocation: AllocationResult


class GangCommit(msgspec.Struct, frozen=True, kw_only=True):
    """The members of a gang that one shard placed together, by one commit: each member's
    Placement carries it, and the binder binds none of them until all have passed Permit."""

    key: str  # the PodGroup, namespace/name
    commit: str  # the commit's id, the same in each member's Placement
    members: int  # how many members the commit placed


class Placement(msgspec.Struct, tag="placement", kw_only=True):
    """A committed reservation: the binder writes it to Kubernetes, or releases it."""

    version: int = SCHEMA_VERSION
    pod: PodRef
    node: str
    claims: list[ClaimPlacement]
    shard: int
    first_seen: float
    # The reservation's lease; a placement that reaches the binder after it is dropped.
    expires_at: float
    # The scoring policy and its score of this placement, for the audit log (None: nothing was
    # newly allocated, or a shard that predates them).
    policy: str | None = None
    score: float | None = None
    # A gang member placed with others (None: a pod placed alone, or a shard that predates it).
    gang: GangCommit | None = None


class NodeFailure(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    reason: str  # one of draplane.scheduling.unschedulable.FailureReason values
    detail: str = ""
    # What kube-scheduler's message counts for this node, in its words ("Insufficient cpu",
    # "cannot allocate all claims: ..."); the same for every node that failed alike.
    reasons: list[str] = msgspec.field(default_factory=list)


class Preemption(msgspec.Struct, frozen=True, kw_only=True):
    """The lower-priority pods whose eviction lets an unschedulable pod fit on `node`."""

    node: str
    victims: list[PodRef]
    # Why these and not others, in words, for the preemptor's condition and the victims' Events.
    explanation: str


class Unschedulable(msgspec.Struct, tag="unschedulable", kw_only=True):
    version: int = SCHEMA_VERSION
    pod: PodRef
    shard: int
    message: str
    # Failures per node, so `draplane explain` and the pod's Event can say what failed where.
    failures: list[NodeFailure] = msgspec.field(default_factory=list)
    # A problem with the pod or its claims themselves (unknown class, bad selector): no node helps.
    claim_error: str = ""
    # Set when the pod has a higher priority than pods whose eviction would let it fit: the binder
    # evicts them and nominates the node (an older shard never sets it).
    preemption: Preemption | None = None
    # The metric label the shard chose (draplane.scheduling.unschedulable's GANG_* ones), where the
    # failures cannot say why: "" means the binder derives it from `failures` and `claim_error`.
    label: str = ""
    # The attempt ended on an error (kube-scheduler's SchedulerError condition), not on a verdict
    # that no node fits; the message is the error. False from an older shard.
    error: bool = False


class ClaimReleased(msgspec.Struct, tag="released", kw_only=True):
    """A claim's devices are free again: the claim was deleted or its allocation was cleared."""

    version: int = SCHEMA_VERSION
    claim: ClaimRef
    node: str | None = None


SchedulingMessage = PendingPod | Placement | Unschedulable | ClaimReleased

class _Envelope(msgspec.Struct):
    # Read first, with nothing else, so that a message of another version is reported as such even
    # when its fields changed shape (which the full decode would report as a field error).
    type: str | None = None
    version: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SchedulingMessage)
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_NAMES = {"pending": "PendingPod", "placement": "Placement", "unschedulable": "Unschedulable", "released": "ClaimReleased"}


def encode_message(message: SchedulingMessage) -> bytes:
    return _encoder.encode(message)


def decode_message(data: bytes) -> SchedulingMessage:
    try:
        envelope = _envelope_decoder.decode(data)
        if envelope.version is not None and envelope.version != SCHEMA_VERSION:
            name = _NAMES.get(envelope.type or "", "scheduling message")
            raise MessageError(f"{name}: field version is {envelope.version}, this build reads {SCHEMA_VERSION}")
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise MessageError(f"scheduling message: {exc}") from None


# --- subjects and partitioning ---------------------------------------------------------------------


class Subjects(msgspec.Struct, frozen=True, kw_only=True):
    """Subject and JetStream names derived from one prefix, so tests can run side by side."""

    prefix: str = DEFAULT_PREFIX

    def pending(self, shard: int) -> str:
        return f"{self.prefix}pending.{shard}"

    @property
    def pending_all(self) -> str:
        return f"{self.prefix}pending.*"

    @property
    def results(self) -> str:
        return f"{self.prefix}placement"

    @property
    def released(self) -> str:
        return f"{self.prefix}released"

    def _name(self, suffix: str) -> str:
        # Stream and bucket names allow only [A-Za-z0-9_-].
        return re.sub(r"[^A-Za-z0-9_-]", "_", self.prefix.rstrip(".")).upper() + "_" + suffix

    @property
    def pending_stream(self) -> str:
        return self._name("PENDING")

    @property
    def results_stream(self) -> str:
        return self._name("PLACEMENTS")

    @property
    def released_stream(self) -> str:
        return self._name("RELEASED")

    @property
    def reservations_bucket(self) -> str:
        return self._name("RESERVATIONS")

    @property
    def cluster_bucket(self) -> str:
        """The binder's view of Kubernetes for the shards (draplane.scheduling.cluster_feed)."""
        return self._name("CLUSTER")

    @property
    def gang_permits_bucket(self) -> str:
        """The gang commits whose Permit barrier opened, kept a while for a binder that restarts
        (draplane_binder.gang_permits)."""
        return self._name("GANG_PERMITS")


def partition_key(pending: PendingPod) -> str:
    """Pods that share a claim must land on one shard, or two shards could allocate that claim
    at once; the lexicographically first claim is shared by all its pods, so key on it.
    Pods whose placement counts other pods (spread, pod affinity, required or preferred) key on
    their namespace.

    The members of a gang (the pods naming one PodGroup in spec.schedulingGroup) go to one shard,
    which places them together: they key on their PodGroup. A claim shared by a gang member and
    a pod outside the gang is the one case this cannot keep on one shard."""
    spec = pending.spec
    group = spec.scheduling_group if spec is not None else None
    if group is not None and group.pod_group_name:
        return f"podgroup:{pending.pod.namespace}/{group.pod_group_name}"
    if spec is not None and _counts_other_pods(spec) and not any(c.resource_claim_name for c in spec.resource_claims or ()):
        # Topology spread and pod (anti-)affinity count the pods placed before: one shard places a
        # namespace's such pods one after the other, each seeing the others (two shards placing
        # replicas at the same moment could both take the emptiest zone). Only pods whose claims
        # are their own (from templates): a shared claim keeps them on its shard.
        return f"constrained:{pending.pod.namespace}"
    if not pending.claims:
        return pending.pod.uid
    return min(c.key() for c in pending.claims)


def _counts_other_pods(spec: PodSpec) -> bool:
    """Required or preferred pod (anti-)affinity, or topology spread of either kind: where the pod
    goes depends on the pods placed before it (preferences too, or replicas placed at once by two
    shards stack where each saw an empty node)."""
    affinity = spec.affinity
    terms = affinity is not None and any(
        part is not None and (part.required_during_scheduling_ignored_during_execution
                              or part.preferred_during_scheduling_ignored_during_execution)
        for part in (affinity.pod_affinity, affinity.pod_anti_affinity))
    return bool(terms or spec.topology_spread_constraints)


def shard_for(key: str, shards: int) -> int:
    """Stable across processes and Python versions (unlike hash())."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards

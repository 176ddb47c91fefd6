"""What a shard carries through a batch, as typed records, and the reservations it writes for a
placed pod. Pure."""

from __future__ import annotations

import dataclasses

from draplane.scheduling.framework.plugins.node_ports import pod_host_ports
from draplane.api.core import Pod
from draplane.api.resource import ResourceClaim
from draplane.scheduling import reservation_protocol as protocol
from draplane.scheduling import reservations as rv
from draplane.scheduling.framework.plugins.inter_pod_affinity import required_anti_affinity
from draplane.scheduling.messages import ClaimPlacement, GangCommit, PendingPod, Placement
from draplane.scheduling.placing import NotPlaced, Placed


@dataclasses.dataclass(frozen=True, slots=True)
class PodToPlace:
    """A pending pod with what placing it reads: the pod (from its PendingPod) and its claims
    (from the cluster bucket)."""

    pending: PendingPod
    pod: Pod
    claims: list[ResourceClaim]


@dataclasses.dataclass(frozen=True, slots=True)
class PlacedPod:
    """A pod the core placed, not committed yet."""

    item: PodToPlace
    placed: Placed


@dataclasses.dataclass(frozen=True, slots=True)
class RefusedPod:
    """A pod the core found no node for."""

    item: PodToPlace
    outcome: NotPlaced


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementToSend:
    """A committed (or already reserved) placement, with the end of its lease."""

    item: PodToPlace
    placed: Placed
    lease_ends: float


@dataclasses.dataclass(slots=True)
class NodeRound:
    """One node's part of a round of a batch: the entry as its one compare-and-set will write it,
    from the revision the view was built on."""

    revision: int
    first_commit: protocol.Commit  # the round's first commit there: what its write prunes
    entry: rv.NodeReservations  # the entry with the round's reservations so far
    staged: list[PlacedPod] = dataclasses.field(default_factory=list)


def claim_reservations(pending: PendingPod, placed: Placed, now: float, expires_at: float,
                       shard: int) -> list[rv.Reservation]:
    """The reservations of the claims newly allocated by a placement."""
    claims = {c.uid: c for c in pending.claims}
    return [
        rv.Reservation(
            claim_uid=uid,
            claim_namespace=claims[uid].namespace,
            claim_name=claims[uid].name,
            pod_uid=pending.pod.uid,
            devices=rv.devices_of(placed.allocations[uid]),
            allocation=placed.allocations[uid],
            reserved_at=now,
            expires_at=expires_at,
            shard=shard,
        )
        for uid in placed.new_claims
    ]


def pod_reservation(pending: PendingPod, requests, now: float, expires_at: float, shard: int) -> rv.PodReservation:
    """The pod's own reservation on its node: its CPU and memory, host ports, and what the
    inter-pod filters of other shards must see of it (labels, required anti-affinity)."""
    spec = pending.spec
    return rv.PodReservation(
        pod_uid=pending.pod.uid, pod_namespace=pending.pod.namespace, pod_name=pending.pod.name,
        requests=requests, reserved_at=now, expires_at=expires_at, shard=shard,
        host_ports=list(pod_host_ports(spec)) if spec is not None else [],
        labels=pending.labels,
        anti_affinity=(list(required_anti_affinity(spec)) or None) if spec is not None else None,
    )


def placement_message(pending: PendingPod, claims: list[ResourceClaim], placed: Placed, expires_at: float, *,
                      shard: int, policy: str, gang: GangCommit | None = None) -> Placement:
    claim_uids = {c.metadata.uid for c in claims}
    return Placement(
        pod=pending.pod,
        node=placed.node,
        claims=[
            ClaimPlacement(claim=ref, allocation=placed.allocations[ref.uid])
            for ref in pending.claims
            if ref.uid in claim_uids
        ],
        shard=shard,
        first_seen=pending.first_seen,
        expires_at=expires_at,
        policy=policy if placed.new_claims else None,
        score=placed.score if placed.new_claims else None,
        gang=gang,
    )

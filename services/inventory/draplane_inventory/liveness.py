"""What the inventory service believes about each node, from the messages its agent sent. Pure.

A node's agent is *fresh* while its heartbeats arrive; past `taint_after` seconds of silence its
devices are published with a NoSchedule taint (*tainted*); past `remove_after` its slices are
deleted (*removed*). Any heartbeat or snapshot makes it fresh again. Messages are checked here:
the body must name the node of the subject it came on, and a snapshot older than the one already
applied (a redelivery, or an agent that was replaced) is ignored.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum

from draplane.api.resource import DeviceTaint
from draplane.messages.inventory import DriverDevices, Heartbeat, MessageError, NodeSnapshot
from draplane.nodes.slices import stale_taint


class Liveness(enum.Enum):
    FRESH = "fresh"
    TAINTED = "tainted"
    REMOVED = "removed"


@dataclasses.dataclass(slots=True)
class NodeRecord:
    node: str
    agent_id: str
    sequence: int
    sent_at: float
    drivers: list[DriverDevices]
    digest: str
    last_seen: float  # monotonic seconds
    liveness: Liveness = Liveness.FRESH
    tainted_at: str | None = None  # RFC 3339, kept so a re-taint does not look like a change


@dataclasses.dataclass(frozen=True, slots=True)
class Desired:
    drivers: list[DriverDevices]
    taint: DeviceTaint | None


def rfc3339(unix: float) -> str:
    return datetime.datetime.fromtimestamp(int(unix), datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class NodeLivenessTable:
    def __init__(self, *, taint_after: float, remove_after: float):
        if not 0 < taint_after < remove_after:
            raise ValueError(f"stale periods: taint_after ({taint_after}s) must be positive and below remove_after ({remove_after}s)")
        self.taint_after = taint_after
        self.remove_after = remove_after
        self.records: dict[str, NodeRecord] = {}

    @staticmethod
    def check_subject(subject_node: str, message: NodeSnapshot | Heartbeat) -> None:
        if message.node != subject_node:
            raise MessageError(
                "node-mismatch",
                f"{type(message).__name__} on the subject of node {subject_node!r} names node {message.node!r}",
            )

    def apply_snapshot(self, message: NodeSnapshot, now: float) -> bool:
        """Record a snapshot; True when the node's slices must be rewritten."""
        record = self.records.get(message.node)
        if record is not None:
            if message.agent_id == record.agent_id and message.sequence <= record.sequence:
                record.last_seen = max(record.last_seen, now)
                return False
            if message.agent_id != record.agent_id and message.sent_at < record.sent_at:
                return False  # from an agent process older than the one we already heard
        digest = message.digest()
        changed = record is None or record.digest != digest or record.liveness is not Liveness.FRESH
        self.records[message.node] = NodeRecord(
            node=message.node, agent_id=message.agent_id, sequence=message.sequence, sent_at=message.sent_at,
            drivers=message.drivers, digest=digest, last_seen=now,
        )
        return changed

    def apply_heartbeat(self, message: Heartbeat, now: float) -> bool:
        """Record a heartbeat; True when the node came back and its taint must go."""
        record = self.records.get(message.node)
        if record is None:
            return False  # no snapshot yet: nothing to publish, the snapshot will follow
        record.last_seen = max(record.last_seen, now)
        if record.liveness is Liveness.FRESH:
            return False
        record.liveness = Liveness.FRESH
        record.tainted_at = None
        return True

    def expire(self, now: float, wall_now: float) -> list[str]:
        """Nodes whose liveness changed at `now`: their slices must be tainted or removed."""
        changed = []
        for record in self.records.values():
            silent = now - record.last_seen
            if silent > self.remove_after and record.liveness is not Liveness.REMOVED:
                record.liveness = Liveness.REMOVED
                changed.append(record.node)
            elif self.taint_after < silent <= self.remove_after and record.liveness is Liveness.FRESH:
                record.liveness = Liveness.TAINTED
                record.tainted_at = rfc3339(wall_now)
                changed.append(record.node)
        return changed

    def desired(self, node: str) -> Desired:
        record = self.records.get(node)
        if record is None or record.liveness is Liveness.REMOVED:
            return Desired(drivers=[], taint=None)
        taint = stale_taint(record.tainted_at) if record.liveness is Liveness.TAINTED else None
        return Desired(drivers=record.drivers, taint=taint)

    def liveness(self, node: str) -> Liveness | None:
        record = self.records.get(node)
        return record.liveness if record else None

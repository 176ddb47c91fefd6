"""What a node agent says next, and how long it waits before reconnecting. Pure: no I/O.

An agent sends a full snapshot at start, whenever discovery finds something different, and after
every reconnect (the server may have lost what it sent while it was away); in between it sends
heartbeats that name the snapshot they vouch for.
"""

from __future__ import annotations

import random
import uuid

from draplane.messages.inventory import SCHEMA_VERSION, DriverDevices, Heartbeat, NodeSnapshot, drivers_digest


def backoff_delay(attempt: int, *, base: float = 0.2, cap: float = 5.0, rng: random.Random | None = None) -> float:
    """"Full jitter" exponential backoff: a thousand agents that lost one server do not come back in step."""
    ceiling = min(cap, base * (2 ** min(attempt, 30)))
    return (rng or random).uniform(ceiling / 2, ceiling)


class AgentState:
    __slots__ = ("node", "agent_id", "sequence", "drivers", "digest", "snapshot_sequence", "snapshot_due")

    def __init__(self, node: str, agent_id: str | None = None):
        self.node = node
        self.agent_id = agent_id or uuid.uuid4().hex
        self.sequence = 0
        self.drivers: list[DriverDevices] | None = None
        self.digest = ""
        self.snapshot_sequence = 0
        self.snapshot_due = True

    def observe(self, drivers: list[DriverDevices]) -> bool:
        """Record what discovery found; True when it differs from what was last announced."""
        digest = drivers_digest(drivers)
        if digest == self.digest and self.drivers is not None:
            return False
        self.drivers, self.digest = drivers, digest
        self.snapshot_due = True
        return True

    def reconnected(self) -> None:
        self.snapshot_due = True

    def snapshot(self, now: float) -> NodeSnapshot:
        if self.drivers is None:
            raise RuntimeError(f"node agent {self.node}: snapshot requested before the first discovery")
        self.sequence += 1
        self.snapshot_sequence = self.sequence
        return NodeSnapshot(
            schema_version=SCHEMA_VERSION, node=self.node, agent_id=self.agent_id, sequence=self.sequence,
            sent_at=now, drivers=self.drivers,
        )

    def snapshot_acked(self, sequence: int) -> None:
        # A newer snapshot may have been requested while this one was in flight; keep that one due.
        if sequence == self.snapshot_sequence:
            self.snapshot_due = False

    def heartbeat(self, now: float) -> Heartbeat:
        self.sequence += 1
        return Heartbeat(
            schema_version=SCHEMA_VERSION, node=self.node, agent_id=self.agent_id, sequence=self.sequence,
            sent_at=now, snapshot_sequence=self.snapshot_sequence, snapshot_digest=self.digest,
        )

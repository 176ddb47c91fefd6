"""PendingPods sent to a shard and not answered yet, and which of them to send again. Pure.

A PendingPod stays in its shard's JetStream work queue until the shard acknowledges it, and the
shard acknowledges once it has published its answer (a Placement or an Unschedulable). A few are
acknowledged with no answer: the pod was gone or bound meanwhile, or a claim vanished. Only those
need sending again, and the shard's consumer tells which: the sequence up to which it has
acknowledged everything (its ack floor). A PendingPod at or below the floor that is still
unanswered will never be answered.

Sending again on age alone, as the binder once did after 60 s, put every pod of a backlog into the
queue a second time each minute while no shard had reached it yet: 20,000 queued pods made 40,000
messages after a minute, and the shard placed each pod twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

# Not asked about before this: most answers come within it, and the consumer's floor, read from
# NATS, costs a request per shard.
ANSWER_EXPECTED_SECONDS = 60.0
# Sent again after this whatever the floor says: the stream may have been deleted and made again
# (its sequences start over), or the publish's acknowledgement, and with it the sequence, was lost.
# A backlog slower than this to drain gets one more copy of a pod every so often, not one a minute.
GIVE_UP_SECONDS = 600.0


@dataclasses.dataclass(slots=True)
class InFlight:
    since: float  # monotonic, when the PendingPod was published
    shard: int
    # its sequence in the pending stream, from the publish's acknowledgement (None until then)
    sequence: int | None = None


def to_ask_about(in_flight: Mapping[str, InFlight], now: float) -> set[int]:
    """The shards whose ack floor decides something: those with a PendingPod unanswered too long."""
    return {entry.shard for entry in in_flight.values()
            if ANSWER_EXPECTED_SECONDS < now - entry.since <= GIVE_UP_SECONDS and entry.sequence is not None}


def lost(in_flight: Mapping[str, InFlight], ack_floors: Mapping[int, int | None], now: float) -> list[str]:
    """The pod uids whose PendingPod will not be answered and must be sent again.

    `ack_floors`: shard -> the stream sequence its consumer has acknowledged everything up to;
    None (or absent) when that is not known, e.g. no shard has made its consumer yet, which means
    the PendingPods wait in the queue.
    """
    found = []
    for uid, entry in in_flight.items():
        age = now - entry.since
        if age <= ANSWER_EXPECTED_SECONDS:
            continue
        if age > GIVE_UP_SECONDS or entry.sequence is None:
            found.append(uid)
            continue
        floor = ack_floors.get(entry.shard)
        if floor is not None and entry.sequence <= floor:
            found.append(uid)
    return found

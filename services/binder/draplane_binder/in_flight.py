"""PendingPods sent to a shard and not answered yet, and which of them to send again. Pure.

A PendingPod stays in its shard's JetStream work queue until the shard acknowledges it, and the
shard acknowledges once it has published its answer (a Placement or an Unschedulable) to the
results stream. A few are acknowledged with no answer: the pod was gone or bound meanwhile, or a
claim vanished. Only those need sending again, and two sequences tell which:
- the shard's consumer has acknowledged everything up to its ack floor: a PendingPod at or below
  it has its answer in the results stream already, if it has one, at or below the results
  stream's last sequence at that moment (`answer_by`);
- once the binder's own consumer of the results has acknowledged (handled) everything up to
  `answer_by`, a PendingPod still unanswered will never be answered.
The second step matters under load: answers waiting for the binder's rate-limited writes are
not lost, and sending their pods again would put duplicates in the queue.

A stream deleted and made again starts its sequences over: a PendingPod whose sequence is beyond
its stream's last one, or whose `answer_by` is beyond the results stream's, is sent again too.

Sending again on age alone, as the binder once did after 60 s, put every pod of a backlog into the
queue a second time each minute while no shard had reached it yet (bench/backpressure.py: 500
pods queued for 78 s made 1,000 messages), and the shard then placed each pod twice. So did any
bound on age: with 10 minutes, 20,000 pods on 1,000 nodes, drained at 7 pods/s on the loaded
2-core machine, made 42,795 messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

# Not asked about before this: most answers come within it, and the consumer's floor, read from
# NATS, costs a request per shard.
ANSWER_EXPECTED_SECONDS = 60.0


@dataclasses.dataclass(slots=True)
class InFlight:
    since: float  # monotonic, when the PendingPod was published
    shard: int
    # its sequence in the pending stream, from the publish's acknowledgement (None until then)
    sequence: int | None = None
    # the results stream's last sequence when the shard was first seen to have acknowledged it
    answer_by: int | None = None


def to_ask_about(in_flight: Mapping[str, InFlight], now: float) -> set[int]:
    """The shards whose ack floor decides something: those with a PendingPod unanswered too long
    that no floor has passed yet."""
    return {entry.shard for entry in in_flight.values()
            if ANSWER_EXPECTED_SECONDS < now - entry.since and entry.sequence is not None and entry.answer_by is None}


def waiting_for_answers(in_flight: Mapping[str, InFlight], now: float) -> bool:
    """Whether the results stream's sequences are needed: some PendingPod is old enough to look at."""
    return any(ANSWER_EXPECTED_SECONDS < now - entry.since for entry in in_flight.values())


def lost(in_flight: Mapping[str, InFlight], ack_floors: Mapping[int, int | None], now: float, *,
         pending_last: int | None, results_last: int | None, results_handled: int | None) -> list[str]:
    """The pod uids whose PendingPod will not be answered and must be sent again.

    `ack_floors`: shard -> the stream sequence its consumer has acknowledged everything up to;
    None (or absent) when that is not known, e.g. no shard has made its consumer yet, which means
    the PendingPods wait in the queue. `pending_last`: the pending stream's last sequence;
    `results_last`: the results stream's, read after the floors; `results_handled`: the binder's
    results consumer's ack floor. Each None when NATS did not say.
    Marks `answer_by` on the entries the floors have passed, for the calls that follow.
    """
    found = []
    for uid, entry in in_flight.items():
        if now - entry.since <= ANSWER_EXPECTED_SECONDS:
            continue
        if entry.sequence is None:
            found.append(uid)  # published, and no acknowledgement said where: nothing to wait for
            continue
        if pending_last is not None and entry.sequence > pending_last:
            found.append(uid)  # its stream was made again: the message is gone
            continue
        if entry.answer_by is None:
            floor = ack_floors.get(entry.shard)
            if floor is not None and entry.sequence <= floor and results_last is not None:
                entry.answer_by = results_last
            continue  # its answer, if any, may still be on its way: decided at the next look
        if results_last is not None and entry.answer_by > results_last:
            found.append(uid)  # the results stream was made again: the answer, if any, is gone
        elif results_handled is not None and results_handled >= entry.answer_by:
            found.append(uid)
    return found

"""What NATS has said about pods, remembered in bounded memory. Pure: the time comes in as an argument.

The dashboard learns about pods from three places, all of them read, none written:

- `PendingPod` on ``{prefix}pending.<shard>``: the binder asks a shard to place the pod. A plain
  NATS subscription sees every publish into the work-queue stream without taking part in it. The
  binder publishes a pod that stays unschedulable again at every retry (at most
  `retry_max_seconds` apart, 20 s by default), and that is the only sign that a pod is still
  pending: no message on NATS says that a pod was deleted.
- `Placement` and `Unschedulable` on ``{prefix}placement``: a shard's answer, with the policy and
  its score, or kube-scheduler's words for why no node fits.
- Audit events (``placed``, ``rejected``): the same facts with history, so a dashboard started late
  still knows the scores of earlier placements and why earlier pods were rejected. A rejection the
  binder decides itself (a claim missing, say) is published once and never repeated, so it is
  only in the audit stream.

A pod not heard of for `quiet_after` seconds is still listed, marked quiet (deleted, or waiting on
something the binder does not repeat); after `forget_after` it is no longer listed. At most
`max_pods` pods are remembered, the least recently heard of forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from draplane.messages.audit import AuditEvent
from draplane.scheduling.messages import Placement, PendingPod, PodRef, SchedulingMessage, Unschedulable

MAX_PODS = 20_000
QUIET_AFTER_SECONDS = 60.0  # three of the binder's longest retry intervals
FORGET_AFTER_SECONDS = 900.0
# A PendingPod the binder sent just before it saw its own binding (its pod cache lags the write)
# does not make a placed pod pending again; a real retry comes again after this anyway.
PLACED_GRACE_SECONDS = 5.0
# The page lists this many pending pods and counts the rest.
MAX_PENDING_LISTED = 500


@dataclass(slots=True)
class PodFacts:
    uid: str
    name: str = ""  # namespace/name
    first_seen: float | None = None  # when the binder first saw it pending (its clock)
    heard_at: float | None = None  # the last sign that it is pending
    reason: str = ""  # why it is pending, in kube-scheduler's words
    reason_at: float = 0.0
    decided_by: str = ""  # "shard-1", or the binder's instance
    shard: int | None = None  # the shard last asked to place it
    placed_at: float | None = None
    node: str | None = None
    policy: str | None = None
    score: float | None = None

    def is_pending(self) -> bool:
        if self.heard_at is None:
            return False
        return self.placed_at is None or self.heard_at > self.placed_at + PLACED_GRACE_SECONDS


class PendingEntry(msgspec.Struct, kw_only=True):
    """One line of the page's pending list."""

    pod: str  # namespace/name
    uid: str
    reason: str
    decided_by: str = ""
    since: float | None = None  # unix seconds
    heard: float  # unix seconds
    quiet: bool = False


class PendingList(msgspec.Struct, kw_only=True):
    pods: list[PendingEntry]
    more: int = 0  # pending pods beyond MAX_PENDING_LISTED


def shard_of_subject(subject: str, prefix: str) -> int | None:
    """The shard of ``{prefix}pending.<shard>``."""
    head = f"{prefix}pending."
    if not subject.startswith(head):
        return None
    try:
        return int(subject[len(head):])
    except ValueError:
        return None


class SchedulingFacts:
    def __init__(self, *, max_pods: int = MAX_PODS, quiet_after: float = QUIET_AFTER_SECONDS,
                 forget_after: float = FORGET_AFTER_SECONDS):
        self.max_pods = max_pods
        self.quiet_after = quiet_after
        self.forget_after = forget_after
        self._pods: OrderedDict[str, PodFacts] = OrderedDict()
        self.version = 0  # bumped by every change, so the shell knows when to redraw

    def __len__(self) -> int:
        return len(self._pods)

    def _pod(self, uid: str, name: str) -> PodFacts:
        facts = self._pods.get(uid)
        if facts is None:
            facts = self._pods[uid] = PodFacts(uid=uid)
            while len(self._pods) > self.max_pods:
                self._pods.popitem(last=False)
        else:
            self._pods.move_to_end(uid)
        if name:
            facts.name = name
        self.version += 1
        return facts

    # --- what was heard ----------------------------------------------------------------------------

    def pod_pending(self, pod: PodRef, *, now: float, first_seen: float | None = None,
                    shard: int | None = None) -> None:
        facts = self._pod(pod.uid, pod.key())
        facts.heard_at = max(facts.heard_at or now, now)
        if first_seen and (facts.first_seen is None or first_seen < facts.first_seen):
            facts.first_seen = first_seen
        if shard is not None:
            facts.shard = shard

    def pod_unschedulable(self, uid: str, name: str, *, reason: str, decided_by: str, at: float,
                          first_seen: float | None = None) -> None:
        facts = self._pod(uid, name)
        facts.heard_at = max(facts.heard_at or at, at)
        if at >= facts.reason_at:  # audit history read after a live answer is older news
            facts.reason, facts.reason_at, facts.decided_by = reason, at, decided_by
        if first_seen and (facts.first_seen is None or first_seen < facts.first_seen):
            facts.first_seen = first_seen

    def pod_placed(self, uid: str, name: str, *, node: str, policy: str | None, score: float | None,
                   at: float) -> None:
        facts = self._pod(uid, name)
        if facts.placed_at is not None and at < facts.placed_at:
            return
        facts.placed_at, facts.node = at, node
        if policy is not None or score is not None:
            # A placement that newly allocated nothing has no score; keep the one that did.
            facts.policy, facts.score = policy, score

    def apply_message(self, message: SchedulingMessage, *, now: float, shard: int | None = None) -> None:
        """A PendingPod (`shard` from its subject), Placement or Unschedulable, as it was published."""
        if isinstance(message, PendingPod):
            self.pod_pending(message.pod, now=now, first_seen=message.first_seen, shard=shard)
        elif isinstance(message, Placement):
            self.pod_placed(message.pod.uid, message.pod.key(), node=message.node, policy=message.policy,
                            score=message.score, at=now)
        elif isinstance(message, Unschedulable):
            self.pod_unschedulable(message.pod.uid, message.pod.key(), reason=message.message,
                                   decided_by=f"shard-{message.shard}", at=now)

    def apply_audit(self, event: AuditEvent) -> None:
        if event.pod is None:
            return
        name = f"{event.pod.namespace}/{event.pod.name}"
        if event.kind == "placed":
            self.pod_placed(event.pod.uid, name, node=event.node or "", policy=event.policy, score=event.score,
                            at=event.at)
        elif event.kind == "rejected":
            first_seen = event.at - event.latency if event.latency is not None else None
            self.pod_unschedulable(event.pod.uid, name, reason=event.reason,
                                   decided_by=event.by[0] if event.by else "", at=event.at, first_seen=first_seen)

    # --- what the page shows -----------------------------------------------------------------------

    def pod(self, uid: str) -> PodFacts | None:
        return self._pods.get(uid)

    def pending(self, now: float, *, limit: int = MAX_PENDING_LISTED) -> PendingList:
        """Pending pods, the ones still heard of first, each group oldest first."""
        entries = []
        for facts in self._pods.values():
            if not facts.is_pending() or now - facts.heard_at > self.forget_after:
                continue
            reason = facts.reason
            if not reason:
                reason = (f"waiting for allocator shard {facts.shard}" if facts.shard is not None
                          else "waiting for an allocator shard")
            entries.append(PendingEntry(pod=facts.name or facts.uid, uid=facts.uid, reason=reason,
                                        decided_by=facts.decided_by, since=facts.first_seen, heard=facts.heard_at,
                                        quiet=now - facts.heard_at > self.quiet_after))
        entries.sort(key=lambda e: (e.quiet, e.since if e.since is not None else e.heard, e.pod))
        return PendingList(pods=entries[:limit], more=max(0, len(entries) - limit))

    def forget_old(self, now: float) -> int:
        """Drop pods never placed and not heard of within `forget_after`. Placed pods stay (their
        devices may be held for days, and their score is shown on hover) until `max_pods` pushes
        them out. Returns how many were dropped."""
        old = [uid for uid, f in self._pods.items()
               if f.placed_at is None and now - (f.heard_at or 0.0) > self.forget_after]
        for uid in old:
            del self._pods[uid]
        if old:
            self.version += 1
        return len(old)

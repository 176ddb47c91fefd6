"""draplane.dashboard.scheduling_facts: pods pending and placed, as NATS tells it, in bounded memory."""

from __future__ import annotations

from draplane.dashboard.scheduling_facts import PLACED_GRACE_SECONDS, SchedulingFacts, shard_of_subject
from draplane.messages import audit
from draplane.scheduling.messages import NodeFailure, PendingPod, Placement, PodRef, Unschedulable

NOW = 1_800_000_000.0
POD = PodRef(namespace="team", name="trainer", uid="pod-1")
REASON = ("0/2 nodes are available: 2 cannot allocate all claims: resourceclaim team/big, request gpu: "
          "not enough devices.")


def pending(pod: PodRef = POD, first_seen: float = NOW - 30) -> PendingPod:
    return PendingPod(pod=pod, claims=[], first_seen=first_seen)


def unschedulable(pod: PodRef = POD, message: str = REASON, shard: int = 1) -> Unschedulable:
    return Unschedulable(pod=pod, shard=shard, message=message,
                         failures=[NodeFailure(node="n", reason="devices", reasons=["cannot allocate all claims"])])


def placement(pod: PodRef = POD, score: float | None = 12.0) -> Placement:
    return Placement(pod=pod, node="n", claims=[], shard=1, first_seen=NOW - 30, expires_at=NOW + 30,
                     policy="draplane" if score is not None else None, score=score)


def test_a_pod_sent_to_a_shard_is_pending_until_the_shard_says_why_then_gone_once_placed():
    facts = SchedulingFacts()
    facts.apply_message(pending(), now=NOW, shard=1)
    (entry,) = facts.pending(NOW).pods
    assert (entry.pod, entry.reason, entry.since, entry.quiet) == ("team/trainer", "waiting for allocator shard 1",
                                                                   NOW - 30, False)
    facts.apply_message(unschedulable(), now=NOW + 1)
    (entry,) = facts.pending(NOW + 1).pods
    assert (entry.reason, entry.decided_by) == (REASON, "shard-1")
    facts.apply_message(placement(), now=NOW + 20)
    assert facts.pending(NOW + 20).pods == []
    placed = facts.pod("pod-1")
    assert (placed.node, placed.policy, placed.score) == ("n", "draplane", 12.0)


def test_a_pending_pod_sent_again_right_after_its_placement_is_no_news_but_a_later_one_is():
    facts = SchedulingFacts()
    facts.apply_message(placement(), now=NOW)
    facts.apply_message(pending(), now=NOW + PLACED_GRACE_SECONDS / 2)
    assert facts.pending(NOW + 3).pods == []
    facts.apply_message(pending(), now=NOW + PLACED_GRACE_SECONDS + 1)  # its binding failed: placed anew
    assert [e.pod for e in facts.pending(NOW + 10).pods] == ["team/trainer"]


def test_a_placement_that_allocated_nothing_new_keeps_the_score_of_the_one_that_did():
    facts = SchedulingFacts()
    facts.apply_message(placement(score=7.5), now=NOW)
    facts.apply_message(placement(score=None), now=NOW + 1)
    assert (facts.pod("pod-1").policy, facts.pod("pod-1").score) == ("draplane", 7.5)


def rejected(at: float, reason: str, by: list[str], latency: float | None = None) -> audit.AuditEvent:
    return audit.AuditEvent(id=audit.rejected_id("pod-1", reason), kind="rejected", at=at, by=by,
                            pod=audit.PodName(namespace="team", name="trainer", uid="pod-1"), reason=reason,
                            latency=latency)


def test_audit_history_read_after_a_live_answer_does_not_overwrite_the_newer_reason():
    facts = SchedulingFacts()
    facts.apply_message(unschedulable(message="newer words"), now=NOW)
    facts.apply_audit(rejected(NOW - 100, "older words", ["shard-0", "binder-1"], latency=5.0))
    (entry,) = facts.pending(NOW).pods
    assert entry.reason == "newer words"
    assert entry.since == NOW - 105  # the rejection's latency says when the binder first saw it


def test_a_rejection_the_binder_made_itself_is_listed_quiet_after_a_while_then_forgotten():
    facts = SchedulingFacts(quiet_after=60.0, forget_after=900.0)
    facts.apply_audit(rejected(NOW, "pod claim gpu: resourceclaim team/missing not found", ["binder-1"]))
    (entry,) = facts.pending(NOW + 10).pods
    assert (entry.decided_by, entry.quiet) == ("binder-1", False)
    (entry,) = facts.pending(NOW + 61).pods
    assert entry.quiet
    assert facts.pending(NOW + 901).pods == []
    assert facts.forget_old(NOW + 901) == 1 and len(facts) == 0


def test_placed_pods_are_not_forgotten_with_time_only_when_the_cap_pushes_them_out():
    facts = SchedulingFacts(max_pods=3)
    facts.apply_message(placement(), now=NOW)
    assert facts.forget_old(NOW + 10_000) == 0 and facts.pod("pod-1") is not None
    for i in range(3):
        facts.apply_message(pending(PodRef(namespace="team", name=f"p{i}", uid=f"u{i}")), now=NOW + i)
    assert len(facts) == 3 and facts.pod("pod-1") is None


def test_audit_placed_events_give_names_and_scores_and_end_pending():
    facts = SchedulingFacts()
    facts.apply_audit(rejected(NOW - 50, REASON, ["shard-1", "binder-1"]))
    facts.apply_audit(audit.AuditEvent(id="placed/pod-1", kind="placed", at=NOW - 10, by=["shard-1", "binder-1"],
                                       node="n", pod=audit.PodName(namespace="team", name="trainer", uid="pod-1"),
                                       policy="draplane", score=3.25))
    assert facts.pending(NOW).pods == []
    assert (facts.pod("pod-1").name, facts.pod("pod-1").score) == ("team/trainer", 3.25)


def test_pending_pods_heard_of_come_first_oldest_first_and_the_list_is_capped():
    facts = SchedulingFacts()
    for i, since in enumerate((NOW - 5, NOW - 50, NOW - 20)):
        facts.apply_message(pending(PodRef(namespace="team", name=f"p{i}", uid=f"u{i}"), first_seen=since), now=NOW)
    facts.pod_unschedulable("old", "team/old", reason="r", decided_by="binder-1", at=NOW - 200, first_seen=NOW - 300)
    listed = facts.pending(NOW, limit=3)
    assert [e.pod for e in listed.pods] == ["team/p1", "team/p2", "team/p0"] and listed.more == 1


def test_the_shard_is_read_from_the_pending_subject():
    assert shard_of_subject("draplane.pending.3", "draplane.") == 3
    assert shard_of_subject("draplane.placement", "draplane.") is None
    assert shard_of_subject("t.x.pending.x", "t.x.") is None

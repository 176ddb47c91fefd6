"""draplane_allocator.view: a shard's view of the cluster bucket, and what a restarted replay does
to it. A pure test: a stand-in for JetStream's key-value watch."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from draplane.api.core import PodSpec
from draplane.api.meta import ObjectMeta
from draplane.api.resource import (
    AllocationResult, DeviceAllocationResult, DeviceClaim, DeviceRequest, DeviceRequestAllocationResult, DeviceTaint,
    DeviceTaintRule, DeviceTaintRuleSpec, DeviceTaintSelector, ExactDeviceRequest, ResourceClaim, ResourceClaimSpec,
    ResourceClaimStatus,
)
from draplane.jetstream import streams
from draplane.scheduling import cluster_changes, cluster_feed
from draplane.scheduling.messages import ClaimRef, ClaimSnapshot, PendingPod, PodRef, Subjects
from draplane.messages.inventory import InventoryNames
from draplane_allocator import view as view_module
from draplane_allocator.metrics import AllocatorMetrics
from draplane_allocator.view import ShardView


class _Audit:
    def __init__(self):
        self.events = []

    def publish(self, event):
        self.events.append(event)


class _JetStream:
    async def key_value(self, bucket):
        return bucket


def _rule(name: str) -> DeviceTaintRule:
    return DeviceTaintRule(metadata=ObjectMeta(name=name, uid=f"uid-{name}", generation=1),
                           spec=DeviceTaintRuleSpec(device_selector=DeviceTaintSelector(),
                                                    taint=DeviceTaint(key="example.com/maintenance",
                                                                      effect="NoSchedule")))


def _put(obj, revision: int):
    return SimpleNamespace(key=cluster_feed.key_of(obj), value=cluster_feed.encode(obj), revision=revision,
                           operation="PUT")


def _synced(revision: int):
    marker = cluster_feed.Synced(binder="binder-1", at=1.0)
    return SimpleNamespace(key=cluster_feed.SYNCED_KEY, value=cluster_feed.encode_synced(marker),
                           revision=revision, operation="PUT")


def _view(monkeypatch, replays: list[list]) -> tuple[ShardView, _Audit]:
    """A view whose cluster watch replays, each time it starts, the next of `replays` (then the
    end-of-replay marker, None)."""

    async def bucket_entries(kv):
        for update in replays.pop(0):
            yield update
        yield None

    monkeypatch.setattr(view_module.streams, "bucket_entries", bucket_entries)
    audit = _Audit()
    view = ShardView(_JetStream(), Subjects(prefix="t."), InventoryNames(prefix="t."), index=0, policy=None,
                     stream_replicas=1, gang_scheduling=True, audit_publisher=audit,
                     metrics=AllocatorMetrics().shard(0), log=logging.getLogger("test"))
    return view, audit


def _rules(view: ShardView) -> set[str]:
    return {r.metadata.name for r in view.state.devices.inventory.taint_rules}


async def test_a_taint_rule_deleted_while_the_watch_restarts_is_taken_off_the_devices(monkeypatch):
    kept, deleted = _rule("kept"), _rule("deleted-meanwhile")
    view, audit = _view(monkeypatch, [
        [_synced(1), _put(kept, 2), _put(deleted, 3)],
        # the watch broke; meanwhile the binder deleted one rule from the bucket: the new replay lacks it
        [_synced(1), _put(kept, 2)],
    ])
    await view._replay_cluster(None)
    assert _rules(view) == {"kept", "deleted-meanwhile"}
    assert view.synced["cluster"].is_set()

    await view._replay_cluster(None)  # what the guarded loop does after the watch crashed
    assert _rules(view) == {"kept"}
    assert cluster_feed.key_of(deleted) not in view.bucket_objects
    # the deletion is news, told once, by the sweep at the end of the replay
    assert [(e.kind, e.by[0]) for e in audit.events] == [("untainted", "devicetaintrule deleted-meanwhile")]


async def test_a_view_is_complete_only_once_a_binder_has_filled_the_bucket(monkeypatch):
    view, _ = _view(monkeypatch, [[_put(_rule("r"), 1)]])
    await view._replay_cluster(None)
    assert not view.synced["cluster"].is_set()  # replayed, but no binder marker: the bucket may be partial
    view.take_cluster_entry(cluster_feed.SYNCED_KEY, _synced(2).value)
    assert view.synced["cluster"].is_set()


async def test_an_unreadable_entry_is_skipped_and_counted(monkeypatch, caplog):
    bad = SimpleNamespace(key=cluster_feed.key_of(_rule("bad")), value=b"\xc1 not msgpack", revision=1,
                          operation="PUT")
    view, _ = _view(monkeypatch, [[_synced(1), bad, _put(_rule("good"), 2)]])
    await view._replay_cluster(None)
    assert _rules(view) == {"good"}
    assert "unreadable cluster bucket entry" in caplog.text


# --- a PendingPod's claim snapshots against the view's own copies ------------------------------------

def _claim(uid: str, *, allocated_on: str | None = None) -> ResourceClaim:
    allocation = None
    if allocated_on is not None:
        allocation = AllocationResult(devices=DeviceAllocationResult(results=[DeviceRequestAllocationResult(
            request="gpu", driver="gpu.example.com", pool=allocated_on, device="gpu-0")]))
    return ResourceClaim(metadata=ObjectMeta(namespace="ns", name=f"claim-{uid}", uid=uid),
                         spec=ResourceClaimSpec(devices=DeviceClaim(requests=[DeviceRequest(
                             name="gpu", exactly=ExactDeviceRequest(device_class_name="gpu.example.com"))])),
                         status=ResourceClaimStatus(allocation=allocation) if allocation else None)


def _pending(*snapshots: ClaimSnapshot | ResourceClaim) -> PendingPod:
    claims = [s.claim if isinstance(s, ClaimSnapshot) else s for s in snapshots]
    return PendingPod(pod=PodRef(namespace="ns", name="web", uid="pod-1"), first_seen=0.0, spec=PodSpec(),
                      claims=[ClaimRef(namespace="ns", name=c.metadata.name, uid=c.metadata.uid) for c in claims],
                      claim_snapshots=[s for s in snapshots if isinstance(s, ClaimSnapshot)] or None)


def _node_of(claim: ResourceClaim) -> str | None:
    return claim.status.allocation.devices.results[0].pool if claim.status and claim.status.allocation else None


async def test_a_claim_the_view_has_not_heard_of_is_placed_from_its_snapshot(monkeypatch):
    view, _ = _view(monkeypatch, [[_synced(1)]])
    await view._replay_cluster(None)
    # the binder has just made it: its write to the bucket is on its way (revision 0)
    item = await view.to_place(_pending(ClaimSnapshot(claim=_claim("c1"), revision=0)))
    assert [c.metadata.uid for c in item.claims] == ["c1"]


async def test_the_views_copy_wins_from_the_snapshots_revision_on(monkeypatch):
    view, _ = _view(monkeypatch, [[_synced(1), _put(_claim("c1"), 5)]])
    await view._replay_cluster(None)
    # allocated for another pod (a shared claim) after the binder sent this one: revision 7 > 5
    view.take_cluster_entry(cluster_feed.key_of(_claim("c1")), cluster_feed.encode(_claim("c1", allocated_on="n2")), 7)
    item = await view.to_place(_pending(ClaimSnapshot(claim=_claim("c1"), revision=5)))
    assert _node_of(item.claims[0]) == "n2"


async def test_a_snapshot_newer_than_the_view_wins(monkeypatch):
    view, _ = _view(monkeypatch, [[_synced(1), _put(_claim("c1", allocated_on="old"), 5)]])
    await view._replay_cluster(None)
    # the binder saw it deallocated (revision 9, or still on its way): this shard is behind
    for revision in (9, 0):
        item = await view.to_place(_pending(ClaimSnapshot(claim=_claim("c1"), revision=revision)))
        assert _node_of(item.claims[0]) is None, revision


async def test_a_pod_whose_claims_travel_by_reference_waits_for_the_bucket(monkeypatch):
    view, _ = _view(monkeypatch, [[_synced(1), _put(_claim("c1", allocated_on="n1"), 3)]])
    await view._replay_cluster(None)
    item = await view.to_place(_pending(_claim("c1")))  # an older binder, or claims too large to carry
    assert _node_of(item.claims[0]) == "n1"
    assert await view.to_place(_pending(_claim("gone"))) is None  # not in the bucket: deleted


# --- following the binder's change batches after the replay -------------------------------------

def _batch(revision: int, *changes: cluster_changes.Change, value: bytes | None = None) -> streams.StreamEntry:
    """The message of a change batch at stream sequence `revision`."""
    if value is None:
        value = cluster_changes._ENCODER.encode(cluster_changes.Changes("binder-1", list(changes)))
    return streams.StreamEntry(cluster_changes.changes_key("t", revision), value, revision)


def _change(obj, revision: int) -> cluster_changes.Change:
    return cluster_changes.change(cluster_feed.key_of(obj), revision, cluster_feed.encode(obj))


def _stream(monkeypatch, messages: dict[int, streams.StreamEntry]) -> list[int]:
    """The bucket's stream as bucket_message_from reads it; returns the sequences asked for."""
    asked = []

    async def bucket_message_from(js, bucket, sequence):
        asked.append(sequence)
        return next((messages[s] for s in sorted(messages) if s >= sequence), None)
    monkeypatch.setattr(view_module.streams, "bucket_message_from", bucket_message_from)
    return asked


def _entry(obj, revision: int) -> streams.StreamEntry:
    return streams.StreamEntry(cluster_feed.key_of(obj), cluster_feed.encode(obj), revision)


async def test_a_batch_is_taken_in_order_skipping_what_the_replay_took(monkeypatch):
    view, _ = _view(monkeypatch, [[_synced(1), _put(_rule("replayed"), 5)]])
    view._cluster_taken = cluster_changes.Taken(await view._replay_cluster(None))
    # the batch also names the replay's own revision 5, with an older value: not taken again
    await view._take_batch("b", _batch(8, _change(_rule("stale"), 5), _change(_rule("a"), 6), _change(_rule("b"), 7)))
    assert _rules(view) == {"replayed", "a", "b"}
    assert view._cluster_taken.upto == 8
    await view._cluster_moved_to(view._cluster_taken.upto)
    assert view.cluster_revision == 8


async def test_what_no_batch_named_is_read_from_the_stream_in_order(monkeypatch):
    view, _ = _view(monkeypatch, [[_synced(1)]])
    view._cluster_taken = cluster_changes.Taken(await view._replay_cluster(None))
    # revision 2 was written by something else than the binder, 3 overwritten by 5 (not in the stream)
    await view._take_batch("b", _batch(6, _change(_rule("four"), 4), _change(_rule("five"), 5)))
    taken = view._cluster_taken
    assert taken.upto == 1 and taken.missing() == (2, 6)
    await view._cluster_moved_to(taken.upto)
    assert view.cluster_revision == 1  # not past what is missing: a pod waiting for 4 still waits
    asked = _stream(monkeypatch, {2: _entry(_rule("two"), 2), 4: _entry(_rule("four"), 4),
                                  5: _entry(_rule("five"), 5), 6: _batch(6)})
    assert await view._read_cluster_stream("b", taken.upto + 1, 6) == 1
    assert asked == [2, 3, 5, 6]  # what was taken is skipped, not applied twice
    assert _rules(view) == {"two", "four", "five"} and taken.upto == 6 and not taken.ahead


async def test_a_value_too_large_for_its_batch_is_read_from_the_stream(monkeypatch):
    view, _ = _view(monkeypatch, [[_synced(1)]])
    view._cluster_taken = cluster_changes.Taken(await view._replay_cluster(None))
    _stream(monkeypatch, {2: _entry(_rule("large"), 2)})
    await view._take_batch("b", _batch(3, cluster_changes.Change(cluster_feed.key_of(_rule("large")), 2, None, True)))
    assert _rules(view) == {"large"} and view._cluster_taken.upto == 3


async def test_an_unreadable_batch_is_counted_and_what_it_named_stays_missing(monkeypatch, caplog):
    view, _ = _view(monkeypatch, [[_synced(1)]])
    view._cluster_taken = cluster_changes.Taken(await view._replay_cluster(None))
    await view._take_batch("b", _batch(3, value=b"\xc1 not msgpack"))
    assert "cluster bucket change batch 'meta.changes.t.3'" in caplog.text
    assert view._cluster_taken.upto == 1 and view._cluster_taken.missing() == (2, 3)

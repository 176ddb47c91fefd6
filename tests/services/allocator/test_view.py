"""draplane_allocator.view: a shard's view of the cluster bucket, and what a restarted watch does
to it. A pure test: a stand-in for JetStream's key-value watch."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from draplane.api.meta import ObjectMeta
from draplane.api.resource import DeviceTaint, DeviceTaintRule, DeviceTaintRuleSpec, DeviceTaintSelector
from draplane.scheduling import cluster_feed
from draplane.scheduling.messages import Subjects
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
    await view._watch_cluster()
    assert _rules(view) == {"kept", "deleted-meanwhile"}
    assert view.synced["cluster"].is_set()

    await view._watch_cluster()  # what the guarded loop does after the watch crashed
    assert _rules(view) == {"kept"}
    assert cluster_feed.key_of(deleted) not in view.bucket_objects
    # the deletion is news, told once, by the sweep at the end of the replay
    assert [(e.kind, e.by[0]) for e in audit.events] == [("untainted", "devicetaintrule deleted-meanwhile")]


async def test_a_view_is_complete_only_once_a_binder_has_filled_the_bucket(monkeypatch):
    view, _ = _view(monkeypatch, [[_put(_rule("r"), 1)]])
    await view._watch_cluster()
    assert not view.synced["cluster"].is_set()  # replayed, but no binder marker: the bucket may be partial
    view.take_cluster_entry(cluster_feed.SYNCED_KEY, _synced(2).value)
    assert view.synced["cluster"].is_set()


async def test_an_unreadable_entry_is_skipped_and_counted(monkeypatch, caplog):
    bad = SimpleNamespace(key=cluster_feed.key_of(_rule("bad")), value=b"\xc1 not msgpack", revision=1,
                          operation="PUT")
    view, _ = _view(monkeypatch, [[_synced(1), bad, _put(_rule("good"), 2)]])
    await view._watch_cluster()
    assert _rules(view) == {"good"}
    assert "unreadable cluster bucket entry" in caplog.text

"""The permission sets of draplane.nats_roles, pure: who may publish, read and write which bucket.

tests/deploy/test_nats_permissions.py has a real nats-server enforce them; these pin down the
sets themselves, for any subject prefix.
"""

from __future__ import annotations

import pytest

from draplane.messages.audit import AuditNames
from draplane.messages.inventory import InventoryNames
from draplane.nats_roles import (
    SERVICE_ROLES, fleet_inbox_prefix, node_agent_permissions, service_inbox_prefix, service_permissions,
)
from draplane.scheduling.messages import Subjects

PREFIX = "prod.draplane."
SUBJECTS, INVENTORY, AUDIT = Subjects(prefix=PREFIX), InventoryNames(PREFIX), AuditNames(PREFIX)


def _roles():
    return {role: service_permissions(role, PREFIX) for role in SERVICE_ROLES}


def _kv_written(permissions) -> set[str]:
    return {s.removeprefix("$KV.").removesuffix(".>") for s in permissions.publish if s.startswith("$KV.")}


def test_each_role_writes_only_its_own_buckets():
    written = {role: _kv_written(p) for role, p in _roles().items()}
    assert written == {
        "inventory": {INVENTORY.feed_bucket},
        "allocator": {SUBJECTS.reservations_bucket},  # compare-and-set of reservations
        "binder": {SUBJECTS.reservations_bucket,  # leases, confirmations
                   SUBJECTS.cluster_bucket,  # the shards' view of Kubernetes
                   SUBJECTS.gang_permits_bucket},  # gang barriers that opened, for a restarted binder
        "audit": set(),
        "reader": set(),
    }


def test_scheduling_subjects_have_one_publisher_each():
    publishers = {subject: {role for role, p in _roles().items() if subject in p.publish}
                  for subject in (SUBJECTS.pending_all, SUBJECTS.released, SUBJECTS.results, INVENTORY.change_wildcard)}
    assert publishers == {SUBJECTS.pending_all: {"binder"}, SUBJECTS.released: {"binder"},
                          SUBJECTS.results: {"allocator"}, INVENTORY.change_wildcard: {"inventory"}}
    # The binder's audit events are the binder's alone: a shard cannot claim a pod was placed.
    for kind, publishers in {"placed": {"binder"}, "released": {"binder"}, "rejected": {"binder"},
                             "tainted": {"allocator", "inventory"}, "removed": {"inventory"}}.items():
        assert {role for role, p in _roles().items() if AUDIT.subject(kind) in p.publish} == publishers, kind


def test_nobody_deletes_or_purges_a_stream_and_the_reader_changes_nothing():
    for role, permissions in _roles().items():
        for subject in permissions.publish:
            assert ".STREAM.DELETE." not in subject and ".STREAM.PURGE." not in subject, (role, subject)
            assert subject != ">" and not subject.endswith("$JS.API.>"), (role, subject)
    reader = _roles()["reader"]
    writes = [s for s in reader.publish if s.startswith(("$KV.", "$JS.ACK.")) or ".STREAM.CREATE." in s
              or ".STREAM.UPDATE." in s or s.startswith(PREFIX)]
    assert writes == []
    # Its consumer rights are wildcards over consumer names: the audit subscriber's is carved out.
    assert f"$JS.API.CONSUMER.MSG.NEXT.{AUDIT.stream}.{AUDIT.consumer}" in reader.deny_publish
    assert reader.config()["publish"]["deny"] == list(reader.deny_publish)


def test_each_role_reads_replies_under_its_own_inbox_only():
    inboxes = {role: p.inbox_prefix for role, p in _roles().items()}
    assert inboxes == {role: service_inbox_prefix(role) for role in SERVICE_ROLES}
    for role, permissions in _roles().items():
        assert f"{permissions.inbox_prefix}.>" in permissions.subscribe
        assert not any(s.startswith("_INBOX") and s != f"{permissions.inbox_prefix}.>" for s in permissions.subscribe), role
        assert "_INBOX.>" not in permissions.subscribe and ">" not in permissions.subscribe
    # Only the inventory hears heartbeats, only the reader watches the work queues go by.
    assert [r for r, p in _roles().items() if INVENTORY.heartbeat_wildcard in p.subscribe] == ["inventory"]
    assert [r for r, p in _roles().items() if SUBJECTS.pending_all in p.subscribe] == ["reader"]


def test_a_node_agent_publishes_its_own_nodes_subjects_and_nothing_else():
    one = node_agent_permissions(["gpu-1.rack-2"], INVENTORY)
    assert one.publish == (INVENTORY.snapshot_subject("gpu-1.rack-2"), INVENTORY.heartbeat_subject("gpu-1.rack-2"))
    assert one.subscribe == ("_INBOX_gpu-1_rack-2.>",)
    assert one.config() == {"publish": {"allow": list(one.publish)}, "subscribe": {"allow": ["_INBOX_gpu-1_rack-2.>"]}}
    fleet = node_agent_permissions(["sim-0000", "sim-0001"], INVENTORY, inbox_prefix=fleet_inbox_prefix("sim"))
    assert set(fleet.publish) == {INVENTORY.snapshot_subject(n) for n in ("sim-0000", "sim-0001")} | {
        INVENTORY.heartbeat_subject(n) for n in ("sim-0000", "sim-0001")}
    assert fleet.subscribe == ("_INBOX_fleet_sim.>",)
    with pytest.raises(ValueError, match="at least one node"):
        node_agent_permissions([], INVENTORY)


def test_an_unknown_role_is_named():
    with pytest.raises(ValueError, match=r"unknown NATS role 'scheduler'; roles are \['inventory'"):
        service_permissions("scheduler", PREFIX)

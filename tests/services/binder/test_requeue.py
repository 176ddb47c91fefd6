"""A node's heartbeat does not retry the unschedulable backlog; a change node fit reads does."""

import msgspec

from draplane.api.core import Node, NodeSpec, NodeStatus, Taint
from draplane.api.meta import Condition, ObjectMeta
from draplane_binder.requeue import node_fit_fingerprint


def _node(**changes) -> Node:
    node = Node(
        metadata=ObjectMeta(name="n1", labels={"zone": "a"}, resource_version="1"),
        spec=NodeSpec(),
        status=NodeStatus(allocatable={"cpu": "8", "memory": "64Gi"},
                          conditions=[Condition(type="Ready", status="True", message="kubelet is posting ready status")]),
    )
    for path, value in changes.items():
        part, field = path.split("__")
        setattr(getattr(node, part), field, value)
    return node


def test_a_status_write_of_conditions_or_a_new_resource_version_changes_nothing():
    beat = _node(status__conditions=[Condition(type="Ready", status="True", message="kubelet is posting ready status (again)", last_transition_time="2026-12-02T01:00:40Z")],
                 metadata__resource_version="2")
    assert node_fit_fingerprint(beat) == node_fit_fingerprint(_node())


def test_what_node_fit_reads_changes_the_fingerprint():
    base = node_fit_fingerprint(_node())
    for changed in (
        _node(metadata__labels={"zone": "b"}),
        _node(spec__taints=[Taint(key="gpu", effect="NoSchedule")]),
        _node(spec__unschedulable=True),
        _node(status__allocatable={"cpu": "16", "memory": "64Gi"}),
        _node(status__declared_features=["RestartAllContainersOnContainerExits"]),
    ):
        assert node_fit_fingerprint(changed) != base, msgspec.to_builtins(changed)

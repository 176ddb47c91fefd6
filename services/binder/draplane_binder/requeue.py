"""Which changes of a node may let an unschedulable pod fit, as kube-scheduler's queueing hints
decide for a node update. Pure.

The binder retries every unschedulable pod at once when a node changes in a way that matters to
node fit (labels, taints, unschedulable, allocatable, the features its kubelet declares), or is
added or deleted. A status write that
only renews the kubelet's heartbeat (every node's, every few tens of seconds; KWOK's too) changes
none of them: retrying the whole backlog on each would keep a shard busy re-placing pods that
still cannot fit, and the pending queue full of them, all the time.
"""

from __future__ import annotations

import msgspec

from draplane.api.core import Node

_encoder = msgspec.json.Encoder()


def node_fit_fingerprint(node: Node) -> bytes:
    """What node fit reads of a node, as bytes to compare; equal bytes, same fit for every pod."""
    spec, status = node.spec, node.status
    return _encoder.encode((
        node.metadata.labels,
        spec.taints if spec else None,
        spec.unschedulable if spec else None,
        status.allocatable if status else None,
        status.declared_features if status else None,  # NodeDeclaredFeatures
    ))

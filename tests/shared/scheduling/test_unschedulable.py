from draplane.scheduling.messages import NodeFailure
from draplane.scheduling.unschedulable import FailureReason, summarize


def test_counts_nodes_per_failure_class_most_common_first():
    failures = [
        NodeFailure(node="a", reason=FailureReason.CAPACITY_EXHAUSTED.value),
        NodeFailure(node="b", reason=FailureReason.CAPACITY_EXHAUSTED.value),
        NodeFailure(node="c", reason=FailureReason.NO_MATCHING_DEVICE.value, detail="class high-memory-gpu"),
    ]
    assert summarize(failures, 3) == (
        "0/3 nodes are available: 2 nodes: capacity exhausted (matching devices are all in use); "
        "1 node: no device matches the class (class high-memory-gpu)."
    )


def test_no_nodes():
    assert "no nodes" in summarize([], 0)

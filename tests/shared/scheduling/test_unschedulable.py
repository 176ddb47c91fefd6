from draplane.scheduling.messages import NodeFailure
from draplane.scheduling.unschedulable import FailureReason, summarize


def test_counts_each_nodes_reasons_in_sorted_order_as_kube_scheduler_does():
    failures = [
        NodeFailure(node="a", reason=FailureReason.NODE_DOES_NOT_FIT.value, reasons=["Insufficient cpu", "Insufficient memory"]),
        NodeFailure(node="b", reason=FailureReason.NODE_DOES_NOT_FIT.value, reasons=["Insufficient cpu"]),
        NodeFailure(node="c", reason=FailureReason.NO_MATCHING_DEVICE.value,
                    reasons=["cannot allocate all claims: resourceclaim ns/c, request gpu: not enough devices"]),
        NodeFailure(node="d", reason=FailureReason.CAPACITY_EXHAUSTED.value),  # from an older shard: class words
    ]
    assert summarize(failures, 4) == (
        "0/4 nodes are available: 1 Insufficient memory, 1 cannot allocate all claims: resourceclaim ns/c, request gpu: "
        "not enough devices, 1 capacity exhausted (too few free matching devices), 2 Insufficient cpu."
    )


def test_no_nodes():
    assert "no nodes" in summarize([], 0)

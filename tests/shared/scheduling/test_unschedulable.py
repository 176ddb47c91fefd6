from draplane.scheduling.messages import NodeFailure
from draplane.scheduling.unschedulable import FailureReason, failure_label, summarize


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


def test_the_metric_label_is_the_class_most_nodes_failed_with():
    def failed(*reasons):
        return [NodeFailure(node=f"n{i}", reason=r.value if isinstance(r, FailureReason) else r)
                for i, r in enumerate(reasons)]

    capacity, fit = FailureReason.CAPACITY_EXHAUSTED, FailureReason.NODE_DOES_NOT_FIT
    assert failure_label(failed(capacity, fit, capacity)) == "CapacityExhausted"
    # a tie goes to FailureReason's order: no matching device, constraint, capacity, node fit
    assert failure_label(failed(fit, capacity)) == "CapacityExhausted"
    assert failure_label(failed(fit, FailureReason.NO_MATCHING_DEVICE)) == "NoMatchingDevice"
    assert failure_label(failed("SomethingNewer", "SomethingNewer", fit)) == "SomethingNewer"
    assert failure_label(failed(fit), claim_error="unknown device class") == "ClaimError"
    assert failure_label([]) == "NoNodes"

"""draplane_binder.backoff: when each pending pod is tried again (kube-scheduler's backoff queue)."""

from draplane_binder.backoff import PodBackoff


def _backoff() -> PodBackoff:
    return PodBackoff(initial=1.0, maximum=8.0, flush=0.2)


def test_each_failure_in_a_row_doubles_the_wait_up_to_the_maximum():
    table = _backoff()
    assert [table.failed("p", now=100.0) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert table.waiting("p", 107.9) and not table.waiting("p", 108.0)


def test_a_due_retry_is_handed_out_once_and_keeps_its_backoff():
    table = _backoff()
    table.failed("p", now=0.0)
    table.failed("p", now=0.0)  # 2 s
    assert table.due(1.0) == []
    assert table.due(2.0) == ["p"]
    assert table.due(2.1) == [] and table.due(50.0) == []  # not put back into the queue every tick
    assert not table.waiting("p", 2.1)
    assert table.failed("p", now=3.0) == 4.0  # the next failure goes on doubling


def test_what_a_pod_waits_for_changing_brings_its_retry_forward_not_back():
    table = _backoff()
    for _ in range(4):
        table.failed("slow", now=0.0)  # due at 8
    table.failed("soon", now=0.0)  # due at 1
    table.wake(["slow", "soon", "unknown"], now=0.9)
    assert table.due(1.1) == ["slow", "soon"]  # slow at 1.1; soon kept its own 1.0
    table.failed("slow", now=2.0)
    table.wake_all(now=2.0)
    assert table.due(2.2) == ["slow"]
    assert table.next_backoff("slow") == 8.0  # waking keeps the backoff


def test_a_pod_not_sent_waits_the_first_backoff_and_keeps_its_own():
    table = _backoff()
    table.failed("p", now=0.0)
    table.failed("p", now=0.0)  # backoff 2
    table.not_sent("p", now=10.0)
    assert table.waiting("p", 10.9) and table.due(11.0) == ["p"]
    assert table.next_backoff("p") == 4.0


def test_an_abandoned_placement_is_tried_soon_and_a_failed_prebind_after_its_backoff():
    table = _backoff()
    for _ in range(3):
        table.failed("p", now=0.0)  # backoff 4
    backoff = table.next_backoff("p")  # read before the placement is abandoned, as the writer does
    table.placement_abandoned("p", now=10.0)
    assert table.due(10.2) == ["p"]
    table.placement_abandoned("p", now=20.0)
    table.back_off("p", backoff, now=20.0)
    assert table.due(27.9) == [] and table.due(28.0) == ["p"]
    table.back_off("gone", 5.0, now=0.0)  # a pod with no entry gets none
    assert "gone" not in table


def test_a_forgotten_pod_starts_afresh():
    table = _backoff()
    table.failed("p", now=0.0)
    table.failed("p", now=0.0)
    table.forget("p")
    assert "p" not in table and len(table) == 0
    assert table.failed("p", now=0.0) == 1.0

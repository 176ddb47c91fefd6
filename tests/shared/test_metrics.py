"""draplane.metrics: reading counts back, and consumer lag that survives NATS failing."""

import nats.js.errors
from prometheus_client import CollectorRegistry, Counter, generate_latest

from draplane.metrics import ConsumerLag, counter_value, sample_value


def test_counts_are_read_back_by_label_from_a_counter_or_a_registry():
    registry = CollectorRegistry()
    conflicts = Counter("x_conflicts", "", ["shard", "kind"], registry=registry)
    conflicts.labels("0", "compare_and_set").inc()
    conflicts.labels("1", "compare_and_set").inc(2)
    conflicts.labels("1", "stale_view").inc(4)
    assert counter_value(conflicts) == 7
    assert counter_value(conflicts, shard="1") == 6
    assert counter_value(conflicts, shard="1", kind="stale_view") == 4
    assert counter_value(conflicts, shard="9") == 0
    assert sample_value(registry, "x_conflicts_total", kind="compare_and_set") == 3
    assert sample_value(registry, "x_missing_total") == 0


class _Info:
    def __init__(self, pending, ack_pending):
        self.num_pending, self.num_ack_pending = pending, ack_pending


class _JetStream:
    def __init__(self, answers):
        self.answers = answers

    async def consumer_info(self, stream, consumer):
        answer = self.answers[(stream, consumer)]
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_consumer_lag_keeps_the_last_values_when_a_poll_fails():
    registry = CollectorRegistry()
    lag = ConsumerLag(registry)
    consumers = [("results", "binder"), ("pending", "shard-0")]
    answers = {("results", "binder"): _Info(3, 1), ("pending", "shard-0"): nats.js.errors.NotFoundError()}
    await lag.poll_once(_JetStream(answers), consumers)  # shard-0's consumer is not made yet: no series
    assert sample_value(registry, "draplane_nats_consumer_pending_messages", consumer="binder") == 3
    assert sample_value(registry, "draplane_nats_consumer_ack_pending_messages", consumer="binder") == 1
    assert 'consumer="shard-0"' not in generate_latest(registry).decode()
    answers[("results", "binder")] = TimeoutError()  # NATS away: the last values stay
    answers[("pending", "shard-0")] = _Info(0, 0)
    await lag.poll_once(_JetStream(answers), consumers)
    assert sample_value(registry, "draplane_nats_consumer_pending_messages", consumer="binder") == 3
    assert sample_value(registry, "draplane_nats_consumer_pending_messages", consumer="shard-0") == 0

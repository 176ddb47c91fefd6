"""What every service's /metrics shares: the endpoint, NATS consumer lag, and reading a registry back.

Each service keeps its metrics in a `CollectorRegistry` of its own, never prometheus_client's
global one: tests run several services (and several shards) in one process, and each must count
only what it did. Metric names start with `draplane_<service>_`; the apiserver's
(`draplane_apiserver_*`, draplane.kube.metrics) and NATS' (`draplane_nats_*`, here) are the same
in every service, told apart by the scrape's job or pod labels.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import nats.errors
import nats.js.errors
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

log = logging.getLogger(__name__)

# Consumer info is one JetStream API request per consumer; every 10 s is plenty for a lag graph
# and nothing for the server.
CONSUMER_LAG_POLL_SECONDS = 10.0


def metrics_handler(registry: CollectorRegistry):
    """An aiohttp handler serving `registry` in the Prometheus text format."""

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return metrics


def sample_value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 when there are
    none): `sample_value(r, "draplane_binder_pods_bound_total")` over every label value."""
    total = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def counter_value(counter, **labels: str) -> float:
    """A counter's count (summed over the children whose labels include `labels`), read from the
    counter itself: unlike reading the registry, it runs none of the collectors computed at scrape."""
    return sum(sample.value for family in counter.collect() for sample in family.samples
               if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in labels.items()))


class ConsumerLag:
    """NATS consumer lag per stream: messages not yet delivered to a durable consumer
    (`num_pending`) and delivered but not acknowledged (`num_ack_pending`), polled from consumer
    info. One per registry; each consumer is polled by the task of whoever reads it. A poll that
    fails keeps the last values and is tried again at the next interval."""

    def __init__(self, registry: CollectorRegistry):
        self.pending = Gauge("draplane_nats_consumer_pending_messages",
                             "Messages in the stream not yet delivered to the consumer (num_pending)",
                             ["stream", "consumer"], registry=registry)
        self.ack_pending = Gauge("draplane_nats_consumer_ack_pending_messages",
                                 "Messages delivered to the consumer and not yet acknowledged (num_ack_pending)",
                                 ["stream", "consumer"], registry=registry)

    async def poll_once(self, js, consumers: Sequence[tuple[str, str]]) -> None:
        for stream, consumer in consumers:
            try:
                info = await js.consumer_info(stream, consumer)
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError, OSError) as exc:
                # not made yet (a service creates its consumer once synced), or NATS is away
                log.debug("consumer info of %s/%s: %s", stream, consumer, exc)
                continue
            self.pending.labels(stream, consumer).set(info.num_pending or 0)
            self.ack_pending.labels(stream, consumer).set(info.num_ack_pending or 0)

    async def poll_forever(self, js, consumers: Sequence[tuple[str, str]]) -> None:
        """(stream, durable consumer) pairs, every CONSUMER_LAG_POLL_SECONDS until cancelled."""
        while True:
            await self.poll_once(js, consumers)
            await asyncio.sleep(CONSUMER_LAG_POLL_SECONDS)

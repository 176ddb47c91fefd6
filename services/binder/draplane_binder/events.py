"""The Events the binder writes, as kube-scheduler's event recorder writes them.

Events about a binding are written aside, never holding up the next one: a bounded queue, as
client-go's event broadcaster keeps one (1,000 deep) and drops what does not fit. One task per
event would pile up without bound whenever the apiserver answers slower than pods are bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from draplane.api.core import Pod
from draplane.kube import KubeApiError, KubeClient
from draplane_binder.metrics import BinderMetrics
from draplane_binder.objects import key_of, now_rfc3339

log = logging.getLogger(__name__)

MAX_QUEUED_EVENTS = 1000
EVENT_WRITERS = 4
# kube-apiserver refuses an Event message longer than this
MAX_MESSAGE_CHARACTERS = 1024


class EventRecorder:
    def __init__(self, kube: KubeClient, *, instance: str, metrics: BinderMetrics) -> None:
        self.kube = kube
        self.instance = instance
        self.metrics = metrics
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=MAX_QUEUED_EVENTS)

    def loops(self) -> list[tuple[str, Callable[[], Awaitable]]]:
        return [(f"event writer {i}", self._write_queued) for i in range(EVENT_WRITERS)]

    async def pod_event(self, pod: Pod, reason: str, message: str, type_: str = "Warning") -> None:
        namespace, name = key_of(pod)
        await self.object_event({"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name,
                                 "uid": pod.metadata.uid}, reason, message, type_)

    async def object_event(self, involved: dict, reason: str, message: str, type_: str = "Warning") -> None:
        """Best effort: an Event the apiserver refuses is logged, never raised."""
        now = now_rfc3339()
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{involved['name']}.", "namespace": involved["namespace"]},
            "involvedObject": involved, "reason": reason, "message": message[:MAX_MESSAGE_CHARACTERS],
            "type": type_, "source": {"component": "draplane"}, "reportingComponent": "draplane",
            "reportingInstance": self.instance, "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        try:
            await self.kube.apply_raw(event)
        except KubeApiError as exc:
            log.warning("event %s for %s %s/%s not written: %s", reason, involved["kind"], involved["namespace"],
                        involved["name"], exc)

    def queue_pod_event(self, pod: Pod, reason: str, message: str, type_: str = "Warning") -> None:
        try:
            self.queue.put_nowait((pod, reason, message, type_))
        except asyncio.QueueFull:
            self.metrics.events_dropped.inc()
            log.debug("event %s for pod %s/%s dropped: %d events wait already", reason, *key_of(pod),
                      self.queue.qsize())

    async def _write_queued(self) -> None:
        while True:
            pod, reason, message, type_ = await self.queue.get()
            await self.pod_event(pod, reason, message, type_)

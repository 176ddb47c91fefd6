"""Preemption, as the binder carries out what a shard decided: the victims evicted through the
Eviction API (which refuses what a PodDisruptionBudget forbids), each told why with
kube-scheduler's `Preempted` Event, and the node nominated on the preemptor. The choice of
victims is the shard's (draplane.scheduling.preemption)."""

from __future__ import annotations

import logging
import time

from draplane.api.core import Pod
from draplane.api.meta import ObjectMeta
from draplane.audit_publisher import AuditPublisher
from draplane.kube import KubeApiError, KubeClient
from draplane.messages import audit
from draplane.scheduling.messages import Preemption
from draplane.structured_logs import fields
from draplane_binder.events import EventRecorder
from draplane_binder.metrics import BinderMetrics
from draplane_binder.objects import key_of

log = logging.getLogger(__name__)


class Preemptor:
    def __init__(self, kube: KubeClient, *, events: EventRecorder, audit_publisher: AuditPublisher,
                 metrics: BinderMetrics, instance: str) -> None:
        self.kube, self.events, self.audit, self.metrics, self.instance = kube, events, audit_publisher, metrics, instance

    async def preempt(self, pod: Pod, preemption: Preemption, message: str, shard: int | None = None) -> str:
        """Evict the victims and nominate the node. Returns the preemptor's message, with any
        refusal.

        Idempotent: a redelivered answer evicts pods already gone (404, or the UID precondition
        fails on a namesake: 409) and nominates the same node again."""
        namespace, name = key_of(pod)
        refused = []
        for victim in preemption.victims:
            try:
                await self.kube.evict_pod(victim.namespace, victim.name, victim.uid)
            except KubeApiError as exc:
                if exc.is_not_found or exc.is_conflict:
                    continue  # gone already, or a new pod under its name: not ours to evict
                if exc.refused_by_disruption_budget:
                    refused.append(f"{victim.key()}: {exc.message}")
                    continue
                raise
            self.metrics.preemption_evictions.inc()
            log.info("pod %s: evicted to make room for %s/%s on node %s", victim.key(), namespace, name,
                     preemption.node, extra=fields(pod=victim.key(), node=preemption.node))
            victim_pod = Pod(metadata=ObjectMeta(namespace=victim.namespace, name=victim.name, uid=victim.uid))
            await self.events.pod_event(victim_pod, "Preempted",
                                        f"Preempted by pod {pod.metadata.uid} on node {preemption.node}",
                                        type_="Normal")
            await self.audit.publish_and_wait(audit.AuditEvent(
                id=audit.preempted_id(victim.uid), kind="preempted", at=time.time(),
                by=[f"shard-{shard}", self.instance] if shard is not None else [self.instance], node=preemption.node,
                pod=audit.PodName(namespace=victim.namespace, name=victim.name, uid=victim.uid),
                reason=f"evicted for {namespace}/{name}: {preemption.explanation}",
            ))
        try:
            await self.kube.patch(Pod, name, {"status": {"nominatedNodeName": preemption.node}}, namespace,
                                  subresource="status")
        except KubeApiError as exc:
            if not exc.is_not_found:
                raise
        if refused:
            return f"{message} Evictions refused: {'; '.join(refused)}."
        return message

"""Reporting double allocations (draplane_binder.double_allocation finds them) as they appear in
the cluster cache."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from draplane.api.resource import ResourceClaim
from draplane.audit_publisher import AuditPublisher
from draplane.messages import audit
from draplane.structured_logs import fields
from draplane_binder.double_allocation import DeviceHolders, DoubleAllocation
from draplane_binder.events import EventRecorder
from draplane_binder.metrics import BinderMetrics

log = logging.getLogger(__name__)


# The reason of the Warning Event on each claim of a double allocation.
DOUBLE_ALLOCATION_REASON = "DeviceAllocatedTwice"


class DoubleAllocationReporter:
    """Follows every claim's devices (DeviceHolders) through the cluster cache and reports a
    device in two claims beyond what adminAccess and shares allow: counted, logged, a Warning
    Event on each claim and an audit record. draplane's own placements never do this (the shards
    commit through one reservation bucket); another scheduler over the same slices can."""

    def __init__(self, *, events: EventRecorder, audit_publisher: AuditPublisher, metrics: BinderMetrics,
                 instance: str, spawn_once: Callable[[Awaitable, str], None]) -> None:
        self.events, self.audit, self.metrics, self.instance = events, audit_publisher, metrics, instance
        self._spawn_once = spawn_once
        self.holders = DeviceHolders()

    def claim_changed(self, kind: str, old: ResourceClaim | None, claim: ResourceClaim) -> None:
        if kind == "DELETED":
            self.holders.forget(claim.metadata.uid or "")
            return
        for double in self.holders.update(claim):
            self.metrics.double_allocations.inc()
            log.error("%s", double.message(), extra=fields(claim=double.first.key, node=double.device[1]))
            self._spawn_once(self._tell(double), f"double allocation {double.id}")

    async def _tell(self, double: DoubleAllocation) -> None:
        for holder in (double.first, double.second):
            await self.events.object_event(
                {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "namespace": holder.namespace,
                 "name": holder.name, "uid": holder.uid}, DOUBLE_ALLOCATION_REASON, double.message())
        driver, pool, device = double.device
        await self.audit.publish_and_wait(audit.AuditEvent(
            id=audit.double_allocation_id(double.id), kind="conflict", at=time.time(), by=[self.instance], node=pool,
            claims=[audit.ClaimDevices(namespace=h.namespace, name=h.name, uid=h.uid, devices=[audit.DeviceRef(
                driver=driver, pool=pool, device=device, share_id=h.share_id, admin_access=h.admin_access)])
                for h in (double.first, double.second)],
            reason=double.message(),
        ))

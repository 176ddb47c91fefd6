"""The claim reconciler: what kube-controller-manager's resourceclaim controller does, where the
binder manages claims (`manage_claims`, the local environment): finished or deleted pods dropped
from reservedFor, a claim nobody reserves deallocated, a template claim of a gone pod deleted,
and the delete-protection finalizer taken off a claim being deleted once it is free.

The decisions are draplane_binder.lifecycle's; this module does the I/O, one claim at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import msgspec

from draplane.api.core import Pod
from draplane.api.resource import ResourceClaim, ResourceClaimConsumerReference
from draplane.kube import KubeApiError, KubeClient
from draplane_binder import lifecycle as lc
from draplane_binder.cache import ClusterCache
from draplane_binder.metrics import BinderMetrics
from draplane_binder.objects import Key, key_of
from draplane_binder.settings import BinderSettings
from draplane_binder.work_queue import WorkQueue, work

log = logging.getLogger(__name__)

CLAIM_WORKERS = 4


class ClaimReconciler:
    def __init__(self, settings: BinderSettings, kube: KubeClient, *, cache: ClusterCache,
                 metrics: BinderMetrics) -> None:
        self.settings, self.kube, self.cache, self.metrics = settings, kube, cache, metrics
        self.claim_queue = WorkQueue()
        cache.pod_listeners.append(self._pod_changed)
        cache.claim_listeners.append(self._claim_changed)
        cache.sync_listeners.append(self._listed)

    def loops(self) -> list[tuple[str, Callable[[], Awaitable]]]:
        return [(f"claim worker {i}", self._work) for i in range(CLAIM_WORKERS)]

    def _pod_changed(self, kind: str, old: Pod | None, pod: Pod) -> None:
        # claims reserved for this pod, or generated for it, may now need cleaning up
        for claim_key in self.cache.claims_by_pod.get(pod.metadata.uid or "", ()):
            self.claim_queue.put(claim_key)

    def _claim_changed(self, kind: str, old: ResourceClaim | None, claim: ResourceClaim) -> None:
        if kind != "DELETED":
            self.claim_queue.put(key_of(claim))

    def _listed(self, what: str) -> None:
        if what in ("pods", "claims"):
            # after a (re-)list every claim is looked at again
            for key in list(self.cache.claims):
                self.claim_queue.put(key)

    async def _work(self) -> None:
        await work(self.claim_queue, self.reconcile_claim, kind="resourceclaim", errors=self.metrics.errors)

    async def _pods_really_gone(self, claim: ResourceClaim, refs) -> list:
        """Confirm with a live read that pods missing from the cache are gone (the cache may lag)."""
        namespace = claim.metadata.namespace or ""
        gone = []
        for ref in refs:
            if ref.uid in self.cache.pods_by_uid:
                gone.append(ref)  # cached and done
                continue
            try:
                live = await self.kube.get(Pod, ref.name, namespace)
            except KubeApiError as exc:
                if exc.is_not_found:
                    gone.append(ref)
                    continue
                raise
            if live.metadata.uid != ref.uid or lc.pod_is_done(live):
                gone.append(ref)
        return gone

    async def reconcile_claim(self, key: Key) -> None:
        if not self.settings.manage_claims:
            return
        await self.cache.wait_synced("pods")
        claim = self.cache.claims.get(key)
        if claim is None:
            return
        drop = lc.reserved_for_to_drop(claim, self.cache.pods_by_uid)
        if drop:
            drop = await self._pods_really_gone(claim, drop)
        if drop or lc.needs_deallocation(claim):
            # never mutate the cached object: the cache's listeners compare old and new to detect releases
            changed = msgspec.structs.replace(claim, status=lc.status_without_consumers(claim, drop))
            updated = await self.kube.update_status(changed)
            what = [f"removed finished or deleted pods {[r.name for r in drop]} from reservedFor"] if drop else []
            if changed.status.allocation is None:
                what.append("deallocated: nobody reserves it")
            log.info("resourceclaim %s/%s: %s", *key, "; ".join(what))
            self.cache.apply_claim("MODIFIED", updated)
            return  # continues from the new state
        if lc.is_template_claim_of_gone_pod(claim, self.cache.pods_by_uid):
            owner_ref = next(r for r in claim.metadata.owner_references if r.controller and r.kind == "Pod")
            if self.cache.pods_by_uid.get(owner_ref.uid) is None:
                gone = await self._pods_really_gone(
                    claim, [ResourceClaimConsumerReference(resource="pods", name=owner_ref.name, uid=owner_ref.uid)]
                )
                if not gone:
                    return
            finalizers = lc.finalizers_without_protection(claim)
            if finalizers is not None:
                claim = await self.kube.update(_with_finalizers(claim, finalizers))
                self.cache.apply_claim("MODIFIED", claim)
            await self.kube.delete(ResourceClaim, key[1], key[0])
            log.info("resourceclaim %s/%s: deleted, the pod it was generated for is gone or finished", *key)
            return
        if claim.metadata.deletion_timestamp and not (claim.status and claim.status.allocation):
            finalizers = lc.finalizers_without_protection(claim)
            if finalizers is not None:
                self.cache.apply_claim("MODIFIED", await self.kube.update(_with_finalizers(claim, finalizers)))


def _with_finalizers(claim: ResourceClaim, finalizers: list[str]) -> ResourceClaim:
    return msgspec.structs.replace(claim, metadata=msgspec.structs.replace(claim.metadata, finalizers=finalizers))

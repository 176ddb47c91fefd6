"""Binder + allocator shards running in-process against the session's real servers (binder and allocator tests).

`scheduling` starts a Binder and N Shards under this test's subject prefix and stops them after
the test; `put_node` publishes a node's ResourceSlices into the inventory feed bucket, exactly as
the inventory service would, and creates the Node object.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

import nats.js.errors
import pytest
from nats.js.api import KeyValueConfig

from draplane.api.core import Node, Pod
from draplane.api.meta import NodeSelector, NodeSelectorRequirement, NodeSelectorTerm
from draplane.api.resource import (
    AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaim, ResourceSlice,
)
from draplane.scheduling import reservations as rv
from draplane.kube import KubeApiError
from draplane.simulation import scenario
from draplane.messages.inventory import SCHEMA_VERSION, FeedEntry, InventoryNames, encode
from draplane_allocator.shard import Shard
from draplane_binder.service import Binder
from draplane_binder.settings import BinderSettings


@dataclasses.dataclass
class Scheduling:
    kube: object
    nats: object
    prefix: str
    # the shards' watches read through it (a paced connection, --follow-pace-ms); None: through `nats`
    follow_nats: object = None
    binder: Binder | None = None
    shards: list[Shard] = dataclasses.field(default_factory=list)
    nodes: list[str] = dataclasses.field(default_factory=list)
    slices: list[str] = dataclasses.field(default_factory=list)
    # Each test schedules only its own pods: the scheduler name is per test, because pods other
    # tests left pending would otherwise compete for this test's devices (classes are cluster-wide).
    scheduler_name: str = dataclasses.field(default_factory=lambda: f"draplane-{uuid.uuid4().hex[:8]}")

    async def start(self, *, shards: int = 1, manage_claims: bool = False, lease_seconds: float = 30.0,
                    scheduler_names=None, policy: str | None = None, gang_scheduling: bool = True,
                    gang_wait_warning_seconds: float = 30.0, binding_timeout_seconds: float = 600.0,
                    concurrency: int = 32) -> "Scheduling":
        settings = BinderSettings(prefix=self.prefix, shards=shards, manage_claims=manage_claims,
                                  scheduler_names=tuple(scheduler_names or (self.scheduler_name,)),
                                  lease_seconds=lease_seconds, gang_wait_warning_seconds=gang_wait_warning_seconds,
                                  binding_timeout_seconds=binding_timeout_seconds, concurrency=concurrency)
        self.binder = Binder(settings, self.kube, self.nats)
        self.shards = [Shard(self.nats, index=i, prefix=self.prefix, lease_seconds=lease_seconds, policy=policy,
                             gang_scheduling=gang_scheduling, follow_nc=self.follow_nats)
                       for i in range(shards)]
        for shard in self.shards:
            await shard.start()
        await self.binder.start()
        await asyncio.gather(self.binder.wait_ready(), *(s.wait_ready() for s in self.shards))
        return self

    async def stop(self) -> None:
        if self.binder is not None:
            await self.binder.stop()
        for shard in self.shards:
            await shard.stop()

    async def feed_bucket(self):
        names = InventoryNames(prefix=self.prefix)
        try:
            return await self.nats.jetstream().key_value(names.feed_bucket)
        except nats.js.errors.BucketNotFoundError:
            return await self.nats.jetstream().create_key_value(KeyValueConfig(bucket=names.feed_bucket, history=1))

    async def put_node(self, node: Node, slices: list[ResourceSlice]) -> None:
        name = node.metadata.name
        try:
            await self.kube.create(node)
        except KubeApiError as exc:
            if not exc.is_already_exists:
                raise
        await make_ready(self.kube, name)
        # the inventory service writes both; `draplane explain` reads the slices from Kubernetes
        for s in slices:
            try:
                await self.kube.create(s)
            except KubeApiError as exc:
                if not exc.is_already_exists:
                    raise
            self.slices.append(s.metadata.name)
        self.nodes.append(name)
        kv = await self.feed_bucket()
        key = InventoryNames.node_key(name)
        await kv.put(key, encode(FeedEntry(schema_version=SCHEMA_VERSION, key=key, node=name, slices=slices)))

    def pod(self, namespace: str, name: str, **kwargs) -> Pod:
        return scenario.pod(namespace, name, scheduler_name=self.scheduler_name, **kwargs)

    async def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition", interval: float = 0.1):
        deadline = time.monotonic() + timeout
        while True:
            value = await predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; {self.diagnostics()}")
            await asyncio.sleep(interval)

    def diagnostics(self) -> str:
        binder = self.binder
        parts = []
        if binder is not None:
            parts.append(f"binder counters={binder.counters} in_flight={len(binder.pending.in_flight)} "
                         f"retry={len(binder.pending.backoff)} "
                         f"reasons={list(binder.pending.last_reason.values())[:3]}")
        for shard in self.shards:
            parts.append(f"shard {shard.index} counters={shard.counters} ready={shard.ready}")
        return "; ".join(parts)

    async def bound_pod(self, namespace: str, name: str, timeout: float = 30.0) -> Pod:
        async def bound():
            pod = await self.kube.get(Pod, name, namespace)
            return pod if pod.spec.node_name else None

        return await self.wait_for(bound, timeout, f"pod {namespace}/{name} to be bound")


async def eventually(check, timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):
    """Await `check()` until it returns something truthy (returned), or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not met within {timeout}s")
        await asyncio.sleep(interval)


def lapsed_reservation(node: str, namespace: str, claim_uid: str) -> rv.NodeReservations:
    """What a shard that died right after its commit leaves: gpu-0 of `node` reserved for a claim
    whose placement never reached Kubernetes, under a lease that has just run out."""
    allocation = AllocationResult(
        devices=DeviceAllocationResult(results=[DeviceRequestAllocationResult(
            request="gpu", driver=scenario.GPU_DRIVER, pool=node, device="gpu-0")]),
        node_selector=NodeSelector(node_selector_terms=[NodeSelectorTerm(match_fields=[
            NodeSelectorRequirement(key="metadata.name", operator="In", values=[node])])]),
    )
    orphan = rv.Reservation(
        claim_uid=claim_uid, claim_namespace=namespace, claim_name="ghost", pod_uid="ghost-pod",
        devices=rv.devices_of(allocation), allocation=allocation,
        reserved_at=time.time() - 60, expires_at=time.time() - 1,
    )
    return rv.add(rv.NodeReservations(node=node), [orphan])


async def make_ready(kube, name: str) -> None:
    """What a kubelet and the node lifecycle controller would do: report Ready, lift not-ready.

    The apiserver taints every new Node node.kubernetes.io/not-ready:NoSchedule; nothing else in
    the local environment removes it."""
    await kube.patch(Node, name, {"spec": {"taints": None}})
    await kube.patch(
        Node, name,
        {"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                    "message": "simulated", "lastHeartbeatTime": None}]}},
        subresource="status", patch_type="application/strategic-merge-patch+json",
    )


class TracebackRecorder(logging.Handler):
    """Every log record of a draplane service that carries a traceback."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.name.startswith(("draplane", "draplane_")):
            self.records.append(record)


@pytest.fixture(autouse=True)
def no_service_tracebacks(request):
    """Fail a test in which a service logged a traceback: an unexpected exception is a bug, even
    when the service recovered from it. Tests that cause one on purpose say so with the
    `tracebacks_expected` mark."""
    recorder = TracebackRecorder()
    root = logging.getLogger()
    root.addHandler(recorder)
    try:
        yield recorder
    finally:
        root.removeHandler(recorder)
    if recorder.records and request.node.get_closest_marker("tracebacks_expected") is None:
        first = recorder.records[0]
        text = logging.Formatter("%(name)s: %(message)s").format(first)
        pytest.fail(f"{len(recorder.records)} traceback(s) logged by the services; the first: {text}", pytrace=False)


@pytest.fixture
async def scheduling(kube, nats, subject_prefix):
    env = Scheduling(kube=kube, nats=nats, prefix=subject_prefix)
    yield env
    await env.stop()
    for name in env.nodes:
        await kube.delete(Node, name)
    for name in env.slices:
        await kube.delete(ResourceSlice, name)


def all_claims_devices(claims: list[ResourceClaim]) -> list[tuple[str, str, str]]:
    devices = []
    for claim in claims:
        allocation = claim.status.allocation if claim.status else None
        for r in (allocation.devices.results if allocation and allocation.devices else None) or ():
            devices.append((r.driver, r.pool, r.device))
    return devices


async def ensure_class(kube, device_class) -> None:
    try:
        await kube.create(device_class)
    except KubeApiError as exc:
        if not exc.is_already_exists:
            raise


async def create_many(kube, objects, batch: int = 50) -> list:
    created = []
    for i in range(0, len(objects), batch):
        created.extend(await asyncio.gather(*(kube.create(o) for o in objects[i : i + batch])))
    return created


def pod_scheduled_false(pod: Pod):
    for condition in (pod.status.conditions if pod.status else None) or ():
        if condition.type == "PodScheduled" and condition.status == "False":
            return condition
    return None


async def audit(kube, namespace: str) -> dict:
    """The invariants over every claim and pod of a namespace.

    Pods are listed before claims, and the order matters: the binder writes a claim's allocation
    and reservedFor before it creates the pod's binding, so a pod bound in the first list has its
    claim written in the second, unless something really cleared it. Listed the other way round,
    a pod bound between the two lists looks bound without its claim (it did, once, in a CI run).
    """
    pods, _ = await kube.list(Pod, namespace)
    claims, _ = await kube.list(ResourceClaim, namespace)
    devices = all_claims_devices(claims)
    claims_by_name = {c.metadata.name: c for c in claims}
    bound_without_claim = []
    for pod in pods:
        if not pod.spec.node_name:
            continue
        for status in (pod.status.resource_claim_statuses if pod.status else None) or ():
            claim = claims_by_name.get(status.resource_claim_name)
            ok = (
                claim is not None and claim.status is not None and claim.status.allocation is not None
                and any(r.uid == pod.metadata.uid for r in claim.status.reserved_for or ())
            )
            if not ok:
                bound_without_claim.append(pod.metadata.name)
        for pc in pod.spec.resource_claims or ():
            if pc.resource_claim_name:
                claim = claims_by_name.get(pc.resource_claim_name)
                if claim is None or not claim.status or not claim.status.allocation or not any(
                    r.uid == pod.metadata.uid for r in claim.status.reserved_for or ()
                ):
                    bound_without_claim.append(pod.metadata.name)
    return {
        "claims": claims,
        "pods": pods,
        "devices": devices,
        "duplicates": sorted({d for d in devices if devices.count(d) > 1}),
        "bound": [p for p in pods if p.spec.node_name],
        "explained": [p for p in pods if not p.spec.node_name and pod_scheduled_false(p) is not None],
        "unexplained": [p for p in pods if not p.spec.node_name and pod_scheduled_false(p) is None],
        "bound_without_claim": bound_without_claim,
    }

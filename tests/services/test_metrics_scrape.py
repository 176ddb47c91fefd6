"""Every service's /metrics after a scripted run: the counts are what happened, exactly.

The four services run as their entry points build them (each aiohttp app with its own NATS
connection, Kubernetes client and metrics registry), in this test's event loop, on ephemeral
ports: a simulated L4 node (4 GPUs) -> inventory -> 2 allocator shards -> binder. Scripted:
1. a reservation left by a dead shard on gpu-0, its lease run out: one lease lapse, released;
2. N = 4 pods bound one after another (each waits for the last to be bound and confirmed, so no
   reservation write races another), the first of them meeting one forced conflict: the other
   shard writes the node's entry between the first shard's view and its compare-and-set;
3. M = 2 pods more, which no free GPU is left for: unschedulable.
Then every /metrics is scraped and read with prometheus_client's own parser.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from draplane import metrics as draplane_metrics
from draplane.api.core import Node, Pod
from draplane.api.meta import NodeSelector, NodeSelectorRequirement, NodeSelectorTerm
from draplane.api.resource import (
    AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceSlice,
)
from draplane.messages.inventory import InventoryNames
from draplane.scheduling import reservations as rv
from draplane.jetstream import streams
from draplane.simulation import scenario
from draplane.scheduling.messages import NodeFailure, Subjects
from draplane.scheduling.unschedulable import FailureReason, failure_label
from draplane_allocator.__main__ import SHARDS, build_app as allocator_app, build_parser as allocator_parser
from draplane_binder.__main__ import BINDER, build_app as binder_app, build_parser as binder_parser, settings_from
from draplane_inventory.__main__ import build_app as inventory_app, parse_args as inventory_args
from draplane_node_agent.__main__ import ProfileDiscovery, serve_probes
from draplane_node_agent.agent import AgentFleet, SimulatedAgent
from conftest import ensure_class, make_ready, pod_scheduled_false  # noqa: E402  (tests/services/conftest.py)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GPUS = 4  # the L4 profile's node
BOUND, UNSCHEDULABLE = GPUS, 2
LEASE_SECONDS = "300"  # no placement's lease may lapse during the test: only the planted one does


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()  # runs the app's cleanup_ctx: the service starts here
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _samples(text: str) -> list:
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def value(samples, name: str, **labels: str) -> float:
    """The sum of the samples called `name` with these labels (among others)."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def series(samples, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in samples if s.name == name}


async def _eventually(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        result = await predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)


def _ghost_reservation(node: str) -> rv.NodeReservations:
    """What a shard that died right after its commit leaves: gpu-0 reserved for a claim that will
    never be written, its lease run out a second ago."""
    allocation = AllocationResult(
        devices=DeviceAllocationResult(results=[DeviceRequestAllocationResult(
            request="gpu", driver=scenario.GPU_DRIVER, pool=node, device="gpu-0")]),
        node_selector=NodeSelector(node_selector_terms=[NodeSelectorTerm(match_fields=[
            NodeSelectorRequirement(key="metadata.name", operator="In", values=[node])])]),
    )
    ghost = rv.Reservation(claim_uid=f"ghost-{uuid.uuid4().hex[:6]}", claim_namespace="gone", claim_name="ghost",
                           pod_uid="ghost-pod", devices=rv.devices_of(allocation), allocation=allocation,
                           reserved_at=time.time() - 60, expires_at=time.time() - 1)
    return rv.add(rv.NodeReservations(node=node), [ghost])


def _force_one_conflict(shards) -> list[str]:
    """The first reservation write of either shard finds the node's entry rewritten by the other
    shard since its view was built, so its compare-and-set is refused. Returns the nodes it hit."""
    hit: list[str] = []
    for shard in shards:
        other = next(s for s in shards if s is not shard)
        original = shard.store.write

        async def write(node, entry, expected_revision, original=original, other=other):
            if not hit:
                hit.append(node)
                revision, current = await other.store.refresh(node)
                await other.store.write(node, current, revision)  # same content, a new revision
            return await original(node, entry, expected_revision)

        shard.store.write = write
    return hit


async def test_every_service_s_metrics_count_what_happened(kube, control_plane, nats, namespace, subject_prefix,
                                                          monkeypatch):
    monkeypatch.setattr(draplane_metrics, "CONSUMER_LAG_POLL_SECONDS", 0.5)
    node = f"metrics-{uuid.uuid4().hex[:6]}"
    scheduler = f"draplane-{uuid.uuid4().hex[:8]}"
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    await kube.create(scenario.gpu_node(node))
    await make_ready(kube, node)
    kubeconfig = str(control_plane.kubeconfig)
    nats_url = control_plane.nats_url
    subjects = Subjects(prefix=subject_prefix)
    bucket = await streams.reservation_bucket(nats.jetstream(), subjects)
    await bucket.put(rv.node_key(node), rv.encode_entry(_ghost_reservation(node)))

    runners: list[web.AppRunner] = []
    fleet = None
    try:
        runner, inventory_url = await _serve(inventory_app(inventory_args(
            ["--nats", nats_url, "--kubeconfig", kubeconfig, "--prefix", subject_prefix, "--listen", "127.0.0.1:0"])))
        runners.append(runner)
        allocator = allocator_app(allocator_parser().parse_args(
            ["--nats", nats_url, "--prefix", subject_prefix, "--shards", "2",
             "--lease-seconds", LEASE_SECONDS, "--port", "0"]))
        runner, allocator_url = await _serve(allocator)
        runners.append(runner)
        binder = binder_app(settings_from(binder_parser().parse_args(
            ["--nats", nats_url, "--kubeconfig", kubeconfig, "--prefix", subject_prefix, "--shards", "2",
             "--scheduler-name", scheduler, "--lease-seconds", LEASE_SECONDS, "--port", "0"])))
        runner, binder_url = await _serve(binder)
        runners.append(runner)
        fleet = AgentFleet(nats_url, [SimulatedAgent(node, ProfileDiscovery("l4", node))],
                           names=InventoryNames(subject_prefix), heartbeat_interval=1.0)
        await fleet.start()
        runner = await serve_probes(fleet, "127.0.0.1:0")
        runners.append(runner)
        agent_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        shards = allocator[SHARDS]

        async def scrape(url: str) -> list:
            async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/plain; version=")
                return _samples(await response.text())

        async def ready():
            return all(s.ready for s in shards) and binder[BINDER].ready and all(
                s.state.devices.nodes.get(node) is not None and s.state.devices.inventory.node_names() >= {node}
                for s in shards)

        await _eventually(ready, 60, "the shards and the binder to be synced and to know the node's devices")
        # 1. the planted lease lapses: a shard's lease reconciler (every 5 s) releases it
        await _eventually(lambda: _lapsed(allocator_url, scrape), 30, "the planted reservation to be released")

        # 2. N pods, one at a time
        hit = _force_one_conflict(shards)

        async def new_pod(name: str) -> None:
            # a claim of its own, made here: whether the binder or kube-controller-manager would
            # make template claims does not change what is counted
            await kube.create(scenario.claim(namespace, name, class_name))
            pod = scenario.pod(namespace, name, claim_name=name, scheduler_name=scheduler)
            pod.spec.node_selector = {"kubernetes.io/hostname": node}
            await kube.create(pod)

        for i in range(BOUND):
            await new_pod(f"bound-{i}")

            async def bound_and_confirmed(name=f"bound-{i}"):
                pod = await kube.get(Pod, name, namespace)
                entries = [entry for s in shards for _, entry in s.store.entries.values()]
                confirmed = all(r.expires_at is None for entry in entries for r in entry.claims.values())
                return pod.spec.node_name == node and confirmed and not binder[BINDER].reservations.to_confirm

            await _eventually(bound_and_confirmed, 30, f"pod bound-{i} to be bound and its reservation confirmed")
        assert hit == [node]

        # 3. M pods that find no GPU left
        for i in range(UNSCHEDULABLE):
            await new_pod(f"waiting-{i}")

        async def explained():
            pods, _ = await kube.list(Pod, namespace)
            waiting = [p for p in pods if p.metadata.name.startswith("waiting-")]
            return len(waiting) == UNSCHEDULABLE and all(pod_scheduled_false(p) is not None for p in waiting)

        await _eventually(explained, 30, "the waiting pods to be told why")

        results, pending = subjects.results_stream, subjects.pending_stream

        async def lag_polled():
            samples = await scrape(binder_url)
            return series(samples, "draplane_nats_consumer_pending_messages").get(
                (("consumer", "binder"), ("stream", results))) == 0

        await _eventually(lag_polled, 10, "the binder's consumer lag to be polled")
        # the binder retries the waiting pods with backoff; what it counted stays as it is
        binder_samples, allocator_samples, inventory_samples, agent_samples = await asyncio.gather(
            scrape(binder_url), scrape(allocator_url), scrape(inventory_url), scrape(agent_url))
        nodes, _ = await kube.list(Node)
    finally:
        if fleet is not None:
            await fleet.stop()
        for runner in reversed(runners):
            await runner.cleanup()
        await kube.delete(Node, node)
        slices, _ = await kube.list(ResourceSlice, field_selector=f"spec.nodeName={node}")
        for s in slices:
            await kube.delete(ResourceSlice, s.metadata.name)

    # --- the binder ---
    b = binder_samples
    assert value(b, "draplane_binder_pods_bound_total") == BOUND
    assert value(b, "draplane_binder_claims_allocated_total") == BOUND
    assert value(b, "draplane_binder_claims_created_total") == 0
    assert value(b, "draplane_binder_create_to_bound_seconds_count") == BOUND
    assert value(b, "draplane_binder_claims_pending") == UNSCHEDULABLE
    # why they wait: capacity exhausted on our node, and the node selector everywhere else
    reason = failure_label([NodeFailure(node=n.metadata.name, reason=(
        FailureReason.CAPACITY_EXHAUSTED if n.metadata.name == node else FailureReason.NODE_DOES_NOT_FIT).value)
        for n in nodes])
    assert series(b, "draplane_binder_claims_failed") == {(("reason", reason),): UNSCHEDULABLE}
    assert series(b, "draplane_binder_scheduling_failures_total") == {(("reason", reason),): UNSCHEDULABLE}
    for name in ("lease_lapses", "placements_abandoned", "errors", "pending_publish_failures"):
        assert value(b, f"draplane_binder_{name}_total") == 0, name
    assert value(b, "draplane_apiserver_requests_total", verb="create", resource="pods/binding") == BOUND
    assert value(b, "draplane_apiserver_requests_total", verb="update", resource="resourceclaims/status") == BOUND
    assert value(b, "draplane_apiserver_request_errors_total", resource="pods/binding") == 0
    assert value(b, "draplane_apiserver_requests_total", verb="watch", resource="pods") >= 1
    assert series(b, "draplane_nats_consumer_pending_messages") == {(("consumer", "binder"), ("stream", results)): 0}

    # --- the allocator: two shards in one process, one registry ---
    a = allocator_samples
    assert value(a, "draplane_allocator_placements_total") == BOUND
    assert value(a, "draplane_allocator_placement_seconds_count") == BOUND
    assert value(a, "draplane_allocator_reservation_conflicts_total", kind="compare_and_set") == 1
    assert value(a, "draplane_allocator_reservation_conflicts_total", kind="stale_view") == 0
    assert value(a, "draplane_allocator_lease_lapses_total", outcome="released") == 1
    assert value(a, "draplane_allocator_lease_lapses_total", outcome="confirmed") == 0
    # every waiting pod was answered at least once (the binder asks again with backoff)
    assert value(a, "draplane_allocator_unschedulable_total") >= UNSCHEDULABLE
    assert value(a, "draplane_allocator_errors_total") == 0
    assert {labels[0][1] for labels in series(a, "draplane_allocator_placements_total")} <= {"0", "1"}
    # whole GPUs are free or taken, never fragmented
    assert series(a, "draplane_allocator_fragmented_devices")[(("device_class", class_name),)] == 0
    assert series(a, "draplane_nats_consumer_pending_messages") == {
        (("consumer", f"shard-{i}"), ("stream", pending)): 0 for i in range(2)}

    # --- the inventory: one node, one slice of 4 GPUs ---
    i = inventory_samples
    assert series(i, "draplane_inventory_slice_writes_total") == {(("verb", "create"),): 1}
    assert value(i, "draplane_apiserver_requests_total", verb="create", resource="resourceslices") == 1
    assert value(i, "draplane_inventory_snapshots_applied_total") == 1
    assert value(i, "draplane_inventory_nodes", state="fresh") == 1
    assert value(i, "draplane_inventory_messages_rejected_total") == 0
    assert value(i, "draplane_nats_consumer_pending_messages", consumer=InventoryNames(subject_prefix).consumer) == 0

    # --- the node agent ---
    n = agent_samples
    assert value(n, "draplane_node_agent_snapshots_published_total") == 1
    assert series(n, "draplane_node_agent_devices") == {(("driver", scenario.GPU_DRIVER),): GPUS}
    assert value(n, "draplane_node_agent_nodes") == 1
    assert value(n, "draplane_node_agent_heartbeats_published_total") >= 1


async def _lapsed(allocator_url: str, scrape) -> bool:
    samples = await scrape(allocator_url)
    return value(samples, "draplane_allocator_lease_lapses_total", outcome="released") == 1

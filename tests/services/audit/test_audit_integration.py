"""draplane-audit against real servers: every event exactly once through a kill -9, bad input.

The audit test runs pods through the binder and two shards (in-process, the `scheduling` fixture)
while `draplane-audit` runs as its own process: placements, an unschedulable pod, a release (a pod
deleted), a DeviceTaintRule. The subscriber is killed with SIGKILL while events flow and started
again; then its log is compared, one by one, with the claims, pods and rule in Kubernetes.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import urllib.request
import uuid
from collections import Counter

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from draplane.api.core import Pod
from draplane.api.meta import ObjectMeta
from draplane.api.resource import DeviceClass, DeviceTaintRule, ResourceClaim
from draplane.audit_log import LOG_NAME, decode_line, read_lines
from draplane.audit_publisher import ensure_audit_stream
from draplane.localenv.processes import ServerProcess, free_port
from draplane.messages import audit
from draplane.messages.inventory import SCHEMA_VERSION, FeedEntry, InventoryNames, encode
from draplane.simulation import scenario
from draplane.scheduling.framework.plugins.dynamic_resources import allocation_node
from draplane_audit.metrics import AuditMetrics
from draplane_audit.subscriber import AuditSubscriber
from conftest import ensure_class, pod_scheduled_false  # noqa: E402  (tests/services/conftest.py)
from prometheus_client import CollectorRegistry

pytestmark = pytest.mark.integration


class AuditProcess:
    """`draplane-audit` as a child process, as `draplane up` and deploy/ run it."""

    def __init__(self, control_plane, prefix: str, tmp_path):
        self.port = free_port()
        self.log_dir = tmp_path / "audit"
        self.process = ServerProcess(
            "audit", [sys.executable, "-m", "draplane_audit", f"--nats={control_plane.nats_url}", "--insecure-dev", f"--prefix={prefix}",
                      f"--log-dir={self.log_dir}", f"--port={self.port}", "--metrics-interval=0.5"],
            tmp_path / "audit.log", env=dict(os.environ, PYTHONUNBUFFERED="1"))

    @property
    def path(self):
        return self.log_dir / LOG_NAME

    async def start(self) -> None:
        self.process.start()
        await asyncio.to_thread(self.process.wait_ready, lambda: self._get("/readyz") is not None, 60)

    def _get(self, path: str) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as response:
                return response.read().decode() if response.status == 200 else None
        except OSError:
            return None

    async def metrics(self) -> dict[tuple, float]:
        text = await asyncio.to_thread(self._get, "/metrics")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def lines(self):
        with self.path.open("rb") as handle:
            return list(read_lines(handle))


async def stream_last_seq(nats, prefix: str) -> int:
    info = await nats.jetstream().stream_info(audit.AuditNames(prefix=prefix).stream)
    return info.state.last_seq


async def wait_caught_up(scheduling, process: AuditProcess, nats, prefix: str, timeout: float = 30.0) -> int:
    """Waits until the log holds the stream's last event, and returns that event's sequence.

    The stream may grow after: this test's binder also tells of other tests' claims that
    kube-controller-manager deallocates, whenever that happens."""
    reached = 0

    async def caught_up():
        nonlocal reached
        await asyncio.sleep(0)
        last = await stream_last_seq(nats, prefix)
        lines = process.lines() if process.path.exists() else []
        if last > 0 and lines and lines[-1].seq >= last:
            reached = last
            return True
        return False

    await scheduling.wait_for(caught_up, timeout, "the audit log to reach the stream's last event")
    return reached


@pytest.mark.timeout(300)
async def test_every_event_exactly_once_through_a_kill_9(scheduling, kube, nats, namespace, subject_prefix,
                                                          control_plane, tmp_path):
    tag = uuid.uuid4().hex[:6]
    class_name = f"audit-gpu-{tag}"
    device_class = scenario.device_class(class_name)
    await ensure_class(kube, device_class)
    nodes = [f"audit-{tag}-{i}" for i in range(2)]
    for node in nodes:
        await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 2, "80Gi")])
    # The class in the feed, as the inventory service publishes it: the metrics read NATS only.
    feed = await scheduling.feed_bucket()
    key = InventoryNames.class_key(class_name)
    await feed.put(key, encode(FeedEntry(schema_version=SCHEMA_VERSION, key=key, device_class=device_class)))
    await scheduling.start(shards=2)
    await ensure_audit_stream(nats.jetstream(), audit.AuditNames(prefix=subject_prefix))
    process = AuditProcess(control_plane, subject_prefix, tmp_path)
    await process.start()

    async def run_pod(name: str, count: int = 1) -> None:
        await kube.create(scenario.claim(namespace, name, class_name, count=count))
        await kube.create(scheduling.pod(namespace, name, claim_name=name))

    try:
        for i in range(2):
            await run_pod(f"first-{i}")
        for i in range(2):
            await scheduling.bound_pod(namespace, f"first-{i}")
        # Killed while the next pods are being placed and written.
        for i in range(2):
            await run_pod(f"second-{i}")
        await asyncio.sleep(0.05)
        process.process.kill()
        for i in range(2):
            await scheduling.bound_pod(namespace, f"second-{i}")
        await run_pod("too-big", count=3)  # 2 GPUs per node: never fits
        await scheduling.wait_for(
            lambda: _unschedulable(kube, namespace, "too-big"), 30, "too-big to be found unschedulable")
        # Its claim's devices are released. At once: no kubelet here finishes a graceful delete.
        await kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/first-0", query={"gracePeriodSeconds": 0})
        await scheduling.wait_for(lambda: _deallocated(kube, namespace, "first-0"), 30, "first-0's claim released")
        rule = f"audit-{tag}"
        await kube.create(msgspec.convert({
            "metadata": {"name": rule},
            "spec": {"deviceSelector": {"driver": scenario.GPU_DRIVER, "pool": nodes[1]},
                     "taint": {"key": "example.com/maintenance", "value": "planned", "effect": "NoSchedule"}},
        }, DeviceTaintRule))
        await asyncio.sleep(1.0)  # the shards see the rule and publish
        await process.start()
        await wait_caught_up(scheduling, process, nats, subject_prefix)
        # Killed again right after it started reading, and started again: still once.
        process.process.kill()
        await process.start()
        reached = await wait_caught_up(scheduling, process, nats, subject_prefix)

        lines = process.lines()
        # The log is the stream, in order, without a gap or a repeat, up to at least the
        # stream's last event when it caught up (more may have come since).
        assert [line.seq for line in lines] == list(range(1, lines[-1].seq + 1))
        assert lines[-1].seq >= reached
        assert len({line.id for line in lines}) == len(lines)
        assert not [line for line in lines if line.kind == "unreadable"]

        claims, _ = await kube.list(ResourceClaim, namespace)
        pods = {p.metadata.name: p for p in (await kube.list(Pod, namespace))[0]}
        placed = {c.uid: (line, c) for line in lines if line.kind == "placed" for c in line.claims}
        # The binder tells of every claim it sees deallocated, and kube-controller-manager
        # deallocates other tests' claims too during this one: count this namespace's.
        released = Counter(c.uid for line in lines if line.kind == "released" for c in line.claims
                           if c.namespace == namespace)
        for claim in claims:
            name, uid = claim.metadata.name, claim.metadata.uid
            if name == "too-big":
                assert uid not in placed
                continue
            line, logged = placed[uid]
            # One placement per claim, naming the pod, node and devices Kubernetes has.
            assert sum(1 for x in lines if x.kind == "placed" and any(c.uid == uid for c in x.claims)) == 1
            if name == "first-0":
                assert released[uid] == 1 and claim.status.allocation is None
                continue
            allocation = claim.status.allocation
            assert released[uid] == 0
            assert line.node == allocation_node(allocation) == pods[name].spec.node_name
            assert line.pod.uid == pods[name].metadata.uid
            assert [(d.driver, d.pool, d.device) for d in logged.devices] == [
                (r.driver, r.pool, r.device) for r in allocation.devices.results]
            assert line.by[0].startswith("shard-") and line.by[1].startswith("draplane-binder-")
            assert line.policy == "draplane" and line.score is not None
        assert len(placed) == 4 and sum(released.values()) == 1
        (rejected,) = [line for line in lines if line.kind == "rejected"]
        too_big = pods["too-big"]
        assert rejected.pod.uid == too_big.metadata.uid
        assert rejected.reason == pod_scheduled_false(too_big).message
        taints = [line for line in lines if line.kind == "tainted"]
        assert len(taints) == 1, [(t.id, t.seq, t.by) for t in taints]
        (tainted,) = taints  # two shards saw it: one event
        assert tainted.by[0] == f"devicetaintrule {rule}"
        assert sorted(d.device for d in tainted.devices) == ["gpu-0", "gpu-1"]
        assert {d.pool for d in tainted.devices} == {nodes[1]} and tainted.device_count == 2
        assert "example.com/maintenance=planned:NoSchedule" in tainted.reason

        # The metrics subscriber in the same process: the cluster's devices, from NATS alone.
        held = sum(len(c.status.allocation.devices.results) for c in claims if c.status and c.status.allocation)

        async def metrics_agree():
            m = await process.metrics()
            states = {labels: v for (name, labels), v in m.items() if name == "draplane_cluster_devices"
                      and dict(labels)["device_class"] == class_name}
            allocated = sum(v for labels, v in states.items() if dict(labels)["state"] == "allocated")
            return sum(states.values()) == 4 and allocated == held and m

        m = await scheduling.wait_for(metrics_agree, 30, "the cluster metrics to match the claims")
        assert m[("draplane_audit_unreadable_total", ())] == 0
    finally:
        process.process.stop()
        await kube.delete(DeviceClass, class_name)
        try:
            await kube.delete(DeviceTaintRule, f"audit-{tag}")
        except Exception:  # noqa: BLE001 - not created when an earlier step failed
            pass


async def _unschedulable(kube, namespace: str, name: str):
    pod = await kube.get(Pod, name, namespace)
    return pod_scheduled_false(pod)


async def _deallocated(kube, namespace: str, name: str):
    claim = await kube.get(ResourceClaim, name, namespace)
    return claim.status is None or claim.status.allocation is None


async def test_a_malformed_message_is_recorded_counted_and_terminated(nats, subject_prefix, tmp_path):
    js = nats.jetstream()
    names = audit.AuditNames(prefix=subject_prefix)
    await ensure_audit_stream(js, names)
    good = lambda i: audit.encode_event(audit.AuditEvent(  # noqa: E731
        id=f"placed/pod-{i}", kind="placed", at=time.time(), by=["test"]))
    await js.publish(names.subject("placed"), good(1))
    await js.publish(names.subject("placed"), b"\xff not an event")
    await js.publish(names.subject("placed"), good(2))
    registry = CollectorRegistry()
    metrics = AuditMetrics(registry)
    subscriber = AuditSubscriber(js, tmp_path, prefix=subject_prefix, metrics=metrics)
    await subscriber.start()
    task = asyncio.create_task(subscriber.run())
    try:
        deadline = time.monotonic() + 20
        while subscriber.last_seq < 3:
            assert time.monotonic() < deadline, "the subscriber did not read the three messages"
            assert not task.done(), "the subscriber stopped"
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.5)  # a terminated message is not delivered again (a nak would be)
        lines = [decode_line(raw) for raw in (tmp_path / LOG_NAME).read_bytes().splitlines()]
        assert [(line.seq, line.kind) for line in lines] == [(1, "placed"), (2, "unreadable"), (3, "placed")]
        assert "not an audit event" in lines[1].reason
        assert registry.get_sample_value("draplane_audit_unreadable_total") == 1
        assert registry.get_sample_value("draplane_audit_events_total", {"kind": "placed"}) == 2
        info = await js.consumer_info(names.stream, names.consumer)
        assert info.num_ack_pending == 0 and info.num_redelivered == 0 and info.delivered.stream_seq == 3
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await subscriber.stop()

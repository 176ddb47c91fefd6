"""draplane.dashboard.server: the page's data from a real NATS, and the server-sent events.

The facts are written to NATS as the services write them (feed and reservation entries, audit
events, scheduling messages), so the test says exactly what is there; tests/services/
test_dashboard_browser.py runs the same against the live binder and shards, in a browser.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from draplane.api.resource import AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult
from draplane.audit_publisher import ensure_audit_stream
from draplane.dashboard.server import Dashboard, Snapshot, build_app, message_for
from draplane.entrypoints import nats_connect_options
from draplane.messages import audit
from draplane.messages.inventory import SCHEMA_VERSION, FeedEntry, InventoryNames, encode
from draplane.jetstream import streams
from draplane.simulation import scenario
from draplane.scheduling.messages import PendingPod, PodRef, Subjects, Unschedulable, encode_message
from draplane.scheduling.reservations import NodeReservations, Reservation, devices_of, encode_entry

GPU = "gpu.nvidia.com"


def test_a_browser_is_sent_the_rows_that_changed_and_the_names_of_the_rows_gone():
    first = Snapshot(version=1, order=["a", "b"], rows={"a": b'{"name":"a"}', "b": b'{"name":"b"}'}, rest=b'{"x":1}')
    assert json.loads(message_for(first, {})) == {
        "version": 1, "order": ["a", "b"], "removed": [], "rows": [{"name": "a"}, {"name": "b"}], "rest": {"x": 1}}
    second = Snapshot(version=2, order=["b", "c"], rows={"b": b'{"name":"b","n":2}', "c": b'{"name":"c"}'},
                      rest=b'{"x":2}')
    assert json.loads(message_for(second, first.rows)) == {
        "version": 2, "order": ["b", "c"], "removed": ["a"], "rows": [{"name": "b", "n": 2}, {"name": "c"}],
        "rest": {"x": 2}}
    assert json.loads(message_for(second, second.rows))["rows"] == []



async def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


def allocation(node: str, device: str) -> AllocationResult:
    return AllocationResult(devices=DeviceAllocationResult(results=[
        DeviceRequestAllocationResult(request="gpu", driver=GPU, pool=node, device=device)]))


def held(claim: str, pod_uid: str, node: str, device: str, reserved_at: float) -> Reservation:
    result = allocation(node, device)
    return Reservation(claim_uid=f"uid-{claim}", claim_namespace="team", claim_name=claim, pod_uid=pod_uid,
                       devices=devices_of(result), allocation=result, reserved_at=reserved_at, expires_at=None)


async def read_events(response, count: int) -> list[dict]:
    events = []
    kind = None
    while len(events) < count:
        line = (await asyncio.wait_for(response.content.readline(), 20)).decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: ") and kind == "map":
            events.append(json.loads(line[len("data: "):]))
    return events


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_the_map_has_history_from_the_audit_stream_and_live_pending_pods_and_streams_changes(
        nats, control_plane, subject_prefix):
    js = nats.jetstream()
    names, subjects, audit_names = InventoryNames(prefix=subject_prefix), Subjects(prefix=subject_prefix), \
        audit.AuditNames(prefix=subject_prefix)
    from nats.js.api import KeyValueConfig

    feed = await js.create_key_value(KeyValueConfig(bucket=names.feed_bucket, history=1))
    for node in ("n1", "n2"):
        key = InventoryNames.node_key(node)
        await feed.put(key, encode(FeedEntry(schema_version=SCHEMA_VERSION, key=key, node=node,
                                             slices=[scenario.gpu_slice(node, 2, "80Gi")])))
    bucket = await streams.reservation_bucket(js, subjects)
    now = time.time()
    # Placed an hour ago, before the dashboard started: its score is only in the audit stream.
    await bucket.put("n1", encode_entry(NodeReservations(node="n1", claims={
        "uid-old": held("old", "pod-old", "n1", "gpu-0", now - 3600)})))
    await ensure_audit_stream(js, audit_names)
    await js.publish(audit_names.subject("placed"), audit.encode_event(audit.AuditEvent(
        id="placed/pod-old", kind="placed", at=now - 3600, by=["shard-0", "binder-x"], node="n1",
        pod=audit.PodName(namespace="team", name="old-pod", uid="pod-old"), policy="draplane", score=9.5)))
    await js.publish(audit_names.subject("tainted"), audit.encode_event(audit.AuditEvent(
        id="tainted/rule/r/1", kind="tainted", at=now - 7200, by=["devicetaintrule repair", "shard-0"],
        devices=[audit.DeviceRef(driver=GPU, pool="n2", device="gpu-1")],
        reason="devicetaintrule repair applied: example.com/repair=true:NoSchedule")))

    dashboard = Dashboard(nats_connect_options(control_plane.nats_url, None, name="dashboard-test"), subject_prefix)
    server = TestServer(build_app(dashboard))
    await server.start_server()
    try:
        def cell(device_id: str):
            latest = dashboard.latest
            for row in latest.rows if latest is not None else ():
                for c in row.cells:
                    if c.id == device_id:
                        return c
            return None

        old = await wait_for(lambda: (c := cell(f"{GPU}/n1/gpu-0")) and c.holders and c.holders[0].score and c,
                             what="the old placement's score from the audit stream")
        assert (old.state, old.holders[0].pod, old.holders[0].policy) == ("allocated", "team/old-pod", "draplane")
        await wait_for(lambda: (c := cell(f"{GPU}/n2/gpu-1")) and c.state == "tainted", what="the rule's taint")

        async with ClientSession() as session, session.get(server.make_url("/events")) as response:
            assert response.headers["Content-Type"] == "text/event-stream"
            (first,) = await read_events(response, 1)
            assert first["order"] == ["n1", "n2"] and [r["name"] for r in first["rows"]] == ["n1", "n2"]

            # Live: a pod sent to shard 1 and found unschedulable there; a new claim on n2.
            pod = PodRef(namespace="team", name="waits", uid="pod-w")
            await nats.publish(subjects.pending(1), encode_message(PendingPod(pod=pod, claims=[], first_seen=now)))
            await nats.publish(subjects.results, encode_message(Unschedulable(
                pod=pod, shard=1, message="0/2 nodes are available: 2 cannot allocate all claims.")))
            await bucket.put("n2", encode_entry(NodeReservations(node="n2", claims={
                "uid-new": held("new", "pod-new", "n2", "gpu-0", time.time())})))

            deadline = time.monotonic() + 20
            pending, rows = [], {}
            while time.monotonic() < deadline and not (pending and "n2" in rows):
                (event,) = await read_events(response, 1)
                assert "n1" not in {r["name"] for r in event["rows"]}  # only what changed is sent again
                rows.update({r["name"]: r for r in event["rows"]})
                pending = [p for p in event["rest"]["pending"]["pods"] if p["pod"] == "team/waits"
                           and p["reason"].startswith("0/2 nodes")]
            assert pending and pending[0]["decided_by"] == "shard-1"
            assert [c["state"] for c in rows["n2"]["cells"]] == ["allocated", "tainted"]

        async with ClientSession() as session:
            async with session.get(server.make_url("/")) as page:
                assert page.status == 200 and "map.js" in await page.text()
            async with session.get(server.make_url("/api/map")) as whole:
                body = await whole.json()
                assert body["totals"]["allocated"] == 2 and body["status"]["nats"] == "connected"
            async with session.get(server.make_url("/readyz")) as ready:
                assert ready.status == 200
    finally:
        await server.close()

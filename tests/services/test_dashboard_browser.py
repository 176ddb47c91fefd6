"""`draplane dashboard` in headless Chromium, against live services.

Node agents (a simulated fleet, from the shipped profiles) publish to the inventory service,
which writes the ResourceSlices and the inventory feed; the binder and two shards run in-process
(the `scheduling` fixture) on the session's real apiserver and NATS; `draplane dashboard` runs as
its own process, as a user starts it; Chromium (Debian's package, tests/chromium.py) loads the
page and is driven over the DevTools protocol. The cluster: a DGX H100 node (8 GPUs, 8 NICs) and
an A100 node with MIG (8 GPUs, 120 devices). Checked: every device is on the map; a
DeviceTaintRule taints its device there; a claim's cell turns allocated within 2 s of the claim
being allocated in Kubernetes, with its claim, pod and score on hover; a MIG slice blocks its
GPU; a pod that cannot be placed is listed with the reason Kubernetes shows for it. The
screenshot is saved under the test's tmp dir (and copied to $DRAPLANE_SCREENSHOT_DIR when set).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
import urllib.request
import uuid

import msgspec
import pytest
from aiohttp import web

from draplane.api.core import Pod
from draplane.api.resource import DeviceTaintRule, ResourceClaim, ResourceSlice
from draplane.audit_publisher import ensure_audit_stream
from draplane.localenv.processes import ServerProcess, free_port
from draplane.messages import audit
from draplane.messages.inventory import InventoryNames
from draplane.simulation import scenario
from draplane_inventory.__main__ import build_app as inventory_app, parse_args as inventory_args
from draplane_node_agent.__main__ import ProfileDiscovery
from draplane_node_agent.agent import AgentFleet, SimulatedAgent
from chromium import BrowserMissing, Chromium  # noqa: E402  (tests/chromium.py)
from conftest import ensure_class, make_ready, pod_scheduled_false  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration

H100 = 'device.attributes["gpu.nvidia.com"].productName == "NVIDIA H100 80GB HBM3"'
# Whole GPUs have no profile: CEL's && is false, not an error, when its type test is false.
MIG_1G = 'device.attributes["gpu.nvidia.com"].type == "mig" && device.attributes["gpu.nvidia.com"].profile == "1g.5gb"'
ALLOCATED_WITHIN_SECONDS = 2.0


class Inventory:
    """The inventory service in-process, as its entry point builds it, and a fleet of node agents."""

    def __init__(self, control_plane, prefix: str, nodes: dict[str, str]):
        self.args = inventory_args(["--nats", control_plane.nats_url, "--kubeconfig", str(control_plane.kubeconfig),
                                    "--prefix", prefix, "--listen", "127.0.0.1:0"])
        self.fleet = AgentFleet(control_plane.nats_url,
                                [SimulatedAgent(node, ProfileDiscovery(profile, node)) for node, profile in nodes.items()],
                                names=InventoryNames(prefix), heartbeat_interval=1.0)
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        self.runner = web.AppRunner(inventory_app(self.args))
        await self.runner.setup()  # the app's cleanup_ctx starts the service
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        await self.fleet.start()

    async def stop(self) -> None:
        await self.fleet.stop()
        if self.runner is not None:
            await self.runner.cleanup()


class DashboardProcess:
    def __init__(self, control_plane, prefix: str, tmp_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.process = ServerProcess(
            "dashboard", [sys.executable, "-m", "draplane.cli", "-v", "dashboard", f"--nats={control_plane.nats_url}",
                          f"--prefix={prefix}", f"--port={self.port}"],
            tmp_path / "dashboard.log", env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"{self.url}readyz", timeout=2) as response:
            return response.status == 200

    async def start(self) -> None:
        self.process.start()
        await asyncio.to_thread(self.process.wait_ready, self._ready, 60)

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture
async def browser(tmp_path):
    try:
        chromium = await Chromium.start(tmp_path)
    except BrowserMissing as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))  # CI installs it (make chromium): a skip there would hide the test
        pytest.skip(str(exc))
    yield chromium
    await chromium.close()


# Records, in the page, when each cell was first drawn allocated (the page's own clock: rows are
# redrawn whole, so an observer on the map sees every change the moment it is made).
WATCH_ALLOCATED = """
window.allocatedAt = {};
new MutationObserver(() => {
  for (const cell of document.querySelectorAll('.cell[data-state="allocated"]'))
    if (!(cell.dataset.id in window.allocatedAt)) window.allocatedAt[cell.dataset.id] = Date.now() / 1000;
}).observe(document.getElementById("map"), {childList: true, subtree: true, attributes: true});
true
"""


def js(value) -> str:
    return json.dumps(value)


async def _true(value: bool) -> bool:
    return value


async def overlapping_devices(kube, pool: str, device: str) -> int:
    """The devices of the pool that share a counter with `device` (its GPU whole, the MIG
    placements on the same memory slices): what allocating it makes unavailable."""
    slices = [s for s in (await kube.list(ResourceSlice))[0] if s.spec.pool.name == pool]
    devices = {d.name: d for s in slices for d in s.spec.devices or ()}

    def used(d) -> set[tuple[str, str]]:
        # The profiles give each placement its memory slices as counters: two placements overlap
        # exactly when they share one (engines and memory in bytes are not short on an A100 here).
        return {(c.counter_set, name) for c in d.consumes_counters or () for name in c.counters
                if name.startswith("memory-slice-")}

    mine = used(devices[device])
    return sum(1 for name, d in devices.items() if name != device and used(d) & mine)


def cells_in_rows(nodes: tuple[str, ...], state: str) -> str:
    """JS: how many cells of these nodes' rows are in `state` (the header's totals count every row
    of the feed, other tests' included)."""
    wanted = "[" + ", ".join(js(n) for n in nodes) + "]"
    return (f"[...document.querySelectorAll('.row')].filter(r => {wanted}.includes(r.dataset.node))"
            f".reduce((n, r) => n + r.querySelectorAll('.cell[data-state={js(state)}]').length, 0)")


@pytest.mark.timeout(300)
async def test_the_map_shows_every_device_follows_an_allocation_and_lists_a_pending_pod(
        scheduling, kube, nats, namespace, subject_prefix, control_plane, browser, tmp_path):
    tag = uuid.uuid4().hex[:6]
    gpu_class, mig_class = f"dash-h100-{tag}", f"dash-mig-{tag}"
    await ensure_class(kube, scenario.device_class(gpu_class, H100))
    await ensure_class(kube, scenario.device_class(mig_class, MIG_1G))
    h100, a100 = f"dash-{tag}-h100", f"dash-{tag}-a100"
    for node in (h100, a100):
        await kube.create(scenario.gpu_node(node))
        await make_ready(kube, node)
        scheduling.nodes.append(node)  # deleted after the test; the inventory's slices go with them
    inventory = Inventory(control_plane, subject_prefix, {h100: "dgx-h100", a100: "a100-mig"})
    dashboard = DashboardProcess(control_plane, subject_prefix, tmp_path)
    rule = f"dash-{tag}"
    try:
        await inventory.start()
        await scheduling.start(shards=2)
        await ensure_audit_stream(nats.jetstream(), audit.AuditNames(prefix=subject_prefix))
        await dashboard.start()
        await browser.navigate(dashboard.url)
        # Every device of the feed, in its node's row: 8 H100s and 8 NICs; 8 A100s, each whole
        # and in 14 MIG placements. The inventory feeds every slice in the apiserver, and the
        # session's apiserver may hold other tests' (the map shows them as rows of their own):
        # only this test's rows are counted.
        counts = await browser.wait_for(
            "(() => { const rows = {}; for (const r of document.querySelectorAll('.row')) "
            "rows[r.dataset.node] = r.querySelectorAll('.cell').length; "
            f"return rows[{js(h100)}] === 16 && rows[{js(a100)}] === 120 && "
            f"{{[{js(h100)}]: rows[{js(h100)}], [{js(a100)}]: rows[{js(a100)}]}}; }})()",
            60, "both nodes' devices from the node agents, through the inventory")
        assert counts == {h100: 16, a100: 8 * 15}

        # A DeviceTaintRule on one GPU: the shards tell the audit stream which devices it
        # selects (from their inventory, so once they have the nodes), the map taints them.
        await scheduling.wait_for(
            lambda: _true(all(s.state.devices.inventory.node_names() >= {h100, a100} for s in scheduling.shards)),
            30, "the shards to know both nodes' devices")
        tainted = f"gpu.nvidia.com/{h100}/gpu-7"
        await kube.create(msgspec.convert({
            "metadata": {"name": rule},
            "spec": {"deviceSelector": {"driver": scenario.GPU_DRIVER, "pool": h100, "device": "gpu-7"},
                     "taint": {"key": "example.com/fan-failure", "value": "true", "effect": "NoSchedule"}},
        }, DeviceTaintRule))
        await browser.wait_for(f"document.querySelector('[data-id={js(tainted)}]').dataset.state === 'tainted'", 30,
                               "the rule's device to be drawn tainted")
        assert "example.com/fan-failure=true:NoSchedule (devicetaintrule " in await browser.evaluate(
            f"document.querySelector('[data-id={js(tainted)}]').title")
        assert await browser.evaluate(cells_in_rows((h100, a100), "free")) == 135
        assert await browser.evaluate(WATCH_ALLOCATED)

        # One GPU for a pod: its cell turns allocated within 2 s of the claim's allocation.
        await kube.create(scenario.claim(namespace, "train", gpu_class))
        await kube.create(scheduling.pod(namespace, "trainer", claim_name="train"))

        async def allocated_claim():
            claim = await kube.get(ResourceClaim, "train", namespace)
            return claim if claim.status and claim.status.allocation else None

        claim = await scheduling.wait_for(allocated_claim, 60, "claim train to be allocated", interval=0.05)
        allocated_in_kubernetes = time.time()
        (result,) = claim.status.allocation.devices.results
        cell_id = f"{result.driver}/{result.pool}/{result.device}"
        drawn_at = await browser.wait_for(f"window.allocatedAt[{js(cell_id)}]", ALLOCATED_WITHIN_SECONDS + 1,
                                          f"cell {cell_id} to turn allocated")
        lag = drawn_at - allocated_in_kubernetes
        print(f"cell {cell_id} drawn allocated {lag:+.3f} s from the claim's allocation seen in Kubernetes")
        assert lag <= ALLOCATED_WITHIN_SECONDS

        # On hover: the claim, the pod and the policy's score, as the shard placed it.
        title = await browser.wait_for(
            f"(() => {{ const t = document.querySelector('[data-id={js(cell_id)}]').title; "
            "return t.includes('score draplane') && t; })()", 10, "the placement's score on the cell")
        assert f"claim {namespace}/train" in title and f"pod {namespace}/trainer" in title

        # A MIG slice for another pod: allocated, and the placements it overlaps blocked.
        await kube.create(scenario.claim(namespace, "slice", mig_class))
        await kube.create(scheduling.pod(namespace, "notebook", claim_name="slice"))
        await scheduling.bound_pod(namespace, "notebook", timeout=60)
        # Which placements the slice blocks depends on where the policy put it (a 1g slice at
        # either end of the GPU overlaps fewer larger placements): count them from the slices.
        slice_claim = await kube.get(ResourceClaim, "slice", namespace)
        (mig,) = slice_claim.status.allocation.devices.results
        overlapping = await overlapping_devices(kube, mig.pool, mig.device)
        assert overlapping >= 2  # at least its whole GPU and the 7g placement
        await browser.wait_for(f"{cells_in_rows((h100, a100), 'blocked')} === {overlapping}", 10,
                               "the MIG slice's GPU and overlapping placements blocked")

        # Eight GPUs where six are left untainted and free: pending, with Kubernetes' reason.
        await kube.create(scenario.claim(namespace, "big", gpu_class, count=8))
        await kube.create(scheduling.pod(namespace, "waits", claim_name="big"))

        async def condition():
            return pod_scheduled_false(await kube.get(Pod, "waits", namespace))

        reason = (await scheduling.wait_for(condition, 60, "pod waits to be unschedulable")).message
        listed = await browser.wait_for(
            f"(() => {{ const li = document.querySelector('#pending li[data-pod={js(namespace + '/waits')}]'); "
            # until the shard's answer has come (the map says "waiting for allocator shard N" first)
            "const text = li && li.querySelector('.reason').textContent; "
            "return text && !text.startsWith('waiting for') && text; })()", 10, "pod waits in the pending list")
        assert listed == reason
        assert "cannot allocate all claims" in reason
        assert await browser.evaluate("document.getElementById('pending-count').textContent") == "1"

        # The screenshot, with the first pod's GPU in the inspector.
        await browser.evaluate(f"document.querySelector('[data-id={js(cell_id)}]')"
                               ".dispatchEvent(new MouseEvent('mouseover', {bubbles: true}))")
        inspected = await browser.evaluate(
            "Object.fromEntries([...document.querySelectorAll('#inspector [data-field]')]"
            ".map(e => [e.dataset.field, e.textContent]))")
        assert inspected["state"] == "allocated" and inspected["claim"] == f"{namespace}/train"
        assert inspected["pod"] == f"{namespace}/trainer" and inspected["score"].startswith("draplane ")
        shot = await browser.screenshot(tmp_path / "dashboard.png")
        print(f"screenshot: {shot}")
        if os.environ.get("DRAPLANE_SCREENSHOT_DIR"):
            shutil.copy(shot, os.environ["DRAPLANE_SCREENSHOT_DIR"])
        assert not [line for line in browser.console if line.startswith("exception")], browser.console
    finally:
        dashboard.stop()
        await inventory.stop()
        try:
            await kube.delete(DeviceTaintRule, rule)
        except Exception:  # noqa: BLE001 - not made when an earlier step failed
            pass

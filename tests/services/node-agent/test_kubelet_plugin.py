"""The node agent as the kubelet's DRA plugin, run as a process against a real API server, NATS and
inventory. The test makes the kubelet's gRPC calls over the plugin's unix sockets, with the stubs
built from k8s.io/kubelet's protos: registration, prepare and unprepare in v1 and v1beta1, a
kill -9 and restart, and the health stream with the health switch."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest

from draplane.api.core import Node
from draplane.api.meta import ObjectMeta
from draplane.api.codec import convert
from draplane.api.resource import ResourceClaim, ResourceClaimStatus, ResourceSlice
from draplane.localenv.processes import free_port
from draplane_node_agent.kubelet_api import load
from draplane_node_agent.preparation import cdi_spec_file_name

from conftest import eventually  # noqa: E402  (tests/services/conftest.py)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

GPU = "gpu.nvidia.com"


class Agent:
    """draplane-node-agent --kubelet-plugin for one simulated node, restartable on the same folders."""

    def __init__(self, *, control_plane, prefix: str, node: str, root: Path, logs: Path | None = None):
        self.node, self.root, self.logs = node, root, logs or root
        self.kubelet_dir, self.cdi_dir = root / "kubelet", root / "cdi"
        self.port = free_port()
        self.argv = [sys.executable, "-m", "draplane_node_agent", "--nats", control_plane.nats_url, "--insecure-dev",
                     "--prefix", prefix, "--profile", "l4", "--node", node, "--heartbeat-interval", "1",
                     "--kubelet-plugin", "--kubelet-dir", str(self.kubelet_dir), "--cdi-dir", str(self.cdi_dir),
                     "--kubeconfig", str(control_plane.kubeconfig), "--health-switch",
                     "--listen", f"127.0.0.1:{self.port}", "--log-format", "json"]
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_dir / "plugins_registry" / f"{GPU}-reg.sock"

    @property
    def dra_socket(self) -> Path:
        return self.kubelet_dir / "plugins" / GPU / "dra.sock"

    def start(self) -> None:
        self.starts += 1
        self.process = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL,
                                        stderr=open(self.logs / f"agent-{self.starts}.log", "wb"))

    def log(self) -> str:
        return "".join((self.logs / f"agent-{i}.log").read_text() for i in range(1, self.starts + 1))

    def put_health(self, device: str, body: dict) -> int:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/devices/{GPU}/{device}/health",
                                         data=json.dumps(body).encode(), method="PUT")
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code


async def get_info(api, socket: Path):
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = api.registration_grpc.RegistrationStub(channel)
        return await stub.GetInfo(api.registration.InfoRequest(), timeout=5)


async def wait_serving(api, agent: Agent):
    async def serving():
        if agent.process.poll() is not None:
            raise AssertionError(f"the agent exited with {agent.process.returncode}: {agent.log()[-3000:]}")
        if not agent.registration_socket.exists():
            return False
        try:
            return await get_info(api, agent.registration_socket)
        except grpc.aio.AioRpcError:
            return False

    return await eventually(serving, timeout=60)


async def prepare(api, agent: Agent, claims: list[ResourceClaim], *, version: str = "v1"):
    messages, services = (api.dra_v1, api.dra_v1_grpc) if version == "v1" else (api.dra_v1beta1, api.dra_v1beta1_grpc)
    async with grpc.aio.insecure_channel(f"unix://{agent.dra_socket}") as channel:
        request = messages.NodePrepareResourcesRequest(claims=[
            messages.Claim(namespace=c.metadata.namespace, name=c.metadata.name, uid=c.metadata.uid) for c in claims])
        return await services.DRAPluginStub(channel).NodePrepareResources(request, timeout=30)


async def unprepare(api, agent: Agent, claims: list[ResourceClaim]):
    async with grpc.aio.insecure_channel(f"unix://{agent.dra_socket}") as channel:
        request = api.dra_v1.NodeUnprepareResourcesRequest(claims=[
            api.dra_v1.Claim(namespace=c.metadata.namespace, name=c.metadata.name, uid=c.metadata.uid) for c in claims])
        return await api.dra_v1_grpc.DRAPluginStub(channel).NodeUnprepareResources(request, timeout=30)


async def allocated_claim(kube, namespace: str, name: str, node: str, devices: list[str], **result_fields):
    """A claim with its allocation written as the binder writes it; the API server checks both."""
    exactly = {"deviceClassName": "gpu.nvidia.com", "count": len(devices)}
    if result_fields.get("adminAccess"):
        exactly["adminAccess"] = True
        await kube.request("PATCH", f"/api/v1/namespaces/{namespace}", content_type="application/merge-patch+json",
                           body={"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}})
    claim = convert({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                     "metadata": {"name": name, "namespace": namespace},
                     "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}, ResourceClaim)
    claim = await kube.create(claim)
    claim.status = convert({"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": GPU, "pool": node, "device": d, **result_fields}
                                for d in devices]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}, ResourceClaimStatus)
    return await kube.update_status(claim)


def devices_of(response, claim: ResourceClaim):
    answer = response.claims[claim.metadata.uid]
    assert not answer.error, answer.error
    return [(d.device_name, list(d.cdi_device_ids), list(d.request_names)) for d in answer.devices]


@pytest.fixture
def short_tmp():
    # A unix socket's path holds at most 107 bytes, and pytest's tmp_path is long.
    folder = Path(tempfile.mkdtemp(prefix="kp-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def test_the_kubelet_plugin_prepares_checkpoints_restarts_and_reports_health(kube, namespace, control_plane,
                                                                                   subject_prefix, short_tmp):
    tmp_path = short_tmp
    api = await asyncio.to_thread(load)  # imports the generated stubs: not on the loop
    node = f"kp-{uuid.uuid4().hex[:6]}"
    await kube.create(Node(metadata=ObjectMeta(name=node)))
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig)}
    inventory = subprocess.Popen(
        [sys.executable, "-m", "draplane_inventory", "--nats", control_plane.nats_url, "--insecure-dev",
         "--prefix", subject_prefix, "--listen", f"127.0.0.1:{free_port()}"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "inventory.log", "wb"))
    agent = Agent(control_plane=control_plane, prefix=subject_prefix, node=node, root=tmp_path)
    agent.start()
    try:
        # Registration: what the kubelet's plugin watcher asks first.
        info = await wait_serving(api, agent)
        assert (info.type, info.name, info.endpoint) == ("DRAPlugin", GPU, str(agent.dra_socket))
        assert set(info.supported_versions) == {"v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth"}

        two = await allocated_claim(kube, namespace, "two-gpus", node, ["gpu-0", "gpu-1"])
        response = await prepare(api, agent, [two])
        uid = two.metadata.uid
        assert devices_of(response, two) == [
            ("gpu-0", [f"k8s.draplane.io/claim={uid}_{GPU}_gpu-0"], ["gpu"]),
            ("gpu-1", [f"k8s.draplane.io/claim={uid}_{GPU}_gpu-1"], ["gpu"])]
        spec = json.loads((agent.cdi_dir / cdi_spec_file_name(uid, GPU)).read_text())
        env_of_gpu0 = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
        assert env_of_gpu0["DRAPLANE_DEVICE_GPU_NVIDIA_COM_GPU_0_UUID"].startswith("GPU-")
        # Idempotent, and the same in v1beta1 (older kubelets).
        assert devices_of(await prepare(api, agent, [two]), two) == devices_of(response, two)
        assert devices_of(await prepare(api, agent, [two], version="v1beta1"), two) == devices_of(response, two)

        # Refusals come back per claim, naming the field; the other claims of the call are prepared.
        elsewhere = await allocated_claim(kube, namespace, "elsewhere", "some-other-node", ["gpu-2"])
        taken = await allocated_claim(kube, namespace, "taken", node, ["gpu-1"])
        admin = await allocated_claim(kube, namespace, "admin", node, ["gpu-1"], adminAccess=True)
        mixed = await prepare(api, agent, [elsewhere, taken, admin])
        assert "status.allocation.devices.results[0].pool: 'some-other-node' is not this node's pool" in \
            mixed.claims[elsewhere.metadata.uid].error
        assert f"already prepared for ResourceClaim {namespace}/two-gpus" in mixed.claims[taken.metadata.uid].error
        assert devices_of(mixed, admin)[0][0] == "gpu-1"  # admin access sees a busy device

        # kill -9, restart on the same folders: the same answer from the checkpoint, nothing prepared twice.
        agent.process.kill()
        agent.process.wait(10)
        agent.start()
        await wait_serving(api, agent)
        assert devices_of(await prepare(api, agent, [two]), two) == devices_of(response, two)
        assert "2 prepared claim(s) restored from the checkpoint" in agent.log()
        assert agent.log().count(f"prepared ResourceClaim {namespace}/two-gpus") == 1

        # Health: the stream shows every device, a device marked unhealthy turns UNHEALTHY, and its
        # slice taints it NoSchedule.
        assert agent.put_health("gpu-9", {"healthy": False}) == 404
        assert agent.put_health("gpu-3", {"healthy": "no"}) == 400
        async with grpc.aio.insecure_channel(f"unix://{agent.dra_socket}") as channel:
            stream = api.health_v1_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                api.health_v1.NodeWatchResourcesRequest())
            first = await asyncio.wait_for(stream.read(), 10)
            assert sorted(d.device.device_name for d in first.devices) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
            assert {d.health for d in first.devices} == {api.health_v1.HEALTHY}
            assert agent.put_health("gpu-3", {"healthy": False, "message": "XID 79 (simulated)"}) == 200
            update = await asyncio.wait_for(stream.read(), 10)
            bad = {d.device.device_name: d for d in update.devices if d.health == api.health_v1.UNHEALTHY}
            assert list(bad) == ["gpu-3"] and bad["gpu-3"].message == "XID 79 (simulated)"
            assert bad["gpu-3"].device.pool_name == node
            stream.cancel()

        async def tainted():
            items, _ = await kube.list(ResourceSlice, field_selector=f"spec.nodeName={node}")
            for item in items:
                for device in item.spec.devices or []:
                    if device.name == "gpu-3" and item.spec.driver == GPU:
                        return [(t.key, t.effect) for t in device.taints or []]
            return None

        assert await eventually(tainted, timeout=60) == [("draplane.io/device-unhealthy", "NoSchedule")]

        # Unprepare: the spec and files go; asked again, nothing to do.
        for _ in range(2):
            answer = await unprepare(api, agent, [two, admin])
            assert not answer.claims[uid].error and not answer.claims[admin.metadata.uid].error
        assert not (agent.cdi_dir / cdi_spec_file_name(uid, GPU)).exists()
        assert list(agent.cdi_dir.iterdir()) == []
        # The device is free for another claim now.
        assert devices_of(await prepare(api, agent, [taken]), taken)[0][0] == "gpu-1"
    finally:
        for process in (agent.process, inventory):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(15)
    assert agent.process.returncode == 0, agent.log()[-3000:]
    # A stopped agent leaves no socket for the kubelet to call.
    assert not agent.registration_socket.exists() and not agent.dra_socket.exists()
    assert "Traceback" not in agent.log(), agent.log()[-3000:]


async def test_a_socket_path_too_long_is_refused_naming_it(control_plane, subject_prefix, tmp_path):
    agent = Agent(control_plane=control_plane, prefix=subject_prefix, node="n-long", root=tmp_path)
    agent.argv[agent.argv.index("--kubelet-dir") + 1] = str(tmp_path / ("k" * 80))
    agent.start()
    assert agent.process.wait(60) == 1
    assert "over the 107 a socket address holds; use a shorter --kubelet-dir" in agent.log()
    assert "Traceback" not in agent.log()


async def test_a_live_socket_of_another_plugin_is_never_taken_over(control_plane, subject_prefix, short_tmp):
    """NVIDIA's DRA driver registers gpu.nvidia.com at the same path: the agent refuses to start
    rather than unlink its socket; a stale socket (nothing listening) is replaced."""
    import socket as sockets

    agent = Agent(control_plane=control_plane, prefix=subject_prefix, node="n-busy", root=short_tmp)
    agent.registration_socket.parent.mkdir(parents=True)
    other = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    other.bind(str(agent.registration_socket))
    other.listen()
    try:
        agent.start()
        assert agent.process.wait(60) == 1
        assert f"unix socket {agent.registration_socket} is in use: another process serves it" in agent.log()
        assert agent.registration_socket.exists() and "Traceback" not in agent.log()
    finally:
        other.close()
    # Closed, the socket file stays behind, as a killed plugin's does: now it is replaced.
    agent.start()
    try:
        assert (await wait_serving(load(), agent)).name == GPU
    finally:
        agent.process.send_signal(signal.SIGTERM)
        agent.process.wait(15)
    assert agent.process.returncode == 0, agent.log()[-2000:]

"""The pod runs: a real kubelet and containerd (draplane.localenv.realnode), draplane's inventory,
allocator and binder, and the node agent as the kubelet's DRA plugin. Pods are applied with
kubectl as a user applies them; the kubelet calls the plugin, containerd applies its CDI specs,
and the containers print what they were given."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from draplane.api.core import Node, Pod
from draplane.api.resource import ResourceSlice
from draplane.localenv.binaries import cache_dir
from draplane.localenv.environment import standard_device_classes
from draplane.localenv.processes import free_port
from draplane.localenv.realnode import RealNode, _mounts_under, _shim_pids, missing_prerequisites

from conftest import eventually  # noqa: E402  (tests/services/conftest.py)
from test_kubelet_plugin import Agent  # noqa: E402  (the agent as a process, on this node's folders)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

GPU = "gpu.nvidia.com"
DEVICES = "/var/run/draplane/devices"


@pytest.fixture
async def real_node(kube, control_plane, tmp_path):
    missing = missing_prerequisites()
    if missing:
        message = "the real node cannot run here: " + "; ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(message)  # `make test` installs the packages where it can (make node-packages)
        pytest.skip(message)
    name = f"real-{uuid.uuid4().hex[:6]}"
    workdir = Path(tempfile.mkdtemp(prefix="rn-", dir="/tmp"))  # short: sockets live under it
    node = await asyncio.to_thread(RealNode.start, name=name, workdir=workdir, logs=tmp_path / "node",
                                   kubeconfig=control_plane.kubeconfig, ca_file=control_plane.ca_file,
                                   images=cache_dir() / "images")
    try:
        async def ready():
            try:
                found = await kube.get(Node, name)
            except Exception:
                return False
            return any(c.type == "Ready" and c.status == "True" for c in (found.status.conditions or []))

        await eventually(ready, timeout=60, interval=0.5, what=f"node {name} Ready")
        # kube-controller-manager's node lifecycle controller lifts the not-ready taint once the
        # kubelet reports Ready; the session's cluster runs none, so the test does it.
        await kube.patch(Node, name, {"spec": {"taints": None}})
        yield node
    finally:
        await asyncio.to_thread(node.stop)
        await kube.delete(Node, name)
        # What the kubelet and containerd left is gone: containers and their shims, mounts, cgroups.
        leftovers = {"shims": _shim_pids(workdir / "containerd.sock"), "mounts": _mounts_under(workdir),
                     "cgroups": [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/draplane-{name}")]}
        shutil.rmtree(workdir, ignore_errors=True)
    assert not any(leftovers.values()), leftovers


def claim(name: str, count: int = 1, *, admin: bool = False) -> dict:
    exactly = {"deviceClassName": "gpu.nvidia.com", "count": count}
    if admin:
        exactly["adminAccess"] = True
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}


def pod(name: str, scheduler: str, claim_name: str | None) -> dict:
    # What the container was given: one file per device, and the env its CDI spec set.
    script = (f"ls {DEVICES} 2>&1; cat {DEVICES}/* 2>/dev/null; env | grep ^DRAPLANE_ | sort; "
              "echo READY; sleep 3600")
    spec = {"schedulerName": scheduler, "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "busybox", "command": ["sh", "-c", script]}]}
    if claim_name:
        spec["resourceClaims"] = [{"name": "gpus", "resourceClaimName": claim_name}]
        spec["containers"][0]["resources"] = {"claims": [{"name": "gpus"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


async def test_pods_run_on_a_real_node_with_exactly_their_devices(kube, kubectl, namespace, control_plane, scheduling,
                                                                   subject_prefix, real_node, tmp_path):
    for device_class in standard_device_classes():
        await kubectl("apply", "-f", "-", stdin=json.dumps(device_class))
    inventory = subprocess.Popen(
        [sys.executable, "-m", "draplane_inventory", "--nats", control_plane.nats_url, "--insecure-dev",
         "--prefix", subject_prefix, "--listen", f"127.0.0.1:{free_port()}"],
        env={**os.environ, "KUBECONFIG": str(control_plane.kubeconfig)}, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "inventory.log", "wb"))
    # RealNode's kubelet/ and cdi/ folders are the ones Agent derives from its root.
    agent = Agent(control_plane=control_plane, prefix=subject_prefix, node=real_node.name, root=real_node.workdir,
                  logs=tmp_path)
    agent.start()
    await scheduling.start(manage_claims=True)
    scheduler = scheduling.scheduler_name
    ns = ["-n", namespace]

    async def apply(*objects: dict) -> None:
        await kubectl(*ns, "apply", "-f", "-", stdin="\n---\n".join(json.dumps(o) for o in objects))

    async def running(name: str, timeout: float = 90.0) -> str:
        async def check():
            found = await kube.get(Pod, name, namespace)
            if found.status and found.status.phase == "Running":
                logs = await kubectl(*ns, "logs", name, check=False)
                return logs if "READY" in logs else None
            return None

        try:
            return await eventually(check, timeout, 0.5, what=f"pod {name} Running")
        except AssertionError:
            described = await kubectl(*ns, "describe", "pod", name, check=False)
            raise AssertionError(f"pod {name} is not Running:\n{described[-2500:]}\nagent:\n{agent.log()[-2000:]}")

    async def uuids() -> dict[str, str]:
        items, _ = await kube.list(ResourceSlice, field_selector=f"spec.nodeName={real_node.name}")
        return {d.name: d.attributes["uuid"].string_value for s in items if s.spec.driver == GPU
                for d in s.spec.devices or []}

    def devices_in(logs: str) -> set[str]:
        return {line.split(": ", 1)[1] for line in logs.splitlines() if line.startswith("device: ")}

    try:
        published = await eventually(lambda: uuids(), timeout=60, what="the real node's slices")
        assert len(published) == 4

        # A pod with a 2-GPU claim runs and sees exactly its 2 devices, by uuid.
        await apply(claim("two", 2), pod("two-gpus", scheduler, "two"))
        logs = await running("two-gpus")
        two = devices_in(logs)
        assert len(two) == 2, logs
        for device in two:
            assert f"uuid: {published[device]}" in logs
        assert sum(1 for line in logs.splitlines() if line.endswith("_UUID=" + published[sorted(two)[0]])) == 1

        # A pod without a claim sees no device.
        await apply(pod("no-claim", scheduler, None))
        logs = await running("no-claim")
        assert "No such file or directory" in logs and "DRAPLANE_" not in logs

        # Two pods sharing one claim see the same device; an adminAccess pod sees a busy one.
        await kubectl("label", "namespace", namespace, "resource.kubernetes.io/admin-access=true")
        await apply(claim("shared"), pod("share-a", scheduler, "shared"), pod("share-b", scheduler, "shared"),
                    claim("admin", admin=True))
        shared_a, shared_b = devices_in(await running("share-a")), devices_in(await running("share-b"))
        assert shared_a == shared_b and len(shared_a) == 1 and not shared_a & two
        await apply(pod("admin", scheduler, "admin"))
        admin_logs = await running("admin")
        assert "adminAccess: true" in admin_logs and devices_in(admin_logs) <= set(published)

        # The last free GPU cannot hold a 2-GPU claim: the pod waits until two-gpus is deleted,
        # whose claim is then unprepared (its CDI spec removed) and its devices go to the new pod.
        await apply(claim("next", 2), pod("next", scheduler, "next"))
        await asyncio.sleep(5)
        assert (await kube.get(Pod, "next", namespace)).status.phase == "Pending"
        two_uid = json.loads(await kubectl(*ns, "get", "resourceclaim", "two", "-o", "json"))["metadata"]["uid"]
        spec_file = real_node.cdi_dir / f"k8s.draplane.io-claim_{two_uid}_{GPU}.json"
        assert spec_file.exists()
        await kubectl(*ns, "delete", "pod", "two-gpus", "--wait=true")
        await eventually(lambda: asyncio.sleep(0, not spec_file.exists()), timeout=60, what="the CDI spec of two removed")
        assert devices_in(await running("next")) & two

        # kill -9 of the node agent during NodePrepareResources: the agent is frozen (SIGSTOP), a
        # pod is bound to the node, and the kubelet's call waits on it (the pod stays in
        # ContainerCreating); then -9. Once the agent is back, the pod starts with the same
        # devices, and no claim is prepared twice.
        await kubectl(*ns, "delete", "pod", "share-a", "share-b", "--wait=true")
        await eventually(lambda: asyncio.sleep(0, f"unprepared ResourceClaim {namespace}/shared " in agent.log()),
                         timeout=60, what="the shared claim unprepared once its pods went")
        agent.process.send_signal(signal.SIGSTOP)
        try:
            await apply(pod("after-crash", scheduler, "shared"))

            async def bound():
                return (await kube.get(Pod, "after-crash", namespace)).spec.node_name
            assert await eventually(bound, timeout=60, what="after-crash bound") == real_node.name
            await asyncio.sleep(5)
            waiting = json.loads(await kubectl(*ns, "get", "pod", "after-crash", "-o", "json"))["status"]
            assert waiting.get("phase") == "Pending", waiting  # its devices are not prepared: no container yet
        finally:
            agent.process.kill()
            agent.process.wait(10)
        agent.start()
        assert devices_in(await running("after-crash")) == shared_a
        log = agent.log()
        assert log.count(f'"prepared ResourceClaim {namespace}/next ') == 1, log[-3000:]
        # once for share-a and share-b, once for after-crash, and not again
        assert log.count(f'"prepared ResourceClaim {namespace}/shared ') == 2, log[-3000:]
        shared_uid = json.loads(await kubectl(*ns, "get", "resourceclaim", "shared", "-o", "json"))["metadata"]["uid"]
        assert [p.name for p in real_node.cdi_dir.iterdir() if shared_uid in p.name] == \
            [f"k8s.draplane.io-claim_{shared_uid}_{GPU}.json"]

        # A restarted kubelet registers the plugin again, and prepares for new pods.
        registrations = agent.log().count("the kubelet registered the plugin of driver gpu.nvidia.com")
        await asyncio.to_thread(real_node.restart_kubelet)
        await eventually(lambda: asyncio.sleep(0, agent.log().count(
            "the kubelet registered the plugin of driver gpu.nvidia.com") > registrations), timeout=60, what="registered again")

        # A device marked unhealthy shows in the pod's status, and its slice taints it NoSchedule.
        (sick,) = shared_a
        assert agent.put_health(sick, {"healthy": False, "message": "XID 79 (simulated)"}) == 200

        async def unhealthy_in_status():
            found = json.loads(await kubectl(*ns, "get", "pod", "after-crash", "-o", "json"))
            for status in found["status"].get("containerStatuses", []):
                for resource in status.get("allocatedResourcesStatus") or []:
                    for health in resource.get("resources") or []:
                        if health.get("health") == "Unhealthy":
                            return resource
            return None

        resource = await eventually(unhealthy_in_status, timeout=60, what="allocatedResourcesStatus Unhealthy")
        assert resource["name"].startswith("claim:gpus")  # the pod's name for the claim

        async def tainted():
            items, _ = await kube.list(ResourceSlice, field_selector=f"spec.nodeName={real_node.name}")
            return [t.key for s in items for d in s.spec.devices or [] if d.name == sick for t in d.taints or []]

        assert await eventually(tainted, timeout=60, what="taint") == ["draplane.io/device-unhealthy"]

        # No new pod lands on it: with the sick GPU freed, of the two free GPUs a new pod gets the
        # healthy one, and the next pod waits, told that the last free one is tainted.
        await kubectl(*ns, "delete", "pod", "after-crash", "admin", "--wait=true")
        await kubectl(*ns, "delete", "resourceclaim", "shared", "--wait=true")
        await apply(claim("fresh"), pod("fresh", scheduler, "fresh"))
        fresh = devices_in(await running("fresh"))
        assert len(fresh) == 1 and sick not in fresh and not fresh & two, (fresh, sick)
        await apply(claim("after-sick"), pod("after-sick", scheduler, "after-sick"))

        async def waits_for_an_untainted_gpu():
            found = await kube.get(Pod, "after-sick", namespace)
            conditions = (found.status.conditions or []) if found.status else []
            return next((c.message for c in conditions if c.type == "PodScheduled" and c.status == "False"
                         and "taint" in (c.message or "")), None)

        message = await eventually(waits_for_an_untainted_gpu, timeout=30, what="after-sick unschedulable for the taint")
        assert not (await kube.get(Pod, "after-sick", namespace)).spec.node_name, message
    finally:
        await kubectl(*ns, "delete", "pods", "--all", "--wait=false", check=False)
        for process, stop in ((agent.process, signal.SIGTERM), (inventory, signal.SIGINT)):
            if process is not None and process.poll() is None:
                process.send_signal(stop)
                process.wait(30)
    assert "Traceback" not in agent.log(), agent.log()[-3000:]

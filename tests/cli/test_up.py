"""`draplane up` as a user runs it: a subprocess, a user's own claim and pod, then Ctrl-C."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from draplane.api import core, resource
from draplane.api.meta import ObjectMeta

pytestmark = pytest.mark.integration


def _wait_for_line(process, needle, timeout):
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            if process.poll() is not None:
                break
            continue
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not printed within {timeout}s:\n{''.join(lines)}")


def _descendants(pid: int) -> set[int]:
    found, frontier = set(), [pid]
    while frontier:
        parent = frontier.pop()
        children = []
        try:
            # Servers started from worker threads are children of those threads' tasks.
            for task in os.listdir(f"/proc/{parent}/task"):
                children += open(f"/proc/{parent}/task/{task}/children").read().split()
        except OSError:
            continue
        for child in map(int, children):
            found.add(child)
            frontier.append(child)
    return found


async def test_up_binds_a_users_pod_and_ctrl_c_leaves_no_orphans(tmp_path, control_plane):
    from draplane.kube import KubeClient

    workdir = tmp_path / "up"
    process = subprocess.Popen(
        [sys.executable, "-m", "draplane.cli", "up", "--nodes=3", f"--workdir={workdir}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        lines = await asyncio.to_thread(_wait_for_line, process, "Ctrl-C stops everything", 180)
        output = "".join(lines)
        kubeconfig = workdir / "controlplane" / "kubeconfig"
        assert f"kubeconfig: {kubeconfig}" in output
        from draplane.localenv import binaries

        kubectl_line = next(line for line in lines if line.strip().startswith("try:")).split("try:", 1)[1].strip()
        assert kubectl_line.startswith(f"{binaries.require(binaries.KUBECTL)} --kubeconfig {kubeconfig} get ")
        # the line works as printed, on a machine with no kubectl of its own
        shown = subprocess.run(kubectl_line.split(), capture_output=True, text=True, timeout=60,
                               env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        assert shown.returncode == 0, shown.stderr
        assert "deviceclass.resource.k8s.io/gpu.nvidia.com" in shown.stdout
        children = _descendants(process.pid)
        assert len(children) >= 10  # etcd, apiserver, nats, inventory, 2 shards, binder, 3 node agents

        second = subprocess.run([sys.executable, "-m", "draplane.cli", "up", f"--workdir={workdir}"],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1
        assert "already running" in second.stderr and str(process.pid) in second.stderr

        async with await KubeClient.from_kubeconfig(kubeconfig) as kube:
            await kube.create_namespace("mine")
            await kube.create(resource.ResourceClaimTemplate(
                metadata=ObjectMeta(name="one-gpu", namespace="mine"),
                spec=resource.ResourceClaimTemplateSpec(spec=resource.ResourceClaimSpec(devices=resource.DeviceClaim(requests=[
                    resource.DeviceRequest(name="gpu", exactly=resource.ExactDeviceRequest(device_class_name="gpu.nvidia.com")),
                ]))),
            ))
            await kube.create(core.Pod(
                metadata=ObjectMeta(name="trainer", namespace="mine"),
                spec=core.PodSpec(
                    containers=[core.Container(name="c", image="busybox", resources=core.ResourceRequirements(claims=[core.ResourceClaimRef(name="gpu")]))],
                    resource_claims=[core.PodResourceClaim(name="gpu", resource_claim_template_name="one-gpu")],
                ),
            ))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                pod = await kube.get(core.Pod, "trainer", "mine")
                if pod.spec.node_name:
                    break
                await asyncio.sleep(0.5)
            assert pod.spec.node_name, f"the pod was not bound: {pod.status}"
            claims, _ = await kube.list(resource.ResourceClaim, "mine")
            assert len(claims) == 1 and claims[0].status.allocation is not None
            assert claims[0].status.reserved_for[0].name == "trainer"
    finally:
        os.killpg(process.pid, signal.SIGINT) if process.poll() is None else None
        process.wait(timeout=60)
    assert process.returncode == 0
    time.sleep(0.5)
    alive = [pid for pid in children if os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert not alive, f"processes left behind after Ctrl-C: {alive}"


def _child_running(parent: int, module: str) -> int:
    for pid in _descendants(parent):
        try:
            cmdline = open(f"/proc/{pid}/cmdline").read().split("\0")
        except OSError:
            continue
        if module in cmdline:
            return pid
    raise AssertionError(f"no child of {parent} runs {module}")


async def test_up_restarts_a_killed_service_keeps_each_runs_logs_and_stops_only_on_ctrl_c(tmp_path, control_plane):
    from draplane.kube import KubeClient

    workdir = tmp_path / "up"
    argv = [sys.executable, "-m", "draplane.cli", "up", "--nodes=1", "--shards=1", f"--workdir={workdir}"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        await asyncio.to_thread(_wait_for_line, process, "Ctrl-C stops everything", 180)
        first_run = (workdir / "logs" / "latest").resolve()
        assert (first_run / "binder.log").is_file() and (first_run / "controlplane" / "kube-apiserver.log").is_file()
        for module in ("draplane_binder", "draplane_node_agent"):
            os.kill(_child_running(process.pid, module), signal.SIGKILL)
            name = "binder" if module == "draplane_binder" else "node-agent"
            lines = await asyncio.to_thread(_wait_for_line, process, f"restarted (pid", 60)
            said = "".join(lines)
            assert f"{name}" in said and "died (killed by SIGKILL); restarting it in 1 s" in said, said
        assert process.poll() is None, "up stopped after a service died"
        kubeconfig = workdir / "controlplane" / "kubeconfig"
        async with await KubeClient.from_kubeconfig(kubeconfig) as kube:
            await kube.create_namespace("after")
            await kube.create(resource.ResourceClaim(
                metadata=ObjectMeta(name="one", namespace="after"),
                spec=resource.ResourceClaimSpec(devices=resource.DeviceClaim(requests=[
                    resource.DeviceRequest(name="gpu", exactly=resource.ExactDeviceRequest(device_class_name="gpu.nvidia.com")),
                ])),
            ))
            await kube.create(core.Pod(
                metadata=ObjectMeta(name="after-restart", namespace="after"),
                spec=core.PodSpec(
                    containers=[core.Container(name="c", image="busybox", resources=core.ResourceRequirements(claims=[core.ResourceClaimRef(name="gpu")]))],
                    resource_claims=[core.PodResourceClaim(name="gpu", resource_claim_name="one")],
                ),
            ))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                pod = await kube.get(core.Pod, "after-restart", "after")
                if pod.spec.node_name:
                    break
                await asyncio.sleep(0.5)
            assert pod.spec.node_name, "the restarted binder did not bind a new pod"
    finally:
        os.killpg(process.pid, signal.SIGINT) if process.poll() is None else None
        process.wait(timeout=60)
    assert process.returncode == 0
    # a second run keeps the first run's logs, the crash evidence included
    again = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        await asyncio.to_thread(_wait_for_line, again, "Ctrl-C stops everything", 180)
        assert (workdir / "logs" / "latest").resolve() != first_run
        assert (first_run / "binder.log").is_file() and (first_run / "controlplane" / "kube-apiserver.log").is_file()
    finally:
        os.killpg(again.pid, signal.SIGINT) if again.poll() is None else None
        again.wait(timeout=60)
    assert again.returncode == 0


async def test_kwok_plays_the_kubelets_pods_run_a_plain_delete_frees_the_device_and_drain_moves_work(tmp_path,
                                                                                                    control_plane):
    from draplane.localenv import binaries

    workdir = tmp_path / "up"
    process = subprocess.Popen(
        [sys.executable, "-m", "draplane.cli", "up", "--nodes=2", "--shards=1", f"--workdir={workdir}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    kubeconfig = workdir / "controlplane" / "kubeconfig"

    def kubectl(*args: str, stdin: str | None = None) -> str:
        done = subprocess.run([str(binaries.require(binaries.KUBECTL)), f"--kubeconfig={kubeconfig}", *args],
                              input=stdin, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def wait(what: str, check, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}")

    # One L4 node (one whole GPU) and one A100 node: a pod asks for the L4's GPU by product.
    manifest = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: the-l4}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.nvidia.com
          selectors: [{cel: {expression: 'device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA L4")'}}]
"""

    def pod(name: str) -> str:
        return f"""
apiVersion: v1
kind: Pod
metadata: {{name: {name}}}
spec:
  containers: [{{name: c, image: registry.k8s.io/pause:3.10, resources: {{claims: [{{name: gpu}}]}}}}]
  resourceClaims: [{{name: gpu, resourceClaimTemplateName: the-l4}}]
"""

    def phase(name: str) -> str:
        return kubectl("get", "pod", name, "-o", "jsonpath={.status.phase}/{.spec.nodeName}")

    try:
        await asyncio.to_thread(_wait_for_line, process, "Ctrl-C stops everything", 180)
        wait("nodes Ready", lambda: kubectl("get", "nodes").count(" Ready ") == 2)
        gpus = int(kubectl("get", "resourceslices", "-o", "json").count('"NVIDIA L4'))
        kubectl("apply", "-f", "-", stdin=manifest + "---" + pod("first"))
        first = wait("first Running", lambda: phase("first").startswith("Running/") and phase("first"))
        node = first.split("/", 1)[1]
        # every L4 GPU taken: the next pod waits
        others = [f"more-{i}" for i in range(gpus - 1)]
        for name in others:
            kubectl("apply", "-f", "-", stdin=pod(name))
        for name in others:
            wait(f"{name} Running", lambda name=name: phase(name).startswith("Running/"))
        kubectl("apply", "-f", "-", stdin=pod("waiting"))
        wait("waiting unschedulable", lambda: "Unschedulable" in kubectl("get", "pod", "waiting", "-o",
                                                                          "jsonpath={.status.conditions}"))
        # a plain delete, as a user types it: kwok finishes it, and the freed GPU goes to the waiting pod
        started = time.monotonic()
        kubectl("delete", "pod", "first", "--wait=true", "--timeout=60s")
        assert time.monotonic() - started < 30
        wait("waiting Running", lambda: phase("waiting") == f"Running/{node}")
        # a Deployment: kube-controller-manager makes the pods and their claims, draplane binds them
        kubectl("apply", "-f", "-", stdin="""
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: any-gpu}
spec:
  spec:
    devices:
      requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: infer}
spec:
  replicas: 3
  selector: {matchLabels: {app: infer}}
  template:
    metadata: {labels: {app: infer}}
    spec:
      containers: [{name: c, image: registry.k8s.io/pause:3.10, resources: {claims: [{name: gpu}]}}]
      resourceClaims: [{name: gpu, resourceClaimTemplateName: any-gpu}]
""")
        wait("the Deployment's 3 pods Running",
             lambda: kubectl("get", "deployment", "infer", "-o", "jsonpath={.status.readyReplicas}") == "3")
        kubectl("scale", "deployment", "infer", "--replicas=1")
        wait("the scaled-down pods' claims deleted",
             lambda: kubectl("get", "resourceclaims", "-o", "name").count("infer-") == 1, timeout=60)
        # drain: the node is cordoned and its pods evicted; a new pod cannot go there any more
        kubectl("drain", node, "--ignore-daemonsets", "--force", "--timeout=90s")
        assert "SchedulingDisabled" in kubectl("get", "node", node)
        assert node not in kubectl("get", "pods", "-o", "wide")
        kubectl("apply", "-f", "-", stdin=pod("after-drain"))
        def judged() -> str:
            # first "waiting for the claim to be created from its template", as kube-scheduler says too
            message = kubectl("get", "pod", "after-drain", "-o", "jsonpath={.status.conditions[0].message}")
            return message if "nodes are available" in message else ""

        message = wait("after-drain unschedulable", judged)
        assert "node(s) were unschedulable" in message, message
    finally:
        os.killpg(process.pid, signal.SIGINT) if process.poll() is None else None
        process.wait(timeout=60)
    assert process.returncode == 0

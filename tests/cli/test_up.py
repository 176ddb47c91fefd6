"""`draplane up` as a user runs it: a subprocess, a user's own claim and pod, then Ctrl-C."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draplane.api import core, resource
from draplane.api.meta import ObjectMeta
# at module level, not in the async tests: the first import of the Kubernetes client reads the file
# system (sysconfig), which blockbuster refuses inside a running event loop (the file run alone)
from draplane.kube import KubeClient

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


def _kubectl_for(kubeconfig: Path):
    """The cache's kubectl against `up`'s cluster, as a user runs it: its output, or the test fails
    naming the command and what kubectl said."""
    from draplane.localenv import binaries

    def kubectl(*args: str, stdin: str | None = None) -> str:
        done = subprocess.run([str(binaries.require(binaries.KUBECTL)), f"--kubeconfig={kubeconfig}", *args],
                              input=stdin, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    return kubectl


def wait(what: str, check, timeout: float = 60.0):
    """`check()`'s first true value, asked every 0.5 s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


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

        # A GPU and the NIC on its PCIe root, through the standard `dranet` class, applied with
        # the kubectl `up` printed: it binds where a node publishes dra.net NICs.
        kubectl_argv = kubectl_line.split()[:3]  # kubectl --kubeconfig PATH
        rdma = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: gpu-and-nic, namespace: mine}
spec:
  spec:
    devices:
      requests:
        - {name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}
        - {name: nic, exactly: {deviceClassName: dranet}}
      constraints:
        - {requests: [gpu, nic], matchAttribute: resource.kubernetes.io/pcieRoot}
---
apiVersion: v1
kind: Pod
metadata: {name: rdma, namespace: mine}
spec:
  containers: [{name: c, image: busybox, resources: {claims: [{name: net}]}}]
  resourceClaims: [{name: net, resourceClaimTemplateName: gpu-and-nic}]
"""
        applied = await asyncio.to_thread(subprocess.run, [*kubectl_argv, "apply", "-f", "-"], input=rdma,
                                          capture_output=True, text=True, timeout=60)
        assert applied.returncode == 0, applied.stderr
        async with await KubeClient.from_kubeconfig(kubeconfig) as kube:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                pod = await kube.get(core.Pod, "rdma", "mine")
                # kcm names the claim it made in the pod's status, which may land after the binding
                if pod.spec.node_name and pod.status and pod.status.resource_claim_statuses:
                    break
                await asyncio.sleep(0.5)
            assert pod.spec.node_name, f"the GPU and NIC pod was not bound: {pod.status}"
            assert pod.status.resource_claim_statuses, f"kcm named no claim in the pod's status: {pod.status}"
            (claim_status,) = pod.status.resource_claim_statuses
            claim = await kube.get(resource.ResourceClaim, claim_status.resource_claim_name, "mine")
            results = claim.status.allocation.devices.results
            assert sorted((r.request, r.driver) for r in results) == [("gpu", "gpu.nvidia.com"), ("nic", "dra.net")]
            slices, _ = await kube.list(resource.ResourceSlice)
            roots = {d.attributes["resource.kubernetes.io/pcieRoot"].string_value
                     for r in results for s in slices if s.spec.driver == r.driver and s.spec.pool.name == r.pool
                     for d in s.spec.devices or () if d.name == r.device}
            assert len(roots) == 1, results

        # The real node, where this machine can run one: the pod `up` suggests, applied with the
        # kubectl line as printed, runs there and its log shows its 2 GPUs by uuid.
        from draplane.localenv.realnode import missing_prerequisites

        real = not missing_prerequisites()
        if real:
            node_dir = (workdir / "real-node").resolve()
            apply_argv = next(line for line in lines if line.strip().startswith("run a pod:")).split("run a pod:", 1)[1].split()
            logs_argv = next(line for line in lines if line.strip().startswith("then:")).split("then:", 1)[1].split()
            applied = await asyncio.to_thread(subprocess.run, apply_argv, capture_output=True, text=True, timeout=60)
            assert applied.returncode == 0, applied.stderr
            deadline, logs = time.monotonic() + 90, ""
            while time.monotonic() < deadline and logs.count("uuid: GPU-") < 2:
                await asyncio.sleep(1)
                logs = (await asyncio.to_thread(subprocess.run, logs_argv, capture_output=True, text=True, timeout=30)).stdout
            assert logs.count("uuid: GPU-") == 2 and "pool: real-0000" in logs, logs
        else:
            assert "real node:  none (this machine cannot run one; missing: " in output

        # NATS as deploy/ runs it: a client without TLS and a key is refused; `draplane free`
        # reads with the reader key up.json names; every service did its job within its role's
        # permissions (the server logs each refusal as a "Violation").
        info = json.loads((workdir / "up.json").read_text())
        import nats

        with pytest.raises((nats.errors.Error, OSError)):
            await nats.connect(info["nats_url"], allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        # `free` run as `up` printed it (with the --workdir it needs), from another directory
        free_line = next(line for line in lines if line.strip().startswith("free:")).split("free:", 1)[1]
        free_argv = free_line.split("(", 1)[0].split()
        assert free_argv == ["draplane", "free", "--workdir", str(workdir)], free_line
        free = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "draplane.cli", *free_argv[1:], "-o", "json"], cwd=tmp_path,
            capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("DRAPLANE_NATS")})
        assert free.returncode == 0, free.stderr
        # the trainer's GPU, read from the reservation bucket
        assert sum(row["states"].get("allocated", 0) for row in json.loads(free.stdout)["byNode"]) >= 1, free.stdout
        nats_log = (workdir / "logs" / "latest" / "controlplane" / "nats-server.log").read_text()
        assert "TLS required for client connections" in nats_log
        assert "Violation" not in nats_log, [line for line in nats_log.splitlines() if "Violation" in line][:5]
    finally:
        os.killpg(process.pid, signal.SIGINT) if process.poll() is None else None
        process.wait(timeout=60)
    assert process.returncode == 0
    time.sleep(0.5)
    alive = [pid for pid in children if os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert not alive, f"processes left behind after Ctrl-C: {alive}"
    if real:
        # The containers, their shims, mounts and cgroups, and the node's folder are gone too.
        from draplane.localenv.realnode import _mounts_under, _shim_pids

        assert not _shim_pids(node_dir / "containerd.sock")
        assert not _mounts_under(node_dir)
        assert not node_dir.exists() and not (workdir / "real-node").exists()
        assert not list(Path("/sys/fs/cgroup").glob("*/draplane-real-0000"))


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
    workdir = tmp_path / "up"
    argv = [sys.executable, "-m", "draplane.cli", "up", "--nodes=1", "--shards=1", f"--workdir={workdir}", "--no-real-node"]
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

    workdir = tmp_path / "up"
    process = subprocess.Popen(
        [sys.executable, "-m", "draplane.cli", "up", "--nodes=2", "--shards=1", f"--workdir={workdir}", "--no-real-node"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    kubeconfig = workdir / "controlplane" / "kubeconfig"
    kubectl = _kubectl_for(kubeconfig)

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
        # every pod deleted above (one plain delete, two scaled down, the drained) was deleted once:
        # KWOK no longer plays its delete stage again on a pod it has just removed
        kwok_log = (workdir / "logs" / "latest" / "kwok.log").read_text()
        assert kwok_log.count('"msg":"Delete pod"') >= 4
        assert "failed to delete pod" not in kwok_log, [
            line for line in kwok_log.splitlines() if "failed to delete pod" in line][:3]
    finally:
        os.killpg(process.pid, signal.SIGINT) if process.poll() is None else None
        process.wait(timeout=60)
    assert process.returncode == 0


async def test_up_with_three_shards_honours_what_a_pod_says_of_where_it_may_run(tmp_path, control_plane):
    """kube-scheduler's pod constraints through `draplane up` with 3 shards, applied with kubectl on
    KWOK's nodes: a Deployment whose replicas must not share a node runs on 3 nodes; a gated pod
    is left alone (no node, its claim unallocated, PodScheduled=False SchedulingGated) until its
    gate is removed; a second pod asking for a host port taken on its node waits with
    kube-scheduler's NodePorts reason."""

    workdir = tmp_path / "up"
    process = subprocess.Popen(
        [sys.executable, "-m", "draplane.cli", "up", "--nodes=4", "--shards=3", f"--workdir={workdir}",
         "--no-real-node"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    kubeconfig = workdir / "controlplane" / "kubeconfig"
    kubectl = _kubectl_for(kubeconfig)

    def pod_json(name: str) -> dict:
        return json.loads(kubectl("get", "pod", name, "-o", "json"))

    def scheduled_condition(name: str) -> dict:
        return next((c for c in pod_json(name)["status"].get("conditions", []) if c["type"] == "PodScheduled"), {})

    try:
        await asyncio.to_thread(_wait_for_line, process, "Ctrl-C stops everything", 180)
        wait("nodes Ready", lambda: kubectl("get", "nodes").count(" Ready ") == 4)
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
metadata: {name: llm}
spec:
  replicas: 3
  selector: {matchLabels: {app: llm}}
  template:
    metadata: {labels: {app: llm}}
    spec:
      affinity:
        podAntiAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            - {topologyKey: kubernetes.io/hostname, labelSelector: {matchLabels: {app: llm}}}
      containers: [{name: c, image: registry.k8s.io/pause:3.10, resources: {claims: [{name: gpu}]}}]
      resourceClaims: [{name: gpu, resourceClaimTemplateName: any-gpu}]
---
apiVersion: v1
kind: Pod
metadata: {name: gated}
spec:
  schedulingGates: [{name: example.com/quota}]
  containers: [{name: c, image: registry.k8s.io/pause:3.10, resources: {claims: [{name: gpu}]}}]
  resourceClaims: [{name: gpu, resourceClaimTemplateName: any-gpu}]
""")
        wait("the Deployment's 3 pods Running",
             lambda: kubectl("get", "deployment", "llm", "-o", "jsonpath={.status.readyReplicas}") == "3", timeout=90)
        nodes = kubectl("get", "pods", "-l", "app=llm", "-o", "jsonpath={.items[*].spec.nodeName}").split()
        assert len(set(nodes)) == 3, nodes

        condition = wait("the gated pod's condition", lambda: scheduled_condition("gated"))
        assert (condition["status"], condition["reason"]) == ("False", "SchedulingGated"), condition
        time.sleep(3)
        assert not pod_json("gated")["spec"].get("nodeName")
        gated_claim = wait("the gated pod's claim", lambda: pod_json("gated")["status"].get("resourceClaimStatuses"))
        claim = json.loads(kubectl("get", "resourceclaim", gated_claim[0]["resourceClaimName"], "-o", "json"))
        assert not claim.get("status", {}).get("allocation"), claim["status"]
        kubectl("patch", "pod", "gated", "--type=json", "-p", '[{"op": "remove", "path": "/spec/schedulingGates"}]')
        wait("the ungated pod Running", lambda: pod_json("gated")["status"].get("phase") == "Running")

        node = nodes[0]

        def port_pod(name: str) -> str:
            return f"""
apiVersion: v1
kind: Pod
metadata: {{name: {name}}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  containers: [{{name: c, image: registry.k8s.io/pause:3.10, ports: [{{containerPort: 80, hostPort: 8080}}]}}]
"""

        kubectl("apply", "-f", "-", stdin=port_pod("port-a"))
        wait("port-a Running", lambda: pod_json("port-a")["status"].get("phase") == "Running")
        kubectl("apply", "-f", "-", stdin=port_pod("port-b"))
        message = wait("port-b refused", lambda: scheduled_condition("port-b").get("message", "")
                       if "nodes are available" in scheduled_condition("port-b").get("message", "") else "")
        assert "1 node(s) didn't have free ports for the requested pod ports" in message, message
        assert not pod_json("port-b")["spec"].get("nodeName")
    finally:
        os.killpg(process.pid, signal.SIGINT) if process.poll() is None else None
        process.wait(timeout=60)
    assert process.returncode == 0


class _Output:
    """`up`'s output as it comes, read by a task of its own (so the pipe never fills), for a test
    to wait on a line while it does other things."""

    def __init__(self, stream: asyncio.StreamReader):
        self.lines: list[str] = []
        self._news = asyncio.Condition()
        self._task = asyncio.create_task(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            async with self._news:
                self.lines.append(line.decode(errors="replace"))
                self._news.notify_all()
        async with self._news:
            self._news.notify_all()

    def text(self, start: int = 0) -> str:
        return "".join(self.lines[start:])

    async def wait_for(self, needle: str, start: int, timeout: float) -> int:
        """The index of the first line from `start` on that holds `needle`."""
        def found() -> int | None:
            return next((i for i in range(start, len(self.lines)) if needle in self.lines[i]), None)

        async with self._news:
            try:
                await asyncio.wait_for(self._news.wait_for(lambda: found() is not None or self._task.done()), timeout)
            except asyncio.TimeoutError:
                pass
            index = found()
        if index is None:
            raise AssertionError(f"{needle!r} not printed within {timeout:.0f}s; up said:\n{self.text(start)}")
        return index


def _service_pids(parent: int) -> dict[str, int]:
    """The processes `up` supervises, by the names it gives them (node-agent-l4, allocator-1, ...)."""
    found = {}
    for pid in _descendants(parent):
        try:
            argv = open(f"/proc/{pid}/cmdline").read().split("\0")
        except OSError:
            continue
        options = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
        binary = os.path.basename(argv[0])
        if "draplane_node_agent" in argv:
            found[f"node-agent-{options['profile']}"] = pid
        elif "draplane_allocator" in argv:
            found[f"allocator-{options['shard-index']}"] = pid
        elif "draplane_inventory" in argv:
            found["inventory"] = pid
        elif "draplane_binder" in argv:
            found["binder"] = pid
        elif binary.startswith("kube-controller-manager"):
            found["kube-controller-manager"] = pid
        elif binary.startswith("kwok"):
            found["kwok"] = pid
    return found


def _readyz(pid: int) -> str | None:
    """The readiness address of a draplane service, from its command line; None for those without."""
    argv = open(f"/proc/{pid}/cmdline").read().split("\0")
    if not any(a.startswith("draplane_") for a in argv):
        return None
    for arg in argv:
        if arg.startswith("--port="):
            return f"http://127.0.0.1:{arg.split('=', 1)[1]}/readyz"
        if arg.startswith("--listen="):
            return f"http://{arg.split('=', 1)[1]}/readyz"
    return None


async def _wait_ready(url: str, timeout: float) -> None:
    import urllib.request

    def ready() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(ready):
        assert time.monotonic() < deadline, f"{url} not ready within {timeout:.0f}s"
        await asyncio.sleep(0.2)


# What the pods ask for, in turn: one GPU, two GPUs in one request, a MIG slice, and a pod with
# two claims (a GPU and a MIG slice, on one node). Forty of them fit the 8 nodes in every case:
# 40 whole GPUs at most (a MIG slice can hold a whole A100) of 52.
_CHAOS_TEMPLATES = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu}
spec:
  spec:
    devices:
      requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}]
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: two-gpus}
spec:
  spec:
    devices:
      requests: [{name: gpus, exactly: {deviceClassName: gpu.nvidia.com, allocationMode: ExactCount, count: 2}}]
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: mig-slice}
spec:
  spec:
    devices:
      requests:
      - name: mig
        exactly:
          deviceClassName: mig.nvidia.com
          selectors: [{cel: {expression: 'device.attributes["gpu.nvidia.com"].profile == "1g.5gb"'}}]
"""
_CHAOS_KINDS = (("one-gpu",), ("two-gpus",), ("mig-slice",), ("one-gpu", "mig-slice"))
_CHAOS_GPUS = {"one-gpu": 1, "two-gpus": 2, "mig-slice": 1}  # devices per claim


def _chaos_pod(index: int) -> str:
    templates = _CHAOS_KINDS[index % len(_CHAOS_KINDS)]
    claims = ", ".join(f"{{name: c{i}}}" for i in range(len(templates)))
    refs = ", ".join(f"{{name: c{i}, resourceClaimTemplateName: {t}}}" for i, t in enumerate(templates))
    return f"""
apiVersion: v1
kind: Pod
metadata: {{name: chaos-{index:02d}, labels: {{app: chaos}}}}
spec:
  containers: [{{name: c, image: registry.k8s.io/pause:3.10, resources: {{claims: [{claims}]}}}}]
  resourceClaims: [{refs}]
"""


def _overbooked_counters(slices: list[dict], claims: list[dict]) -> list[str]:
    """Counter sets whose allocated devices consume more than the set has: a whole A100 and one of
    its MIG slices, or two overlapping slices, given at once."""
    from draplane.api.quantity import parse_quantity

    newest: dict[tuple[str, str], int] = {}
    for s in slices:
        pool = (s["spec"]["driver"], s["spec"]["pool"]["name"])
        newest[pool] = max(newest.get(pool, 0), s["spec"]["pool"]["generation"])
    capacity, consumes = {}, {}
    for s in slices:
        pool = (s["spec"]["driver"], s["spec"]["pool"]["name"])
        if s["spec"]["pool"]["generation"] != newest[pool]:
            continue
        for counter_set in s["spec"].get("sharedCounters") or ():
            for counter, value in counter_set["counters"].items():
                capacity[(*pool, counter_set["name"], counter)] = parse_quantity(value["value"])
        for device in s["spec"].get("devices") or ():
            consumes[(*pool, device["name"])] = device.get("consumesCounters") or ()
    used: dict[tuple, object] = {}
    for claim in claims:
        for result in claim["status"]["allocation"]["devices"]["results"]:
            pool = (result["driver"], result["pool"])
            for consumption in consumes.get((*pool, result["device"]), ()):
                for counter, value in consumption["counters"].items():
                    key = (*pool, consumption["counterSet"], counter)
                    amount = parse_quantity(value["value"])
                    used[key] = used[key] + amount if key in used else amount
    return [f"{key}: {used[key]} used of {capacity.get(key)}" for key in used
            if key not in capacity or capacity[key] < used[key]]


async def test_up_keeps_binding_pods_while_each_service_in_turn_is_killed(tmp_path, control_plane, kubectl):
    """kill -9 of every process `up` supervises but the servers under it (each node agent, the
    inventory, each shard, the binder, kube-controller-manager, KWOK), one after the other, while
    pods with template claims keep coming through kubectl: each is restarted, every pod binds with
    its claims allocated and reserved for it, and no device (nor MIG memory slice) is given twice."""
    import json

    from draplane.localenv.environment import DEFAULT_PROFILES

    workdir = tmp_path / "up"
    nodes = 8  # two of each profile: one node agent per profile
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "draplane.cli", "up", f"--nodes={nodes}", "--shards=2", f"--workdir={workdir}", "--no-real-node",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
    )
    output = _Output(process.stdout)
    ctl = type(kubectl)(kubectl.binary, workdir / "controlplane" / "kubeconfig")
    victims = [f"node-agent-{p}" for p in DEFAULT_PROFILES] + ["inventory", "allocator-0", "allocator-1", "binder",
                                                                "kube-controller-manager", "kwok"]
    created = 0

    async def create(count: int) -> None:
        nonlocal created
        for _ in range(count):
            await ctl.apply(_chaos_pod(created))
            created += 1

    async def lease_holders() -> dict[str, str]:
        leases = json.loads(await ctl("get", "leases", "-n", "kube-node-lease", "-o", "json"))["items"]
        return {lease["metadata"]["name"]: lease["spec"].get("holderIdentity") for lease in leases}

    started = time.monotonic()
    try:
        await output.wait_for("Ctrl-C stops everything", 0, 180)
        up_at = time.monotonic()
        await ctl.apply(_CHAOS_TEMPLATES)
        await create(2)
        pids = _service_pids(process.pid)
        assert set(victims) <= set(pids), f"up does not run all of {victims}: {sorted(pids)}"
        for name in victims:
            mark = len(output.lines)
            if name == "kwok":
                dead_holders = set((await lease_holders()).values())
            os.kill(pids[name], signal.SIGKILL)
            # pods keep coming while it is dead and while it starts again
            coming = asyncio.create_task(create(3))
            died = await output.wait_for(f"draplane up: {name} died (killed by SIGKILL); restarting it in 1 s", mark, 30)
            restarted = await output.wait_for(f"draplane up: {name} restarted (pid ", died, 30)
            pid = int(output.lines[restarted].split("(pid ", 1)[1].split(")", 1)[0])
            assert _service_pids(process.pid).get(name) == pid, f"pid {pid} does not run {name}"
            pids[name] = pid
            if url := _readyz(pid):
                await _wait_ready(url, 60)
            if name == "kwok":
                # the new KWOK is every node's kubelet at once, not once the dead one's leases
                # expire (--node-lease-duration-seconds=40 after their last renewal)
                back = time.monotonic()
                while len(holders := await lease_holders()) < nodes or set(holders.values()) & dead_holders:
                    assert time.monotonic() - back < 20, f"the restarted KWOK did not take the node leases: {holders}"
                    await asyncio.sleep(0.5)
            await coming
        kills_done = time.monotonic()

        # every pod bound (and Running: KWOK, killed last, came back too)
        waited = await ctl("wait", "pods", "-l", "app=chaos", "--for=condition=Ready", "--timeout=55s", check=False)
        pods = json.loads(await ctl("get", "pods", "-l", "app=chaos", "-o", "json"))["items"]
        claims = json.loads(await ctl("get", "resourceclaims", "-o", "json"))["items"]
        slices = json.loads(await ctl("get", "resourceslices", "-o", "json"))["items"]
        settled = time.monotonic()
        unbound = {p["metadata"]["name"]: p.get("status", {}).get("conditions") for p in pods
                   if not p["spec"].get("nodeName") or p.get("status", {}).get("phase") != "Running"}
        assert len(pods) == created == 2 + 3 * len(victims)
        assert not unbound, f"pods not bound and Running ({waited.strip()}): {unbound}\nup said:\n{output.text()}"

        claims_by_name = {c["metadata"]["name"]: c for c in claims}
        owned = set()
        for pod in pods:
            statuses = pod["status"].get("resourceClaimStatuses") or []
            templates = _CHAOS_KINDS[int(pod["metadata"]["name"].split("-")[1]) % len(_CHAOS_KINDS)]
            assert len(statuses) == len(templates), pod["status"]
            for status, template in zip(sorted(statuses, key=lambda s: s["name"]), templates):
                claim = claims_by_name[status["resourceClaimName"]]
                owned.add(claim["metadata"]["name"])
                allocation = claim["status"]["allocation"]
                assert [r["uid"] for r in claim["status"]["reservedFor"]] == [pod["metadata"]["uid"]], claim["status"]
                assert len(allocation["devices"]["results"]) == _CHAOS_GPUS[template], allocation
                terms = allocation["nodeSelector"]["nodeSelectorTerms"]
                assert terms[0]["matchFields"][0]["values"] == [pod["spec"]["nodeName"]], (allocation, pod["spec"])
        assert owned == set(claims_by_name), f"claims no pod of ours uses: {sorted(set(claims_by_name) - owned)}"
        devices = [(r["driver"], r["pool"], r["device"]) for c in claims
                   for r in c["status"]["allocation"]["devices"]["results"]]
        assert not [r for c in claims for r in c["status"]["allocation"]["devices"]["results"] if r.get("adminAccess")]
        assert len(devices) == len(set(devices)), f"devices given twice: {sorted({d for d in devices if devices.count(d) > 1})}"
        assert not _overbooked_counters(slices, claims)

        # up is still running and said who died, how, and that it came back; nothing else died
        assert process.returncode is None, f"up exited:\n{output.text()}"
        said = output.text()
        died = sorted(line.split("draplane up: ", 1)[1].split(" died", 1)[0] for line in output.lines if " died (" in line)
        assert died == sorted(victims), said
        for name in victims:
            assert f"draplane up: {name} died (killed by SIGKILL); restarting it in 1 s" in said
            assert f"draplane up: {name} restarted (pid " in said
        assert "cannot be kept alive" not in said
        logs = workdir / "logs" / "latest"
        # no pod went away, so no claim was ever deallocated (a binder once took an event older
        # than its own write for one, and released the reservation of an allocated claim)
        assert "allocation gone" not in (logs / "binder.log").read_text()
        # and nothing restarted spins: a service in a hot loop of errors fills its log
        big = {p.name: p.stat().st_size for p in logs.glob("*.log") if p.stat().st_size > 2 << 20}
        assert not big, f"logs that grew past 2 MiB: {big}"
        print(f"\nup ready in {up_at - started:.0f} s; {len(victims)} kills in {kills_done - up_at:.0f} s; "
              f"{created} pods bound {settled - kills_done:.0f} s after the last restart")
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGINT)
        await asyncio.wait_for(process.wait(), 60)
    assert process.returncode == 0, output.text()


def test_real_node_and_no_real_node_exclude_each_other():
    result = subprocess.run([sys.executable, "-m", "draplane.cli", "up", "--real-node", "--no-real-node"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--no-real-node: not allowed with argument --real-node" in result.stderr


async def test_a_real_node_asked_for_where_the_machine_cannot_run_one_names_what_is_missing(tmp_path, monkeypatch):
    from draplane.localenv import environment, realnode

    monkeypatch.setattr(realnode, "missing_prerequisites", lambda: ["root (the kubelet and containerd ...)"])
    with pytest.raises(realnode.RealNodeError, match=r"the real node cannot run here; missing: root \(the kubelet"):
        await environment.start(node_count=1, shards=1, workdir=tmp_path / "up", progress=lambda m: None, real_node=True)
    assert not (tmp_path / "up" / "up.json").exists()
    # where it is not required, `up` goes on without one and says why
    messages: list[str] = []
    env = await environment.start(node_count=1, shards=1, workdir=tmp_path / "up", progress=messages.append)
    try:
        assert env.real_node is None and env.real_node_absent.startswith("this machine cannot run one; missing: root")
        assert any(m.startswith("no real node: this machine cannot run one") for m in messages)
    finally:
        await asyncio.to_thread(env.stop)


async def test_a_real_node_that_fails_to_start_leaves_the_simulated_cluster_up_unless_required(tmp_path, monkeypatch):
    """A machine that seems able to run the real node but cannot (a cgroup layout the kubelet
    refuses, say): by default `up` says why and goes on without it; `--real-node` makes it an error."""
    from draplane.localenv import environment, realnode

    monkeypatch.setattr(realnode, "missing_prerequisites", lambda: [])

    def fails(**kwargs):
        raise realnode.RealNodeError("kubelet exited with code 1 while starting (log: kubelet.log): cgroup refused")

    monkeypatch.setattr(realnode.RealNode, "start", staticmethod(fails))
    with pytest.raises(realnode.RealNodeError, match="cgroup refused"):
        await environment.start(node_count=1, shards=1, workdir=tmp_path / "required", progress=lambda m: None,
                                real_node=True)
    assert not (tmp_path / "required" / "up.json").exists()
    messages: list[str] = []
    env = await environment.start(node_count=1, shards=1, workdir=tmp_path / "auto", progress=messages.append)
    try:
        assert env.real_node is None and "cgroup refused" in env.real_node_absent
        assert any(m.startswith("no real node: it did not start:") and "--real-node` makes this an error" in m
                   for m in messages), messages
        assert "node-agent-real" not in {s.name for s in env.services}
        for workdir in (tmp_path / "required", tmp_path / "auto"):  # the folders made for it went too
            assert not environment.real_node_dir(workdir).exists() and not (workdir / "real-node").exists()
        assert sum(len(n) for n in env.nodes.values()) == 1
    finally:
        await asyncio.to_thread(env.stop)

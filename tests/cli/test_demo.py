"""`draplane demo` as a user runs it, plus its input checks."""

import asyncio
import os
import re
import subprocess
import sys
import time

import pytest

from draplane.api import core, resource
from draplane.api.meta import ObjectMeta
from draplane.cli.demo import DemoError, load_objects, running_up_kubeconfig
# imported here, not in the async test: the first import of the Kubernetes client reads the file
# system (sysconfig), which blockbuster refuses inside a running event loop
from draplane.kube import KubeClient
from draplane.localenv import environment


def _demo(*args, env_extra=None, timeout=150):
    env = dict(os.environ, **(env_extra or {}))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "draplane.cli", "demo", *args], capture_output=True, text=True,
                            timeout=timeout, env=env)
    print(f"draplane demo {' '.join(args)}: exit {result.returncode} in {time.monotonic() - started:.1f}s")
    return result


def test_a_missing_seed_folder_is_one_line_and_exit_2(tmp_path):
    result = _demo(f"--seed-dir={tmp_path / 'nowhere'}", env_extra={"DRAPLANE_STATE": str(tmp_path)})
    assert result.returncode == 2
    assert result.stderr.startswith(f"draplane demo: cannot read {tmp_path / 'nowhere' / 'deviceclass.yaml'}")
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_seed_files_that_are_not_objects_are_named(tmp_path):
    for name in ("deviceclass.yaml", "resourceclaim.yaml", "pod.yaml"):
        (tmp_path / name).write_text("kind: Pod\nmetadata: {name: p}\n")
    with pytest.raises(DemoError, match="no DeviceClass, ResourceClaim among"):
        load_objects(tmp_path)
    (tmp_path / "pod.yaml").write_text("- just\n- a list\n")
    with pytest.raises(DemoError, match=r"pod.yaml: expected one Kubernetes object"):
        load_objects(tmp_path)
    (tmp_path / "pod.yaml").write_text("kind: [unclosed\n")
    with pytest.raises(DemoError, match=r"pod.yaml: not valid YAML"):
        load_objects(tmp_path)


def test_a_running_up_is_found_only_while_its_process_lives(tmp_path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\n")
    assert running_up_kubeconfig(tmp_path) is None
    (tmp_path / "up.json").write_text(f'{{"pid": {os.getpid()}, "kubeconfig": "{kubeconfig}"}}')
    assert running_up_kubeconfig(tmp_path) == kubeconfig
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "up.json").write_text(f'{{"pid": {dead.pid}, "kubeconfig": "{kubeconfig}"}}')
    assert running_up_kubeconfig(tmp_path) is None
    (tmp_path / "up.json").write_text("not json")
    assert running_up_kubeconfig(tmp_path) is None


def _check_story(output: str) -> dict:
    # 1. lint: the two problems and their fixes
    assert "spec.selectors[0].cel.expression: Invalid value" in output
    assert 'fix: device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))' in output
    assert "spec.devices.requests[0]: Unknown field" in output and "fix: move them under exactly:" in output
    assert "2 problems in 2 of 3 objects" in output
    # 2. the apiserver's own verdict on the verbatim files, then the corrected ones applied
    assert "verbatim DeviceClass high-memory-gpu, dry run: kube-apiserver says REJECTED (422 Invalid)" in output
    assert "verbatim ResourceClaim vllm-gpu-claim, dry run: kube-apiserver says REJECTED (400" in output
    assert "corrected ResourceClaim default/vllm-gpu-claim: created" in output
    # 3. node, device, reasons, score, time
    node = re.search(r"^\s+node\s+(dgx-h100-\d+)", output, re.M)
    device = re.search(r"^\s+device\s+gpu\.nvidia\.com/(dgx-h100-\d+)/(gpu-\d+)\s+\(NVIDIA H100 80GB HBM3, memory 79.6Gi\)", output, re.M)
    assert node and device and device.group(1) == node.group(1), output
    assert "high-memory-gpu matched the device" in output
    score = re.search(r"^\s+score\s+(\d\.\d{3}), lowest wins; next best \d\.\d{3} on mixed-0000", output, re.M)
    assert score, output
    assert re.search(r"a100-mig\s+a100-mig-0000\s+40Gi\s+0/\d+\s+NoDeviceMatchesClass", output)
    assert re.search(r"l4\s+l4-0000\s+22.5Gi\s+0/\d+\s+NoDeviceMatchesClass", output)
    bound = re.search(r"create -> bound\s+(\d+\.\d\d)s", output)
    assert bound and 0 < float(bound.group(1)) < 60
    return {"node": node.group(1), "device": device.group(2), "score": score.group(1), "bound_s": float(bound.group(1))}


@pytest.mark.integration
def test_demo_with_its_own_environment_tells_the_whole_story_and_stops_it(tmp_path):
    started = time.monotonic()
    result = _demo("--fresh", f"--workdir={tmp_path / 'demo'}",
                   env_extra={"DRAPLANE_STATE": str(tmp_path)})
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    _check_story(result.stdout)
    assert "No `draplane up` is running: starting the demo's own environment" in result.stdout
    # The pod runs: on the real node (where this machine can run one; CI installs what it needs),
    # the busybox stand-in prints the one GPU it was given, by name and uuid.
    from draplane.localenv.realnode import missing_prerequisites

    if not missing_prerequisites():
        step = result.stdout.split("4. The pod runs, on the real node", 1)[1]
        assert "bound to real-0000" in step and "Running" in step, step
        devices = [line.split("device: ", 1)[1] for line in step.splitlines() if line.strip().startswith("device: ")]
        uuids = [line for line in step.splitlines() if line.strip().startswith("uuid: GPU-")]
        assert len(devices) == 1 and len(uuids) == 1, step
        assert "DRAPLANE_DEVICE_GPU_NVIDIA_COM_" in step
    assert "Stopping the demo's environment (--keep leaves it up until Ctrl-C)" in result.stdout
    assert not (tmp_path / "demo" / "up.json").exists()
    print(f"demo with its own environment: {elapsed:.1f}s")


@pytest.mark.integration
async def test_demo_on_a_running_environment_leaves_objects_and_runs_twice(tmp_path):
    """The `draplane up` case: the objects stay for kubectl, and a second demo replaces the first's."""

    started = time.monotonic()
    # No real node: the last step counts the GPUs over 40Gi of the simulated nodes.
    env = await environment.start(node_count=4, workdir=tmp_path / "up", progress=lambda m: None, real_node=False)
    print(f"environment up in {time.monotonic() - started:.1f}s")
    try:
        extra = {"DRAPLANE_STATE": str(tmp_path / "elsewhere")}
        first = await asyncio.to_thread(_demo, f"--kubeconfig={env.kubeconfig}", env_extra=extra)
        assert first.returncode == 0, first.stdout + first.stderr
        story = _check_story(first.stdout)
        assert "Stopping" not in first.stdout
        assert "This environment has no real node" in first.stdout
        async with await KubeClient.from_kubeconfig(env.kubeconfig) as kube:
            pod = await kube.get(core.Pod, "vllm-inference", "default")
            claim = await kube.get(resource.ResourceClaim, "vllm-gpu-claim", "default")
        assert pod.spec.node_name == story["node"]
        assert claim.status.allocation.devices.results[0].device == story["device"]
        assert claim.status.reserved_for[0].name == "vllm-inference"

        second = await asyncio.to_thread(_demo, f"--kubeconfig={env.kubeconfig}", env_extra=extra)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "removing the previous demo's Pod and ResourceClaim in default" in second.stdout
        again = _check_story(second.stdout)
        # The first claim's GPU was freed before the second was placed: no GPU is taken twice, and
        # the score (which counts free GPUs) is what the first run saw.
        assert (again["node"], again["score"]) == (story["node"], story["score"])

        # Every GPU over 40Gi taken by someone else: the demo ends with the scheduler's reason, exit 1.
        async with await KubeClient.from_kubeconfig(env.kubeconfig) as kube:
            await kube.create_namespace("others")
            await kube.create(resource.ResourceClaimTemplate(
                metadata=ObjectMeta(name="big-gpu", namespace="others"),
                spec=resource.ResourceClaimTemplateSpec(spec=resource.ResourceClaimSpec(devices=resource.DeviceClaim(requests=[
                    resource.DeviceRequest(name="gpu", exactly=resource.ExactDeviceRequest(device_class_name="high-memory-gpu")),
                ]))),
            ))
            for i in range(10):  # 8 on the dgx-h100 node, 2 on the mixed one; the demo's own is freed first
                await kube.create(core.Pod(
                    metadata=ObjectMeta(name=f"taker-{i}", namespace="others"),
                    spec=core.PodSpec(
                        containers=[core.Container(name="c", image="busybox",
                                                   resources=core.ResourceRequirements(claims=[core.ResourceClaimRef(name="gpu")]))],
                        resource_claims=[core.PodResourceClaim(name="gpu", resource_claim_template_name="big-gpu")],
                    ),
                ))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the 9 GPUs not the demo's are taken before it runs
                pods, _ = await kube.list(core.Pod, "others")
                if sum(bool(p.spec.node_name) for p in pods) == 9:
                    break
                await asyncio.sleep(0.3)
            else:
                raise AssertionError("the takers were not bound")
        third = await asyncio.to_thread(_demo, f"--kubeconfig={env.kubeconfig}", "--timeout=5", env_extra=extra)
        assert third.returncode == 1, third.stdout + third.stderr
        assert "Traceback" not in third.stderr
        assert third.stderr.startswith("draplane demo: Pod default/vllm-inference was not bound within 5s: Unschedulable:"), third.stderr
    except AssertionError:
        # CI keeps only what the test prints
        await asyncio.to_thread(_print_scheduling_logs, tmp_path / "up" / "logs" / "latest")
        raise
    finally:
        await asyncio.to_thread(env.stop)


def _print_scheduling_logs(logs, lines: int = 80) -> None:
    """The end of the binder's and the shards' logs: who placed which pod, and why one was not."""
    for path in sorted([logs / "binder.log", *logs.glob("allocator-*.log")]):
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            print(f"--- {path}: not readable ({exc})")
            continue
        print(f"--- the last {len(tail)} lines of {path}")
        print("\n".join(tail))


def test_nodes_whose_pools_are_missing_or_incomplete_are_unsettled():
    from draplane.api.core import Node
    from draplane.api.meta import ObjectMeta
    from draplane.api.resource import ResourcePool, ResourceSlice, ResourceSliceSpec, Device
    from draplane.cli.demo import unsettled_nodes

    def slice_(name, node, count):
        return ResourceSlice(metadata=ObjectMeta(name=name), spec=ResourceSliceSpec(
            driver="gpu.nvidia.com", pool=ResourcePool(name=node, generation=1, resource_slice_count=count),
            node_name=node, devices=[Device(name=f"{name}-gpu")]))

    nodes = [Node(metadata=ObjectMeta(name=n)) for n in ("a", "b", "c")]
    slices = [slice_("a-0", "a", 1), slice_("b-0", "b", 2)]
    assert unsettled_nodes(slices, nodes) == ["b", "c"]
    assert unsettled_nodes([*slices, slice_("b-1", "b", 2), slice_("c-0", "c", 1)], nodes) == []


def test_the_real_node_copies_keep_the_request_and_stand_in_busybox():
    from draplane.cli.demo import fixed_dir, load_objects, real_node_copies

    fixed = load_objects(fixed_dir())
    claim, pod = fixed["ResourceClaim"], fixed["Pod"]
    real_claim, real_pod = real_node_copies(claim, pod)
    assert real_claim["spec"] == claim["spec"]
    assert real_claim["metadata"]["name"] == claim["metadata"]["name"] + "-on-real-node"
    assert real_pod["spec"]["resourceClaims"][0]["resourceClaimName"] == real_claim["metadata"]["name"]
    assert real_pod["spec"]["nodeSelector"] == {"draplane.dev/real-node": "true"}
    (container,) = real_pod["spec"]["containers"]
    assert container["image"] == "busybox" and container["resources"] == pod["spec"]["containers"][0]["resources"]
    assert "/var/run/draplane/devices" in container["command"][-1]
    assert pod["spec"]["containers"][0]["image"].startswith("vllm/")  # the originals are untouched

"""kube-scheduler, built with the other Kubernetes binaries, runs against the local control plane
and allocates DRA claims as the comparison with draplane needs."""

import asyncio
import json
import time
import uuid

import pytest

from draplane.api.core import Node, Pod, Toleration
from draplane.api.resource import ResourceClaim
from draplane.localenv import binaries
from draplane.localenv.kubescheduler import kube_scheduler, scheduler_configuration
from draplane.simulation import scenario


def test_configuration_is_one_instance_with_the_given_client_limits(tmp_path):
    config = scheduler_configuration(tmp_path / "kubeconfig", qps=5000, burst=5000)
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["clientConnection"] == {"kubeconfig": str(tmp_path / "kubeconfig"), "qps": 5000, "burst": 5000}
    json.dumps(config)  # written as JSON, which --config reads as YAML


@pytest.mark.integration
async def test_kube_scheduler_allocates_a_template_claim_and_binds_the_pod(control_plane, kube, namespace, tmp_path):
    tag = uuid.uuid4().hex[:6]
    node = f"ks-{tag}"
    # a product only this test's devices have: other tests' nodes in the session never match
    product = f"ks-test-{tag}"
    await kube.create(scenario.gpu_node(node))
    # The apiserver's not-ready taint (no kubelet) replaced by one only this test's pod tolerates:
    # left untainted, kube-scheduler gave its two GPUs to other tests' pending default-scheduler
    # pods first (CI: two seed-example vllm pods bound there, the test's pod unschedulable).
    only_this_test = {"key": "draplane.test/kube-scheduler", "value": tag, "effect": "NoSchedule"}
    await kube.patch(Node, node, {"spec": {"taints": [only_this_test]}})
    await kube.create(scenario.gpu_slice(node, 2, "80Gi", product=product))
    class_name = f"ks-{tag}"
    await kube.create(scenario.device_class(class_name, f'device.attributes["gpu.nvidia.com"].productName == "{product}"'))
    await kube.create(scenario.claim_template(namespace, "one-gpu", class_name))
    # no schedulerName: the default, kube-scheduler's; draplane's services would not take it
    pod = scenario.pod(namespace, "p", template_name="one-gpu", scheduler_name=None)
    pod.spec.tolerations = [Toleration(key=only_this_test["key"], operator="Equal", value=tag, effect="NoSchedule")]
    await kube.create(pod)

    scheduler = kube_scheduler(control_plane, tmp_path / "kube-scheduler.log", verbosity=2)
    assert scheduler.argv[0] == str(binaries.require(binaries.KUBE_SCHEDULER))
    scheduler.start()
    try:
        # generous: in the full suite kube-scheduler first lists every node, slice and pod the
        # session's other tests left (CI once took over 45 s on a loaded 2-core machine)
        deadline = time.monotonic() + 120
        while True:
            pod = await kube.get(Pod, "p", namespace)
            claims, _ = await kube.list(ResourceClaim, namespace)
            if pod.spec.node_name and claims and claims[0].status and claims[0].status.allocation:
                break
            assert scheduler.alive(), scheduler.log_tail()
            assert time.monotonic() < deadline, (
                f"not scheduled in 120 s; pod conditions {pod.status.conditions if pod.status else None}; "
                f"claims {[c.metadata.name for c in claims]}:\n{scheduler.log_tail()}"
            )
            await asyncio.sleep(0.2)
    finally:
        scheduler.stop()
    assert pod.spec.node_name == node
    results = claims[0].status.allocation.devices.results
    assert [(r.driver, r.pool, r.request) for r in results] == [("gpu.nvidia.com", node, "gpu")]
    assert results[0].device in ("gpu-0", "gpu-1")
    assert [ref.name for ref in claims[0].status.reserved_for] == ["p"]

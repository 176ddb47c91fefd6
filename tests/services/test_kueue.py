"""Kueue in front of draplane: a Job with device claims that Kueue holds is left alone, and placed
by draplane once Kueue admits it.

Kueue v0.17.0 runs as its own manager on the local cluster (draplane.localenv.kueue: built from
its Go module, its CRDs and configuration as its release installs them, less the webhooks that
only a pod network reaches). Everything the user does goes through kubectl.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from draplane.localenv.kueue import API_VERSION, Kueue
from draplane.simulation import scenario
from conftest import ensure_class  # noqa: E402  (tests/services/conftest.py)
from test_user_flows import one_gpu_template_yaml

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def kueue(control_plane, tmp_path_factory):
    manager = Kueue(control_plane, tmp_path_factory.mktemp("kueue"))
    manager.start()
    yield manager
    manager.stop()


def queue_yaml(namespace: str, tag: str, cpu: str) -> str:
    return f"""
apiVersion: {API_VERSION}
kind: ResourceFlavor
metadata: {{name: default-{tag}}}
---
apiVersion: {API_VERSION}
kind: ClusterQueue
metadata: {{name: team-{tag}}}
spec:
  namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: {namespace}}}}}
  resourceGroups:
    - coveredResources: [cpu]
      flavors:
        - name: default-{tag}
          resources: [{{name: cpu, nominalQuota: "{cpu}"}}]
---
apiVersion: {API_VERSION}
kind: LocalQueue
metadata: {{name: team, namespace: {namespace}}}
spec: {{clusterQueue: team-{tag}}}
"""


def job_yaml(namespace: str, scheduler: str, class_name: str) -> str:
    """Two pods of one GPU each (a claim template), queued in `team`; suspended, as Kueue's
    webhook would make it."""
    return one_gpu_template_yaml(namespace, class_name) + f"""---
apiVersion: batch/v1
kind: Job
metadata:
  name: train
  namespace: {namespace}
  labels: {{kueue.x-k8s.io/queue-name: team}}
spec:
  suspend: true
  parallelism: 2
  completions: 2
  template:
    spec:
      schedulerName: {scheduler}
      restartPolicy: Never
      containers:
        - name: trainer
          image: registry.k8s.io/pause:3.10
          resources: {{requests: {{cpu: 500m}}, claims: [{{name: gpu}}]}}
      resourceClaims:
        - name: gpu
          resourceClaimTemplateName: one-gpu
"""


async def get_json(kubectl, *args: str) -> dict:
    return json.loads(await kubectl("get", *args, "-o", "json"))


def condition(obj: dict, kind: str) -> dict | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == kind), None)


async def test_a_job_kueue_holds_is_left_alone_and_placed_with_its_claims_once_admitted(
        scheduling, kube, kubectl, namespace, kueue):
    tag = uuid.uuid4().hex[:6]
    class_name = f"gpu-{tag}"
    await ensure_class(kube, scenario.device_class(class_name))
    nodes = [f"kueue-{i}-{tag}" for i in range(2)]
    for node in nodes:
        await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 1, "80Gi")])
    await scheduling.start(shards=1)
    # no CPU quota yet: Kueue keeps the Job suspended
    await kubectl.apply(queue_yaml(namespace, tag, cpu="0") + "---" + job_yaml(namespace, scheduling.scheduler_name,
                                                                              class_name))
    try:
        async def workload_pending():
            items = (await get_json(kubectl, "workloads.kueue.x-k8s.io", "-n", namespace))["items"]
            reserved = condition(items[0], "QuotaReserved") if items else None
            return items[0] if reserved is not None and reserved["status"] == "False" else None

        workload = await scheduling.wait_for(workload_pending, 30, "Kueue's Workload for the Job, without quota")
        assert "insufficient" in condition(workload, "QuotaReserved")["message"].lower(), workload["status"]
        await asyncio.sleep(3)
        job = await get_json(kubectl, "job", "train", "-n", namespace)
        assert job["spec"]["suspend"] is True
        assert not (await get_json(kubectl, "pods", "-n", namespace))["items"]
        assert scheduling.binder.counters["pods_bound"] == 0

        # quota for both pods: Kueue admits the Job, the Job controller makes its pods, draplane places them
        await kubectl("patch", "clusterqueue", f"team-{tag}", "--type=json", "-p", json.dumps([
            {"op": "replace", "path": "/spec/resourceGroups/0/flavors/0/resources/0/nominalQuota", "value": "1"}]))

        async def both_bound():
            pods = (await get_json(kubectl, "pods", "-n", namespace, "-l", "job-name=train"))["items"]
            bound = [p for p in pods if p["spec"].get("nodeName")]
            return bound if len(bound) == 2 else None

        pods = await scheduling.wait_for(both_bound, 60, "the admitted Job's two pods bound")
        assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(nodes)  # one GPU per node
        claims = {c["metadata"]["name"]: c for c in (await get_json(kubectl, "resourceclaims", "-n", namespace))["items"]}
        for pod in pods:
            (status,) = pod["status"]["resourceClaimStatuses"]
            results = claims[status["resourceClaimName"]]["status"]["allocation"]["devices"]["results"]
            assert [r["pool"] for r in results] == [pod["spec"]["nodeName"]]
        workload = (await get_json(kubectl, "workloads.kueue.x-k8s.io", "-n", namespace))["items"][0]
        assert condition(workload, "Admitted")["status"] == "True"
        assert (await get_json(kubectl, "job", "train", "-n", namespace))["spec"]["suspend"] is False
    finally:
        await kubectl("delete", "job", "train", "-n", namespace, "--ignore-not-found", "--wait=false")
        await kubectl("delete", "clusterqueue", f"team-{tag}", "--ignore-not-found", "--wait=false")
        await kubectl("delete", "resourceflavor", f"default-{tag}", "--ignore-not-found", "--wait=false")

"""A new user's first claims, applied with the real kubectl, through the binder and the shards.

Each flow is what a developer types: a ResourceClaim or ResourceClaimTemplate and a Pod in YAML,
`kubectl apply`, then `kubectl get` until the pod is bound or explained. The nodes and their
ResourceSlices are the cluster's (put in place as the inventory service would); everything the
user touches goes through kubectl and the apiserver judges it.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid

import pytest

from draplane.api.core import Node
from draplane.api.meta import ObjectMeta
from draplane.api.resource import (
    CELDeviceSelector,
    Device,
    DeviceAttribute,
    DeviceClass,
    DeviceClassSpec,
    DeviceSelector,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)
from draplane.cli import explain
from draplane.simulation import scenario
from conftest import ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration

NIC_DRIVER = "nic.example.com"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"


def nic_slice(node: str, nics: int) -> ResourceSlice:
    """One NIC per PCIe root, where gpu_slice puts two GPUs per root."""
    devices = [Device(name=f"nic-{i}", attributes={PCIE_ROOT: DeviceAttribute(string_value=f"pci0000:{i:02x}")})
               for i in range(nics)]
    return ResourceSlice(
        metadata=ObjectMeta(name=f"{node}-{NIC_DRIVER}"),
        spec=ResourceSliceSpec(driver=NIC_DRIVER, pool=ResourcePool(name=node, generation=1, resource_slice_count=1),
                               node_name=node, devices=devices),
    )


def pod_yaml(namespace: str, name: str, scheduler: str, claim: str | None = None, template: str | None = None,
             cpu: str | None = None, node_selector: dict | None = None) -> str:
    source = f"resourceClaimName: {claim}" if claim else f"resourceClaimTemplateName: {template}"
    requests = f"\n        requests: {{cpu: \"{cpu}\"}}" if cpu else ""
    selector = f"\n  nodeSelector: {json.dumps(node_selector)}" if node_selector else ""
    return f"""
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  schedulerName: {scheduler}{selector}
  containers:
    - name: main
      image: registry.k8s.io/pause:3.10
      resources:
        claims: [{{name: devices}}]{requests}
  resourceClaims:
    - name: devices
      {source}
"""


def claim_yaml(namespace: str, name: str, class_name: str, count: int = 1, extra: str = "") -> str:
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  devices:
    requests:
      - name: gpus
        exactly:
          deviceClassName: {class_name}
          count: {count}{extra}
"""


def one_gpu_template_yaml(namespace: str, class_name: str) -> str:
    """A ResourceClaimTemplate `one-gpu`: one device of the class for each pod."""
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: one-gpu, namespace: {namespace}}}
spec:
  spec:
    devices:
      requests:
        - name: gpus
          exactly: {{deviceClassName: {class_name}}}
"""


def deployment_yaml(namespace: str, name: str, scheduler: str, replicas: int, constraints: str) -> str:
    """A Deployment of pause pods labelled app=<name>, one GPU each from `one-gpu`; `constraints`
    is YAML for the pod spec (affinity, topologySpreadConstraints), indented by 6."""
    return f"""
apiVersion: apps/v1
kind: Deployment
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata: {{labels: {{app: {name}}}}}
    spec:
      schedulerName: {scheduler}
{constraints.rstrip()}
      containers:
        - name: server
          image: registry.k8s.io/pause:3.10
          resources: {{claims: [{{name: gpu}}]}}
      resourceClaims:
        - name: gpu
          resourceClaimTemplateName: one-gpu
"""


async def get_json(kubectl, *args: str) -> dict:
    return json.loads(await kubectl("get", *args, "-o", "json"))


async def wait_bound(scheduling, kubectl, namespace: str, pod: str, timeout: float = 45.0) -> dict:
    async def bound():
        got = await get_json(kubectl, "pod", pod, "-n", namespace)
        return got if got["spec"].get("nodeName") else None

    return await scheduling.wait_for(bound, timeout, f"pod {namespace}/{pod} bound (kubectl get)")


async def wait_unschedulable(scheduling, kubectl, namespace: str, pod: str, contains: str = "",
                             timeout: float = 45.0) -> str:
    async def explained():
        got = await get_json(kubectl, "pod", pod, "-n", namespace)
        assert not got["spec"].get("nodeName"), f"pod {pod} was bound to {got['spec']['nodeName']}"
        for condition in got.get("status", {}).get("conditions", []):
            if condition["type"] == "PodScheduled" and condition["status"] == "False" and contains in condition["message"]:
                return condition["message"]
        return None

    return await scheduling.wait_for(explained, timeout, f"pod {namespace}/{pod} unschedulable saying {contains!r}")


async def claim_results(kubectl, namespace: str, claim: str) -> list[dict]:
    got = await get_json(kubectl, "resourceclaim", claim, "-n", namespace)
    return got["status"]["allocation"]["devices"]["results"]


async def gpu_cluster(scheduling, kube, *, nodes: int = 1, gpus: int = 8, nics: int = 0, cpu: str = "64",
                      labels=None) -> tuple[str, list[str]]:
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    names = []
    for i in range(nodes):
        name = f"user-{i}-{uuid.uuid4().hex[:6]}"
        slices = [scenario.gpu_slice(name, gpus, "80Gi")] + ([nic_slice(name, nics)] if nics else [])
        await scheduling.put_node(scenario.gpu_node(name, cpu=cpu, labels=(labels or {}).get(i)), slices)
        names.append(name)
    return class_name, names


def no_races_or_errors(scheduling) -> None:
    for shard in scheduling.shards:
        assert shard.counters["errors"] == 0, shard.counters
    assert scheduling.binder.counters["errors"] == 0, scheduling.binder.counters


@pytest.mark.parametrize("shards", [1, 2])
async def test_a_claim_for_two_gpus_binds(scheduling, kube, kubectl, namespace, shards):
    class_name, (node,) = await gpu_cluster(scheduling, kube)
    await scheduling.start(shards=shards)
    await kubectl.apply(claim_yaml(namespace, "two-gpus", class_name, count=2)
                        + "---" + pod_yaml(namespace, "trainer", scheduling.scheduler_name, claim="two-gpus"))
    pod = await wait_bound(scheduling, kubectl, namespace, "trainer")
    assert pod["spec"]["nodeName"] == node
    results = await claim_results(kubectl, namespace, "two-gpus")
    assert len({r["device"] for r in results}) == 2 and all(r["pool"] == node for r in results)
    claim = await get_json(kubectl, "resourceclaim", "two-gpus", "-n", namespace)
    assert [c["name"] for c in claim["status"]["reservedFor"]] == ["trainer"]

    async def scheduled_event():
        events = await get_json(kubectl, "events", "-n", namespace, "--field-selector", "involvedObject.name=trainer")
        return [e for e in events["items"] if e["reason"] == "Scheduled"]

    (event,) = await scheduling.wait_for(scheduled_event, 10, "the Scheduled event")
    assert event["type"] == "Normal" and event["message"] == f"Successfully assigned {namespace}/trainer to {node}"
    no_races_or_errors(scheduling)


async def test_two_gpus_and_a_nic_under_one_pcie_root_from_a_template(scheduling, kube, kubectl, namespace):
    class_name, (node,) = await gpu_cluster(scheduling, kube, nics=4)
    nic_class = f"nic-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, DeviceClass(metadata=ObjectMeta(name=nic_class), spec=DeviceClassSpec(
        selectors=[DeviceSelector(cel=CELDeviceSelector(expression=f'device.driver == "{NIC_DRIVER}"'))])))
    await scheduling.start(shards=1)
    template = f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: gpus-and-nic, namespace: {namespace}}}
spec:
  spec:
    devices:
      requests:
        - name: gpus
          exactly: {{deviceClassName: {class_name}, count: 2}}
        - name: nic
          exactly: {{deviceClassName: {nic_class}}}
      constraints:
        - requests: [gpus, nic]
          matchAttribute: {PCIE_ROOT}
"""
    await kubectl.apply(template + "---" + pod_yaml(namespace, "rdma", scheduling.scheduler_name, template="gpus-and-nic"))
    pod = await wait_bound(scheduling, kubectl, namespace, "rdma")
    claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    results = await claim_results(kubectl, namespace, claim_name)
    assert sorted(r["request"] for r in results) == ["gpus", "gpus", "nic"]
    slices = {s.metadata.name: s for s in (await kube.list(ResourceSlice))[0] if s.spec.node_name == node}
    roots = set()
    for r in results:
        (device,) = [d for s in slices.values() if s.spec.driver == r["driver"] for d in s.spec.devices
                     if d.name == r["device"]]
        roots.add(device.attributes[PCIE_ROOT].string_value)
    assert len(roots) == 1, results
    no_races_or_errors(scheduling)


async def test_admin_access_on_a_busy_device_and_an_ordinary_claim_beside_it(scheduling, kube, kubectl, namespace):
    class_name, (node,) = await gpu_cluster(scheduling, kube, gpus=1)
    await kubectl("label", "namespace", namespace, "resource.kubernetes.io/admin-access=true")
    await scheduling.start(shards=2)
    admin = "\n          adminAccess: true"
    # An admin watches the only GPU first; an ordinary user still gets it; a second admin watches
    # it while it is in use.
    await kubectl.apply(claim_yaml(namespace, "monitor", class_name, extra=admin)
                        + "---" + pod_yaml(namespace, "monitor", scheduling.scheduler_name, claim="monitor"))
    await wait_bound(scheduling, kubectl, namespace, "monitor")
    await kubectl.apply(claim_yaml(namespace, "work", class_name)
                        + "---" + pod_yaml(namespace, "work", scheduling.scheduler_name, claim="work"))
    await wait_bound(scheduling, kubectl, namespace, "work")
    await kubectl.apply(claim_yaml(namespace, "debug", class_name, extra=admin)
                        + "---" + pod_yaml(namespace, "debug", scheduling.scheduler_name, claim="debug"))
    await wait_bound(scheduling, kubectl, namespace, "debug")
    for claim, admin_access in (("monitor", True), ("work", None), ("debug", True)):
        (result,) = await claim_results(kubectl, namespace, claim)
        assert (result["pool"], result["device"], result.get("adminAccess")) == (node, "gpu-0", admin_access)
    # and a second ordinary user does not get it
    await kubectl.apply(claim_yaml(namespace, "more", class_name)
                        + "---" + pod_yaml(namespace, "more", scheduling.scheduler_name, claim="more"))
    await wait_unschedulable(scheduling, kubectl, namespace, "more", "too few matching devices are free")
    no_races_or_errors(scheduling)


async def test_a_device_taint_rule_keeps_untolerating_claims_off_until_it_is_deleted(scheduling, kube, kubectl,
                                                                                      namespace):
    class_name, (node,) = await gpu_cluster(scheduling, kube, gpus=2)
    await scheduling.start(shards=1)
    rule = f"maintenance-{namespace[-6:]}"
    await kubectl.apply(f"""
apiVersion: resource.k8s.io/v1
kind: DeviceTaintRule
metadata: {{name: {rule}}}
spec:
  deviceSelector: {{driver: {scenario.GPU_DRIVER}, pool: {node}}}
  taint: {{key: example.com/maintenance, value: planned, effect: NoSchedule}}
""")
    try:
        await kubectl.apply(claim_yaml(namespace, "plain", class_name)
                            + "---" + pod_yaml(namespace, "plain", scheduling.scheduler_name, claim="plain"))
        message = await wait_unschedulable(scheduling, kubectl, namespace, "plain", "taints")
        assert "resourceclaim " + namespace + "/plain" in message
        tolerating = "\n          tolerations: [{key: example.com/maintenance, operator: Exists}]"
        await kubectl.apply(claim_yaml(namespace, "tolerant", class_name, extra=tolerating)
                            + "---" + pod_yaml(namespace, "tolerant", scheduling.scheduler_name, claim="tolerant"))
        pod = await wait_bound(scheduling, kubectl, namespace, "tolerant")
        assert pod["spec"]["nodeName"] == node
        events = await get_json(kubectl, "events", "-n", namespace, "--field-selector", "involvedObject.name=plain")
        assert any(e["reason"] == "FailedScheduling" and "taints" in e["message"] for e in events["items"])
    finally:
        await kubectl("delete", "devicetaintrule", rule, "--ignore-not-found")
    await wait_bound(scheduling, kubectl, namespace, "plain")
    no_races_or_errors(scheduling)


async def test_nine_gpus_on_eight_gpu_nodes_is_not_enough_devices(scheduling, kube, kubectl, namespace):
    class_name, _ = await gpu_cluster(scheduling, kube, nodes=2)
    await scheduling.start(shards=1)
    await kubectl.apply(claim_yaml(namespace, "nine", class_name, count=9)
                        + "---" + pod_yaml(namespace, "big", scheduling.scheduler_name, claim="nine"))
    message = await wait_unschedulable(scheduling, kubectl, namespace, "big", "not enough devices")
    total = len((await kube.list(Node))[0])
    assert message.startswith(f"0/{total} nodes are available: ")
    assert f"2 cannot allocate all claims: resourceclaim {namespace}/nine, request gpus: not enough devices" in message
    assert "no device matches" not in message
    described = await kubectl("describe", "pod", "big", "-n", namespace)
    assert "FailedScheduling" in described and "not enough devices" in described
    no_races_or_errors(scheduling)


async def test_a_second_cpu_bound_pod_gets_kube_schedulers_reasons(scheduling, kube, kubectl, namespace):
    pool = f"big-{namespace[-6:]}"
    class_name, names = await gpu_cluster(scheduling, kube, nodes=4, labels={0: {"pool": pool}})
    await scheduling.start(shards=1)
    for name in ("first", "second"):
        await kubectl.apply(claim_yaml(namespace, name, class_name) + "---"
                            + pod_yaml(namespace, name, scheduling.scheduler_name, claim=name, cpu="40",
                                       node_selector={"pool": pool}))
        if name == "first":
            assert (await wait_bound(scheduling, kubectl, namespace, "first"))["spec"]["nodeName"] == names[0]
    message = await wait_unschedulable(scheduling, kubectl, namespace, "second", "Insufficient cpu")
    # Nodes other tests of the session left behind (not ready, say) are counted too, each under
    # its own first failing filter, as kube-scheduler counts them.
    total = len((await kube.list(Node))[0])
    head, _, counted = message.partition(": ")
    assert head == f"0/{total} nodes are available" and counted.endswith("."), message
    counts = {reason: int(n) for n, reason in re.findall(r"(\d+) ([^,]+?)(?:, |\.$)", counted)}
    assert sum(counts.values()) == total, counts
    assert counts["Insufficient cpu"] == 1, counts
    assert counts["node(s) didn't match Pod's node affinity/selector"] >= 3, counts
    assert sorted(counted.rstrip(".").split(", ")) == counted.rstrip(".").split(", ")  # kube-scheduler's order
    if total == 4:
        assert message == ("0/4 nodes are available: 1 Insufficient cpu, "
                           "3 node(s) didn't match Pod's node affinity/selector.")
    no_races_or_errors(scheduling)


@pytest.mark.parametrize("shards", [1, 3])
async def test_a_gated_pod_is_left_alone_until_its_last_gate_is_removed(scheduling, kube, kubectl, namespace, shards):
    """Kueue's way: the pod is created with a scheduling gate and admitted later by removing it.
    kube-scheduler never tries a gated pod (and the apiserver refuses to bind one)."""
    class_name, (node,) = await gpu_cluster(scheduling, kube, gpus=2)
    await scheduling.start(shards=shards)
    template = one_gpu_template_yaml(namespace, class_name)
    gated = pod_yaml(namespace, "gated", scheduling.scheduler_name, template="one-gpu").replace(
        "spec:\n", "spec:\n  schedulingGates: [{name: example.com/quota}, {name: kueue.x-k8s.io/admission}]\n", 1)
    await kubectl.apply(template + "---" + gated)

    async def claim_of_gated():
        got = await get_json(kubectl, "pod", "gated", "-n", namespace)
        statuses = got.get("status", {}).get("resourceClaimStatuses") or []
        return statuses[0].get("resourceClaimName") if statuses else None

    # kube-controller-manager makes the claim of a gated pod too; placing it is what waits
    gated_claim = await scheduling.wait_for(claim_of_gated, 30, "the gated pod's claim made from its template")
    # a pod applied after it is published, placed and bound: the queue went past the gated one
    await kubectl.apply(pod_yaml(namespace, "after", scheduling.scheduler_name, template="one-gpu"))
    await wait_bound(scheduling, kubectl, namespace, "after")
    await asyncio.sleep(3.0)  # room for a late attempt, which must not come
    pod = await get_json(kubectl, "pod", "gated", "-n", namespace)
    assert not pod["spec"].get("nodeName")
    (condition,) = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert (condition["status"], condition["reason"]) == ("False", "SchedulingGated"), condition
    claim = await get_json(kubectl, "resourceclaim", gated_claim, "-n", namespace)
    assert not claim.get("status", {}).get("allocation"), claim["status"]
    assert scheduling.binder.counters["pending_published"] == 1, scheduling.binder.counters
    events = await get_json(kubectl, "events", "-n", namespace, "--field-selector", "involvedObject.name=gated")
    assert [e["reason"] for e in events["items"]] == [], events["items"]

    # one gate removed: still held
    await kubectl("patch", "pod", "gated", "-n", namespace, "--type=json",
                  "-p", '[{"op": "remove", "path": "/spec/schedulingGates/0"}]')
    await asyncio.sleep(2.0)
    assert not (await get_json(kubectl, "pod", "gated", "-n", namespace))["spec"].get("nodeName")
    assert scheduling.binder.counters["pending_published"] == 1, scheduling.binder.counters
    # the last gate removed: placed on the GPU left
    await kubectl("patch", "pod", "gated", "-n", namespace, "--type=json",
                  "-p", '[{"op": "remove", "path": "/spec/schedulingGates"}]')
    pod = await wait_bound(scheduling, kubectl, namespace, "gated")
    assert pod["spec"]["nodeName"] == node
    (result,) = await claim_results(kubectl, namespace, gated_claim)
    (other,) = await claim_results(kubectl, namespace,
                                   (await get_json(kubectl, "pod", "after", "-n", namespace))["status"]
                                   ["resourceClaimStatuses"][0]["resourceClaimName"])
    assert {result["device"], other["device"]} == {"gpu-0", "gpu-1"}
    no_races_or_errors(scheduling)



@pytest.mark.parametrize("shards", [1, 3])
async def test_a_pod_that_restarts_all_its_containers_waits_for_a_node_that_declares_the_feature(
        scheduling, kube, kubectl, namespace, shards):
    """A container restart rule that restarts all containers (beta in 1.37) needs a kubelet that
    declares RestartAllContainersOnContainerExits in the node's status.declaredFeatures
    (NodeDeclaredFeatures, GA in 1.37). No node declares it: the pod waits with kube-scheduler's
    reason, its claim for two GPUs unallocated. Once one node's kubelet declares it, the pod binds
    there with both GPUs of that node."""
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=3)
    await scheduling.start(shards=shards)
    pod = pod_yaml(namespace, "restarter", scheduling.scheduler_name, claim="two-gpus").replace(
        "        claims: [{name: devices}]",
        "        claims: [{name: devices}]\n"
        "      restartPolicy: Never\n"
        "      restartPolicyRules: [{action: RestartAllContainers, exitCodes: {operator: In, values: [42]}}]")
    await kubectl.apply(claim_yaml(namespace, "two-gpus", class_name, count=2) + "---" + pod.replace(
        "spec:\n  schedulerName", "spec:\n  restartPolicy: Never\n  schedulerName", 1))
    message = await wait_unschedulable(scheduling, kubectl, namespace, "restarter", "required features")
    # the suite's other tests' nodes are tainted away from this one's pods
    assert re.search(r"nodes are available: (.*, )?3 node\(s\) didn't match Pod's required features", message), message
    claims = (await get_json(kubectl, "resourceclaims", "-n", namespace))["items"]
    assert claims and not any(c.get("status", {}).get("allocation") for c in claims)

    # the kubelet of the last node says it supports the feature
    await kubectl("patch", "node", nodes[2], "--subresource=status", "--type=merge", "-p",
                  json.dumps({"status": {"declaredFeatures": ["RestartAllContainersOnContainerExits"]}}))
    bound = await wait_bound(scheduling, kubectl, namespace, "restarter")
    assert bound["spec"]["nodeName"] == nodes[2]
    results = await claim_results(kubectl, namespace, "two-gpus")
    assert len({r["device"] for r in results}) == 2 and all(r["pool"] == nodes[2] for r in results)
    no_races_or_errors(scheduling)


@pytest.mark.parametrize("shards", [1, 3])
async def test_pods_that_ask_for_one_host_port_never_share_a_node(scheduling, kube, kubectl, namespace, shards):
    """Three replicas with hostPort 8080 and a GPU each, applied at once, on two 8-GPU nodes: two
    bind, on different nodes, whichever shards place them; the third waits with kube-scheduler's
    NodePorts reason. It binds once one of the others is deleted."""
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=2)
    await scheduling.start(shards=shards)
    template = one_gpu_template_yaml(namespace, class_name)
    replicas = [pod_yaml(namespace, f"web-{i}", scheduling.scheduler_name, template="one-gpu").replace(
        "        claims: [{name: devices}]",
        "        claims: [{name: devices}]\n      ports: [{containerPort: 80, hostPort: 8080}]") for i in range(3)]
    await kubectl.apply("---".join([template] + replicas))

    async def two_bound_one_waiting():
        pods = (await get_json(kubectl, "pods", "-n", namespace))["items"]
        bound = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName")}
        waiting = [c["message"] for p in pods if not p["spec"].get("nodeName")
                   for c in p.get("status", {}).get("conditions", []) if c["type"] == "PodScheduled"
                   and c["status"] == "False" and "free ports" in c["message"]]
        return (bound, waiting) if len(bound) == 2 and waiting else None

    bound, (message,) = await scheduling.wait_for(two_bound_one_waiting, 45, "two replicas bound, one waiting")
    assert sorted(bound.values()) == sorted(nodes), bound
    assert "2 node(s) didn't have free ports for the requested pod ports" in message, message
    (waiting,) = {"web-0", "web-1", "web-2"} - set(bound)
    # no kubelet here to finish a graceful delete: gone at once, as a kubelet would make it
    await kubectl("delete", "pod", sorted(bound)[0], "-n", namespace, "--grace-period=0", "--force")
    pod = await wait_bound(scheduling, kubectl, namespace, waiting)
    assert pod["spec"]["nodeName"] == bound[sorted(bound)[0]]
    no_races_or_errors(scheduling)


@pytest.mark.parametrize("shards", [1, 3])
async def test_a_deployment_with_hostname_anti_affinity_puts_each_replica_on_its_own_node(
        scheduling, kube, kubectl, namespace, shards):
    """The inference Deployment's usual shape: 3 replicas, one GPU each, required podAntiAffinity on
    kubernetes.io/hostname, on 3 nodes of 8 GPUs (each could take all three). kube-scheduler puts
    them on 3 nodes; so must draplane, with 3 shards placing at once. A fourth replica waits with
    kube-scheduler's InterPodAffinity reason."""
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=3)
    await scheduling.start(shards=shards)
    anti_affinity = """
      affinity:
        podAntiAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            - topologyKey: kubernetes.io/hostname
              labelSelector: {matchLabels: {app: llm}}
"""
    await kubectl.apply(one_gpu_template_yaml(namespace, class_name) + "---"
                        + deployment_yaml(namespace, "llm", scheduling.scheduler_name, 3, anti_affinity))

    async def replicas_bound(count: int):
        pods = (await get_json(kubectl, "pods", "-n", namespace, "-l", "app=llm"))["items"]
        bound = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName")}
        return bound if len(bound) == count else None

    bound = await scheduling.wait_for(lambda: replicas_bound(3), 60, "3 replicas bound")
    assert sorted(bound.values()) == sorted(nodes), bound
    await kubectl("scale", "deployment", "llm", "-n", namespace, "--replicas=4")

    async def fourth_waits():
        pods = (await get_json(kubectl, "pods", "-n", namespace, "-l", "app=llm"))["items"]
        for p in pods:
            if p["spec"].get("nodeName"):
                continue
            for c in p.get("status", {}).get("conditions", []):
                if c["type"] == "PodScheduled" and c["status"] == "False" and "anti-affinity" in c["message"]:
                    return c["message"]
        return None

    message = await scheduling.wait_for(fourth_waits, 45, "the fourth replica unschedulable")
    assert "3 node(s) didn't match pod anti-affinity rules" in message, message
    assert await replicas_bound(3), "the fourth replica was bound"
    no_races_or_errors(scheduling)


@pytest.mark.parametrize("shards", [1, 3])
async def test_topology_spread_keeps_replicas_within_max_skew_over_zones(scheduling, kube, kubectl, namespace, shards):
    """5 one-GPU replicas spread over zones with maxSkew 1 (DoNotSchedule): zone a has two 8-GPU
    nodes, zone b one; busy-first packing alone would put them all on one node. 3 and 2, or
    2 and 3, never 4 and 1; a node without the zone label takes none."""
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=4,
                                          labels={0: {"zone": "a"}, 1: {"zone": "a"}, 2: {"zone": "b"}})
    zone_of = {nodes[0]: "a", nodes[1]: "a", nodes[2]: "b"}  # nodes[3] has no zone
    await scheduling.start(shards=shards)
    spread = """
      topologySpreadConstraints:
        - maxSkew: 1
          topologyKey: zone
          whenUnsatisfiable: DoNotSchedule
          labelSelector: {matchLabels: {app: spread}}
"""
    await kubectl.apply(one_gpu_template_yaml(namespace, class_name) + "---"
                        + deployment_yaml(namespace, "spread", scheduling.scheduler_name, 5, spread))

    async def all_bound():
        pods = (await get_json(kubectl, "pods", "-n", namespace, "-l", "app=spread"))["items"]
        bound = [p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName")]
        return bound if len(bound) == 5 else None

    bound = await scheduling.wait_for(all_bound, 60, "5 replicas bound")
    assert all(node in zone_of for node in bound), f"a replica on the node without a zone: {bound}"
    per_zone = {z: sum(1 for n in bound if zone_of[n] == z) for z in ("a", "b")}
    assert sorted(per_zone.values()) == [2, 3], per_zone
    no_races_or_errors(scheduling)


@pytest.mark.parametrize("shards", [1, 2])
async def test_a_deployment_behind_a_service_spreads_over_nodes_by_kube_schedulers_default_constraints(
        scheduling, kube, kubectl, namespace, shards):
    """No constraint in the pod spec: kube-scheduler's default profile spreads the replicas of a
    ReplicaSet (and a Service's pods) over hostnames and zones, ScheduleAnyway. Busy-first packing
    alone would stack three two-GPU replicas on one 8-GPU node; draplane spreads them over three,
    as kube-scheduler does, each with both its GPUs there. Pods that nothing owns or selects still
    pack."""
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=3)
    await scheduling.start(shards=shards)
    service = f"""
apiVersion: v1
kind: Service
metadata: {{name: infer, namespace: {namespace}}}
spec:
  selector: {{app: infer}}
  ports: [{{port: 80, protocol: TCP}}]
"""
    two_gpus = one_gpu_template_yaml(namespace, class_name).replace("name: one-gpu", "name: two-gpus").replace(
        "exactly: {deviceClassName: " + class_name + "}", "exactly: {deviceClassName: " + class_name + ", count: 2}")
    deployment = deployment_yaml(namespace, "infer", scheduling.scheduler_name, 3, "").replace(
        "resourceClaimTemplateName: one-gpu", "resourceClaimTemplateName: two-gpus")
    await kubectl.apply("---".join([one_gpu_template_yaml(namespace, class_name), two_gpus, service, deployment]))

    async def replicas_bound():
        pods = (await get_json(kubectl, "pods", "-n", namespace, "-l", "app=infer"))["items"]
        bound = [p for p in pods if p["spec"].get("nodeName")]
        return bound if len(bound) == 3 else None

    replicas = await scheduling.wait_for(replicas_bound, 60, "3 replicas bound")
    assert sorted(p["spec"]["nodeName"] for p in replicas) == sorted(nodes), replicas
    for replica in replicas:
        (status,) = replica["status"]["resourceClaimStatuses"]
        results = await claim_results(kubectl, namespace, status["resourceClaimName"])
        assert [r["pool"] for r in results] == [replica["spec"]["nodeName"]] * 2, results
    # pods that nothing owns or selects pack where the devices are busiest
    await kubectl.apply(pod_yaml(namespace, "plain-0", scheduling.scheduler_name, template="one-gpu"))
    first = (await wait_bound(scheduling, kubectl, namespace, "plain-0"))["spec"]["nodeName"]
    await kubectl.apply(pod_yaml(namespace, "plain-1", scheduling.scheduler_name, template="one-gpu"))
    assert (await wait_bound(scheduling, kubectl, namespace, "plain-1"))["spec"]["nodeName"] == first
    no_races_or_errors(scheduling)


# --- volumes: kube-scheduler's VolumeBinding and the PV controller of kube-controller-manager ---------


async def explained(control_plane, namespace: str, pod: str) -> list[str]:
    """`draplane explain pod/<pod>`'s lines, over what the apiserver holds now."""
    snapshot = await explain.gather(control_plane.kubeconfig)
    return explain.explain_pod(snapshot, explain.find_target(snapshot, f"pod/{pod}", namespace))


def pod_with_volume_yaml(namespace: str, name: str, scheduler: str, claim: str) -> str:
    """A one-GPU pod (template `one-gpu`) that mounts the PersistentVolumeClaim `claim`."""
    return pod_yaml(namespace, name, scheduler, template="one-gpu").replace(
        "        claims: [{name: devices}]",
        "        claims: [{name: devices}]\n      volumeMounts: [{name: data, mountPath: /data}]"
    ) + f"""  volumes:
    - name: data
      persistentVolumeClaim: {{claimName: {claim}}}
"""


def local_volume_yaml(name: str, class_name: str, node: str | None, size: str = "1Gi",
                      claim_ref: dict | None = None) -> str:
    affinity = f"""
  nodeAffinity:
    required:
      nodeSelectorTerms:
        - matchExpressions: [{{key: kubernetes.io/hostname, operator: In, values: [{node}]}}]""" if node else ""
    ref = f"\n  claimRef: {json.dumps(claim_ref)}" if claim_ref else ""
    source = f"local: {{path: /mnt/{name}}}" if node else f"hostPath: {{path: /mnt/{name}}}"
    return f"""
apiVersion: v1
kind: PersistentVolume
metadata: {{name: {name}}}
spec:
  capacity: {{storage: {size}}}
  accessModes: [ReadWriteOnce]
  storageClassName: {class_name}
  persistentVolumeReclaimPolicy: Retain
  {source}{affinity}{ref}
"""


def volume_claim_yaml(namespace: str, name: str, class_name: str, size: str = "1Gi") -> str:
    return f"""
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: {class_name}
  resources: {{requests: {{storage: {size}}}}}
"""


def storage_class_yaml(name: str, provisioner: str, allowed_nodes: list[str] | None = None) -> str:
    topologies = f"""
allowedTopologies:
  - matchLabelExpressions: [{{key: kubernetes.io/hostname, values: {json.dumps(allowed_nodes)}}}]""" \
        if allowed_nodes else ""
    return f"""
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {{name: {name}}}
provisioner: {provisioner}
volumeBindingMode: WaitForFirstConsumer{topologies}
"""


async def wait_claim_bound(scheduling, kubectl, namespace: str, claim: str) -> dict:
    async def bound():
        got = await get_json(kubectl, "pvc", claim, "-n", namespace)
        return got if got.get("status", {}).get("phase") == "Bound" else None

    return await scheduling.wait_for(bound, 45, f"persistentvolumeclaim {namespace}/{claim} Bound")


@pytest.mark.parametrize("shards", [1, 3])
async def test_a_pod_whose_claim_is_bound_to_a_local_volume_lands_on_that_volumes_node(
        scheduling, kube, kubectl, namespace, shards):
    """A PersistentVolume on the third of three nodes, a claim the PV controller binds to it
    (immediate binding), and a GPU pod that mounts the claim, all applied at once: until the
    claim is bound the pod waits with kube-scheduler's message, then it lands on that node."""
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=3)
    await scheduling.start(shards=shards)
    storage = f"manual-{namespace[-8:]}"
    await kubectl.apply("---".join([
        one_gpu_template_yaml(namespace, class_name),
        local_volume_yaml(f"pv-{namespace[-8:]}", storage, nodes[2]),
        volume_claim_yaml(namespace, "data", storage),
        pod_with_volume_yaml(namespace, "trainer", scheduling.scheduler_name, "data"),
    ]))
    pod = await wait_bound(scheduling, kubectl, namespace, "trainer")
    assert pod["spec"]["nodeName"] == nodes[2]
    claim = await get_json(kubectl, "pvc", "data", "-n", namespace)
    assert claim["status"]["phase"] == "Bound" and claim["spec"]["volumeName"] == f"pv-{namespace[-8:]}"
    no_races_or_errors(scheduling)


@pytest.mark.parametrize("shards", [1, 3])
async def test_a_wait_for_first_consumer_claim_binds_the_local_volume_that_fits_on_the_chosen_node(
        scheduling, kube, kubectl, namespace, shards, control_plane):
    """A WaitForFirstConsumer class without a provisioner (local volumes): a 500Mi volume on one
    node and a 5Gi one on another; a pod whose claim asks for 2Gi goes where the 5Gi volume is,
    and draplane binds it there (claimRef), the PV controller completing the binding. A second
    pod asking for 100Gi, which no volume holds, waits with kube-scheduler's reason."""
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=3)
    await scheduling.start(shards=shards)
    tag = namespace[-8:]
    storage = f"local-{tag}"
    await kubectl.apply("---".join([
        storage_class_yaml(storage, "kubernetes.io/no-provisioner"),
        local_volume_yaml(f"small-{tag}", storage, nodes[0], size="500Mi"),
        local_volume_yaml(f"big-{tag}", storage, nodes[1], size="5Gi"),
        one_gpu_template_yaml(namespace, class_name),
        volume_claim_yaml(namespace, "data", storage, size="2Gi"),
        volume_claim_yaml(namespace, "huge", storage, size="100Gi"),
        pod_with_volume_yaml(namespace, "trainer", scheduling.scheduler_name, "data"),
        pod_with_volume_yaml(namespace, "hoarder", scheduling.scheduler_name, "huge"),
    ]))
    pod = await wait_bound(scheduling, kubectl, namespace, "trainer")
    assert pod["spec"]["nodeName"] == nodes[1]
    claim = await wait_claim_bound(scheduling, kubectl, namespace, "data")
    assert claim["spec"]["volumeName"] == f"big-{tag}"
    assert "volume.kubernetes.io/selected-node" not in claim["metadata"].get("annotations", {})
    message = await wait_unschedulable(scheduling, kubectl, namespace, "hoarder",
                                       "node(s) didn't find available persistent volumes to bind")
    # (nodes other tests of the session left behind count too, unless an earlier filter rejects them)
    counted = re.search(r"\b(\d+) node\(s\) didn't find available persistent volumes to bind", message)
    assert counted and int(counted.group(1)) >= 3, message
    lines = await explained(control_plane, namespace, "hoarder")
    assert not any("fits now" in line for line in lines), lines
    assert any("didn't find available persistent volumes to bind" in line for line in lines), lines
    no_races_or_errors(scheduling)


async def test_a_wait_for_first_consumer_claim_is_provisioned_on_the_chosen_node_before_the_pod_binds(
        scheduling, kube, kubectl, namespace):
    """A class with an (external) provisioner allowed on one node only: the claim gets
    `volume.kubernetes.io/selected-node` for that node and the pod stays unbound while the volume
    is made. This test is the provisioner: it creates the volume for the claim, the PV controller
    binds them, and the pod binds on that node."""
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=3)
    await scheduling.start(shards=1)
    tag = namespace[-8:]
    storage = f"provisioned-{tag}"
    await kubectl.apply("---".join([
        storage_class_yaml(storage, "example.com/test-provisioner", allowed_nodes=[nodes[1]]),
        one_gpu_template_yaml(namespace, class_name),
        volume_claim_yaml(namespace, "data", storage),
        pod_with_volume_yaml(namespace, "trainer", scheduling.scheduler_name, "data"),
    ]))

    async def selected():
        got = await get_json(kubectl, "pvc", "data", "-n", namespace)
        return got if got["metadata"].get("annotations", {}).get("volume.kubernetes.io/selected-node") else None

    claim = await scheduling.wait_for(selected, 45, "the claim's selected-node annotation")
    assert claim["metadata"]["annotations"]["volume.kubernetes.io/selected-node"] == nodes[1]
    await asyncio.sleep(2)
    assert not (await get_json(kubectl, "pod", "trainer", "-n", namespace))["spec"].get("nodeName"), \
        "the pod was bound before its volume exists"
    await kubectl.apply(local_volume_yaml(f"made-{tag}", storage, nodes[1], claim_ref={
        "kind": "PersistentVolumeClaim", "apiVersion": "v1", "namespace": namespace, "name": "data",
        "uid": claim["metadata"]["uid"]}))
    pod = await wait_bound(scheduling, kubectl, namespace, "trainer")
    assert pod["spec"]["nodeName"] == nodes[1]
    assert (await wait_claim_bound(scheduling, kubectl, namespace, "data"))["spec"]["volumeName"] == f"made-{tag}"
    no_races_or_errors(scheduling)


async def test_a_missing_claim_then_an_unbound_immediate_one_are_explained_until_a_volume_binds_it(
        scheduling, kube, kubectl, namespace, control_plane):
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=1)
    await scheduling.start(shards=1)
    tag = namespace[-8:]
    await kubectl.apply(one_gpu_template_yaml(namespace, class_name) + "---"
                        + pod_with_volume_yaml(namespace, "trainer", scheduling.scheduler_name, "data"))
    message = await wait_unschedulable(scheduling, kubectl, namespace, "trainer", 'persistentvolumeclaim "data" not found')
    assert re.fullmatch(r'0/\d+ nodes are available: persistentvolumeclaim "data" not found\.', message), message
    assert any(line.startswith('Cannot be scheduled yet: persistentvolumeclaim "data" not found')
               for line in await explained(control_plane, namespace, "trainer"))
    await kubectl.apply(volume_claim_yaml(namespace, "data", f"manual-{tag}"))
    message = await wait_unschedulable(scheduling, kubectl, namespace, "trainer", "unbound immediate")
    assert re.fullmatch(r"0/\d+ nodes are available: pod has unbound immediate PersistentVolumeClaims\.", message)
    await kubectl.apply(local_volume_yaml(f"pv-{tag}", f"manual-{tag}", nodes[0]))
    pod = await wait_bound(scheduling, kubectl, namespace, "trainer")
    assert pod["spec"]["nodeName"] == nodes[0]
    no_races_or_errors(scheduling)


async def test_an_allocation_error_ends_the_attempt_with_scheduler_error_and_the_pod_binds_once_it_clears(
        scheduling, kube, kubectl, namespace):
    """A claim for all GPUs of the class on a node whose pool is being updated (one of its two
    slices published): Kubernetes' allocator returns an error, and kube-scheduler's
    DynamicResources Filter ends the attempt with it (PodScheduled=False, SchedulerError), even
    though the other node fits. Once the pool is whole the pod binds."""
    class_name, (whole,) = await gpu_cluster(scheduling, kube, nodes=1, gpus=2)
    updating = f"user-updating-{uuid.uuid4().hex[:6]}"
    half = scenario.gpu_slice(updating, 2, "80Gi")
    half.spec.pool.resource_slice_count = 2
    await scheduling.put_node(scenario.gpu_node(updating), [half])
    await scheduling.start(shards=1)
    await kubectl.apply(claim_yaml(namespace, "all", class_name).replace("count: 1", "allocationMode: All") + "---"
                        + pod_yaml(namespace, "p", scheduling.scheduler_name, claim="all"))

    async def errored():
        got = await get_json(kubectl, "pod", "p", "-n", namespace)
        assert not got["spec"].get("nodeName"), f"bound to {got['spec']['nodeName']}"
        return next((c for c in got.get("status", {}).get("conditions", [])
                     if c["type"] == "PodScheduled" and c.get("reason") == "SchedulerError"), None)

    condition = await scheduling.wait_for(errored, 45, "PodScheduled=False with reason SchedulerError")
    assert condition["message"].startswith('running "DynamicResources" filter plugin: '), condition
    assert "is currently being updated" in condition["message"], condition
    # the inventory publishes the pool whole (a new generation of one slice)
    await scheduling.put_node(scenario.gpu_node(updating), [scenario.gpu_slice(updating, 2, "80Gi", generation=2)])
    pod = await wait_bound(scheduling, kubectl, namespace, "p")
    assert pod["spec"]["nodeName"] in (whole, updating)
    no_races_or_errors(scheduling)


# --- binding conditions: devices that must be attached before the pod may bind ------------------------

ATTACHED, ATTACH_FAILED = "dra.example.com/attached", "dra.example.com/attach-failed"


async def attachable_gpus_node(scheduling, kube) -> tuple[str, str]:
    """One node whose two GPUs must be attached first (bindingConditions), and their class."""
    class_name, _ = await gpu_cluster(scheduling, kube, nodes=0)
    name = f"user-attach-{uuid.uuid4().hex[:6]}"
    gpus = scenario.gpu_slice(name, 2, "80Gi")
    for device in gpus.spec.devices:
        device.binding_conditions = [ATTACHED]
        device.binding_failure_conditions = [ATTACH_FAILED]
    await scheduling.put_node(scenario.gpu_node(name), [gpus])
    return class_name, name


async def set_device_condition(kubectl, namespace: str, claim: str, condition: str) -> None:
    """What the device's driver does once it attached it: a condition in the claim's status.devices."""
    got = await get_json(kubectl, "resourceclaim", claim, "-n", namespace)
    (result,) = got["status"]["allocation"]["devices"]["results"]
    status = {"devices": [{"driver": result["driver"], "pool": result["pool"], "device": result["device"],
                           "conditions": [{"type": condition, "status": "True", "reason": "Attached",
                                           "message": "attached by the test", "lastTransitionTime":
                                           "2026-01-01T00:00:00Z"}]}]}
    await kubectl("patch", "resourceclaim", claim, "-n", namespace, "--subresource=status", "--type=merge",
                  "-p", json.dumps({"status": status}))


async def test_a_device_with_a_binding_condition_keeps_the_pod_unbound_until_the_condition_holds(
        scheduling, kube, kubectl, namespace):
    """The wait gives up its placement slot: with one slot, a pod that needs no device binds
    meanwhile."""
    class_name, node = await attachable_gpus_node(scheduling, kube)
    await scheduling.start(shards=1, concurrency=1)
    await kubectl.apply(claim_yaml(namespace, "gpu", class_name) + "---"
                        + pod_yaml(namespace, "p", scheduling.scheduler_name, claim="gpu"))

    async def allocated():
        got = await get_json(kubectl, "resourceclaim", "gpu", "-n", namespace)
        return got if got.get("status", {}).get("allocation") else None

    claim = await scheduling.wait_for(allocated, 45, "the claim allocated")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["bindingConditions"] == [ATTACHED] and claim["status"]["allocation"]["allocationTimestamp"]
    await asyncio.sleep(3)
    assert not (await get_json(kubectl, "pod", "p", "-n", namespace))["spec"].get("nodeName"), \
        "bound before its device was attached"
    events = await get_json(kubectl, "events", "-n", namespace, "--field-selector", "reason=BindingConditionsPending")
    assert [e["message"] for e in events["items"]] == [f"waiting for binding conditions for device on node {node}"]
    await kubectl.apply(f"""
apiVersion: v1
kind: Pod
metadata: {{name: plain, namespace: {namespace}}}
spec:
  schedulerName: {scheduling.scheduler_name}
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  containers: [{{name: main, image: registry.k8s.io/pause:3.10}}]
""")
    await wait_bound(scheduling, kubectl, namespace, "plain", timeout=20)
    assert not (await get_json(kubectl, "pod", "p", "-n", namespace))["spec"].get("nodeName")
    await set_device_condition(kubectl, namespace, "gpu", ATTACHED)
    pod = await wait_bound(scheduling, kubectl, namespace, "p")
    assert pod["spec"]["nodeName"] == node
    no_races_or_errors(scheduling)


async def test_a_device_whose_binding_condition_never_holds_is_given_back_after_the_timeout(
        scheduling, kube, kubectl, namespace):
    """With a 4 s binding timeout: the attempt fails with kube-scheduler's error, the claim is
    deallocated (so the next attempt may pick other devices) and the pod tried again; a failure
    condition ends the wait at once the same way."""
    class_name, node = await attachable_gpus_node(scheduling, kube)
    await scheduling.start(shards=1, binding_timeout_seconds=4.0)
    await kubectl.apply(claim_yaml(namespace, "gpu", class_name) + "---"
                        + pod_yaml(namespace, "p", scheduling.scheduler_name, claim="gpu"))
    first = await wait_unschedulable(scheduling, kubectl, namespace, "p", "device binding timeout", timeout=30)
    assert first == 'running PreBind plugin "DynamicResources": device binding timeout: claim=gpu', first
    stamps = set()

    async def allocated_again():
        got = await get_json(kubectl, "resourceclaim", "gpu", "-n", namespace)
        allocation = got.get("status", {}).get("allocation")
        if allocation:
            stamps.add(allocation["allocationTimestamp"])
        return len(stamps) >= 2 or None

    await scheduling.wait_for(allocated_again, 30, "the claim deallocated and allocated again by a new attempt")
    assert not (await get_json(kubectl, "pod", "p", "-n", namespace))["spec"].get("nodeName")

    async def attach_failed():
        # the claim comes and goes with each attempt: report the failure while it is allocated
        try:
            await set_device_condition(kubectl, namespace, "gpu", ATTACH_FAILED)
        except (AssertionError, KeyError, RuntimeError, TypeError):
            return None
        return True

    await scheduling.wait_for(attach_failed, 30, "the attach failure reported on an allocated claim", interval=0.5)
    await wait_unschedulable(scheduling, kubectl, namespace, "p", "device binding failed: claim=gpu, reason=Attached",
                             timeout=30)
    assert scheduling.binder.counters["pods_bound"] == 0


async def test_a_read_write_once_pod_claim_in_use_keeps_a_second_pod_waiting_until_the_first_goes(
        scheduling, kube, kubectl, namespace):
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=2)
    await scheduling.start(shards=1)
    tag = namespace[-8:]
    storage = f"manual-{tag}"
    await kubectl.apply("---".join([
        one_gpu_template_yaml(namespace, class_name),
        local_volume_yaml(f"pv-{tag}", storage, None).replace("[ReadWriteOnce]", "[ReadWriteOncePod]"),
        volume_claim_yaml(namespace, "data", storage).replace("[ReadWriteOnce]", "[ReadWriteOncePod]"),
        pod_with_volume_yaml(namespace, "first", scheduling.scheduler_name, "data"),
    ]))
    await wait_bound(scheduling, kubectl, namespace, "first")
    await kubectl.apply(pod_with_volume_yaml(namespace, "second", scheduling.scheduler_name, "data"))
    message = await wait_unschedulable(scheduling, kubectl, namespace, "second", "ReadWriteOncePod")
    # every node fails it (nodes other tests of the session left behind too, unless an earlier filter rejects them)
    counted = re.search(r"\b(\d+) node\(s\) unavailable due to PersistentVolumeClaim with ReadWriteOncePod access "
                        r"mode already in-use by another pod\b", message)
    assert counted and int(counted.group(1)) >= 2, message
    await kubectl("delete", "pod", "first", "-n", namespace, "--grace-period=0", "--force")
    await wait_bound(scheduling, kubectl, namespace, "second")
    no_races_or_errors(scheduling)


def csi_storage_yaml(driver: str, nodes: dict[str, int], volumes: int, storage: str) -> list[str]:
    """A CSIDriver that keeps its volumes' pods off nodes that do not register it, a CSINode per
    node registering it with that attach limit, and CSI volumes of class `storage` (no
    StorageClass: the PV controller binds their claims at once)."""
    docs = [f"""
apiVersion: storage.k8s.io/v1
kind: CSIDriver
metadata: {{name: {driver}}}
spec: {{attachRequired: true, preventPodSchedulingIfMissing: true}}
"""]
    docs += [f"""
apiVersion: storage.k8s.io/v1
kind: CSINode
metadata: {{name: {node}}}
spec:
  drivers: [{{name: {driver}, nodeID: {node}, allocatable: {{count: {count}}}}}]
""" for node, count in nodes.items()]
    docs += [f"""
apiVersion: v1
kind: PersistentVolume
metadata: {{name: {storage}-{i}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  storageClassName: {storage}
  persistentVolumeReclaimPolicy: Retain
  csi: {{driver: {driver}, volumeHandle: vol-{i}}}
""" for i in range(volumes)]
    return docs


async def test_csi_attach_limits_from_csinodes_keep_a_pod_off_full_nodes_until_a_volume_goes(
        scheduling, kube, kubectl, namespace, control_plane):
    """NodeVolumeLimits: two nodes whose CSINodes allow one volume of a driver each (the nodes of
    other tests register no such driver, which its CSIDriver requires). Three pods with a CSI
    volume each: the first two bind on different nodes, the third waits with kube-scheduler's
    reason (and `draplane explain` says it) until the first pod is deleted, then binds on its node."""
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=2)
    await scheduling.start(shards=1)
    tag = namespace[-8:]
    driver, storage = f"block-{tag}.csi.example.com", f"csi-{tag}"
    await kubectl.apply("---".join([
        *csi_storage_yaml(driver, {node: 1 for node in nodes}, 3, storage),
        one_gpu_template_yaml(namespace, class_name),
        *(volume_claim_yaml(namespace, f"data-{i}", storage) for i in range(3)),
    ]))
    await kubectl.apply(pod_with_volume_yaml(namespace, "first", scheduling.scheduler_name, "data-0"))
    first = (await wait_bound(scheduling, kubectl, namespace, "first"))["spec"]["nodeName"]
    await kubectl.apply(pod_with_volume_yaml(namespace, "second", scheduling.scheduler_name, "data-1"))
    second = (await wait_bound(scheduling, kubectl, namespace, "second"))["spec"]["nodeName"]
    assert {first, second} == set(nodes)
    await kubectl.apply(pod_with_volume_yaml(namespace, "third", scheduling.scheduler_name, "data-2"))
    message = await wait_unschedulable(scheduling, kubectl, namespace, "third", "exceed max volume count")
    assert re.search(r"\b2 node\(s\) exceed max volume count\b", message), message
    lines = await explained(control_plane, namespace, "third")
    assert any("exceed max volume count" in line for line in lines), lines
    await kubectl("delete", "pod", "first", "-n", namespace, "--grace-period=0", "--force")
    third = await wait_bound(scheduling, kubectl, namespace, "third")
    assert third["spec"]["nodeName"] == first
    no_races_or_errors(scheduling)


async def test_two_pods_placed_at_once_on_a_node_with_room_for_one_volume_bind_one(
        scheduling, kube, kubectl, namespace):
    """Both pods are published before either is bound, so the shard may place both on the node;
    PreBind checks the limit again, counting the pod it is binding there, and turns the second back
    to wait with kube-scheduler's reason."""
    class_name, (node,) = await gpu_cluster(scheduling, kube, nodes=1)
    await scheduling.start(shards=1)
    tag = namespace[-8:]
    driver, storage = f"block-{tag}.csi.example.com", f"csi-{tag}"
    await kubectl.apply("---".join([
        *csi_storage_yaml(driver, {node: 1}, 2, storage),
        one_gpu_template_yaml(namespace, class_name),
        *(volume_claim_yaml(namespace, f"data-{i}", storage) for i in range(2)),
    ]))
    for i in range(2):
        await wait_claim_bound(scheduling, kubectl, namespace, f"data-{i}")
    await kubectl.apply("---".join(pod_with_volume_yaml(namespace, f"p{i}", scheduling.scheduler_name, f"data-{i}")
                                   for i in range(2)))

    async def one_bound_one_refused():
        pods = (await get_json(kubectl, "pods", "-n", namespace))["items"]
        bound = [p for p in pods if p["spec"].get("nodeName")]
        refused = [p for p in pods if any(c["type"] == "PodScheduled" and c["status"] == "False"
                                          and "exceed max volume count" in c["message"]
                                          for c in p.get("status", {}).get("conditions", []))]
        return len(bound) == 1 and len(refused) == 1 and (bound, refused)

    bound, _ = await scheduling.wait_for(one_bound_one_refused, 45, "one pod bound, the other over the limit")
    await asyncio.sleep(2)
    assert sum(bool(p["spec"].get("nodeName"))
               for p in (await get_json(kubectl, "pods", "-n", namespace))["items"]) == 1
    no_races_or_errors(scheduling)


# --- extended resources backed by DRA (KEP-5004) ----------------------------------------------------


def device_plugin_style_pod_yaml(namespace: str, name: str, scheduler: str, resources: dict[str, int]) -> str:
    """A pod that asks for devices the device-plugin way: extended resources in requests and limits."""
    amounts = json.dumps({r: str(n) for r, n in resources.items()})
    return f"""
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  schedulerName: {scheduler}
  initContainers:
    - name: warm-up
      image: registry.k8s.io/pause:3.10
      resources: {{requests: {amounts}, limits: {amounts}}}
  containers:
    - name: server
      image: registry.k8s.io/pause:3.10
      resources: {{requests: {amounts}, limits: {amounts}}}
"""


async def test_a_device_plugin_style_gpu_request_binds_on_dra_devices_through_a_claim_made_for_the_pod(
        scheduling, kube, kubectl, namespace, control_plane):
    """`example.com/gpu-<tag>: 2` in a pod's requests and limits, a DeviceClass whose
    extendedResourceName names it, and no node with it in allocatable: the pod gets a claim of its
    own for 2 devices, the mapping in status.extendedResourceClaimStatus, and binds; the init
    container reuses the server's request. The implicit name deviceclass.resource.kubernetes.io/
    <class> works the same. Deleting the pod frees the devices."""
    class_name, (node,) = await gpu_cluster(scheduling, kube, nodes=1, gpus=3)
    resource = f"example.com/gpu-{namespace[-8:]}"
    await kubectl("patch", "deviceclass", class_name, "--type=merge", "-p",
                  json.dumps({"spec": {"extendedResourceName": resource}}))
    await scheduling.start(shards=1)
    await kubectl.apply(device_plugin_style_pod_yaml(namespace, "trainer", scheduling.scheduler_name, {resource: 2}))
    pod = await wait_bound(scheduling, kubectl, namespace, "trainer")
    assert pod["spec"]["nodeName"] == node
    status = pod["status"]["extendedResourceClaimStatus"]
    claim_name = status["resourceClaimName"]
    assert claim_name.startswith("trainer-extended-resources-")
    assert sorted(status["requestMappings"], key=lambda m: m["containerName"]) == [
        {"containerName": "server", "resourceName": resource, "requestName": "container-1-request-0"},
        {"containerName": "warm-up", "resourceName": resource, "requestName": "container-1-request-0"},
    ]
    claim = await get_json(kubectl, "resourceclaim", claim_name, "-n", namespace)
    assert claim["metadata"]["annotations"]["resource.kubernetes.io/extended-resource-claim"] == "true"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 2 and {r["request"] for r in results} == {"container-1-request-0"}
    # the implicit name, for the third GPU: the first pod's two are taken
    implicit = f"deviceclass.resource.kubernetes.io/{class_name}"
    await kubectl.apply(device_plugin_style_pod_yaml(namespace, "notebook", scheduling.scheduler_name, {implicit: 1}))
    assert (await wait_bound(scheduling, kubectl, namespace, "notebook"))["spec"]["nodeName"] == node
    await kubectl.apply(device_plugin_style_pod_yaml(namespace, "late", scheduling.scheduler_name, {resource: 1}))
    await wait_unschedulable(scheduling, kubectl, namespace, "late", "cannot allocate all claims")
    lines = await explained(control_plane, namespace, "late")
    assert not any("Insufficient" in line for line in lines) and any("not enough" in line or "too few" in line
                                                                    for line in lines), lines
    # the devices come back with the pod's deletion: its claim goes with it
    await kubectl("delete", "pod", "trainer", "-n", namespace, "--grace-period=0", "--force")
    assert (await wait_bound(scheduling, kubectl, namespace, "late"))["spec"]["nodeName"] == node
    no_races_or_errors(scheduling)


async def profile_node(scheduling, kube, profile: str, name: str) -> None:
    """A node of one of the node agent's profiles, its slices planned as the inventory plans them."""
    from draplane.api.core import Node as NodeObject
    from draplane.nodes.slices import NodeRef, plan_node
    from draplane.nodes.hardware import driver_devices
    from draplane.nodes.profile import load_profile, profile_hardware

    node = scenario.gpu_node(name)
    await kube.create(node)
    uid = (await kube.get(NodeObject, name)).metadata.uid
    drivers = driver_devices(profile_hardware(load_profile(profile), name))
    slices = [s for plan in plan_node(NodeRef(name, uid), drivers, []) for s in plan.creates]
    await scheduling.put_node(node, slices)


async def test_generic_claims_leave_the_gpus_only_some_classes_can_use_to_those_classes(scheduling, kube, kubectl,
                                                                                      namespace):
    """Issue 27, items 13 and 14, on the nodes of `draplane up --nodes 6` (2 L4, 2 A100 nodes whose
    GPUs MIG can split, a DGX H100, a mixed node of 2 H100, 2 A100 and 2 L4), with a generic GPU
    class, a high-memory class only the H100s meet and a MIG class: an 8-GPU generic claim takes an
    A100 node, not the only 8 x H100, which the high-memory claim after it still finds whole; on the
    mixed node, with one A100 partitioned, a generic 1-GPU claim takes an L4, not an H100."""
    from draplane.localenv.environment import DEFAULT_PROFILES, node_names

    suffix = uuid.uuid4().hex[:6]
    generic, high_memory, mig = f"any-gpu-{suffix}", f"high-memory-{suffix}", f"mig-{suffix}"
    await ensure_class(kube, scenario.device_class(generic, "device.attributes['gpu.nvidia.com'].type == 'gpu'"))
    await ensure_class(kube, scenario.device_class(high_memory, scenario.HIGH_MEMORY_EXPRESSION))
    await ensure_class(kube, scenario.device_class(mig, "device.attributes['gpu.nvidia.com'].type == 'mig'"))
    for profile, names in node_names(DEFAULT_PROFILES, 6).items():
        for name in names:
            await profile_node(scheduling, kube, profile, f"{name}-{suffix}")
    dgx, mixed = f"dgx-h100-0000-{suffix}", f"mixed-0000-{suffix}"
    await scheduling.start(shards=1)
    scheduler = scheduling.scheduler_name

    await kubectl.apply(claim_yaml(namespace, "eight", generic, count=8)
                        + "---" + pod_yaml(namespace, "trainer", scheduler, claim="eight"))
    assert (await wait_bound(scheduling, kubectl, namespace, "trainer"))["spec"]["nodeName"].startswith("a100-mig-")
    await kubectl.apply(claim_yaml(namespace, "eight-big", high_memory, count=8)
                        + "---" + pod_yaml(namespace, "big-trainer", scheduler, claim="eight-big"))
    assert (await wait_bound(scheduling, kubectl, namespace, "big-trainer"))["spec"]["nodeName"] == dgx

    on_mixed = {"kubernetes.io/hostname": mixed}
    await kubectl.apply(
        claim_yaml(namespace, "slice", mig, extra="""
          selectors:
            - cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'"}""")
        + "---" + pod_yaml(namespace, "notebook", scheduler, claim="slice", node_selector=on_mixed))
    assert (await wait_bound(scheduling, kubectl, namespace, "notebook"))["spec"]["nodeName"] == mixed
    await kubectl.apply(claim_yaml(namespace, "one", generic)
                        + "---" + pod_yaml(namespace, "inference", scheduler, claim="one", node_selector=on_mixed))
    assert (await wait_bound(scheduling, kubectl, namespace, "inference"))["spec"]["nodeName"] == mixed
    (result,) = await claim_results(kubectl, namespace, "one")
    slices = [s for s in (await kube.list(ResourceSlice))[0] if s.spec.node_name == mixed]
    (device,) = [d for s in slices for d in s.spec.devices or () if d.name == result["device"]]
    assert device.attributes["productName"].string_value == "NVIDIA L4", result
    no_races_or_errors(scheduling)

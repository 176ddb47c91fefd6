"""Preemption through the live services, applied with kubectl: a high-priority pod that fits
nowhere evicts lower-priority pods (Eviction API), is nominated, and binds where they were.

The fixtures run no kubelet, so the victims set terminationGracePeriodSeconds: 0 and go at once
when evicted; under `draplane up`, KWOK finishes their graceful deletion. kube-controller-manager
runs (tests/conftest.py): it deletes the victims' template claims and computes the budgets.
"""

from __future__ import annotations

import json
import uuid

import pytest

from draplane.cli import explain
from draplane.messages import audit
from test_user_flows import get_json, gpu_cluster, no_races_or_errors, wait_bound, wait_unschedulable

pytestmark = pytest.mark.integration


def priority_class(name: str, value: int, never: bool = False) -> str:
    return f"""
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {{name: {name}}}
value: {value}
{"preemptionPolicy: Never" if never else ""}
"""


def template_yaml(namespace: str, name: str, class_name: str, count: int) -> str:
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  spec:
    devices:
      requests:
        - name: gpus
          exactly: {{deviceClassName: {class_name}, count: {count}}}
"""


def pod_yaml(namespace: str, name: str, scheduler: str, template: str, *, priority_class_name: str | None = None,
             node: str | None = None, labels: dict | None = None) -> str:
    extra = f"\n  priorityClassName: {priority_class_name}" if priority_class_name else ""
    if node:
        extra += f"\n  nodeSelector: {json.dumps({'kubernetes.io/hostname': node})}"
    return f"""
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {namespace}, labels: {json.dumps(labels or {})}}}
spec:
  schedulerName: {scheduler}
  terminationGracePeriodSeconds: 0{extra}
  containers:
    - name: main
      image: registry.k8s.io/pause:3.10
      resources: {{claims: [{{name: devices}}]}}
  resourceClaims:
    - {{name: devices, resourceClaimTemplateName: {template}}}
"""


@pytest.fixture
async def classes(kubectl):
    suffix = uuid.uuid4().hex[:6]
    names = {"high": f"high-{suffix}", "never": f"high-never-{suffix}"}
    await kubectl.apply(priority_class(names["high"], 1000) + "---" + priority_class(names["never"], 1000, never=True))
    yield names
    await kubectl("delete", "priorityclass", *names.values(), "--ignore-not-found")


async def full_cluster(scheduling, kube, kubectl, namespace, *, nodes: int = 2, labels_by_node=None):
    """`nodes` nodes of 8 GPUs, each GPU held by a priority-0 pod pinned there."""
    class_name, names = await gpu_cluster(scheduling, kube, nodes=nodes)
    docs = [template_yaml(namespace, "one-gpu", class_name, 1), template_yaml(namespace, "eight-gpus", class_name, 8)]
    for n, node in enumerate(names):
        for g in range(8):
            docs.append(pod_yaml(namespace, f"low-{n}-{g}", scheduling.scheduler_name, "one-gpu", node=node,
                                 labels=(labels_by_node or {}).get(n)))
    await kubectl.apply("---".join(docs))
    for n in range(nodes):
        for g in range(8):
            await wait_bound(scheduling, kubectl, namespace, f"low-{n}-{g}", timeout=90)
    return names


async def pods_left(kubectl, namespace) -> dict[str, str]:
    got = await get_json(kubectl, "pods", "-n", namespace)
    return {p["metadata"]["name"]: p["spec"].get("nodeName", "") for p in got["items"]
            if not p["metadata"].get("deletionTimestamp")}


async def explained(control_plane, namespace: str, pod: str) -> list[str]:
    snapshot = await explain.gather(control_plane.kubeconfig)
    return explain.explain_pod(snapshot, explain.find_target(snapshot, f"pod/{pod}", namespace))


async def audit_events(nats, prefix: str, kind: str) -> list:
    names = audit.AuditNames(prefix=prefix)
    sub = await nats.jetstream().subscribe(names.subject(kind), stream=names.stream, ordered_consumer=True)
    events = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except TimeoutError:
                return events
            events.append(audit.decode_event(msg.data))
    finally:
        await sub.unsubscribe()


async def test_an_eight_gpu_pod_evicts_exactly_one_nodes_pods_and_binds_there(scheduling, kube, kubectl, namespace,
                                                                               classes, control_plane, nats,
                                                                               subject_prefix, caplog):
    caplog.set_level("INFO", logger="draplane_allocator")
    await scheduling.start()
    nodes = await full_cluster(scheduling, kube, kubectl, namespace)
    await kubectl.apply(pod_yaml(namespace, "big", scheduling.scheduler_name, "eight-gpus",
                                 priority_class_name=classes["high"]))
    pod = await wait_bound(scheduling, kubectl, namespace, "big", timeout=90)
    node = pod["spec"]["nodeName"]
    assert node in nodes
    index = nodes.index(node)
    left = await pods_left(kubectl, namespace)
    assert {name for name in left if name.startswith("low-")} == {
        f"low-{n}-{g}" for n in range(2) for g in range(8) if n != index}
    assert pod["status"].get("nominatedNodeName") in (None, node)
    events = await get_json(kubectl, "events", "-n", namespace, "--field-selector", "reason=Preempted")
    assert sorted(e["involvedObject"]["name"] for e in events["items"]) == sorted(f"low-{index}-{g}" for g in range(8))
    assert all(e["message"] == f"Preempted by pod {pod['metadata']['uid']} on node {node}" for e in events["items"])
    victims = ", ".join(sorted(f"{namespace}/low-{index}-{g}" for g in range(8)))
    assert f"It preempted 8 pod(s) on node {node} (lower priority, evicted to free what it needs): {victims}" in \
        await explained(control_plane, namespace, "big")
    # The shard held the eight GPUs for it in the reservation bucket before anyone was evicted.
    assert any(f"node {node}'s devices held for it until its 8 victim(s) go" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records if "preempt" in r.getMessage()]
    # The audit log has one preempted event per victim, naming the preemptor.
    preempted = await audit_events(nats, subject_prefix, "preempted")
    assert sorted(e.pod.name for e in preempted) == sorted(f"low-{index}-{g}" for g in range(8))
    assert all(e.node == node and e.reason.startswith(f"evicted for {namespace}/big: preempting 8 pod(s)")
               for e in preempted)
    no_races_or_errors(scheduling)


async def test_a_budget_moves_the_preemption_or_leaves_the_pod_pending_naming_it(scheduling, kube, kubectl, namespace,
                                                                                   classes, control_plane):
    await scheduling.start()
    nodes = await full_cluster(scheduling, kube, kubectl, namespace,
                               labels_by_node={0: {"app": "a"}, 1: {"app": "b"}})
    budgets = "---".join(f"""
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {{name: keep-{app}, namespace: {namespace}}}
spec:
  maxUnavailable: 0
  selector: {{matchLabels: {{app: {app}}}}}
""" for app in ("a", "b"))
    await kubectl.apply(budgets)
    await kubectl.apply(pod_yaml(namespace, "big", scheduling.scheduler_name, "eight-gpus",
                                 priority_class_name=classes["high"]))
    message = await wait_unschedulable(scheduling, kubectl, namespace, "big", contains="PodDisruptionBudget",
                                       timeout=60)
    assert f"PodDisruptionBudget {namespace}/keep-a" in message and f"PodDisruptionBudget {namespace}/keep-b" in message
    assert len(await pods_left(kubectl, namespace)) == 17  # nobody evicted
    lines = await explained(control_plane, namespace, "big")
    (line,) = [line for line in lines if line.startswith("Preemption cannot help: ")]
    assert f"would violate PodDisruptionBudget {namespace}/keep-a" in line, lines
    assert f"would violate PodDisruptionBudget {namespace}/keep-b" in line, lines
    # Node 1's pods lose their protection: the preemption goes there, and only there.
    await kubectl("delete", "pdb", "keep-b", "-n", namespace)
    pod = await wait_bound(scheduling, kubectl, namespace, "big", timeout=90)
    assert pod["spec"]["nodeName"] == nodes[1]
    left = await pods_left(kubectl, namespace)
    assert {name for name in left if name.startswith("low-")} == {f"low-0-{g}" for g in range(8)}


async def test_a_pod_with_preemption_policy_never_waits(scheduling, kube, kubectl, namespace, classes):
    await scheduling.start()
    await full_cluster(scheduling, kube, kubectl, namespace, nodes=1)
    await kubectl.apply(pod_yaml(namespace, "patient", scheduling.scheduler_name, "eight-gpus",
                                 priority_class_name=classes["never"]))
    message = await wait_unschedulable(scheduling, kubectl, namespace, "patient",
                                       contains="preemption: not eligible due to preemptionPolicy=Never.")
    # (the session's apiserver holds other tests' nodes too: only this node's reason is checked)
    assert " 1 cannot allocate all claims: resourceclaim " in message and message.startswith("0/")
    assert len(await pods_left(kubectl, namespace)) == 9


async def test_a_gang_preempts_as_a_whole_evicting_exactly_two_nodes_pods_and_binds_there(
        scheduling, kube, kubectl, namespace, classes):
    """kube-scheduler preempts for one pod at a time; here a PodGroup of two 8-GPU pods on a full
    cluster of one-GPU priority-0 pods evicts the pods of two nodes, and both members bind there."""
    await scheduling.start()
    nodes = await full_cluster(scheduling, kube, kubectl, namespace, nodes=3)
    group = f"""
apiVersion: scheduling.k8s.io/v1beta1
kind: PodGroup
metadata: {{name: pair, namespace: {namespace}}}
spec:
  schedulingPolicy: {{gang: {{minCount: 2}}}}
"""
    members = [pod_yaml(namespace, f"pair-{i}", scheduling.scheduler_name, "eight-gpus",
                        priority_class_name=classes["high"]).replace(
        "  terminationGracePeriodSeconds: 0", "  terminationGracePeriodSeconds: 0\n  schedulingGroup: {podGroupName: pair}")
        for i in range(2)]
    await kubectl.apply("---".join([group, *members]))
    bound = [await wait_bound(scheduling, kubectl, namespace, f"pair-{i}", timeout=120) for i in range(2)]
    used = {p["spec"]["nodeName"] for p in bound}
    assert len(used) == 2 and used <= set(nodes)
    (kept,) = set(nodes) - used
    left = await pods_left(kubectl, namespace)
    assert {name for name in left if name.startswith("low-")} == {f"low-{nodes.index(kept)}-{g}" for g in range(8)}
    events = await get_json(kubectl, "events", "-n", namespace, "--field-selector", "reason=Preempted")
    assert len(events["items"]) == 16
    no_races_or_errors(scheduling)


async def test_a_pod_whose_anti_affinity_a_lower_priority_pod_breaks_evicts_only_that_pod(
        scheduling, kube, kubectl, namespace, classes):
    """One node with GPUs to spare: the priority-0 `db` pod there is all that refuses a pod with a
    required anti-affinity to db, and the other priority-0 pod refuses nothing. kube-scheduler
    reruns its filters with the victims gone: db is evicted, the other pod stays, and the pod
    binds beside it."""
    class_name, (node,) = await gpu_cluster(scheduling, kube, nodes=1)
    await scheduling.start()
    await kubectl.apply("---".join([
        template_yaml(namespace, "one-gpu", class_name, 1),
        pod_yaml(namespace, "db", scheduling.scheduler_name, "one-gpu", labels={"app": "db"}),
        pod_yaml(namespace, "batch", scheduling.scheduler_name, "one-gpu", labels={"app": "batch"}),
    ]))
    for name in ("db", "batch"):
        await wait_bound(scheduling, kubectl, namespace, name)
    web = pod_yaml(namespace, "web", scheduling.scheduler_name, "one-gpu", priority_class_name=classes["high"],
                   labels={"app": "web"}).replace("  containers:", """  affinity:
    podAntiAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        - {topologyKey: kubernetes.io/hostname, labelSelector: {matchLabels: {app: db}}}
  containers:""")
    await kubectl.apply(web)
    pod = await wait_bound(scheduling, kubectl, namespace, "web", timeout=60)
    assert pod["spec"]["nodeName"] == node
    assert set(await pods_left(kubectl, namespace)) == {"batch", "web"}
    events = await get_json(kubectl, "events", "-n", namespace, "--field-selector", "reason=Preempted")
    assert [e["involvedObject"]["name"] for e in events["items"]] == ["db"]
    no_races_or_errors(scheduling)

"""A pod's soft constraints through the live services: replicas with a preferred anti-affinity on
the hostname spread over nodes that busy-first packing would have stacked them on, and a
ScheduleAnyway zone spread evens out zones (draplane.scheduling.pod_scores)."""

from __future__ import annotations

import collections
import uuid

import msgspec
import pytest

from draplane.api.core import Affinity, TopologySpreadConstraint
from draplane.api.policy import LabelSelector
from draplane.simulation import scenario
from conftest import create_many, ensure_class  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration


async def _nodes(scheduling, kube, namespace, count: int, zones=None) -> tuple[str, list[str]]:
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    names = []
    for i in range(count):
        name = f"soft-{i}-{namespace[-6:]}"
        labels = {"topology.kubernetes.io/zone": zones[i]} if zones else None
        await scheduling.put_node(scenario.gpu_node(name, labels=labels), [scenario.gpu_slice(name, 8, "80Gi")])
        names.append(name)
    return class_name, names


async def test_replicas_with_a_preferred_anti_affinity_land_on_distinct_nodes(scheduling, kube, namespace):
    class_name, nodes = await _nodes(scheduling, kube, namespace, 3)
    await scheduling.start(shards=2)
    await kube.create(scenario.claim_template(namespace, "one-gpu", class_name))
    affinity = msgspec.convert({"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                            "labelSelector": {"matchLabels": {"app": "infer"}}}}]}}, Affinity)
    replicas = []
    for i in range(3):
        pod = scheduling.pod(namespace, f"infer-{i}", template_name="one-gpu")
        pod.metadata.labels = {"app": "infer"}
        pod.spec.affinity = affinity
        replicas.append(pod)
    await create_many(kube, replicas)
    bound = [await scheduling.bound_pod(namespace, f"infer-{i}", timeout=60) for i in range(3)]
    assert sorted(p.spec.node_name for p in bound) == sorted(nodes)


async def test_a_schedule_anyway_zone_spread_evens_out_the_zones(scheduling, kube, namespace):
    zones = ["a", "a", "b", "c"]
    class_name, nodes = await _nodes(scheduling, kube, namespace, 4, zones=zones)
    await scheduling.start(shards=1)
    await kube.create(scenario.claim_template(namespace, "one-gpu", class_name))
    constraint = TopologySpreadConstraint(max_skew=1, topology_key="topology.kubernetes.io/zone",
                                          when_unsatisfiable="ScheduleAnyway",
                                          label_selector=LabelSelector(match_labels={"app": "web"}))
    pods = []
    for i in range(6):
        pod = scheduling.pod(namespace, f"web-{i}", template_name="one-gpu")
        pod.metadata.labels = {"app": "web"}
        pod.spec.topology_spread_constraints = [constraint]
        pods.append(pod)
    await create_many(kube, pods)
    zone_of = dict(zip(nodes, zones))
    per_zone = collections.Counter()
    for i in range(6):
        per_zone[zone_of[(await scheduling.bound_pod(namespace, f"web-{i}", timeout=60)).spec.node_name]] += 1
    assert per_zone == {"a": 2, "b": 2, "c": 2}



async def test_a_bound_pods_preferred_affinity_draws_a_plain_pod_to_its_node(scheduling, kube, namespace):
    """kube-scheduler scores with the placed pods' terms too: a bound pod preferring web pods
    beside it draws a web pod that says nothing of it to its node, though busy-first packing
    would have put it on the node already in use; a pod the term does not select still packs."""
    class_name, (used, drawing) = await _nodes(scheduling, kube, namespace, 2)
    await scheduling.start(shards=1)
    await kube.create(scenario.claim_template(namespace, "one-gpu", class_name))
    filler = scheduling.pod(namespace, "filler", template_name="one-gpu")
    filler.spec.node_selector = {"kubernetes.io/hostname": used}
    await kube.create(filler)
    await scheduling.bound_pod(namespace, "filler", timeout=60)
    cache = scheduling.pod(namespace, "cache")
    cache.metadata.labels = {"app": "cache"}
    cache.spec.node_selector = {"kubernetes.io/hostname": drawing}
    cache.spec.affinity = msgspec.convert({"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                            "labelSelector": {"matchLabels": {"app": "web"}}}}]}}, Affinity)
    await kube.create(cache)
    await scheduling.bound_pod(namespace, "cache", timeout=60)
    other = scheduling.pod(namespace, "batch", template_name="one-gpu")
    other.metadata.labels = {"app": "batch"}
    await kube.create(other)
    assert (await scheduling.bound_pod(namespace, "batch", timeout=60)).spec.node_name == used
    web = scheduling.pod(namespace, "web", template_name="one-gpu")
    web.metadata.labels = {"app": "web"}
    await kube.create(web)
    assert (await scheduling.bound_pod(namespace, "web", timeout=60)).spec.node_name == drawing

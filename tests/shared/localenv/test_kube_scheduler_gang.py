"""kubernetes/kubernetes#138765 on the real kube-scheduler, at the apiserver's version.

A gang (PodGroup, gang minCount 2) of two pods, each with its own claim asking
`firstAvailable: [whole GPU, half GPU]`, on one node whose one 80Gi GPU can be given whole
(`gpu-0`) or as two halves (`gpu-0-half-0`, `gpu-0-half-1`) drawing on the same counter set.
Two halves fit both pods; kube-scheduler, placing the group's pods one after the other and each
greedily (its first choice, the whole GPU, for the first pod), finds nothing for the second, and
the gang does not bind: on 1.37.2 neither pod binds (watched 30 s) and neither claim is ever allocated
(PodGroup condition PodGroupInitiallyScheduled False, "minCount (2) cannot be satisfied: 1
scheduled, 0 remaining"; the pod tried second "0/1 nodes are available: 1 cannot allocate all claims.").
The offline version of the case is in tests/shared/allocation/test_gang.py.

`case_138765` builds the objects, so that the same case can run through draplane's services
(schedulerName draplane's) as well as through kube-scheduler (schedulerName None: the default).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import msgspec
import pytest

from draplane.api.core import Node, Pod, PodSchedulingGroup
from draplane.api.meta import ObjectMeta
from draplane.api.resource import (
    CELDeviceSelector,
    Counter,
    CounterSet,
    Device,
    DeviceAttribute,
    DeviceClaim,
    DeviceCounterConsumption,
    DeviceRequest,
    DeviceSelector,
    DeviceSubRequest,
    ResourceClaim,
    ResourceClaimSpec,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)
from draplane.api.scheduling import GangSchedulingPolicy, PodGroup, PodGroupSchedulingPolicy, PodGroupSpec
from draplane.localenv.kubescheduler import kube_scheduler
from draplane.simulation import scenario

DRIVER = scenario.GPU_DRIVER
# kube-scheduler retried the group at about 1, 3, 5, 9 and 15 s in every run seen: 30 s covers five
# attempts, all with the same result (60 s gave the same facts, in twice the suite's time)
OBSERVE_SECONDS = 30


def case_138765(namespace: str, tag: str, *, scheduler_name: str | None = None) -> dict:
    """The objects of kubernetes#138765, named with `tag` (unique per run), as a dict of lists:

    - "node": [Node `k138765-<tag>`] (no taints set; the apiserver adds not-ready, remove it),
    - "slices": [the counter set slice, the devices slice] of one pool named after the node:
      counter set `gpu-0` with memory 80Gi; devices `gpu-0` (kind whole, consumes 80Gi),
      `gpu-0-half-0` and `gpu-0-half-1` (kind half, 40Gi each); every device's productName is
      `k138765-<tag>`, which only this case's devices have,
    - "classes": [DeviceClass `k138765-<tag>`, matching that productName],
    - "podgroups": [PodGroup `pair` in `namespace`, gang minCount 2],
    - "claims": [ResourceClaim `pair-0-gpu`, `pair-1-gpu`]: request `gpu`, firstAvailable
      [`whole` (kind == "whole"), `half` (kind == "half")],
    - "pods": [Pod `pair-0`, `pair-1`], spec.schedulingGroup.podGroupName `pair`, each with its claim.

    `scheduler_name` None leaves the pods to kube-scheduler (default-scheduler); pass draplane's
    to run the case through draplane's services. Create them in the order of the keys above.
    """
    node = f"k138765-{tag}"
    product = f"k138765-{tag}"
    class_name = f"k138765-{tag}"

    def gpu(name: str, kind: str, memory: str) -> Device:
        return Device(
            name=name,
            attributes={"kind": DeviceAttribute(string_value=kind),
                        "productName": DeviceAttribute(string_value=product)},
            consumes_counters=[DeviceCounterConsumption(counter_set="gpu-0", counters={"memory": Counter(value=memory)})],
        )

    pool = ResourcePool(name=node, generation=1, resource_slice_count=2)
    slices = [
        ResourceSlice(metadata=ObjectMeta(name=f"{node}-counters"),
                      spec=ResourceSliceSpec(driver=DRIVER, pool=pool, node_name=node,
                                             shared_counters=[CounterSet(name="gpu-0", counters={"memory": Counter(value="80Gi")})])),
        ResourceSlice(metadata=ObjectMeta(name=f"{node}-gpus"),
                      spec=ResourceSliceSpec(driver=DRIVER, pool=pool, node_name=node,
                                             devices=[gpu("gpu-0", "whole", "80Gi"), gpu("gpu-0-half-0", "half", "40Gi"),
                                                      gpu("gpu-0-half-1", "half", "40Gi")])),
    ]
    device_class = scenario.device_class(class_name, f'device.attributes["{DRIVER}"].productName == "{product}"')

    def whole_or_half(name: str) -> ResourceClaim:
        def sub(kind: str) -> DeviceSubRequest:
            return DeviceSubRequest(name=kind, device_class_name=class_name,
                                    selectors=[DeviceSelector(cel=CELDeviceSelector(
                                        expression=f'device.attributes["{DRIVER}"].kind == "{kind}"'))])
        return ResourceClaim(metadata=ObjectMeta(name=name, namespace=namespace),
                             spec=ResourceClaimSpec(devices=DeviceClaim(requests=[
                                 DeviceRequest(name="gpu", first_available=[sub("whole"), sub("half")])])))

    group = PodGroup(metadata=ObjectMeta(name="pair", namespace=namespace),
                     spec=PodGroupSpec(scheduling_policy=PodGroupSchedulingPolicy(gang=GangSchedulingPolicy(min_count=2))))
    claims = [whole_or_half(f"pair-{i}-gpu") for i in range(2)]
    pods = []
    for i in range(2):
        p = scenario.pod(namespace, f"pair-{i}", claim_name=f"pair-{i}-gpu", scheduler_name=scheduler_name)
        p.spec.scheduling_group = PodSchedulingGroup(pod_group_name="pair")
        pods.append(p)
    return {"node": [scenario.gpu_node(node)], "slices": slices, "classes": [device_class],
            "podgroups": [group], "claims": claims, "pods": pods}


async def _events(kube, namespace: str) -> list[str]:
    data = await kube.request("GET", f"/api/v1/namespaces/{namespace}/events")
    items = msgspec.json.decode(data).get("items", [])
    return [f"{e['involvedObject'].get('kind')}/{e['involvedObject'].get('name')} {e.get('reason')}: {e.get('message')}"
            for e in sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")]


@pytest.fixture
async def made_objects(kube):
    """Every object a test makes, deleted after it, newest first (pods before their claims, classes
    and node). The control plane serves the whole session:
    - this case's devices have no `type` attribute: left behind, they make the standard
      gpu.nvidia.com class's selector a CEL runtime error for every later test's claims (seen when
      tests/services/test_pipeline_nats_cluster.py ran after this file);
    - its pods, left pending once their class is gone, keep every later kube-scheduler retrying
      their pod group (CI saw test_kubescheduler.py's template pod wait out its 120 s beside
      them)."""
    made: list = []
    yield made
    for obj in reversed(made):
        await kube.delete(type(obj), obj.metadata.name, obj.metadata.namespace)


@pytest.mark.integration
async def test_kube_scheduler_does_not_place_the_whole_or_half_gang_that_two_halves_fit(control_plane, kube, namespace, tmp_path,
                                                                                        made_objects):
    tag = uuid.uuid4().hex[:6]
    case = case_138765(namespace, tag)
    node = case["node"][0].metadata.name
    await kube.create(case["node"][0])
    made_objects.append(case["node"][0])
    await kube.patch(Node, node, {"spec": {"taints": None}})  # the apiserver's not-ready taint: no kubelet
    for obj in case["slices"] + case["classes"] + case["podgroups"] + case["claims"] + case["pods"]:
        await kube.create(obj)
        made_objects.append(obj)

    scheduler = kube_scheduler(control_plane, tmp_path / "kube-scheduler.log", verbosity=2)
    started = time.monotonic()
    scheduler.start()
    first_seen: dict[str, float] = {}
    try:
        deadline = started + OBSERVE_SECONDS
        while time.monotonic() < deadline:
            pods = [await kube.get(Pod, p.metadata.name, namespace) for p in case["pods"]]
            claims = [await kube.get(ResourceClaim, c.metadata.name, namespace) for c in case["claims"]]
            for c in claims:
                if c.status and c.status.allocation and c.metadata.name not in first_seen:
                    first_seen[c.metadata.name] = round(time.monotonic() - started, 1)
            for p in pods:
                if p.spec.node_name and p.metadata.name not in first_seen:
                    first_seen[p.metadata.name] = round(time.monotonic() - started, 1)
            if all(p.spec.node_name for p in pods):
                break
            assert scheduler.alive(), scheduler.log_tail()
            await asyncio.sleep(0.5)
        log = scheduler.log_tail()
    finally:
        scheduler.stop()
    watched = round(time.monotonic() - started, 1)

    def allocation(c: ResourceClaim):
        if not (c.status and c.status.allocation and c.status.allocation.devices):
            return None
        return [(r.request, r.device) for r in c.status.allocation.devices.results or []]

    bound = {p.metadata.name: p.spec.node_name for p in pods}
    conditions = {p.metadata.name: [(c.type, c.status, c.reason, c.message) for c in (p.status.conditions or [])]
                  for p in pods if p.status}
    devices = {c.metadata.name: allocation(c) for c in claims}
    group_raw = msgspec.json.decode(await kube.request("GET", f"/apis/scheduling.k8s.io/v1beta1/namespaces/{namespace}/podgroups/pair"))
    events = await _events(kube, namespace)
    facts = (
        f"watched {watched} s (first seen: {first_seen}); bound {bound}; claims' devices {devices}; "
        f"pod conditions {json.dumps(conditions)}; podgroup status {json.dumps(group_raw.get('status'))}; "
        f"events {json.dumps(events)}"
    )
    print("\nkubernetes#138765 on kube-scheduler:", facts)
    if all(bound.values()):
        # Not what the issue reports: kube-scheduler placed both. Said, not hidden.
        pytest.fail(f"kube-scheduler placed BOTH gang pods (the issue says it does not): {facts}\n{log}")
    assert not any(bound.values()), facts
    # What kube-scheduler 1.37.2 did (seen in every run): its pod group cycle tries the pods one
    # after the other in memory; the first (pair-0 or pair-1) fits (its first choice, the whole gpu-0), the other then
    # "cannot allocate all claims", minCount 2 is not met, and everything is rolled back: no claim
    # is ever written with an allocation, no half is ever tried, and it retries with backoff the
    # same way for the whole time watched.
    assert devices == {"pair-0-gpu": None, "pair-1-gpu": None}, facts
    assert all(any(t == "PodScheduled" and s == "False" and r == "Unschedulable" for t, s, r, _ in conds)
               for conds in conditions.values()), facts
    messages = {name: next(m for t, _, _, m in conds if t == "PodScheduled") for name, conds in conditions.items()}
    # which of the two goes first in the cycle varies from run to run
    assert sorted("cannot allocate all claims" in m for m in messages.values()) == [False, True], facts
    assert sorted("minCount (2) cannot be satisfied: 1 scheduled" in m for m in messages.values()) == [False, True], facts

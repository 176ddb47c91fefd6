"""draplane and kube-scheduler on one cluster, allocating from the same ResourceSlices.

1. Together on the same nodes: pods for both are created at once, more than there are GPUs.
   Neither scheduler sees the other's in-flight allocations, so both may write one GPU into two
   claims (kubernetes#128980). Whatever happens, the binder reports exactly the pairs the claims
   hold: a Warning Event on each, one audit record per pair.
2. Apart, as deploy/separation/ keeps them: draplane's nodes carry its label and taint, and the
   MutatingAdmissionPolicy gives every draplane pod the toleration and nodeSelector. The same
   burst then puts each scheduler's pods on its own nodes only, and no GPU is allocated twice.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest
import yaml

from draplane.api.core import Node, Pod, Toleration
from draplane.api.resource import ResourceClaim
from draplane.localenv.kubescheduler import kube_scheduler
from draplane.simulation import scenario

from conftest import eventually  # noqa: E402  (tests/services/conftest.py)
from test_preemption_flows import audit_events  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

POLICY = Path(__file__).resolve().parents[2] / "deploy" / "separation" / "pods-to-draplane-nodes.yaml"
GPUS_PER_NODE = 2


def double_allocations(claims: list[ResourceClaim]) -> set[tuple[str, frozenset]]:
    """From the claims themselves: (device, the two claim names) for every device two claims hold
    without adminAccess or shares. The independent count the binder's reports must match."""
    holders: dict[str, list[str]] = {}
    for claim in claims:
        allocation = claim.status.allocation if claim.status else None
        for result in (allocation.devices.results if allocation and allocation.devices else None) or ():
            if not result.admin_access and not result.share_id:
                holders.setdefault(f"{result.pool}/{result.device}", []).append(claim.metadata.name)
    return {(device, frozenset((a, b))) for device, names in holders.items()
            for i, a in enumerate(names) for b in names[i + 1:]}


class Burst:
    """One round: nodes, a device class only their GPUs match, a claim per pod, then all pods at once."""

    def __init__(self, kube, scheduling, namespace: str, tag: str):
        self.kube, self.scheduling, self.namespace, self.tag = kube, scheduling, namespace, tag
        self.product = f"two-schedulers-{tag}"
        self.class_name = f"two-{tag}"
        # Only this round's pods tolerate it: other tests' pending pods never take these GPUs.
        self.only_us = {"key": "draplane.test/two-schedulers", "value": tag, "effect": "NoSchedule"}

    async def device_class(self) -> None:
        await self.kube.create(scenario.device_class(
            self.class_name, f'device.attributes["gpu.nvidia.com"].productName == "{self.product}"'))

    async def node(self, name: str, *, draplane_owned: bool) -> None:
        taints = [self.only_us]
        labels = None
        if draplane_owned:
            labels = {"draplane.io/scheduler": "draplane"}
            taints.append({"key": "draplane.io/scheduler", "value": "draplane", "effect": "NoSchedule"})
        await self.scheduling.put_node(scenario.gpu_node(name, labels=labels),
                                       [scenario.gpu_slice(name, GPUS_PER_NODE, "80Gi", product=self.product)])
        await self.kube.patch(Node, name, {"spec": {"taints": taints}})

    async def pods(self, count: int) -> dict[str, str]:
        """`count` pods for each scheduler, created concurrently; name -> scheduler."""
        wanted = {}
        for i in range(count):  # interleaved: neither scheduler gets a head start
            wanted[f"ks-{self.tag}-{i}"] = "default-scheduler"
            wanted[f"dp-{self.tag}-{i}"] = self.scheduling.scheduler_name
        await asyncio.gather(*(self.kube.create(scenario.claim(self.namespace, name, self.class_name))
                               for name in wanted))
        tolerate = Toleration(key=self.only_us["key"], operator="Equal", value=self.tag, effect="NoSchedule")

        async def create(name: str, scheduler: str) -> None:
            pod = scenario.pod(self.namespace, name, claim_name=name, scheduler_name=scheduler)
            pod.spec.tolerations = [tolerate]
            await self.kube.create(pod)

        await asyncio.gather(*(create(name, s) for name, s in wanted.items()))
        return wanted

    async def settled(self, wanted: dict[str, str], gpus: int) -> dict[str, str]:
        """Wait until as many pods are bound as GPUs exist (or the schedulers stop binding); name -> node."""
        last, stable_since = None, time.monotonic()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pods, _ = await self.kube.list(Pod, self.namespace)
            bound = {p.metadata.name: p.spec.node_name for p in pods if p.metadata.name in wanted and p.spec.node_name}
            if bound != last:
                last, stable_since = bound, time.monotonic()
            if len(bound) >= gpus and time.monotonic() - stable_since > 3 or time.monotonic() - stable_since > 15:
                return bound
            await asyncio.sleep(0.5)
        return last or {}

    async def claims(self, wanted: dict[str, str]) -> list[ResourceClaim]:
        items, _ = await self.kube.list(ResourceClaim, self.namespace)
        return [c for c in items if c.metadata.name in wanted]

    async def clean(self, wanted: dict[str, str]) -> None:
        for name in wanted:
            await self.kube.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{name}",
                                    query={"gracePeriodSeconds": 0})


async def test_two_schedulers_race_over_one_pool_and_the_separation_keeps_them_apart(
        scheduling, kube, kubectl, namespace, control_plane, nats, subject_prefix, tmp_path):
    # The inventory feed's bucket first, as the inventory service makes it before any shard runs:
    # a shard that starts without it looks again once a second, and nodes added meanwhile would
    # be seen without their devices.
    await scheduling.feed_bucket()
    await scheduling.start()
    scheduler = kube_scheduler(control_plane, tmp_path / "kube-scheduler.log", verbosity=2)
    scheduler.start()
    policy_objects = []
    try:
        # 1. Together: 3 nodes, 6 GPUs, 6 pods for each scheduler at once.
        together = Burst(kube, scheduling, namespace, uuid.uuid4().hex[:6])
        nodes = [f"together-{together.tag}-{i}" for i in range(3)]
        await together.device_class()
        for name in nodes:
            await together.node(name, draplane_owned=False)
        # kube-scheduler lists the whole session's cluster first: let it get there before the burst
        warm = Burst(kube, scheduling, namespace, f"w{together.tag}")
        await warm.node(f"warm-{together.tag}", draplane_owned=False)
        await warm.device_class()
        await kube.create(scenario.claim(namespace, f"ks-warm-{together.tag}", warm.class_name))
        warm_pod = scenario.pod(namespace, f"ks-warm-{together.tag}", claim_name=f"ks-warm-{together.tag}", scheduler_name=None)
        warm_pod.spec.tolerations = [Toleration(key=warm.only_us["key"], operator="Equal", value=warm.tag, effect="NoSchedule")]
        await kube.create(warm_pod)

        async def warm_bound():
            assert scheduler.alive(), scheduler.log_tail()
            return (await kube.get(Pod, f"ks-warm-{together.tag}", namespace)).spec.node_name

        await eventually(warm_bound, timeout=120, what="kube-scheduler binding its first pod")

        wanted = await together.pods(6)
        bound = await together.settled(wanted, gpus=6)
        claims = await together.claims(wanted)
        doubles = double_allocations(claims)
        by_scheduler = {s: sum(1 for n in bound if wanted[n] == s) for s in set(wanted.values())}
        print(f"together: {len(bound)} of {len(wanted)} pods bound on 6 GPUs {by_scheduler}; "
              f"{len(doubles)} GPU(s) allocated twice: {sorted((d, sorted(p)) for d, p in doubles)}")
        # Whatever the race did, the binder reported exactly those pairs, once each.
        async def reported():
            records = [r for r in await audit_events(nats, subject_prefix, "conflict")
                       if any(c.namespace == namespace for c in r.claims)]
            found = {(f"{r.claims[0].devices[0].pool}/{r.claims[0].devices[0].device}",
                      frozenset(c.name for c in r.claims)) for r in records}
            return found if found == doubles else None

        if doubles:
            await eventually(reported, timeout=30, what=f"audit records for {doubles}")
            events = json.loads(await kubectl("-n", namespace, "get", "events", "-o", "json",
                                              "--field-selector", "reason=DeviceAllocatedTwice"))["items"]
            assert {e["involvedObject"]["name"] for e in events} == {n for _, pair in doubles for n in pair}
        else:
            await asyncio.sleep(2)
            assert await reported() == set()
        assert scheduling.binder.metrics.double_allocations._value.get() == len(doubles)
        await together.clean(wanted)

        # 2. Apart: deploy/separation/'s policy (for this test's draplane scheduler name), 2 nodes
        # of draplane's and 2 of kube-scheduler's, 4 pods for each at once.
        documents = [d for d in yaml.safe_load_all(POLICY.read_text()) if d]
        policy, binding = documents
        condition = policy["spec"]["matchConditions"][0]
        assert condition["expression"].endswith('== "draplane"')
        condition["expression"] = condition["expression"].replace('"draplane"', json.dumps(scheduling.scheduler_name))
        for document in (policy, binding):
            document["metadata"]["name"] += f"-{together.tag}"
        binding["spec"]["policyName"] = policy["metadata"]["name"]
        await kubectl("apply", "-f", "-", stdin=json.dumps(policy) + "\n---\n" + json.dumps(binding))
        policy_objects = [("mutatingadmissionpolicy", policy["metadata"]["name"]),
                          ("mutatingadmissionpolicybinding", binding["metadata"]["name"])]

        apart = Burst(kube, scheduling, namespace, uuid.uuid4().hex[:6])
        owned = {f"apart-{apart.tag}-dp-{i}": True for i in range(2)} | {f"apart-{apart.tag}-ks-{i}": False for i in range(2)}
        await apart.device_class()
        for name, draplane_owned in owned.items():
            await apart.node(name, draplane_owned=draplane_owned)

        async def policy_active():
            probe = scenario.pod(namespace, "probe", scheduler_name=scheduling.scheduler_name)
            made = json.loads(await kubectl("-n", namespace, "create", "--dry-run=server", "-o", "json", "-f", "-",
                                            stdin=json.dumps(_raw(probe))))
            return made["spec"].get("nodeSelector") == {"draplane.io/scheduler": "draplane"}

        await eventually(policy_active, timeout=30, what="the MutatingAdmissionPolicy in force")
        before = scheduling.binder.metrics.double_allocations._value.get()
        wanted = await apart.pods(4)
        bound = await apart.settled(wanted, gpus=8)
        claims = await apart.claims(wanted)
        print(f"apart: {len(bound)} of {len(wanted)} pods bound on 8 GPUs; {len(double_allocations(claims))} allocated twice")
        assert len(bound) == 8, bound
        for name, node in bound.items():
            assert owned[node] == (wanted[name] == scheduling.scheduler_name), (name, node)
        assert double_allocations(claims) == set()
        assert scheduling.binder.metrics.double_allocations._value.get() == before
        pod = await kube.get(Pod, f"dp-{apart.tag}-0", namespace)
        assert any(t.key == "draplane.io/scheduler" for t in pod.spec.tolerations or [])
    finally:
        scheduler.stop()
        for kind, name in policy_objects:
            await kubectl("delete", kind, name, "--ignore-not-found", check=False)


def _raw(pod: Pod) -> dict:
    import msgspec

    return {"apiVersion": "v1", "kind": "Pod", **json.loads(msgspec.json.encode(pod))}

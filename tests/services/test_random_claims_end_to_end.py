"""Random claims through the live binder and two shards, judged by a checker of their own.

Hypothesis draws a handful of pods whose claims mix counts, selectors on memory and product,
matchAttribute on the PCIe root, adminAccess and tolerations, over nodes whose devices carry a
taint and a DeviceTaintRule. Every pod must end bound, with an allocation the checker below
validates from the apiserver's objects alone (it evaluates the drawn predicates in Python, not
draplane's CEL), or pending with kube-scheduler's message while the checker, searching every
combination of the devices left free, agrees that nothing fits. No device may be held whole twice.

DRAPLANE_RANDOM_E2E_EXAMPLES (default 6) sets the number of examples; bench runs take more.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draplane.api.core import Pod
from draplane.api.meta import ObjectMeta
from draplane.api.resource import (
    CELDeviceSelector,
    DeviceClaim,
    DeviceConstraint,
    DeviceRequest,
    DeviceSelector,
    DeviceTaint,
    DeviceTaintRule,
    DeviceTaintRuleSpec,
    DeviceTaintSelector,
    DeviceToleration,
    ExactDeviceRequest,
    ResourceClaim,
    ResourceClaimSpec,
)
from draplane.kube import KubeApiError
from draplane.simulation import scenario
from conftest import ensure_class, pod_scheduled_false  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("DRAPLANE_RANDOM_E2E_EXAMPLES", "6"))
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
# node suffix -> (GPUs, memory in Gi, product)
NODES = {"a": (4, 24, "NVIDIA L4"), "b": (4, 40, "NVIDIA A100-SXM4-40GB"), "c": (4, 80, "NVIDIA H100 80GB HBM3")}
FLAKY = "example.com/flaky"  # a taint on gpu-3 of node b, from the slice itself
MAINTENANCE = "example.com/maintenance"  # a DeviceTaintRule's, on gpu-0 of node c


@dataclass(frozen=True)
class ClaimShape:
    count: int
    min_memory: int | None  # Gi
    product: str | None
    same_root: bool
    admin: bool
    tolerate: bool

    def selector(self) -> str | None:
        parts = []
        if self.min_memory is not None:
            parts.append(f'device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("{self.min_memory}Gi")) >= 0')
        if self.product is not None:
            parts.append(f'device.attributes["gpu.nvidia.com"].productName == "{self.product}"')
        return " && ".join(parts) or None

    def device_ok(self, device: "Gpu") -> bool:
        """The drawn selector and the taints, in Python: the checker's own reading."""
        if self.min_memory is not None and device.memory < self.min_memory:
            return False
        if self.product is not None and device.product != self.product:
            return False
        return self.tolerate or not device.taints

    def claim(self, namespace: str, name: str, class_name: str) -> ResourceClaim:
        selector = self.selector()
        request = ExactDeviceRequest(
            device_class_name=class_name, count=self.count, admin_access=True if self.admin else None,
            selectors=[DeviceSelector(cel=CELDeviceSelector(expression=selector))] if selector else None,
            tolerations=[DeviceToleration(operator="Exists")] if self.tolerate else None,
        )
        constraints = [DeviceConstraint(requests=["gpu"], match_attribute=PCIE_ROOT)] if self.same_root else None
        return ResourceClaim(metadata=ObjectMeta(name=name, namespace=namespace), spec=ResourceClaimSpec(
            devices=DeviceClaim(requests=[DeviceRequest(name="gpu", exactly=request)], constraints=constraints)))


@dataclass(frozen=True)
class Gpu:
    node: str
    name: str
    memory: int
    product: str
    root: str
    taints: tuple[str, ...]


shapes = st.builds(
    ClaimShape,
    count=st.integers(1, 3),
    min_memory=st.sampled_from([None, None, 30, 60]),
    product=st.sampled_from([None, None, None, "NVIDIA L4", "NVIDIA H100 80GB HBM3"]),
    same_root=st.booleans(),
    admin=st.sampled_from([False, False, False, True]),
    tolerate=st.booleans(),
)


def fits_somewhere(shape: ClaimShape, gpus: list[Gpu], held: set[tuple[str, str]]) -> bool:
    """Whether any node has `count` devices that the shape accepts, free (unless admin), and under
    one PCIe root when asked: an exhaustive search, small enough here."""
    for node in {g.node for g in gpus}:
        usable = [g for g in gpus if g.node == node and shape.device_ok(g) and (shape.admin or (g.node, g.name) not in held)]
        for combo in itertools.combinations(usable, shape.count):
            if not shape.same_root or len({g.root for g in combo}) == 1:
                return True
    return False


async def cluster(scheduling, kube, suffix: str) -> tuple[str, list[Gpu]]:
    class_name = f"gpu-{suffix}"
    await ensure_class(kube, scenario.device_class(class_name))
    gpus = []
    for key, (count, memory, product) in NODES.items():
        node = f"rand-{key}-{suffix}"
        gpu_slice = scenario.gpu_slice(node, count, f"{memory}Gi", product=product)
        for device in gpu_slice.spec.devices:
            taints = ()
            if key == "b" and device.name == "gpu-3":
                device.taints = [DeviceTaint(key=FLAKY, effect="NoSchedule")]
                taints = (FLAKY,)
            if key == "c" and device.name == "gpu-0":
                taints = (MAINTENANCE,)
            gpus.append(Gpu(node, device.name, memory, product, device.attributes[PCIE_ROOT].string_value, taints))
        await scheduling.put_node(scenario.gpu_node(node), [gpu_slice])
    rule = DeviceTaintRule(metadata=ObjectMeta(name=f"maintenance-{suffix}"), spec=DeviceTaintRuleSpec(
        device_selector=DeviceTaintSelector(driver=scenario.GPU_DRIVER, pool=f"rand-c-{suffix}", device="gpu-0"),
        taint=DeviceTaint(key=MAINTENANCE, value="planned", effect="NoExecute")))
    await kube.create(rule)
    return class_name, gpus


def settled(pod: Pod | None) -> bool:
    """Bound, or judged against the nodes. A pod created a moment after its claim may first be
    told that the claim is not found (kube-scheduler says so too), and is looked at again once the
    claim shows up: not an end state."""
    if pod is None:
        return False
    condition = pod_scheduled_false(pod)
    return bool(pod.spec.node_name) or (condition is not None and "nodes are available" in condition.message)


async def settle(kube, namespace: str, names: list[str], timeout: float = 60.0) -> dict[str, Pod]:
    deadline = time.monotonic() + timeout
    while True:
        pods = {p.metadata.name: p for p in (await kube.list(Pod, namespace))[0]}
        if all(settled(pods.get(n)) for n in names):
            return pods
        if time.monotonic() > deadline:
            raise AssertionError(f"pods neither bound nor explained after {timeout}s: "
                                 f"{[n for n in names if not (pods.get(n) and pods[n].spec.node_name)]}")
        await asyncio.sleep(0.3)


async def test_random_claims_end_bound_and_valid_or_explained_and_really_unplaceable(scheduling, kube, namespace):
    suffix = namespace[-6:]
    await kube.request("PATCH", f"/api/v1/namespaces/{namespace}",
                       body={"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}},
                       content_type="application/merge-patch+json")
    class_name, gpus = await cluster(scheduling, kube, suffix)
    await scheduling.start(shards=2)
    by_device = {(g.node, g.name): g for g in gpus}
    examples = iter(range(10_000))

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.lists(shapes, min_size=1, max_size=6))
    def run(drawn: list[ClaimShape]) -> None:
        asyncio.run_coroutine_threadsafe(one_example(drawn, next(examples)), loop).result(timeout=300)

    async def one_example(drawn: list[ClaimShape], index: int) -> None:
        names = [f"e{index}-p{i}" for i in range(len(drawn))]
        for name, shape in zip(names, drawn):
            await kube.create(shape.claim(namespace, name, class_name))
            await kube.create(scheduling.pod(namespace, name, claim_name=name))
        try:
            pods = await settle(kube, namespace, names)
            await check(drawn, names, pods)
        finally:
            await cleanup(names)

    async def check(drawn, names, pods) -> None:
        claims = {c.metadata.name: c for c in (await kube.list(ResourceClaim, namespace))[0]}
        held: dict[tuple[str, str], str] = {}
        for name, shape in zip(names, drawn):
            pod = pods[name]
            if not pod.spec.node_name:
                continue
            allocation = claims[name].status.allocation
            results = allocation.devices.results
            assert len(results) == shape.count, (shape, results)
            assert [r.uid for r in claims[name].status.reserved_for] == [pod.metadata.uid]
            chosen = [by_device[(r.pool, r.device)] for r in results]
            assert {g.node for g in chosen} == {pod.spec.node_name}, (shape, results)
            assert all(shape.device_ok(g) for g in chosen), (shape, chosen)
            assert len({g.name for g in chosen}) == shape.count, chosen
            if shape.same_root:
                assert len({g.root for g in chosen}) == 1, (shape, chosen)
            assert all(bool(r.admin_access) == shape.admin for r in results), results
            if not shape.admin:
                for g in chosen:
                    assert (g.node, g.name) not in held, f"{g.node}/{g.name} given to {held[(g.node, g.name)]} and {name}"
                    held[(g.node, g.name)] = name
        for name, shape in zip(names, drawn):
            if pods[name].spec.node_name:
                continue
            message = pod_scheduled_false(pods[name]).message
            assert message.startswith("0/") and "nodes are available" in message, message
            if fits_somewhere(shape, gpus, set(held)):
                # A retry may still be on its way (the binder's backoff is at most 20 s): give it that.
                pods = await settle(kube, namespace, [name], timeout=5)
                deadline = time.monotonic() + 25
                while not pods[name].spec.node_name and time.monotonic() < deadline:
                    await asyncio.sleep(1)
                    pods = {p.metadata.name: p for p in (await kube.list(Pod, namespace))[0]}
                assert pods[name].spec.node_name, f"{name} ({shape}) fits on the free devices but stays pending: {message}"

    async def cleanup(names) -> None:
        for name in names:
            try:
                await kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                                   query={"gracePeriodSeconds": 0})
            except KubeApiError as exc:
                if not exc.is_not_found:
                    raise
            await kube.delete(ResourceClaim, name, namespace)
        deadline = time.monotonic() + 60
        while (await kube.list(ResourceClaim, namespace))[0]:
            assert time.monotonic() < deadline, "claims of deleted pods were not released"
            await asyncio.sleep(0.3)

    loop = asyncio.get_running_loop()
    try:
        await asyncio.to_thread(run)
    finally:
        await kube.delete(DeviceTaintRule, f"maintenance-{suffix}")
    for shard in scheduling.shards:
        assert shard.counters["errors"] == 0, shard.counters

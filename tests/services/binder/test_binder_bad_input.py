"""Bad input ends in an Event and a PodScheduled=False condition, and the services carry on."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from draplane.api.core import Pod
from draplane.simulation import scenario
from conftest import ensure_class, pod_scheduled_false  # noqa: E402  (tests/services/conftest.py)

pytestmark = pytest.mark.integration


async def events_for(kube, namespace: str, pod: str) -> list[dict]:
    """The scheduler's Events for a pod. kube-controller-manager's resourceclaim controller adds
    its own (FailedResourceClaimCreation for a missing template), as in a real cluster."""
    data = await kube.request("GET", f"/api/v1/namespaces/{namespace}/events")
    return [e for e in msgspec.json.decode(data)["items"]
            if e["involvedObject"]["name"] == pod and e["reason"] != "FailedResourceClaimCreation"]


async def test_bad_claims_and_missing_templates_are_explained(scheduling, kube, namespace):
    class_name = f"gpu-{uuid.uuid4().hex[:6]}"
    await ensure_class(kube, scenario.device_class(class_name))
    node = f"bad-{namespace[-6:]}"
    await scheduling.put_node(scenario.gpu_node(node), [scenario.gpu_slice(node, 2, "80Gi")])
    await scheduling.start()

    cases = {
        # pod name: (claim or None, template name or None, words expected in the condition)
        "unknown-class": (scenario.claim(namespace, "unknown-class", "no-such-class"), None, "no-such-class"),
        "bad-selector": (
            scenario.claim(namespace, "bad-selector", class_name,
                           selector='device.attributes["gpu.nvidia.com"].noSuchAttribute == "x"'),
            None, "noSuchAttribute",
        ),
        "too-many": (scenario.claim(namespace, "too-many", class_name, count=16), None, "1 node"),
        "no-template": (None, "no-such-template", 'resourceclaimtemplate "no-such-template" not found'),
    }
    for pod_name, (claim, template, _) in cases.items():
        if claim is not None:
            await kube.create(claim)
        await kube.create(scheduling.pod(namespace, pod_name, claim_name=claim.metadata.name if claim else None,
                                       template_name=template))

    for pod_name, (_, _, words) in cases.items():
        async def explained():
            pod = await kube.get(Pod, pod_name, namespace)
            return pod_scheduled_false(pod)

        condition = await scheduling.wait_for(explained, what=f"pod {pod_name} to be explained")
        assert condition.reason == "Unschedulable"
        assert words in condition.message, (pod_name, condition.message)
        events = await scheduling.wait_for(lambda: events_for(kube, namespace, pod_name),
                                           what=f"an event for pod {pod_name}")
        assert events and events[0]["reason"] == "FailedScheduling" and events[0]["type"] == "Warning"
        assert words in events[0]["message"]

    # a crash loop would show here: the services are still ready and still place a good pod
    assert scheduling.binder.ready and all(s.ready for s in scheduling.shards)
    await kube.create(scenario.claim(namespace, "good", class_name))
    await kube.create(scheduling.pod(namespace, "good", claim_name="good"))
    assert (await scheduling.bound_pod(namespace, "good")).spec.node_name == node
    # each bad pod was told once, not rewritten on every retry
    for pod_name in cases:
        assert len(await events_for(kube, namespace, pod_name)) == 1

"""The seed's verbatim objects against the real apiserver: the two problems DESIGN.md names.

The apiserver's exact messages are recorded in tests/fixtures/apiserver_messages.json; `draplane
lint` is held to naming the same fields with a fix, in words a user can act on.
"""

import json
from pathlib import Path

import pytest
import yaml

from draplane.kube import KubeApiError

pytestmark = pytest.mark.integration

MESSAGES = Path(__file__).resolve().parents[2] / "fixtures" / "apiserver_messages.json"
FIXED_CLASS = 'device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))'
NEUTRAL_CLASS = (
    '"memory" in device.capacity[device.driver] && '
    'device.capacity[device.driver].memory.isGreaterThan(quantity("40Gi"))'
)


def _load(seed_example_dir, name):
    return yaml.safe_load((seed_example_dir / name).read_text())


async def _create(kube, raw, namespace=None, strict=False):
    if namespace:
        raw.setdefault("metadata", {})["namespace"] = namespace
    from draplane.kube.client import raw_collection_path

    return await kube.request(
        "POST", raw_collection_path(raw), body=raw, query={"fieldValidation": "Strict" if strict else None}
    )


def _recorded():
    return json.loads(MESSAGES.read_text())


async def test_seed_device_class_is_rejected_for_the_cel_type_error(kube, seed_example_dir):
    raw = _load(seed_example_dir, "deviceclass.yaml")
    raw["metadata"]["name"] = "seed-high-memory-gpu-verbatim"
    with pytest.raises(KubeApiError) as caught:
        await _create(kube, raw)
    assert caught.value.status == 422
    message = caught.value.message.replace("seed-high-memory-gpu-verbatim", "high-memory-gpu")
    assert "spec.selectors[0].cel.expression" in message
    assert "no matching overload for 'isGreaterThan'" in message
    assert message == _recorded()["deviceclass"]


async def test_seed_claim_is_rejected_for_the_v1beta1_shaped_request(kube, seed_example_dir, namespace):
    raw = _load(seed_example_dir, "resourceclaim.yaml")
    with pytest.raises(KubeApiError) as caught:
        await _create(kube, dict(raw), namespace)
    assert caught.value.status == 422
    message = caught.value.message.replace(namespace, "NAMESPACE")
    assert "spec.devices.requests[0]" in message
    assert message == _recorded()["resourceclaim"]

    # kubectl asks for strict field validation: then the misplaced fields themselves are named.
    with pytest.raises(KubeApiError) as strict:
        await _create(kube, _load(seed_example_dir, "resourceclaim.yaml"), namespace, strict=True)
    strict_message = strict.value.message.replace(namespace, "NAMESPACE")
    assert 'unknown field "spec.devices.requests[0].deviceClassName"' in strict_message
    assert strict_message == _recorded()["resourceclaim_strict"]


@pytest.mark.parametrize("expression", [FIXED_CLASS, NEUTRAL_CLASS], ids=["gpu-domain", "driver-neutral"])
async def test_corrected_objects_are_accepted(kube, seed_example_dir, namespace, expression):
    device_class = _load(seed_example_dir, "deviceclass.yaml")
    device_class["metadata"]["name"] = f"high-memory-gpu-{namespace[-6:]}"
    device_class["spec"]["selectors"][0]["cel"]["expression"] = expression
    await _create(kube, device_class, strict=True)

    claim = _load(seed_example_dir, "resourceclaim.yaml")
    request = claim["spec"]["devices"]["requests"][0]
    request["exactly"] = {"deviceClassName": device_class["metadata"]["name"], "count": request.pop("count")}
    del request["deviceClassName"]
    await _create(kube, claim, namespace, strict=True)

    pod = _load(seed_example_dir, "pod.yaml")  # the Pod is valid verbatim
    await _create(kube, pod, namespace, strict=True)


def test_the_shipped_example_is_the_article_s_own(seed_example_dir, shared_dir):
    """examples/seed-vllm holds the article's files unchanged, mistakes included."""
    for name in ("deviceclass.yaml", "resourceclaim.yaml", "pod.yaml"):
        assert (seed_example_dir / name).read_text() == (shared_dir / "examples" / "seed-vllm" / name).read_text(), name

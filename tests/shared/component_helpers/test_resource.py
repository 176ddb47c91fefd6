"""What a pod asks of its node (draplane.component_helpers.resource)."""

import msgspec
import pytest

from draplane.api.core import Pod
from draplane.component_helpers.errors import SpecError
from draplane.component_helpers.resource import pod_requests


def make_pod(name="p", containers=None, init=None, overhead=None) -> Pod:
    raw_spec = {"containers": [{"name": f"c{i}", "resources": {"requests": r}} for i, r in enumerate(containers or [{}])]}
    if init is not None:
        raw_spec["initContainers"] = [{"name": f"i{i}", "resources": {"requests": r}} for i, r in enumerate(init)]
    if overhead is not None:
        raw_spec["overhead"] = overhead
    return msgspec.convert({"metadata": {"name": name}, "spec": raw_spec}, Pod)


def test_requests_sum_containers_take_max_init_and_add_overhead():
    pod = make_pod(
        containers=[{"cpu": "500m", "memory": "1Gi"}, {"cpu": "250m", "nvidia.com/gpu": "1"}],
        init=[{"cpu": "2", "memory": "100Mi"}, {"cpu": "100m", "memory": "3Gi"}],
        overhead={"cpu": "10m", "memory": "1Mi"},
    )
    assert pod_requests(pod) == {"cpu": 2010, "memory": 3 * 2**30 + 2**20, "nvidia.com/gpu": 1}


def test_request_defaults_to_limit_and_rounds_up():
    pod = msgspec.convert(
        {"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "c", "resources": {"limits": {"cpu": "1", "memory": "1500m"}, "requests": {"cpu": "0.0005"}}}
        ]}},
        Pod,
    )
    # 0.5 millicores rounds up to 1, 1.5 bytes to 2.
    assert pod_requests(pod) == {"cpu": 1, "memory": 2}


def test_bad_quantity_names_pod_and_field():
    pod = make_pod(name="web", containers=[{"cpu": "lots"}])
    with pytest.raises(SpecError, match=r"pod web: spec.containers\[0\].resources.requests\['cpu'\]"):
        pod_requests(pod)

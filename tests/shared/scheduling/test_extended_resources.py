"""Extended resources backed by DRA (KEP-5004), pure: which resources DRA serves, the claim's
requests and the pod's request mappings, as kube-scheduler 1.37 builds them."""

from __future__ import annotations

import pytest

from draplane.api.core import Container, Pod, PodSpec, ResourceRequirements
from draplane.api.meta import ObjectMeta
from draplane.api.resource import DeviceClass, DeviceClassSpec
from draplane.scheduling import extended_resources as er

GPU = "nvidia.com/gpu"


def device_class(name: str, resource: str | None = None, created: str = "2026-01-01T00:00:00Z") -> DeviceClass:
    return DeviceClass(metadata=ObjectMeta(name=name, creation_timestamp=created),
                       spec=DeviceClassSpec(extended_resource_name=resource))


def container(name: str, restart: str | None = None, **requests: int) -> Container:
    amounts = {k.replace("__", "/").replace("_", "."): str(v) for k, v in requests.items()}
    return Container(name=name, restart_policy=restart, resources=ResourceRequirements(requests=amounts, limits=amounts))


def pod(containers, init=()) -> Pod:
    return Pod(metadata=ObjectMeta(name="web", namespace="ns", uid="pod-uid"),
               spec=PodSpec(containers=list(containers), init_containers=list(init) or None))


def test_names_that_dra_may_back():
    assert er.is_dra_extended_resource_name("nvidia.com/gpu")
    assert er.is_dra_extended_resource_name("deviceclass.resource.kubernetes.io/gpu")
    for native in ("cpu", "memory", "kubernetes.io/something", "requests.nvidia.com/gpu", "hugepages-2Mi"):
        assert not er.is_dra_extended_resource_name(native), native


def test_the_newest_class_naming_a_resource_wins_and_every_class_has_its_implicit_name():
    resolver = er.ClassResolver([device_class("old", GPU, "2026-01-01T00:00:00Z"),
                                 device_class("new", GPU, "2026-02-01T00:00:00Z"),
                                 device_class("also-new", GPU, "2026-02-01T00:00:00Z")])
    assert resolver.class_for(GPU).metadata.name == "also-new"  # equal age: the lower name
    assert resolver.class_for("deviceclass.resource.kubernetes.io/old").metadata.name == "old"
    assert resolver.class_for("example.com/other") is None


def test_a_resource_some_node_offers_keeps_the_device_plugin_path():
    p = pod([container("main", nvidia_com__gpu=2)])
    resolver = er.ClassResolver([device_class("gpu", GPU)])
    assert er.dra_backed_resources(p, resolver, offered=lambda r: False) == {GPU: "gpu"}
    assert er.dra_backed_resources(p, resolver, offered=lambda r: r == GPU) == {}
    assert er.dra_backed_resources(pod([container("main", cpu=2)]), resolver, offered=lambda r: False) == {}


def test_requests_per_container_and_init_containers_reuse_what_later_ones_ask_for():
    p = pod([container("a", nvidia_com__gpu=2), container("b", cpu=1, nvidia_com__gpu=1)],
            init=[container("setup", nvidia_com__gpu=3), container("sidecar", "Always", nvidia_com__gpu=1)])
    requests, mappings = er.claim_requests(p, {GPU: "gpu"})
    # containers: 0 setup (init), 1 sidecar (init, long-lived), 2 a, 3 b; b's gpu is its 2nd sorted request
    assert [(r.name, r.exactly.count, r.exactly.device_class_name) for r in requests] == [
        ("container-1-request-0", 1, "gpu"), ("container-2-request-0", 2, "gpu"), ("container-3-request-1", 1, "gpu")]
    by_container = {}
    for m in mappings:
        by_container.setdefault(m["containerName"], []).append(m["requestName"])
    assert by_container["a"] == ["container-2-request-0"] and by_container["b"] == ["container-3-request-1"]
    assert by_container["sidecar"] == ["container-1-request-0"]
    # setup needs 3: it reuses what the sidecar, a (and b) hold from its position on, 1 + 2 = 3
    assert by_container["setup"] == ["container-1-request-0", "container-2-request-0"]


def test_the_largest_init_request_serves_every_init_container_that_needs_its_own():
    p = pod([container("main", cpu=1)], init=[container("one", nvidia_com__gpu=1), container("two", nvidia_com__gpu=2)])
    requests, mappings = er.claim_requests(p, {GPU: "gpu"})
    assert [(r.name, r.exactly.count) for r in requests] == [("container-1-request-0", 2)]
    assert {m["containerName"]: m["requestName"] for m in mappings} == {"one": "container-1-request-0",
                                                                       "two": "container-1-request-0"}


def test_a_fraction_of_a_device_is_refused_naming_the_container():
    p = pod([container("main")])
    p.spec.containers[0].resources.requests = {GPU: "500m"}
    resolver = er.ClassResolver([device_class("gpu", GPU)])
    with pytest.raises(er.ExtendedResourceError, match=r"container main: resources.requests\['nvidia.com/gpu'\]"):
        er.dra_backed_resources(p, resolver, offered=lambda r: False)


def test_the_special_claim_is_owned_by_the_pod_and_found_again():
    p = pod([container("main", nvidia_com__gpu=1)])
    requests, _ = er.claim_requests(p, {GPU: "gpu"})
    claim = er.special_claim(p, requests)
    assert claim.metadata.generate_name == "web-extended-resources-"
    assert claim.metadata.owner_references[0].uid == "pod-uid" and claim.metadata.owner_references[0].controller
    claim.metadata.name = "web-extended-resources-x1"
    assert er.find_special_claim(p, [claim]) is claim
    claim.metadata.annotations = {}
    assert er.find_special_claim(p, [claim]) is None

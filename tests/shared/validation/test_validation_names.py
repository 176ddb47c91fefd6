"""Name formats: the same accept/reject decisions as k8s.io/apimachinery's validators."""

import pytest

from draplane.validation import names


@pytest.mark.parametrize("value", ["a", "gpu-0", "0gpu", "a" * 63])
def test_dns_label_accepts(value):
    assert names.dns1123_label(value) == []


@pytest.mark.parametrize("value", ["", "-a", "a-", "GPU", "a.b", "a_b", "a" * 64])
def test_dns_label_rejects(value):
    assert names.dns1123_label(value)


@pytest.mark.parametrize("value", ["gpu.nvidia.com", "high-memory-gpu", "a", "a" * 63 + "." + "b" * 63])
def test_dns_subdomain_accepts(value):
    assert names.dns1123_subdomain(value) == []


@pytest.mark.parametrize("value", ["", "a..b", ".a", "A.b", "a_b", "x" * 254])
def test_dns_subdomain_rejects(value):
    assert names.dns1123_subdomain(value)


def test_driver_name_is_case_insensitive_and_short():
    assert names.driver_name("GPU.Example.com") == []
    assert names.driver_name("a" * 64)
    assert names.driver_name("bad_driver")


@pytest.mark.parametrize("value", ["memory", "pcieRoot", "_x", "gpu.nvidia.com/memory", "resource.kubernetes.io/pcieRoot"])
def test_qualified_device_name_accepts(value):
    assert names.qualified_device_name(value) == []


@pytest.mark.parametrize("value", ["0memory", "a-b", "gpu.nvidia.com/", "/memory", "a/b/c", "x" * 33, "bad_dom/x"])
def test_qualified_device_name_rejects(value):
    assert names.qualified_device_name(value)


def test_fully_qualified_name_needs_a_domain():
    assert names.fully_qualified_device_name("resource.kubernetes.io/pcieRoot") == []
    assert any("domain" in m for m in names.fully_qualified_device_name("pcieRoot"))


@pytest.mark.parametrize("value", ["app", "example.com/app", "a.b-c_d"])
def test_label_key_accepts(value):
    assert names.label_key(value) == []


@pytest.mark.parametrize("value", ["", "-app", "example.com/", "a/b/c", "Example_.com/x", "x" * 64])
def test_label_key_rejects(value):
    assert names.label_key(value)


def test_label_value():
    assert names.label_value("") == []
    assert names.label_value("v1.2_x") == []
    assert names.label_value("-x")
    assert names.label_value("x" * 64)


@pytest.mark.parametrize("value", ["1.2.3", "12.4.0-rc.1", "1.0.0+build.5", "0.0.0-alpha"])
def test_semver_accepts(value):
    assert names.SEMVER.match(value)


@pytest.mark.parametrize("value", ["1.2", "v1.2.3", "01.2.3", "1.2.3-", "1.2.3.4"])
def test_semver_rejects(value):
    assert not names.SEMVER.match(value)


def test_extended_resource_name():
    assert names.is_extended_resource_name("example.com/gpu")
    assert not names.is_extended_resource_name("gpu")
    assert not names.is_extended_resource_name("kubernetes.io/gpu")


def test_fix_helpers_produce_valid_names():
    assert names.dns1123_label(names.to_dns_label("My_GPU 0")) == []
    assert names.dns1123_subdomain(names.to_dns_subdomain("High.Memory_GPU")) == []
    assert names.c_identifier(names.to_c_identifier("0-memory")) == []


def test_declared_fully_qualified_name_skips_names_with_several_slashes():
    # What kube-apiserver v1.37 does for matchAttribute and friends (checked in the conformance test).
    assert names.declared_fully_qualified_name("a/b/c") == []
    assert names.declared_fully_qualified_name("x.io/0bad")
    assert names.fully_qualified_device_name("a/b/c")

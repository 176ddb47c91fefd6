"""Builders for small valid objects that each test breaks in one place."""

from __future__ import annotations

import copy
from typing import Any

import pytest


def claim(requests: list[dict[str, Any]] | None = None, **devices: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "claim-a", "namespace": "default"},
        "spec": {"devices": {"requests": requests if requests is not None else [exact("gpu")], **devices}},
    }


def exact(name: str, class_name: str = "gpu-class", **fields: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": class_name, **fields}}


def device(name: str, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"productName": {"string": "H100"}, "resource.kubernetes.io/pcieRoot": {"string": "pci0"}},
        "capacity": {"memory": {"value": "80Gi"}},
        **fields,
    }


_DEFAULT: Any = object()


def resource_slice(devices: list[dict[str, Any]] | None = _DEFAULT, **spec: Any) -> dict[str, Any]:
    """A valid node-local slice; devices=None leaves the devices out, a None spec value removes that field."""
    body: dict[str, Any] = {
        "driver": "gpu.nvidia.com",
        "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
        "nodeName": "node-1",
        "devices": [device("gpu-0"), device("gpu-1")] if devices is _DEFAULT else devices,
    }
    body.update(spec)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "node-1-gpu"},
            "spec": {k: v for k, v in body.items() if v is not None}}


def device_class(*expressions: str, name: str = "gpu-class", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": e}} for e in expressions], **spec},
    }


def fields(problems) -> list[str]:
    return [p.field for p in problems]


@pytest.fixture
def build():
    class Build:
        pass

    b = Build()
    b.claim, b.exact, b.device, b.slice, b.device_class = claim, exact, device, resource_slice, device_class
    b.copy = copy.deepcopy
    b.fields = fields
    return b

"""The seed's vLLM example: exactly the two problems DESIGN.md names, and the corrected objects are clean."""

from pathlib import Path

import pytest
import yaml

from draplane.api.codec import load_files
from draplane.validation import validate_objects, validate_typed

REPO = Path(__file__).resolve().parents[3]
FIXED = REPO / "examples" / "seed-vllm-fixed"

NEUTRAL = ('"memory" in device.capacity[device.driver] && '
           'device.capacity[device.driver].memory.isGreaterThan(quantity("40Gi"))')
QUALIFIED = 'device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))'


def documents(folder: Path):
    return [(str(path), yaml.safe_load(path.read_text())) for path in sorted(folder.glob("*.yaml"))]


@pytest.fixture
def seed_dir(seed_example_dir):
    folder = seed_example_dir
    if not folder.is_dir():
        pytest.skip(f"the seed example is not at {folder}")
    return folder


def test_seed_has_exactly_the_two_documented_problems(seed_dir):
    problems = validate_objects(documents(seed_dir))
    assert [(p.kind, p.name, p.field) for p in problems] == [
        ("DeviceClass", "high-memory-gpu", "spec.selectors[0].cel.expression"),
        ("ResourceClaim", "vllm-gpu-claim", "spec.devices.requests[0]"),
    ]
    cel, shape = problems
    assert cel.source.endswith("deviceclass.yaml")
    assert "keyed by domain first" in cel.message
    assert QUALIFIED in cel.fix and NEUTRAL in cel.fix
    assert "v1beta1" in shape.message and "`exactly:`" in shape.message
    assert "spec.devices.requests[0].deviceClassName" in shape.message
    assert "spec.devices.requests[0].count" in shape.message
    assert "- name: gpu\n  exactly:\n    deviceClassName: high-memory-gpu\n    count: 1" in shape.fix
    assert str(shape).startswith('ResourceClaim "vllm-gpu-claim" is invalid: spec.devices.requests[0]: Unknown field: ')


def test_fixed_seed_objects_are_valid():
    assert sorted(p.name for p in FIXED.glob("*.yaml")) == ["deviceclass.yaml", "pod.yaml", "resourceclaim.yaml"]
    assert validate_objects(documents(FIXED)) == []
    for obj in load_files(sorted(FIXED.glob("*.yaml"))):
        assert validate_typed(obj) == []


def test_fixed_class_uses_the_driver_neutral_expression_and_claim_uses_exactly():
    cls = yaml.safe_load((FIXED / "deviceclass.yaml").read_text())
    assert cls["spec"]["selectors"][0]["cel"]["expression"] == NEUTRAL
    claim = yaml.safe_load((FIXED / "resourceclaim.yaml").read_text())
    assert claim["spec"]["devices"]["requests"] == [
        {"name": "gpu", "exactly": {"deviceClassName": "high-memory-gpu", "count": 1}}]


def test_fixed_pod_is_the_seed_pod(seed_dir):
    assert (FIXED / "pod.yaml").read_text() == (seed_dir / "pod.yaml").read_text()

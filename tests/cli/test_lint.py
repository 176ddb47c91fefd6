"""`draplane lint`: exit codes, what it prints for each problem, the seed's two problems, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draplane.cli import main

REPO = Path(__file__).resolve().parents[2]
FIXED = REPO / "examples" / "seed-vllm-fixed"
APISERVER_MESSAGES = REPO / "tests" / "fixtures" / "apiserver_messages.json"


@pytest.fixture
def seed_dir(seed_example_dir):
    folder = seed_example_dir
    if not folder.is_dir():
        pytest.skip(f"the seed example is not at {folder}")
    return folder


def lint(capsys, *args) -> tuple[int, str, str]:
    code = main(["lint", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, name: str, *objects) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    return path


def slice_with(n_devices: int, duplicate: bool = False) -> dict:
    devices = [{"name": f"gpu-{i}", "capacity": {"memory": {"value": "80Gi"}}} for i in range(n_devices)]
    if duplicate:
        devices.append(dict(devices[0]))
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "node-1-gpu"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-1", "devices": devices,
                     "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1}}}


def claim_with(requests: list[dict]) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "big"},
            "spec": {"devices": {"requests": requests}}}


def test_seed_reports_both_documented_problems(capsys, seed_dir):
    code, out, err = lint(capsys, *sorted(seed_dir.glob("*.yaml")))
    assert code == 1
    assert err == ""
    # Object, field and fix for the CEL problem, with both corrected expressions.
    assert f"{seed_dir / 'deviceclass.yaml'}: DeviceClass high-memory-gpu" in out
    assert "spec.selectors[0].cel.expression: Invalid value" in out
    assert 'fix: device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))' in out
    assert ('"memory" in device.capacity[device.driver] && '
            'device.capacity[device.driver].memory.isGreaterThan(quantity("40Gi"))') in out
    # Object, field and the corrected YAML for the v1beta1 request shape.
    assert f"{seed_dir / 'resourceclaim.yaml'}: ResourceClaim vllm-gpu-claim" in out
    assert "spec.devices.requests[0]: Unknown field" in out
    assert "v1beta1" in out
    assert ("         - name: gpu\n           exactly:\n             deviceClassName: high-memory-gpu\n"
            "             count: 1\n") in out
    assert "2 problems in 2 of 3 objects" in out
    assert "Pod" not in out  # the seed's pod is fine


def test_fixed_seed_is_clean(capsys):
    code, out, err = lint(capsys, *sorted(FIXED.glob("*.yaml")))
    assert (code, err) == (0, "")
    assert out == "3 objects checked: no problems\n"


def test_a_folder_is_linted_file_by_file(capsys, seed_dir):
    code, out, _ = lint(capsys, seed_dir)
    assert code == 1
    assert "2 problems in 2 of 3 objects" in out
    code, out, _ = lint(capsys, FIXED)
    assert (code, out) == (0, "3 objects checked: no problems\n")


def test_stdin(capsys, monkeypatch, seed_dir):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO((seed_dir / "resourceclaim.yaml").read_text()))
    code, out, _ = lint(capsys, "-")
    assert code == 1
    assert "<stdin>: ResourceClaim vllm-gpu-claim" in out


def test_json_output(capsys, seed_dir):
    code, out, _ = lint(capsys, "-o", "json", seed_dir / "resourceclaim.yaml")
    assert code == 1
    [problem] = json.loads(out)
    assert problem["kind"] == "ResourceClaim" and problem["name"] == "vllm-gpu-claim"
    assert problem["field"] == "spec.devices.requests[0]"
    assert "exactly:" in problem["fix"]
    assert problem["source"] == str(seed_dir / "resourceclaim.yaml")


def test_not_yaml_is_exit_2_and_other_files_are_still_checked(capsys, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: [unclosed\n  - : :")
    bad = write(tmp_path, "slice.yaml", slice_with(129))
    code, out, err = lint(capsys, broken, bad)
    assert code == 2
    assert f"{broken}: not valid YAML or JSON" in err
    assert "spec.devices: Too many" in out


def test_missing_file_is_exit_2(capsys, tmp_path):
    code, out, err = lint(capsys, tmp_path / "nope.yaml")
    assert code == 2
    assert "nope.yaml: cannot read: No such file or directory" in err


def test_yaml_that_is_not_a_kubernetes_object(capsys, tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- just\n- a list\n")
    code, out, _ = lint(capsys, path)
    assert code == 1
    assert "Not a Kubernetes object" in out and "a list of 2 items" in out
    path.write_text("name: x\nspec: {}\n")
    code, out, _ = lint(capsys, path)
    assert code == 1
    assert "has no apiVersion or kind" in out
    assert "fix: start it with apiVersion: resource.k8s.io/v1" in out


def test_kinds_of_other_groups_are_passed_over_and_a_misspelt_dra_kind_is_not(capsys, tmp_path):
    path = write(tmp_path, "deploy.yaml", {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}},
                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}})
    code, out, _ = lint(capsys, path)
    assert code == 0, out
    assert "2 objects of other kinds not checked: Deployment web, Namespace team" in out
    path = write(tmp_path, "typo.yaml", {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClas", "metadata": {"name": "x"}})
    code, out, _ = lint(capsys, path)
    assert code == 1
    assert "DeviceClas x" in out and "kind: Unsupported value" in out


def test_yaml_1_1_booleans_are_read_as_kubectl_reads_them(capsys, tmp_path):
    path = tmp_path / "class.yaml"
    path.write_text("apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: n\n")
    code, out, _ = lint(capsys, path)
    assert code == 1
    assert "metadata.name: " in out and "must be a string, got a boolean" in out, out
    assert 'quote the value you meant, such as "n"' in out
    path.write_text("apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: \"n\"\n")
    assert lint(capsys, path)[0] == 0


def test_a_namespace_in_the_same_input_allows_admin_access(capsys, tmp_path):
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "watch", "namespace": "ops"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu", "adminAccess": True}}]}}}
    alone = write(tmp_path, "claim.yaml", claim)
    code, out, _ = lint(capsys, alone)
    assert code == 1 and "adminAccess" in out
    namespace = {"apiVersion": "v1", "kind": "Namespace",
                 "metadata": {"name": "ops", "labels": {"resource.kubernetes.io/admin-access": "true"}}}
    assert lint(capsys, write(tmp_path, "both.yaml", namespace, claim))[0] == 0
    other = {**claim, "metadata": {"name": "watch", "namespace": "elsewhere"}}
    assert lint(capsys, write(tmp_path, "other.yaml", namespace, other))[0] == 1


def test_device_taint_rules(capsys, tmp_path):
    rule = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": "maintenance"},
            "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": "node-1"},
                     "taint": {"key": "example.com/maintenance", "value": "true", "effect": "NoSchedule"}}}
    assert lint(capsys, write(tmp_path, "rule.yaml", rule))[0] == 0
    for effect in ("None", "NoExecute"):
        ok = {**rule, "spec": {**rule["spec"], "taint": {**rule["spec"]["taint"], "effect": effect}}}
        assert lint(capsys, write(tmp_path, "rule.yaml", ok))[0] == 0
    bad = {**rule, "spec": {"deviceSelector": {"pool": "Node_1", "device": "GPU 0", "deviceClassName": "gpu"},
                            "taint": {"key": "-bad", "effect": "PreferNoSchedule"}}}
    code, out, _ = lint(capsys, write(tmp_path, "bad.yaml", bad))
    assert code == 1
    for field in ("spec.deviceSelector.pool", "spec.deviceSelector.device", "spec.deviceSelector.deviceClassName",
                  "spec.taint.key", "spec.taint.effect"):
        assert f"{field}: " in out, (field, out)


def test_oversized_objects(capsys, tmp_path):
    requests = [{"name": f"r{i}", "exactly": {"deviceClassName": "gpu"}} for i in range(33)]
    path = write(tmp_path, "big.yaml", slice_with(129), claim_with(requests))
    code, out, _ = lint(capsys, path)
    assert code == 1
    assert f"{path} (document 1): ResourceSlice node-1-gpu" in out
    assert "spec.devices: Too many\n    129 devices; the v1 API allows at most 128" in out
    assert f"{path} (document 2): ResourceClaim big" in out
    assert "spec.devices.requests: Too many\n    33 requests; the v1 API allows at most 32" in out
    assert out.count("fix: ") == 2


def test_duplicate_names(capsys, tmp_path):
    requests = [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}] * 2
    path = write(tmp_path, "dup.yaml", slice_with(2, duplicate=True), claim_with(requests))
    code, out, _ = lint(capsys, path)
    assert code == 1
    assert "spec.devices[2]: Duplicate value" in out
    assert "spec.devices.requests[1]: Duplicate value" in out


def test_list_kind_items_are_checked_one_by_one(capsys, tmp_path):
    items = [slice_with(1), claim_with([{"name": "gpu"}])]
    path = write(tmp_path, "list.yaml", {"apiVersion": "v1", "kind": "List", "items": items})
    code, out, _ = lint(capsys, path)
    assert code == 1
    assert f"{path} items[1]: ResourceClaim big" in out
    assert "spec.devices.requests[0]: Required value" in out


def test_entry_point_runs_as_a_command(seed_dir):
    done = subprocess.run([sys.executable, "-m", "draplane.cli", "lint", str(seed_dir / "deviceclass.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "spec.selectors[0].cel.expression" in done.stdout
    assert "Traceback" not in done.stderr


# What a v1.37 apiserver answers for the seed, in its own words (kubectl's strict mode is the third);
# the recorded file from a real apiserver, when present, is held to the same standard below.
APISERVER_STYLE = {
    "deviceclass": 'DeviceClass.resource.k8s.io "high-memory-gpu" is invalid: spec.selectors[0].cel.expression: '
                   'Invalid value: "device.capacity[\\"memory\\"].isGreaterThan(quantity(\\"40Gi\\"))": compilation '
                   "failed: ERROR: <input>:1:40: found no matching overload for 'isGreaterThan' applied to "
                   "'map(string, kubernetes.Quantity).(kubernetes.Quantity)'",
    "resourceclaim": 'ResourceClaim.resource.k8s.io "vllm-gpu-claim" is invalid: spec.devices.requests[0]: Required '
                     "value: exactly one of `exactly` or `firstAvailable` is required",
    "resourceclaim_strict": 'ResourceClaim in version "v1" cannot be handled as a ResourceClaim: strict decoding '
                            'error: unknown field "spec.devices.requests[0].count", unknown field '
                            '"spec.devices.requests[0].deviceClassName"',
}


def assert_lint_covers(recorded, problems):
    """For every field an apiserver message names, lint has a problem there (or naming it) with a fix."""
    cases = list(_iter_cases(recorded))
    assert cases
    for case in cases:
        fields = _fields_in(case["message"])
        assert fields, f"no field path in the apiserver message {case['message']!r}"
        mine = [p for p in problems if p.kind == case.get("kind", p.kind)]
        for field in fields:
            covering = [p for p in mine if p.field == field or field.startswith(p.field + ".") or field in p.message]
            assert covering, f"lint names no problem at {field} (apiserver: {case['message']!r})"
            for problem in covering:
                assert problem.fix, f"no fix for {problem}"
                # Clearer: lint explains in its own words rather than repeating the apiserver's detail.
                detail = case["message"].split(field, 1)[-1]
                assert problem.message not in detail


def _seed_problems(seed_dir):
    from draplane.validation import validate_objects

    return validate_objects([(str(p), yaml.safe_load(p.read_text())) for p in sorted(seed_dir.glob("*.yaml"))])


def test_lint_names_the_fields_an_apiserver_names_and_gives_a_fix(seed_dir):
    assert_lint_covers(APISERVER_STYLE, _seed_problems(seed_dir))


def test_lint_names_the_fields_the_recorded_apiserver_named(seed_dir):
    if not APISERVER_MESSAGES.exists():
        pytest.skip("tests/fixtures/apiserver_messages.json is not recorded yet")
    text = APISERVER_MESSAGES.read_text().strip()
    recorded = json.loads(text) if text else None
    if not recorded:
        pytest.skip("tests/fixtures/apiserver_messages.json is still empty")
    assert_lint_covers(recorded, _seed_problems(seed_dir))


def _iter_cases(recorded):
    """Accepts a list of {kind, message} or a mapping of name -> message / {message: ...}."""
    items = recorded.items() if isinstance(recorded, dict) else enumerate(recorded)
    for key, value in items:
        if isinstance(value, str):
            yield {"message": value, **({"kind": _kind_of(key)} if _kind_of(key) else {})}
        elif isinstance(value, dict):
            message = value.get("message") or value.get("error") or json.dumps(value)
            kind = value.get("kind") or _kind_of(str(key))
            yield {"message": message, **({"kind": kind} if kind else {})}


def _kind_of(key) -> str | None:
    text = str(key).lower()
    if "class" in text:
        return "DeviceClass"
    if "claim" in text:
        return "ResourceClaim"
    return None


def _fields_in(message: str) -> list[str]:
    import re

    return sorted(set(re.findall(r"\b(?:spec|metadata)(?:\.[A-Za-z]+(?:\[\d+\])*)+", message)))


def test_admin_access_flag(capsys, tmp_path):
    claim = claim_with([{"name": "gpu", "exactly": {"deviceClassName": "gpu", "adminAccess": True}}])
    path = write(tmp_path, "admin.yaml", claim)
    code, out, _ = lint(capsys, path)
    assert code == 1
    assert "spec.devices.requests[0].adminAccess: Forbidden" in out
    code, out, _ = lint(capsys, "--admin-access", path)
    assert (code, out) == (0, "1 object checked: no problems\n")

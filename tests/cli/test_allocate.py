"""`draplane allocate`: exit codes, output as kube-scheduler writes it, and one-line errors."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from draplane.cli import main

SEED = Path("/work/shared/examples/seed-vllm")
if not SEED.exists():
    SEED = Path(__file__).resolve().parents[3] / "shared" / "examples" / "seed-vllm"

GPU_CLASS = """
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: high-memory-gpu
spec:
  selectors:
  - cel:
      expression: device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))
"""

SLICES = """
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata:
  name: node-a-gpu
spec:
  driver: gpu.nvidia.com
  nodeName: node-a
  pool: {name: node-a, generation: 1, resourceSliceCount: 1}
  devices:
  - name: gpu-0
    attributes:
      productName: {string: NVIDIA L4}
      resource.kubernetes.io/pcieRoot: {string: pci0000:00}
    capacity:
      memory: {value: 24Gi}
  - name: gpu-1
    attributes:
      productName: {string: NVIDIA H100}
      resource.kubernetes.io/pcieRoot: {string: pci0000:01}
    capacity:
      memory: {value: 80Gi}
---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata:
  name: node-b-gpu
spec:
  driver: gpu.nvidia.com
  nodeName: node-b
  pool: {name: node-b, generation: 1, resourceSliceCount: 1}
  devices:
  - name: gpu-0
    attributes:
      productName: {string: NVIDIA A100}
    capacity:
      memory: {value: 40Gi}
"""

CLAIM = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: vllm-gpu-claim
  namespace: default
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: high-memory-gpu
        count: 1
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["allocate", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def inputs(tmp_path: Path, claim: str = CLAIM, cls: str = GPU_CLASS, slices: str = SLICES) -> list[str]:
    return [write(tmp_path, "class.yaml", cls), write(tmp_path, "slices.yaml", slices), write(tmp_path, "claim.yaml", claim)]


def test_allocates_the_corrected_seed_claim(tmp_path, capsys):
    code, out, err = run(capsys, *inputs(tmp_path))
    assert code == 0, err
    claim = yaml.safe_load(out)
    assert claim["kind"] == "ResourceClaim" and claim["metadata"]["name"] == "vllm-gpu-claim"
    allocation = claim["status"]["allocation"]
    assert allocation["devices"]["results"] == [
        {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-1"}
    ]
    assert allocation["nodeSelector"] == {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}]
    }


def test_json_output_and_node_flag(tmp_path, capsys):
    code, out, err = run(capsys, "-o", "json", "--node", "node-b", *inputs(tmp_path))
    assert code == 1  # node-b's 40Gi GPU is not greater than 40Gi
    assert "node-b" in err and "high-memory-gpu" in err
    code, out, _ = run(capsys, "-o", "json", "--node", "node-a", "--policy", "first-fit", *inputs(tmp_path))
    assert code == 0
    assert json.loads(out)["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-1"


def test_allocated_claims_are_in_use(tmp_path, capsys):
    taken = CLAIM.replace("vllm-gpu-claim", "other") + textwrap.dedent("""
    status:
      allocation:
        devices:
          results:
          - {request: gpu, driver: gpu.nvidia.com, pool: node-a, device: gpu-1}
    """)
    files = inputs(tmp_path) + [write(tmp_path, "taken.yaml", taken)]
    code, out, err = run(capsys, *files)
    assert code == 1
    assert "cannot allocate ResourceClaim default/vllm-gpu-claim" in err
    assert "node node-a:" in err and "node node-b:" in err


def test_pending_claims_all_or_nothing(tmp_path, capsys):
    second = CLAIM.replace("vllm-gpu-claim", "second")
    files = inputs(tmp_path) + [write(tmp_path, "second.yaml", second)]
    code, _, err = run(capsys, *files)
    assert code == 1, "two claims need two >40Gi GPUs on one node; only one exists"
    cheap = CLAIM.replace("vllm-gpu-claim", "second").replace("high-memory-gpu", "any-gpu")
    any_class = GPU_CLASS.replace("high-memory-gpu", "any-gpu").replace(
        'device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))', 'device.driver == "gpu.nvidia.com"')
    files = inputs(tmp_path) + [write(tmp_path, "second.yaml", cheap), write(tmp_path, "any.yaml", any_class)]
    code, out, err = run(capsys, *files)
    assert code == 0, err
    doc = yaml.safe_load(out)
    assert doc["kind"] == "List" and [i["metadata"]["name"] for i in doc["items"]] == ["vllm-gpu-claim", "second"]
    devices = [i["status"]["allocation"]["devices"]["results"][0]["device"] for i in doc["items"]]
    assert sorted(devices) == ["gpu-0", "gpu-1"]


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_unknown_class(tmp_path, capsys):
    code, _, err = run(capsys, *inputs(tmp_path, claim=CLAIM.replace("high-memory-gpu", "no-such-class")))
    assert code == 2
    line = one_line(err)
    assert "vllm-gpu-claim" in line and "deviceClassName" in line and "no-such-class" in line


def test_cel_syntax_error(tmp_path, capsys):
    bad = GPU_CLASS.replace('device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))', "device.driver ==")
    code, _, err = run(capsys, *inputs(tmp_path, cls=bad))
    assert code == 2
    line = one_line(err)
    assert "high-memory-gpu" in line and "spec.selectors[0].cel.expression" in line


def test_cel_type_error_of_the_seed(tmp_path, capsys):
    files = [str(SEED / "deviceclass.yaml"), write(tmp_path, "slices.yaml", SLICES), write(tmp_path, "claim.yaml", CLAIM)]
    code, _, err = run(capsys, *files)
    assert code == 2
    line = one_line(err)
    assert "high-memory-gpu" in line and "spec.selectors[0].cel.expression" in line


def test_seed_claim_v1beta1_shape(tmp_path, capsys):
    files = [write(tmp_path, "class.yaml", GPU_CLASS), write(tmp_path, "slices.yaml", SLICES), str(SEED / "resourceclaim.yaml")]
    code, _, err = run(capsys, *files)
    assert code == 2
    line = one_line(err)
    assert "vllm-gpu-claim" in line and "exactly" in line


def test_runtime_error_on_some_devices(tmp_path, capsys):
    # node-b's GPU has no productName... give one device a missing attribute instead
    slices = SLICES.replace("      productName: {string: NVIDIA A100}\n", "      model: {string: A100}\n")
    cls = GPU_CLASS.replace('device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))',
                            'device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA H")')
    code, _, err = run(capsys, *inputs(tmp_path, cls=cls, slices=slices))
    assert code == 2
    line = one_line(err)
    assert "CEL runtime error" in line and "gpu.nvidia.com/node-b/gpu-0" in line and "high-memory-gpu" in line


def test_oversize_slice(tmp_path, capsys):
    devices = "\n".join(f"  - name: d{i}" for i in range(129))
    big = textwrap.dedent("""
    apiVersion: resource.k8s.io/v1
    kind: ResourceSlice
    metadata:
      name: big
    spec:
      driver: gpu.nvidia.com
      nodeName: node-a
      pool: {name: big, generation: 1, resourceSliceCount: 1}
      devices:
    """) + devices + "\n"
    code, _, err = run(capsys, *inputs(tmp_path, slices=big))
    assert code == 2
    line = one_line(err)
    assert "big" in line and "spec.devices" in line


def test_oversize_claim(tmp_path, capsys):
    requests = "".join(f"    - name: r{i}\n      exactly: {{deviceClassName: high-memory-gpu}}\n" for i in range(33))
    claim = "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: big, namespace: default}\n" \
            "spec:\n  devices:\n    requests:\n" + requests
    code, _, err = run(capsys, *inputs(tmp_path, claim=claim))
    assert code == 2
    line = one_line(err)
    assert "big" in line and "spec.devices.requests" in line


def test_duplicate_names(tmp_path, capsys):
    files = inputs(tmp_path) + [write(tmp_path, "again.yaml", CLAIM)]
    code, _, err = run(capsys, *files)
    assert code == 2
    line = one_line(err)
    assert "vllm-gpu-claim" in line and "metadata.name" in line and "duplicate" in line


@pytest.mark.parametrize("text, expected", [
    ("just: a mapping\n", "apiVersion and kind"),
    ("- a\n- list\n", "apiVersion and kind"),
    ("key: [unclosed\n", "not valid YAML"),
    ("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\n", "Deployment"),
])
def test_not_kubernetes(tmp_path, capsys, text, expected):
    files = inputs(tmp_path) + [write(tmp_path, "junk.yaml", text)]
    code, _, err = run(capsys, *files)
    assert code == 2
    assert expected in one_line(err)


def test_unknown_node(tmp_path, capsys):
    code, _, err = run(capsys, "--node", "nowhere", *inputs(tmp_path))
    assert code == 2 and "nowhere" in one_line(err)


def test_missing_file(tmp_path, capsys):
    code, _, err = run(capsys, str(tmp_path / "missing.yaml"))
    assert code == 2 and "cannot read" in one_line(err)


def test_pods_in_the_input_are_ignored(tmp_path, capsys):
    code, out, err = run(capsys, *inputs(tmp_path), str(SEED / "pod.yaml"))
    assert code == 0, err
    assert yaml.safe_load(out)["kind"] == "ResourceClaim"


def test_admin_access_claims_are_allocated_not_rejected(tmp_path, capsys):
    """The apiserver allows adminAccess by a namespace label allocate cannot see; the allocator
    must still place such claims, flagging the result and ignoring the devices' other users."""
    admin = CLAIM.replace("count: 1", "count: 1\n        adminAccess: true")
    code, out, err = run(capsys, *inputs(tmp_path, claim=admin))
    assert code == 0, err
    result = yaml.safe_load(out)["status"]["allocation"]["devices"]["results"][0]
    assert result["adminAccess"] is True and result["device"] == "gpu-1"


def test_a_device_taint_rule_in_the_input_keeps_the_claim_off_the_tainted_device(tmp_path, capsys):
    rule = """
    apiVersion: resource.k8s.io/v1
    kind: DeviceTaintRule
    metadata:
      name: h100-maintenance
    spec:
      deviceSelector: {driver: gpu.nvidia.com, pool: node-a, device: gpu-1}
      taint: {key: example.com/maintenance, effect: NoSchedule}
    """
    files = [*inputs(tmp_path), write(tmp_path, "rule.yaml", rule)]
    code, _, err = run(capsys, *files)
    assert code == 1, err  # the only device over 40Gi is tainted
    assert "taint" in err
    tolerating = CLAIM.replace("count: 1", "count: 1\n        tolerations: [{key: example.com/maintenance, operator: Exists}]")
    code, out, err = run(capsys, *inputs(tmp_path, claim=tolerating), write(tmp_path, "rule.yaml", rule))
    assert code == 0, err
    assert yaml.safe_load(out)["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-1"


# --- Pods among the files: placed with their constraints, as the binder and a shard would ----------

NODES = """
apiVersion: v1
kind: Node
metadata: {name: node-a, labels: {kubernetes.io/hostname: node-a, topology.kubernetes.io/zone: z1}}
status: {allocatable: {cpu: "8", memory: 32Gi, pods: "110"}}
---
apiVersion: v1
kind: Node
metadata: {name: node-b, labels: {kubernetes.io/hostname: node-b, topology.kubernetes.io/zone: z2}}
status: {allocatable: {cpu: "8", memory: 32Gi, pods: "110"}}
"""

ANY_GPU = """
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: any-gpu}
spec:
  selectors: [{cel: {expression: 'device.driver == "gpu.nvidia.com"'}}]
"""


def gpu_claim(name: str) -> str:
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: {name}, namespace: default}}
spec:
  devices:
    requests: [{{name: gpu, exactly: {{deviceClassName: any-gpu}}}}]
"""


def pod(name: str, claim: str | None = None, *, node: str | None = None, labels: str = "{}", extra: str = "") -> str:
    claims = f"\n  resourceClaims: [{{name: gpu, resourceClaimName: {claim}}}]" if claim else ""
    bound = f"\n  nodeName: {node}" if node else ""
    return f"""
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default, labels: {labels}}}
spec:{bound}{claims}{extra}
  containers: [{{name: c, image: registry.k8s.io/pause:3.10, resources: {{requests: {{cpu: "1"}}}}}}]
"""


def documents(out: str) -> list[dict]:
    loaded = yaml.safe_load(out)
    return loaded["items"] if loaded.get("kind") == "List" else [loaded]


def bindings(out: str) -> dict[str, str]:
    return {d["metadata"]["name"]: d["target"]["name"] for d in documents(out) if d["kind"] == "Binding"}


def test_a_pod_is_placed_where_its_node_selector_says_with_its_claim_allocated_there(tmp_path, capsys):
    files = [write(tmp_path, "cluster.yaml", NODES + "---" + SLICES + "---" + ANY_GPU),
             write(tmp_path, "work.yaml", gpu_claim("c1") + "---" + pod("p1", "c1", extra="\n  nodeSelector: {topology.kubernetes.io/zone: z2}"))]
    code, out, err = run(capsys, *files)
    assert code == 0, err
    assert bindings(out) == {"p1": "node-b"}
    (claim,) = [d for d in documents(out) if d["kind"] == "ResourceClaim"]
    assert [r["pool"] for r in claim["status"]["allocation"]["devices"]["results"]] == ["node-b"]
    assert [c["name"] for c in claim["status"]["reservedFor"]] == ["p1"]
    assert "placed 1 pod(s): Pod default/p1 on node node-b" in err


def test_pods_placed_in_turn_honour_anti_affinity_against_bound_and_earlier_pods(tmp_path, capsys):
    anti = """
  affinity:
    podAntiAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
      - {topologyKey: kubernetes.io/hostname, labelSelector: {matchLabels: {app: web}}}"""
    work = "---".join([pod("bound", node="node-a", labels="{app: web}"),
                       gpu_claim("c1"), pod("p1", "c1", labels="{app: web}", extra=anti),
                       gpu_claim("c2"), pod("p2", "c2", labels="{app: web}", extra=anti)])
    code, out, err = run(capsys, write(tmp_path, "cluster.yaml", NODES + "---" + SLICES + "---" + ANY_GPU),
                         write(tmp_path, "work.yaml", work))
    # p1 cannot share node-a with the bound web pod; p2 then has no node left
    assert code == 1, err
    assert bindings(out) == {"p1": "node-b"}
    assert "cannot place Pod default/p2: 0/2 nodes are available: 2 node(s) didn't match pod anti-affinity rules." in err


def test_a_pod_goes_to_its_local_volumes_node_and_waits_for_a_missing_claim(tmp_path, capsys):
    volume = """
apiVersion: v1
kind: PersistentVolume
metadata: {name: local-a}
spec:
  capacity: {storage: 10Gi}
  accessModes: [ReadWriteOnce]
  storageClassName: local
  local: {path: /mnt/a}
  claimRef: {namespace: default, name: data}
  nodeAffinity:
    required:
      nodeSelectorTerms: [{matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [node-a]}]}]
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: data, namespace: default, annotations: {pv.kubernetes.io/bind-completed: "yes"}}
spec: {accessModes: [ReadWriteOnce], storageClassName: local, volumeName: local-a, resources: {requests: {storage: 1Gi}}}
"""
    mounts = "\n  volumes: [{name: data, persistentVolumeClaim: {claimName: %s}}]"
    work = "---".join([gpu_claim("c1"), pod("p1", "c1", extra=mounts % "data"),
                       gpu_claim("c2"), pod("p2", "c2", extra=mounts % "missing")])
    code, out, err = run(capsys, write(tmp_path, "cluster.yaml", NODES + "---" + SLICES + "---" + ANY_GPU),
                         write(tmp_path, "volumes.yaml", volume), write(tmp_path, "work.yaml", work))
    assert code == 1, err
    assert bindings(out) == {"p1": "node-a"}
    assert 'cannot place Pod default/p2: 0/2 nodes are available: persistentvolumeclaim "missing" not found.' in err


def test_a_pod_with_a_template_claim_or_an_absent_claim_is_invalid_input(tmp_path, capsys):
    cluster = write(tmp_path, "cluster.yaml", NODES + "---" + SLICES + "---" + ANY_GPU)
    templated = pod("p1").replace("spec:", "spec:\n  resourceClaims: [{name: gpu, resourceClaimTemplateName: t}]", 1)
    code, _, err = run(capsys, cluster, write(tmp_path, "work.yaml", templated))
    assert code == 2 and "Pod default/p1: field spec.resourceClaims[0]: resourceClaimTemplateName" in err, err
    code, _, err = run(capsys, cluster, write(tmp_path, "work.yaml", pod("p1", "nowhere")))
    assert code == 2, err
    assert "spec.resourceClaims[0].resourceClaimName: ResourceClaim default/nowhere is not among the files" in err
    code, _, err = run(capsys, "--node", "node-a", cluster, write(tmp_path, "work.yaml", gpu_claim("c1") + "---" + pod("p1", "c1")))
    assert code == 2 and "--node" in err


def test_without_a_node_object_for_every_sliced_node_the_claims_are_allocated_alone(tmp_path, capsys):
    """kube-scheduler places pods on Node objects only: a pod is not placed against part of the
    cluster; the claims are allocated alone, as without pods, and stderr says why."""
    only_a = NODES.split("---")[0]
    files = [write(tmp_path, "cluster.yaml", only_a + "---" + SLICES + "---" + ANY_GPU),
             write(tmp_path, "work.yaml", gpu_claim("c1") + "---" + pod("p1", "c1"))]
    code, out, err = run(capsys, *files)
    assert code == 0, err
    assert documents(out)[0]["kind"] == "ResourceClaim" and not bindings(out)
    assert "placed only with a Node object for every node their ResourceSlices name (none for node-b)" in err


def test_pods_placed_in_turn_do_not_share_a_volume_one_of_them_took(tmp_path, capsys):
    """VolumeBinding's PreBind, offline: the first pod's WaitForFirstConsumer claim takes the one
    free local volume (its claimRef written, printed), so the second pod's claim finds none; a
    ReadWriteOncePod claim the first pod mounts keeps the second off it too. Namespaces left out
    of the files are "default", as kubectl reads them."""
    storage = """
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: local}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: v1
kind: PersistentVolume
metadata: {name: only-one}
spec:
  capacity: {storage: 10Gi}
  accessModes: [ReadWriteOnce]
  storageClassName: local
  local: {path: /mnt/one}
  nodeAffinity:
    required:
      nodeSelectorTerms: [{matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [node-a]}]}]
status: {phase: Available}
"""
    def pvc(name: str, access: str = "ReadWriteOnce", class_line: str = "storageClassName: local") -> str:
        return f"""
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {name}}}
spec: {{accessModes: [{access}], {class_line}, resources: {{requests: {{storage: 1Gi}}}}}}
"""
    mounts = "\n  volumes: [{name: data, persistentVolumeClaim: {claimName: %s}}]"
    cluster = write(tmp_path, "cluster.yaml", NODES + "---" + SLICES + "---" + ANY_GPU + "---" + storage)
    work = "---".join([pvc("first"), pvc("second"), gpu_claim("c1"), pod("p1", "c1", extra=mounts % "first"),
                       gpu_claim("c2"), pod("p2", "c2", extra=mounts % "second")])
    code, out, err = run(capsys, cluster, write(tmp_path, "work.yaml", work))
    assert code == 1, err
    assert bindings(out) == {"p1": "node-a"}
    (volume,) = [d for d in documents(out) if d["kind"] == "PersistentVolume"]
    assert volume["spec"]["claimRef"]["name"] == "first"
    assert "cannot place Pod default/p2: 0/2 nodes are available: 2 node(s) didn't find available persistent " \
           "volumes to bind." in err
    bound = """
apiVersion: v1
kind: PersistentVolume
metadata: {name: rwop}
spec:
  capacity: {storage: 10Gi}
  accessModes: [ReadWriteOncePod]
  storageClassName: manual
  hostPath: {path: /mnt/rwop}
  claimRef: {namespace: default, name: shared}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: shared, annotations: {pv.kubernetes.io/bind-completed: "yes"}}
spec: {accessModes: [ReadWriteOncePod], storageClassName: manual, volumeName: rwop, resources: {requests: {storage: 1Gi}}}
"""
    work = "---".join([gpu_claim("c1"), pod("p1", "c1", extra=mounts % "shared"),
                       gpu_claim("c2"), pod("p2", "c2", extra=mounts % "shared")])
    code, out, err = run(capsys, write(tmp_path, "cluster.yaml", NODES + "---" + SLICES + "---" + ANY_GPU),
                         write(tmp_path, "rwop.yaml", bound), write(tmp_path, "work.yaml", work))
    assert code == 1, err
    assert list(bindings(out)) == ["p1"]
    assert "ReadWriteOncePod access mode already in-use by another pod" in err

"""deploy/ read as `kubectl apply -k` would send it: the objects are complete and consistent.

Pure checks, milliseconds. The apiserver's own verdict is in test_deploy_apiserver.py.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from draplane import manifests
from draplane.manifests import ManifestError, object_id, render

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SERVICES = ("inventory", "allocator", "binder", "node-agent")


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(DEPLOY)


def by_kind(objects, kind):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects):
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def container_args(obj) -> dict[str, str]:
    (container,) = manifests.pod_spec(obj)["containers"]
    flags = [arg.removeprefix("--") for arg in container.get("args", []) if arg.startswith("--")]
    return dict(flag.split("=", 1) if "=" in flag else (flag, "") for flag in flags)


def test_every_service_has_its_workload_kind(objects):
    assert set(by_kind(objects, "Deployment")) == {"draplane-inventory", "draplane-binder"}
    assert set(by_kind(objects, "StatefulSet")) == {"draplane-allocator", "draplane-nats"}
    assert set(by_kind(objects, "DaemonSet")) == {"draplane-node-agent"}
    assert set(by_kind(objects, "ServiceAccount")) == {f"draplane-{s}" for s in SERVICES}


def test_everything_namespaced_is_in_the_kustomization_namespace(objects):
    namespace = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["namespace"]
    assert set(by_kind(objects, "Namespace")) == {namespace}
    for obj in objects:
        if obj["kind"] not in manifests.CLUSTER_SCOPED_KINDS:
            assert obj["metadata"]["namespace"] == namespace, object_id(obj)


def test_entry_points_are_the_ones_pyproject_declares(objects):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    used = set()
    for obj in workloads(objects):
        if obj["metadata"]["name"] == "draplane-nats":
            continue
        (container,) = manifests.pod_spec(obj)["containers"]
        (command,) = container["command"]
        assert command in scripts, f"{object_id(obj)} runs {command!r}, which pyproject.toml does not declare"
        assert container["image"] == "draplane:0.1.0", object_id(obj)
        used.add(command)
    assert used == {f"draplane-{s}" for s in SERVICES}


def test_draplane_services_probe_healthz_and_readyz_and_request_resources(objects):
    for obj in workloads(objects):
        for container in manifests.containers(obj):
            requests = container["resources"]["requests"]
            assert {"cpu", "memory"} <= set(requests), object_id(obj)
            assert "memory" in container["resources"]["limits"], object_id(obj)
            liveness, readiness = container["livenessProbe"], container["readinessProbe"]
            if obj["metadata"]["name"] == "draplane-nats":
                assert liveness["httpGet"]["path"].startswith("/healthz"), object_id(obj)
                assert readiness["httpGet"]["path"] == "/healthz", object_id(obj)
                continue
            assert liveness["httpGet"]["path"] == "/healthz", object_id(obj)
            assert readiness["httpGet"]["path"] == "/readyz", object_id(obj)
            port_names = {p["name"] for p in container["ports"]}
            assert liveness["httpGet"]["port"] in port_names and readiness["httpGet"]["port"] in port_names
            args = container_args(obj)
            if "port" in args or "listen" in args:  # the node agent has no HTTP flag yet
                served = args.get("port") or args["listen"].rsplit(":", 1)[1]
                assert served == str(container["ports"][0]["containerPort"]), object_id(obj)
            if "listen" in args:  # kubelet probes the pod IP, so loopback-only would always fail
                assert args["listen"].startswith("0.0.0.0:"), object_id(obj)


def test_containers_run_unprivileged(objects):
    for obj in workloads(objects):
        spec = manifests.pod_spec(obj)
        assert spec["securityContext"]["runAsNonRoot"] is True, object_id(obj)
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, object_id(obj)
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], object_id(obj)


def test_every_disruption_budget_selects_exactly_one_workload(objects):
    budgets = by_kind(objects, "PodDisruptionBudget")
    assert set(budgets) == {"draplane-inventory", "draplane-allocator", "draplane-binder", "draplane-nats"}
    for budget in budgets.values():
        selector = budget["spec"]["selector"]["matchLabels"]
        matched = [
            w for w in workloads(objects)
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matched) == 1, f"{object_id(budget)} selects {[object_id(w) for w in matched]}"


def test_workload_selectors_match_their_own_pod_labels(objects):
    for obj in workloads(objects):
        assert obj["spec"]["selector"]["matchLabels"].items() <= obj["spec"]["template"]["metadata"]["labels"].items()


def test_service_accounts_roles_and_bindings_refer_to_each_other(objects):
    accounts = by_kind(objects, "ServiceAccount")
    roles = by_kind(objects, "ClusterRole")
    bindings = by_kind(objects, "ClusterRoleBinding")
    for obj in workloads(objects):
        name = manifests.pod_spec(obj).get("serviceAccountName")
        if obj["metadata"]["name"] != "draplane-nats":
            assert name in accounts, f"{object_id(obj)} runs as missing ServiceAccount {name!r}"
    bound = set()
    for binding in bindings.values():
        assert binding["roleRef"]["name"] in roles, object_id(binding)
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["name"] in accounts, object_id(binding)
            assert subject["namespace"] == accounts[subject["name"]]["metadata"]["namespace"]
            bound.add(subject["name"])
    # The node agent holds no Kubernetes role at all, and has no token to use one with.
    assert bound == {"draplane-inventory", "draplane-allocator", "draplane-binder"}
    assert accounts["draplane-node-agent"]["automountServiceAccountToken"] is False
    node_agent = manifests.pod_spec(by_kind(objects, "DaemonSet")["draplane-node-agent"])
    assert node_agent["automountServiceAccountToken"] is False


def test_binder_role_has_the_binding_subresource_kubernetes_1_36_requires(objects):
    rules = by_kind(objects, "ClusterRole")["draplane-binder"]["rules"]
    granted = {
        (group, resource, verb)
        for rule in rules for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]
    }
    for verb in ("update", "patch"):
        assert ("resource.k8s.io", "resourceclaims/status", verb) in granted
        assert ("resource.k8s.io", "resourceclaims/binding", verb) in granted
    assert ("", "pods/binding", "create") in granted
    assert not any(resource == "resourceslices" for _, resource, _ in granted)


def test_allocator_shards_agree_between_statefulset_and_binder(objects):
    allocator = by_kind(objects, "StatefulSet")["draplane-allocator"]
    binder = by_kind(objects, "Deployment")["draplane-binder"]
    replicas = allocator["spec"]["replicas"]
    assert container_args(allocator)["shards"] == str(replicas)
    assert container_args(binder)["shards"] == str(replicas)
    # The shard index is the StatefulSet ordinal, handed over by the pod-index label.
    (container,) = manifests.pod_spec(allocator)["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert container_args(allocator)["shard-index"] == "$(DRAPLANE_SHARD_INDEX)"
    assert env["DRAPLANE_SHARD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert allocator["spec"]["serviceName"] in by_kind(objects, "Service")


def test_nats_routes_name_every_server_of_the_statefulset(objects):
    nats = by_kind(objects, "StatefulSet")["draplane-nats"]
    config = by_kind(objects, "ConfigMap")["draplane-nats-config"]["data"]["nats.conf"]
    headless = nats["spec"]["serviceName"]
    assert by_kind(objects, "Service")[headless]["spec"]["clusterIP"] == "None"
    routes = re.findall(r"nats-route://([a-z0-9.-]+):(\d+)", config)
    expected = {f"{nats['metadata']['name']}-{i}.{headless}" for i in range(nats["spec"]["replicas"])}
    assert nats["spec"]["replicas"] == 3
    assert {host for host, _ in routes} == expected
    assert "jetstream" in config and "include ./auth/auth.conf" in config


def test_nats_clients_point_at_the_nats_service(objects):
    services = by_kind(objects, "Service")
    for obj in workloads(objects):
        if obj["metadata"]["name"] == "draplane-nats":
            continue
        host = re.fullmatch(r"nats://([a-z0-9-]+):4222", container_args(obj)["nats"]).group(1)
        assert host in services, object_id(obj)
        (container,) = manifests.pod_spec(obj)["containers"]
        seed = {e["name"]: e.get("value") for e in container["env"]}["DRAPLANE_NATS_NKEY_SEED"]
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        assert str(Path(seed).parent) in mounts, f"{object_id(obj)}: {seed} is not on a mounted volume"


# Service modules, by the command that runs them. Their argument parsers are the real contract;
# a flag here that the service does not know would crash-loop the pod.
ENTRY_MODULES = {
    "draplane-inventory": "draplane_inventory.__main__",
    "draplane-allocator": "draplane_allocator.__main__",
    "draplane-binder": "draplane_binder.__main__",
    "draplane-node-agent": "draplane_node_agent.__main__",
}


@pytest.mark.parametrize("command", sorted(ENTRY_MODULES))
def test_workload_args_are_accepted_by_the_services_own_parser(objects, command):
    import importlib

    try:
        module = importlib.import_module(ENTRY_MODULES[command])
    except ModuleNotFoundError as exc:
        if exc.name != ENTRY_MODULES[command]:
            raise
        pytest.skip(f"{ENTRY_MODULES[command]} is not written yet")
    (workload,) = [o for o in workloads(objects) if manifests.pod_spec(o)["containers"][0].get("command") == [command]]
    (container,) = manifests.pod_spec(workload)["containers"]
    # What the kubelet substitutes for $(VAR): stand-ins of the right shape.
    stand_ins = {"DRAPLANE_SHARD_INDEX": "1", "NODE_NAME": "gpu-node-1"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: stand_ins[m.group(1)], arg) for arg in container["args"]]
    parse = module.build_parser().parse_args if hasattr(module, "build_parser") else module.parse_args
    try:
        parse(argv)
    except SystemExit as exc:
        pytest.fail(f"{object_id(workload)}: {command} refuses its args {argv} (exit {exc.code}); see stderr")


# --- the renderer itself ------------------------------------------------------------------------


def _write(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  template:
    spec:
      containers:
        - {name: a, image: "registry.local:5000/team/draplane:old"}
        - {name: b, image: "other:1"}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: crb}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: r}
subjects: [{kind: ServiceAccount, name: sa, namespace: old}, {kind: User, name: alice}, {kind: ServiceAccount, name: default, namespace: old}]
"""


def test_namespace_and_images_are_applied_like_kustomize(tmp_path: Path):
    _write(tmp_path, {
        "kustomization.yaml": "namespace: prod\nresources: [app.yaml]\nimages:\n"
                              "  - {name: registry.local:5000/team/draplane, newName: mirror/draplane, newTag: '2'}\n",
        "app.yaml": DEPLOYMENT,
    })
    deployment, binding = render(tmp_path)
    assert deployment["metadata"]["namespace"] == "prod"
    images = [c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]]
    assert images == ["mirror/draplane:2", "other:1"]
    assert "namespace" not in binding["metadata"]
    # Kustomize's default: only subjects named "default" follow the namespace.
    assert [s.get("namespace") for s in binding["subjects"]] == ["old", None, "prod"]
    # An explicit namespace wins, as an overlay's would.
    assert render(tmp_path, namespace="test-1")[0]["metadata"]["namespace"] == "test-1"


def test_nested_kustomization_folders_are_rendered(tmp_path: Path):
    _write(tmp_path, {
        "kustomization.yaml": "resources: [base]\nnamespace: outer\n",
        "base/kustomization.yaml": "resources: [app.yaml]\nnamespace: inner\n",
        "base/app.yaml": DEPLOYMENT,
    })
    assert render(tmp_path)[0]["metadata"]["namespace"] == "outer"


def test_unsupported_kustomization_fields_are_refused(tmp_path: Path):
    _write(tmp_path, {"kustomization.yaml": "resources: []\npatches: [{path: p.yaml}]\n"})
    with pytest.raises(ManifestError, match=r"\['patches'\] are not rendered here"):
        render(tmp_path)


def test_missing_resource_file_is_named(tmp_path: Path):
    _write(tmp_path, {"kustomization.yaml": "resources: [gone.yaml]\n"})
    with pytest.raises(ManifestError, match="resource 'gone.yaml' does not exist"):
        render(tmp_path)


def test_object_without_name_is_named_by_file_and_document(tmp_path: Path):
    _write(tmp_path, {"kustomization.yaml": "resources: [a.yaml]\n", "a.yaml": "apiVersion: v1\nkind: Service\nmetadata: {name: ok}\n---\napiVersion: v1\nkind: Service\nmetadata: {}\n"})
    with pytest.raises(ManifestError, match=r"a.yaml: document 1 \(Service\) has no metadata.name"):
        render(tmp_path)


def test_duplicate_objects_are_refused(tmp_path: Path):
    _write(tmp_path, {"kustomization.yaml": "resources: [a.yaml, b.yaml]\nnamespace: x\n", "a.yaml": DEPLOYMENT, "b.yaml": DEPLOYMENT})
    with pytest.raises(ManifestError, match="Deployment x/web is defined twice"):
        render(tmp_path)


def test_directory_without_kustomization_is_refused(tmp_path: Path):
    with pytest.raises(ManifestError, match="no kustomization.yaml"):
        render(tmp_path)


@pytest.mark.parametrize(
    "image, name",
    [("draplane", "draplane"), ("draplane:0.1", "draplane"), ("host:5000/a/b:tag", "host:5000/a/b"),
     ("a/b@sha256:abc", "a/b"), ("host:5000/a", "host:5000/a")],
)
def test_image_name_drops_tag_and_digest_but_not_registry_port(image, name):
    assert manifests.image_name(image) == name


# --- the container image ------------------------------------------------------------------------


def test_dockerfile_copies_every_package_root_and_checks_every_entry_point(objects):
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    copied = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ") and "--from" not in line]
    for root in pyproject["tool"]["setuptools"]["packages"]["find"]["where"]:
        assert any(root == c.rstrip("/") or root.startswith(c) for c in copied), f"Dockerfile does not copy {root}"
    checked = re.search(r"for command in ([^;]+);", dockerfile).group(1).split()
    assert set(checked) == set(pyproject["project"]["scripts"])
    # The image's user is the one the workloads run as.
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    for obj in workloads(objects):
        if obj["metadata"]["name"] != "draplane-nats":
            context = manifests.pod_spec(obj)["securityContext"]
            assert (str(context["runAsUser"]), str(context["runAsGroup"])) == user.groups(), object_id(obj)

"""deploy/ as `kubectl apply -k` sends it: the objects are complete and consistent.

deploy/ is rendered once by the real `kubectl kustomize` from the server cache (half a second);
the checks on its objects are pure. The apiserver's own verdict is in test_deploy_apiserver.py.
"""

from __future__ import annotations

import inspect
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from draplane.localenv import kustomize
from draplane.localenv.kustomize import object_id

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SERVICES = ("inventory", "allocator", "binder", "node-agent", "audit")
# The kinds in deploy/ that have no namespace.
CLUSTER_SCOPED_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding"}

pytestmark = pytest.mark.integration  # kubectl, from `make servers`


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return kustomize.build(DEPLOY)


def pod_spec(obj) -> dict:
    """The pod template's spec of a Deployment, StatefulSet or DaemonSet."""
    return obj["spec"]["template"]["spec"]


def containers(obj) -> list[dict]:
    spec = pod_spec(obj)
    return [*(spec.get("initContainers") or []), *spec["containers"]]


def by_kind(objects, kind):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects):
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def container_args(obj) -> dict[str, str]:
    (container,) = pod_spec(obj)["containers"]
    flags = [arg.removeprefix("--") for arg in container.get("args", []) if arg.startswith("--")]
    return dict(flag.split("=", 1) if "=" in flag else (flag, "") for flag in flags)


def test_every_service_has_its_workload_kind(objects):
    assert set(by_kind(objects, "Deployment")) == {"draplane-inventory", "draplane-binder", "draplane-audit"}
    assert set(by_kind(objects, "StatefulSet")) == {"draplane-allocator", "draplane-nats"}
    assert set(by_kind(objects, "DaemonSet")) == {"draplane-node-agent"}
    assert set(by_kind(objects, "ServiceAccount")) == {f"draplane-{s}" for s in SERVICES}


def test_everything_namespaced_is_in_the_kustomization_namespace(objects):
    namespace = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["namespace"]
    assert set(by_kind(objects, "Namespace")) == {namespace}
    for obj in objects:
        if obj["kind"] in CLUSTER_SCOPED_KINDS:
            assert "namespace" not in obj["metadata"], object_id(obj)
        else:
            assert obj["metadata"]["namespace"] == namespace, object_id(obj)


def test_entry_points_are_the_ones_pyproject_declares(objects):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    used = set()
    for obj in workloads(objects):
        if obj["metadata"]["name"] == "draplane-nats":
            continue
        (container,) = pod_spec(obj)["containers"]
        (command,) = container["command"]
        assert command in scripts, f"{object_id(obj)} runs {command!r}, which pyproject.toml does not declare"
        assert container["image"] == "draplane:0.1.0", object_id(obj)
        used.add(command)
    assert used == {f"draplane-{s}" for s in SERVICES}


def test_draplane_services_probe_healthz_and_readyz_and_request_resources(objects):
    for obj in workloads(objects):
        for container in containers(obj):
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


# The one container that runs as root, and why: as the kubelet's DRA plugin it creates sockets,
# its checkpoint, device files and CDI specs in host folders that belong to root
# (deploy/services/node-agent.yaml). It runs with no capabilities all the same.
ROOT_CONTAINERS = {("draplane-node-agent", "node-agent")}


def test_containers_run_unprivileged(objects):
    as_root = set()
    for obj in workloads(objects):
        spec = pod_spec(obj)
        assert spec["securityContext"]["runAsNonRoot"] is True, object_id(obj)
        assert spec["securityContext"].get("runAsUser", 0) != 0, object_id(obj)
        for container in containers(obj):
            context = container["securityContext"]
            where = f"{object_id(obj)} container {container['name']}"
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"] == {"drop": ["ALL"]}, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert not context.get("privileged"), where
            if (obj["metadata"]["name"], container["name"]) in ROOT_CONTAINERS:
                assert (context["runAsUser"], context["runAsGroup"], context["runAsNonRoot"]) == (0, 0, False), where
                as_root.add((obj["metadata"]["name"], container["name"]))
            else:
                # Everything else keeps the pod's non-root user: no container-level override.
                assert not {"runAsUser", "runAsGroup", "runAsNonRoot"} & set(context), where
    assert as_root == ROOT_CONTAINERS


def test_every_disruption_budget_selects_exactly_one_workload(objects):
    budgets = by_kind(objects, "PodDisruptionBudget")
    assert set(budgets) == {"draplane-inventory", "draplane-allocator", "draplane-binder", "draplane-audit",
                            "draplane-nats"}
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
        name = pod_spec(obj).get("serviceAccountName")
        if obj["metadata"]["name"] != "draplane-nats":
            assert name in accounts, f"{object_id(obj)} runs as missing ServiceAccount {name!r}"
    bound = set()
    for binding in bindings.values():
        assert binding["roleRef"]["name"] in roles, object_id(binding)
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["name"] in accounts, object_id(binding)
            assert subject["namespace"] == accounts[subject["name"]]["metadata"]["namespace"]
            bound.add(subject["name"])
    # The allocator shards and the audit subscriber hold no Kubernetes role at all, and have no
    # token to use one with: they talk to NATS only.
    assert bound == {"draplane-inventory", "draplane-binder", "draplane-node-agent"}
    for account in ("draplane-node-agent", "draplane-allocator", "draplane-audit"):
        assert accounts[account]["automountServiceAccountToken"] is False
    assert pod_spec(by_kind(objects, "StatefulSet")["draplane-allocator"])["automountServiceAccountToken"] is False
    assert pod_spec(by_kind(objects, "Deployment")["draplane-audit"])["automountServiceAccountToken"] is False
    # The node agent's account mounts no token by default; its DaemonSet's pod asks for one,
    # because the kubelet plugin reads the claims it prepares.
    assert pod_spec(by_kind(objects, "DaemonSet")["draplane-node-agent"])["automountServiceAccountToken"] is True


def granted_rules(role) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) a ClusterRole grants; a name-scoped rule is not expected."""
    assert not any(rule.get("resourceNames") or rule.get("nonResourceURLs") for rule in role["rules"]), object_id(role)
    return {
        (group, resource, verb)
        for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]
    }


def test_node_agent_role_is_get_on_resourceclaims_only(objects):
    # The kubelet plugin GETs the one claim it prepares, by namespace and name: no list, no
    # watch, no write, no other resource.
    role = by_kind(objects, "ClusterRole")["draplane-node-agent"]
    assert granted_rules(role) == {("resource.k8s.io", "resourceclaims", "get")}
    binding = by_kind(objects, "ClusterRoleBinding")["draplane-node-agent"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "draplane-node-agent"}
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", "draplane-node-agent")]


def test_node_agent_is_the_kubelet_plugin_with_the_host_paths_at_the_same_paths(objects):
    from draplane_node_agent.__main__ import parse_args

    agent = by_kind(objects, "DaemonSet")["draplane-node-agent"]
    (container,) = pod_spec(agent)["containers"]
    assert "--kubelet-plugin" in container["args"]
    # Where the agent puts its sockets, checkpoint, device files and CDI specs, as its own parser
    # reads the DaemonSet's args (the defaults unless deploy/ names others).
    args = parse_args([a.replace("$(NODE_NAME)", "gpu-node-1") for a in container["args"]])
    assert args.kubelet_plugin is True
    kubelet_dir = Path(args.kubelet_dir)
    wanted = {kubelet_dir / "plugins_registry", kubelet_dir / "plugins", Path(args.cdi_dir)}
    assert wanted == {Path("/var/lib/kubelet/plugins_registry"), Path("/var/lib/kubelet/plugins"), Path("/var/run/cdi")}
    volumes = {v["name"]: v for v in pod_spec(agent)["volumes"]}
    mounted = {}
    for mount in container["volumeMounts"]:
        host = volumes[mount["name"]].get("hostPath")
        if host is not None and Path(mount["mountPath"]) in wanted:
            # The same path inside as on the host: the kubelet and the container runtime (CDI
            # mounts of the claims' device files) resolve what the agent writes on the host.
            assert host["path"] == mount["mountPath"], mount
            assert host["type"] == "DirectoryOrCreate", mount
            assert not mount.get("readOnly"), mount
            assert "subPath" not in mount, mount
            mounted[Path(mount["mountPath"])] = mount["name"]
    assert set(mounted) == wanted
    # Its token (the claims' reads) is mounted; the root filesystem stays read-only and the
    # container holds no capabilities (test_containers_run_unprivileged checks every container).
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_binder_role_has_the_binding_subresource_kubernetes_1_36_requires(objects):
    granted = granted_rules(by_kind(objects, "ClusterRole")["draplane-binder"])
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
    (container,) = pod_spec(allocator)["containers"]
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
        (container,) = pod_spec(obj)["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        seed, ca = env["DRAPLANE_NATS_NKEY_SEED"], env["DRAPLANE_NATS_CA"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert str(Path(seed).parent) in mounts, f"{object_id(obj)}: {seed} is not on a mounted volume"
        # TLS: the CA certificate, and nothing else, of the servers' Secret.
        (volume,) = [v for v in pod_spec(obj)["volumes"] if v["name"] == mounts.get(str(Path(ca).parent))]
        assert volume["secret"] == {"secretName": "draplane-nats-tls", "items": [{"key": "ca.crt", "path": Path(ca).name}]}


def test_nats_servers_take_clients_over_tls_from_the_tls_secret(objects):
    nats = by_kind(objects, "StatefulSet")["draplane-nats"]
    config = by_kind(objects, "ConfigMap")["draplane-nats-config"]["data"]["nats.conf"]
    tls = re.search(r"^tls \{\n(.*?)^\}", config, re.M | re.S).group(1)
    files = dict(re.findall(r"(\w+_file): (\S+)", tls))
    (container,) = pod_spec(nats)["containers"]
    (mount,) = [m for m in container["volumeMounts"] if all(f.startswith(m["mountPath"] + "/") for f in files.values())]
    (volume,) = [v for v in pod_spec(nats)["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "draplane-nats-tls"
    assert sorted(Path(f).name for f in files.values()) == ["tls.crt", "tls.key"]


# Service modules, by the command that runs them. Their argument parsers are the real contract;
# a flag here that the service does not know would crash-loop the pod.
ENTRY_MODULES = {
    "draplane-inventory": "draplane_inventory.__main__",
    "draplane-allocator": "draplane_allocator.__main__",
    "draplane-binder": "draplane_binder.__main__",
    "draplane-node-agent": "draplane_node_agent.__main__",
    "draplane-audit": "draplane_audit.__main__",
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
    (workload,) = [o for o in workloads(objects) if pod_spec(o)["containers"][0].get("command") == [command]]
    (container,) = pod_spec(workload)["containers"]
    # What the kubelet substitutes for $(VAR): stand-ins of the right shape.
    stand_ins = {"DRAPLANE_SHARD_INDEX": "1", "NODE_NAME": "gpu-node-1"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: stand_ins[m.group(1)], arg) for arg in container["args"]]
    parse = module.build_parser().parse_args if hasattr(module, "build_parser") else module.parse_args
    try:
        parse(argv)
    except SystemExit as exc:
        pytest.fail(f"{object_id(workload)}: {command} refuses its args {argv} (exit {exc.code}); see stderr")


# --- the container image ------------------------------------------------------------------------


def test_dockerfile_copies_every_package_root_and_checks_every_entry_point(objects):
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    copied = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ") and "--from" not in line]
    for root in pyproject["tool"]["setuptools"]["packages"]["find"]["where"]:
        assert any(root == c.rstrip("/") or root.startswith(c) for c in copied), f"Dockerfile does not copy {root}"
    checked = re.search(r"for command in ([^;]+);", dockerfile).group(1).split()
    assert set(checked) == set(pyproject["project"]["scripts"])
    # The image's user is the one the workloads run as (the node agent's container alone
    # overrides it with root, see test_containers_run_unprivileged).
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    for obj in workloads(objects):
        if obj["metadata"]["name"] != "draplane-nats":
            context = pod_spec(obj)["securityContext"]
            assert (str(context["runAsUser"]), str(context["runAsGroup"])) == user.groups(), object_id(obj)


def dockerfile_stages() -> list[tuple[str, list[str]]]:
    """(FROM instruction, the stage's other instructions), in order; continued lines joined."""
    stages: list[tuple[str, list[str]]] = []
    pending: list[str] = []
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue  # blank lines and comments, inside a continued instruction too
        pending.append(stripped.removesuffix("\\").strip())
        if stripped.endswith("\\"):
            continue
        instruction, pending = " ".join(pending), []
        if instruction.startswith("FROM "):
            stages.append((instruction, []))
        elif stages:  # ARGs before the first FROM are global, not a stage's
            stages[-1][1].append(instruction)
    return stages


def test_dockerfile_builds_the_kubelet_stubs_into_the_image_without_go():
    from draplane_node_agent import kubelet_api

    stages = dockerfile_stages()
    *earlier, (final_from, final) = stages
    (build,) = [body for line, body in earlier if line.split()[-1] == "build"]
    go_stages = [line.split()[-1] for line, _ in earlier if line.split()[1].startswith("golang:")]
    env_name = kubelet_api.ENV_OVERRIDE

    def env(body) -> dict[str, str]:
        return dict(re.findall(rf"\b({env_name})=(\S+)", " ".join(i for i in body if i.startswith("ENV "))))

    # The build stage copies a Go toolchain in, and generates the stubs with it into the folder
    # that DRAPLANE_KUBELET_API names there.
    assert go_stages, "no golang stage to copy the toolchain from"
    assert any(i.startswith("COPY --from=") and i.split()[1].removeprefix("--from=") in go_stages
               and "/usr/local/go" in i for i in build)
    generated = env(build)[env_name]
    assert any("-m draplane_node_agent.kubelet_api" in i for i in build if i.startswith("RUN "))
    # The final stage: the venv (which holds that folder) from the build stage, the same
    # DRAPLANE_KUBELET_API, and nothing from a Go stage.
    assert env(final)[env_name] == generated
    copies = [i for i in final if i.startswith("COPY ")]
    assert copies == ["COPY --from=build /opt/draplane /opt/draplane"]
    assert generated.startswith("/opt/draplane/")
    assert "golang" not in final_from
    # The toolchain is as new as the go.mod that kubelet_api fetches the protos through asks
    # (it runs go with GOTOOLCHAIN=local, so an older one fails the build).
    required = re.search(r"\\ngo (\d+)\.(\d+)", inspect.getsource(kubelet_api._proto_sources))
    pinned = re.search(r"^ARG GO_VERSION=(\d+)\.(\d+)", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert required and pinned, "the go directive or ARG GO_VERSION moved"
    assert any(line == "FROM golang:${GO_VERSION} AS go" for line, _ in earlier)
    assert tuple(map(int, pinned.groups())) >= tuple(map(int, required.groups()))


def test_beside_nvidias_driver_no_node_agent_runs_and_the_rest_is_the_base(tmp_path):
    """deploy/components/beside-nvidia-driver, in a site's overlay as its comment says: NVIDIA's
    kubelet plugin publishes and prepares, so the node agent's DaemonSet and RBAC go; every other
    object is the base's, unchanged."""
    import os

    site = tmp_path / "site"
    site.mkdir()
    (site / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY, site)],
        "components": [os.path.relpath(DEPLOY / "components" / "beside-nvidia-driver", site)]}))
    base = {object_id(o): o for o in kustomize.build(DEPLOY)}
    beside = {object_id(o): o for o in kustomize.build(site)}
    gone = set(base) - set(beside)
    assert gone == {"DaemonSet draplane/draplane-node-agent", "ServiceAccount draplane/draplane-node-agent",
                    "ClusterRole draplane-node-agent", "ClusterRoleBinding draplane-node-agent"}
    assert set(beside) <= set(base)
    assert all(beside[i] == base[i] for i in beside)


def test_the_separation_policy_renders_and_matches_only_draplanes_pods():
    """deploy/separation/: not in the base (kube-scheduler may run without DRA pods); its
    MutatingAdmissionPolicy matches pods created with schedulerName draplane, the name the binder
    takes, and is bound. The apiserver's verdict is tests/services/test_two_schedulers.py."""
    rendered = kustomize.build(DEPLOY / "separation")
    kinds = sorted(o["kind"] for o in rendered)
    assert kinds == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"]
    policy = next(o for o in rendered if o["kind"] == "MutatingAdmissionPolicy")
    binding = next(o for o in rendered if o["kind"] == "MutatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConditions"][0]["expression"].endswith('== "draplane"')
    binder = next(o for o in kustomize.build(DEPLOY) if o["kind"] == "Deployment" and o["metadata"]["name"] == "draplane-binder")
    assert "--scheduler-name=draplane" in containers(binder)[0]["args"]
    assert not any(o["kind"].startswith("MutatingAdmissionPolicy") for o in kustomize.build(DEPLOY))

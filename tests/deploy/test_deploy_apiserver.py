"""deploy/ against a real kube-apiserver: every object accepted, and RBAC that is exactly enough.

The RBAC tests create the deploy/ ServiceAccounts, ClusterRoles and ClusterRoleBindings for real
(cluster-scoped names suffixed with the test's namespace, so tests never share them), then act as
each ServiceAccount through impersonation.

Each test renders deploy/ into its own namespace the way a site would: an overlay with
`namespace:` and deploy/ as its one resource, built by the real `kubectl kustomize`.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import msgspec
import pytest

from draplane.api.resource import ResourceClaim
from draplane.kube import KubeClient
from draplane.kube.client import KubeApiError, raw_collection_path
from draplane.localenv import kustomize
from draplane.localenv.kustomize import object_id

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

pytestmark = pytest.mark.integration


async def _render(namespace: str, tmp_path: Path) -> list[dict]:
    """deploy/ moved to `namespace` by an overlay written under `tmp_path`."""
    overlay = tmp_path / "overlay"
    overlay.mkdir(exist_ok=True)
    # Kustomize takes a base by relative path only.
    base = os.path.relpath(DEPLOY, overlay)
    (overlay / "kustomization.yaml").write_text(f"namespace: {namespace}\nresources: [{base}]\n")
    return await asyncio.to_thread(kustomize.build, overlay)


async def test_every_manifest_is_accepted_in_a_server_side_dry_run(kube, namespace, tmp_path):
    objects = await _render(namespace, tmp_path)
    accepted = []
    for obj in objects:
        if obj["kind"] == "Namespace":
            # Another test or a running `draplane up` may own "draplane"; the object is the same.
            obj["metadata"]["name"] = f"{namespace}-ns"
        try:
            result = await _dry_run(kube, obj)
        except KubeApiError as exc:
            pytest.fail(f"{object_id(obj)} rejected by kube-apiserver: {exc}")
        assert result["kind"] == obj["kind"] and result["metadata"]["name"] == obj["metadata"]["name"]
        accepted.append(object_id(obj))
    assert len(accepted) == len(objects) >= 20
    # Dry run: nothing was persisted.
    with pytest.raises(KubeApiError) as missing:
        await kube.request("GET", f"/apis/apps/v1/namespaces/{namespace}/statefulsets/draplane-allocator")
    assert missing.value.status == 404


async def _dry_run(kube: KubeClient, obj: dict) -> dict:
    # Strict field validation: a misspelled field (say `readinesProbe`) is an error, where the
    # default would drop it with only a warning and the probe would silently not exist.
    data = await kube.request(
        "POST", raw_collection_path(obj), body=obj, query={"dryRun": "All", "fieldValidation": "Strict"}
    )
    return msgspec.json.decode(data)


async def test_a_misspelled_field_is_rejected_by_the_strict_dry_run(kube, namespace, tmp_path):
    (binder,) = [o for o in await _render(namespace, tmp_path) if o["kind"] == "Deployment" and o["metadata"]["name"] == "draplane-binder"]
    container = binder["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(KubeApiError) as rejected:
        await _dry_run(kube, binder)
    assert rejected.value.status == 400 and 'unknown field "spec.template.spec.containers[0].readinesProbe"' in rejected.value.message


async def test_a_broken_manifest_is_rejected_by_the_dry_run(kube, namespace, tmp_path):
    # The test above can fail: the same call refuses an object the apiserver finds invalid.
    (allocator,) = [o for o in await _render(namespace, tmp_path) if o["metadata"]["name"] == "draplane-allocator" and o["kind"] == "StatefulSet"]
    allocator["spec"]["selector"]["matchLabels"] = {"app.kubernetes.io/name": "something-else"}
    with pytest.raises(KubeApiError) as rejected:
        await _dry_run(kube, allocator)
    assert rejected.value.status == 422 and "selector" in rejected.value.message


# --- RBAC ---------------------------------------------------------------------------------------


async def _rbac_objects(namespace: str, tmp_path: Path) -> list[dict]:
    """deploy/'s ServiceAccounts and cluster RBAC, moved to `namespace` and given unique names."""
    objects = []
    for obj in await _render(namespace, tmp_path):
        if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            obj["metadata"]["name"] += f"-{namespace}"
            if obj["kind"] == "ClusterRoleBinding":
                obj["roleRef"]["name"] += f"-{namespace}"
                # Kustomize's `namespace:` moves the subjects that name its own ServiceAccounts
                # too, so an overlay needs no patch for them (see deploy/README.md).
                assert {s["namespace"] for s in obj["subjects"]} == {namespace}, object_id(obj)
        if obj["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
            objects.append(obj)
    return objects


async def _install_rbac(kube: KubeClient, objects: list[dict]) -> None:
    for obj in objects:
        await kube.apply_raw(obj)


async def _cleanup_cluster_rbac(kube: KubeClient, objects: list[dict]) -> None:
    for obj in objects:
        if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            plural = obj["kind"].lower() + "s"
            try:
                await kube.request("DELETE", f"/apis/rbac.authorization.k8s.io/v1/{plural}/{obj['metadata']['name']}")
            except KubeApiError as exc:
                if exc.status != 404:
                    raise


def _user(namespace: str, service_account: str) -> str:
    return f"system:serviceaccount:{namespace}:{service_account}"


async def _rules(kube: KubeClient, namespace: str, service_account: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) that `service_account` may use in `namespace`, as the
    apiserver's own SelfSubjectRulesReview answers when asked as that ServiceAccount."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectRulesReview",
        "spec": {"namespace": namespace},
    }
    data = await kube.request(
        "POST", "/apis/authorization.k8s.io/v1/selfsubjectrulesreviews", body=review,
        headers={"Impersonate-User": _user(namespace, service_account)},
    )
    status = msgspec.json.decode(data)["status"]
    assert not status.get("incomplete"), status.get("evaluationError")
    granted = set()
    for rule in status.get("resourceRules") or []:
        assert not rule.get("resourceNames"), f"{service_account}: unexpected name-scoped rule {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    granted.add((group, resource, verb))
    return granted


def _expand(*entries: tuple[str, str, str]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for groups, resources, verbs in entries
        for group in groups.split(",")
        for resource in resources.split(",")
        for verb in verbs.split(",")
    }


READ = "get,list,watch"
R = "resource.k8s.io"

# Each service's job, written from the design (not read from deploy/): what deploy/ must grant.
JOBS = {
    "draplane-inventory": _expand(
        (R, "resourceslices", "get,list,watch,create,update,patch,delete"),
        ("", "nodes", READ),
        (R, "deviceclasses", READ),
    ),
    "draplane-allocator": set(),  # NATS only: the binder's cluster bucket is its view of Kubernetes
    "draplane-binder": _expand(
        ("", "pods", "get,list,watch,patch"),
        ("", "pods/binding", "create"),
        ("", "pods/status", "patch"),
        ("", "pods/eviction", "create"),  # preemption's victims
        (R, "resourceclaims", "get,list,watch,create,update,patch"),
        (R, "resourceclaims/status", "update,patch"),
        (R, "resourceclaims/binding", "update,patch"),
        (R, "resourceclaimtemplates", READ),
        ("", "nodes", READ),
        (",events.k8s.io", "events", "create,patch"),
        # published to the shards' cluster bucket
        (R, "deviceclasses,devicetaintrules", READ),
        ("policy", "poddisruptionbudgets", READ),
        ("scheduling.k8s.io", "podgroups", READ),
        # VolumeBinding: a volume's claimRef (static binding), a claim's selected-node (provisioning)
        ("", "persistentvolumeclaims,persistentvolumes", "get,list,watch,patch"),
        ("storage.k8s.io", "storageclasses,csinodes,csidrivers,volumeattachments", READ),
        # default topology spreading: the selectors of services and controllers
        ("", "services,replicationcontrollers", "list,watch"),
        ("apps", "replicasets,statefulsets", "list,watch"),
    ),
    # The kubelet plugin GETs the one claim it prepares, by namespace and name; nothing else.
    "draplane-node-agent": _expand((R, "resourceclaims", "get")),
    "draplane-audit": set(),  # NATS only
}

WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}


@pytest.fixture
async def rbac(kube, namespace, tmp_path):
    objects = await _rbac_objects(namespace, tmp_path)
    # A ServiceAccount bound to nothing: what every authenticated identity may do anyway
    # (self reviews, discovery), subtracted from what each service is shown to hold.
    objects.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody", "namespace": namespace}})
    await _install_rbac(kube, objects)
    yield objects
    await _cleanup_cluster_rbac(kube, objects)


async def test_each_service_account_holds_exactly_its_job(kube, namespace, rbac):
    baseline = await _rules(kube, namespace, "nobody")
    assert not any(verb in WRITE_VERBS and not resource.startswith(("selfsubject",)) for _, resource, verb in baseline), baseline
    for account, job in JOBS.items():
        granted = await _rules(kube, namespace, account) - baseline
        assert granted == job, (
            f"{account}: granted beyond its job {sorted(granted - job)}; missing {sorted(job - granted)}"
        )
    # The three lines the issue names, as the apiserver sees them:
    binder = await _rules(kube, namespace, "draplane-binder")
    assert not {(R, "resourceslices", v) for v in WRITE_VERBS} & binder
    inventory = await _rules(kube, namespace, "draplane-inventory")
    assert ("", "pods/binding", "create") not in inventory
    node_agent = await _rules(kube, namespace, "draplane-node-agent")
    assert node_agent - baseline == {(R, "resourceclaims", "get")}
    assert not {(R, "resourceslices", v) for v in {"list", *WRITE_VERBS}} & node_agent
    assert not {(R, "resourceclaims", v) for v in {"list", "watch", *WRITE_VERBS}} & node_agent
    assert ("", "nodes", "patch") not in node_agent


def _node(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def _slice(name: str, node: dict) -> dict:
    return {
        "apiVersion": f"{R}/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "name": name,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node["metadata"]["name"], "uid": node["metadata"]["uid"]}],
        },
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node["metadata"]["name"],
            "pool": {"name": node["metadata"]["name"], "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}}],
        },
    }


def _claim(namespace: str, name: str) -> dict:
    return {
        "apiVersion": f"{R}/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }


def _pod(namespace: str, name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"schedulerName": "draplane", "containers": [{"name": "c", "image": "busybox"}]},
    }


async def _as(control_plane, namespace: str, account: str) -> KubeClient:
    return await KubeClient.from_kubeconfig(control_plane.kubeconfig, impersonate=_user(namespace, account))


async def _forbidden(call) -> KubeApiError:
    with pytest.raises(KubeApiError) as denied:
        await call
    assert denied.value.status == 403, denied.value
    return denied.value


async def test_services_do_their_jobs_and_are_refused_the_rest(kube, control_plane, namespace, rbac):
    suffix = uuid.uuid4().hex[:6]
    node = msgspec.json.decode(await kube.request("POST", "/api/v1/nodes", body=_node(f"rbac-node-{suffix}")))
    pod = await kube.apply_raw(_pod(namespace, "workload"))
    inventory = await _as(control_plane, namespace, "draplane-inventory")
    binder = await _as(control_plane, namespace, "draplane-binder")
    allocator = await _as(control_plane, namespace, "draplane-allocator")
    node_agent = await _as(control_plane, namespace, "draplane-node-agent")
    slices = f"/apis/{R}/v1/resourceslices"
    claims = f"/apis/{R}/v1/namespaces/{namespace}/resourceclaims"
    try:
        # inventory: writes ResourceSlices owned by the Node; cannot bind pods or touch claims.
        created = await inventory.apply_raw(_slice(f"rbac-{suffix}", node))
        await inventory.request("DELETE", f"{slices}/{created['metadata']['name']}")
        await _forbidden(inventory.bind_pod(namespace, "workload", node["metadata"]["name"]))
        await _forbidden(inventory.apply_raw(_claim(namespace, "by-inventory")))

        # binder: the scheduler's protocol, end to end. Claim, finalizer, allocation and
        # reservedFor in one status update (which needs resourceclaims/binding), pod binding.
        claim = await binder.apply_raw(_claim(namespace, "gpu-claim"))
        claim["metadata"]["finalizers"] = ["resource.kubernetes.io/delete-protection"]
        claim = msgspec.json.decode(await binder.request("PUT", f"{claims}/gpu-claim", body=claim))
        claim["status"] = {
            "allocation": {
                "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": node["metadata"]["name"], "device": "gpu-0"}]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node["metadata"]["name"]]}]}]},
            },
            "reservedFor": [{"resource": "pods", "name": "workload", "uid": pod["metadata"]["uid"]}],
        }
        allocated = msgspec.json.decode(await binder.request("PUT", f"{claims}/gpu-claim/status", body=claim))
        assert allocated["status"]["reservedFor"][0]["uid"] == pod["metadata"]["uid"]
        await binder.bind_pod(namespace, "workload", node["metadata"]["name"], pod["metadata"]["uid"])
        bound = msgspec.json.decode(await kube.request("GET", f"/api/v1/namespaces/{namespace}/pods/workload"))
        assert bound["spec"]["nodeName"] == node["metadata"]["name"]
        await _forbidden(binder.apply_raw(_slice(f"by-binder-{suffix}", node)))
        await _forbidden(binder.request("DELETE", f"{claims}/gpu-claim"))

        # allocator: no Kubernetes access at all (NATS only), not even reads.
        await _forbidden(allocator.request("GET", f"/apis/{R}/v1/resourceclaims"))
        await _forbidden(allocator.apply_raw(_claim(namespace, "by-allocator")))
        await _forbidden(allocator.request("PUT", f"{claims}/gpu-claim/status", body=allocated))

        # node-agent: the kubelet plugin's one read, a claim by namespace and name, as the agent
        # makes it (KubeClient.get); nothing else, not even listing or watching claims.
        read = await node_agent.get(ResourceClaim, "gpu-claim", namespace)
        assert read.metadata.uid == allocated["metadata"]["uid"]
        assert read.status.reserved_for[0].uid == pod["metadata"]["uid"]
        await _forbidden(node_agent.request("GET", claims))
        await _forbidden(node_agent.request("GET", f"/apis/{R}/v1/resourceclaims"))
        await _forbidden(node_agent.request("GET", claims, query={"watch": "true"}))
        await _forbidden(node_agent.apply_raw(_claim(namespace, "by-agent")))
        await _forbidden(node_agent.request("PUT", f"{claims}/gpu-claim/status", body=allocated))
        await _forbidden(node_agent.request("GET", f"{slices}"))
        await _forbidden(node_agent.apply_raw(_slice(f"by-agent-{suffix}", node)))
        await _forbidden(node_agent.request("PATCH", f"/api/v1/nodes/{node['metadata']['name']}",
                                            body=b'{"metadata":{"labels":{"x":"y"}}}', content_type="application/merge-patch+json"))
    finally:
        for client in (inventory, binder, allocator, node_agent):
            await client.close()
        await kube.request("DELETE", f"/api/v1/nodes/{node['metadata']['name']}")


async def test_claim_allocation_needs_the_binding_subresource(kube, control_plane, namespace, rbac):
    """Why deploy/ grants resourceclaims/binding: without it, the same status write is refused."""
    role = next(o for o in rbac if o["kind"] == "ClusterRole" and o["metadata"]["name"].startswith("draplane-binder-"))
    without = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": f"binder-without-binding-{namespace}"},
        "rules": [r for r in role["rules"] if "resourceclaims/binding" not in r["resources"]],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": f"binder-without-binding-{namespace}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": without["metadata"]["name"]},
        "subjects": [{"kind": "ServiceAccount", "name": "nobody", "namespace": namespace}],
    }
    await _install_rbac(kube, [without, binding])
    client = await _as(control_plane, namespace, "nobody")
    try:
        claim = await client.apply_raw(_claim(namespace, "no-binding"))
        claim["status"] = {
            "allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "p", "device": "gpu-0"}]}}
        }
        path = f"/apis/{R}/v1/namespaces/{namespace}/resourceclaims/no-binding/status"
        with pytest.raises(KubeApiError) as denied:
            await client.request("PUT", path, body=claim)
        # The check runs in the status strategy's validation, so it comes back as 422 Invalid
        # (field status.allocation: Forbidden), not as a 403 from the authorizer.
        assert denied.value.status == 422, denied.value
        assert 'requires resource="resourceclaims/binding"' in denied.value.message
        assert "cannot update resource \"resourceclaims/binding\"" in denied.value.message
    finally:
        await client.close()
        await _cleanup_cluster_rbac(kube, [without, binding])

"""The deploy/ manifests as `kubectl apply -k` would send them, without kubectl.

deploy/ is plain multi-document YAML listed by a kustomization.yaml. This renders the subset of
Kustomize that it uses — `resources` (files and nested kustomization folders), `namespace` and
`images` — so tests, and tools on machines without kubectl, see exactly the objects a cluster
would get. A kustomization field outside that subset is an error, not silently ignored: a
renderer that skipped a patch would test different objects than the ones deployed.

Pure: reads files, no network, no Kubernetes client.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILE = "kustomization.yaml"

_SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images"}

# Kinds with no namespace; everything else gets the kustomization's namespace.
CLUSTER_SCOPED_KINDS = frozenset(
    {
        "Namespace", "Node", "PersistentVolume", "StorageClass", "PriorityClass", "RuntimeClass",
        "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "APIService",
        "DeviceClass", "ResourceSlice", "DeviceTaintRule",
        "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    }
)

# Where pod specs sit in the workload kinds deploy/ uses.
_POD_SPEC_PATHS = {
    "Pod": ("spec",),
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}


class ManifestError(ValueError):
    """deploy/ is not what it should be. The message names the file and, where known, the object."""


def object_id(obj: dict[str, Any]) -> str:
    """`Kind namespace/name` (or `Kind name` for cluster-scoped objects), for messages and lookups."""
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{obj.get('kind')} {namespace + '/' if namespace else ''}{meta.get('name')}"


def load_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document of a file; each must be a Kubernetes object."""
    try:
        documents = list(yaml.safe_load_all(path.read_text()))
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML: {exc}") from None
    objects = []
    for index, doc in enumerate(documents):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ManifestError(f"{path}: document {index} is a {type(doc).__name__}, not a Kubernetes object")
        for field in ("apiVersion", "kind"):
            if not isinstance(doc.get(field), str) or not doc[field]:
                raise ManifestError(f"{path}: document {index} has no {field}")
        name = (doc.get("metadata") or {}).get("name")
        if not isinstance(name, str) or not name:
            raise ManifestError(f"{path}: document {index} ({doc['kind']}) has no metadata.name")
        objects.append(doc)
    return objects


def render(directory: Path, *, namespace: str | None = None) -> list[dict[str, Any]]:
    """The objects of the kustomization in `directory`, in `resources` order.

    `namespace`, if given, replaces the kustomization's own, as an overlay would.
    """
    directory = Path(directory)
    kustomization_path = directory / KUSTOMIZATION_FILE
    if not kustomization_path.is_file():
        raise ManifestError(f"{directory}: no {KUSTOMIZATION_FILE}")
    kustomization = yaml.safe_load(kustomization_path.read_text()) or {}
    if not isinstance(kustomization, dict):
        raise ManifestError(f"{kustomization_path}: not a mapping")
    unsupported = sorted(set(kustomization) - _SUPPORTED_FIELDS)
    if unsupported:
        raise ManifestError(
            f"{kustomization_path}: fields {unsupported} are not rendered here "
            f"(supported: {sorted(_SUPPORTED_FIELDS)}); extend draplane.manifests before using them"
        )

    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources") or []:
        if not isinstance(entry, str) or "://" in entry:
            raise ManifestError(f"{kustomization_path}: resource {entry!r} must be a local path")
        path = (directory / entry).resolve()
        if path.is_dir():
            objects.extend(render(path))
        elif path.is_file():
            objects.extend(load_documents(path))
        else:
            raise ManifestError(f"{kustomization_path}: resource {entry!r} does not exist ({path})")

    objects = [copy.deepcopy(obj) for obj in objects]
    target_namespace = namespace or kustomization.get("namespace")
    if target_namespace:
        for obj in objects:
            set_namespace(obj, target_namespace)
    for image in kustomization.get("images") or []:
        _apply_image(objects, image, kustomization_path)

    seen: dict[tuple[str, str, str | None, str], None] = {}
    for obj in objects:
        meta = obj["metadata"]
        key = (obj["apiVersion"].split("/")[0], obj["kind"], meta.get("namespace"), meta["name"])
        if key in seen:
            raise ManifestError(f"{kustomization_path}: {object_id(obj)} is defined twice")
        seen[key] = None
    return objects


def set_namespace(obj: dict[str, Any], namespace: str) -> None:
    """Move a namespaced object to `namespace`, as Kustomize's `namespace:` field does.

    Like Kustomize (its NamespaceTransformer in the default `defaultOnly` mode), binding subjects
    get the namespace only when they are named `default`; other subjects keep theirs. So an
    overlay that changes the namespace must also patch the bindings' ServiceAccount subjects.
    """
    kind = obj["kind"]
    if kind not in CLUSTER_SCOPED_KINDS:
        obj["metadata"]["namespace"] = namespace
    if kind in ("RoleBinding", "ClusterRoleBinding"):
        for subject in obj.get("subjects") or []:
            if subject.get("name") == "default":
                subject["namespace"] = namespace


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    path = _POD_SPEC_PATHS.get(obj["kind"])
    if path is None:
        return None
    node: Any = obj
    for key in path:
        node = (node or {}).get(key)
    return node


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(obj) or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def image_name(image: str) -> str:
    """The name part of an image reference: without the tag or digest."""
    if "@" in image:
        image = image.split("@", 1)[0]
    last = image.rsplit("/", 1)[-1]
    if ":" in last:  # a tag; a colon before the last slash is a registry port
        image = image[: len(image) - len(last)] + last.split(":", 1)[0]
    return image


def _apply_image(objects: list[dict[str, Any]], image: Any, source: Path) -> None:
    if not isinstance(image, dict) or not isinstance(image.get("name"), str):
        raise ManifestError(f"{source}: images entry {image!r} needs a name")
    unknown = sorted(set(image) - {"name", "newName", "newTag", "digest"})
    if unknown:
        raise ManifestError(f"{source}: images entry {image['name']!r} has unknown fields {unknown}")
    for obj in objects:
        for container in containers(obj):
            current = container.get("image", "")
            if image_name(current) != image["name"]:
                continue
            name = image.get("newName", image["name"])
            if "digest" in image:
                container["image"] = f"{name}@{image['digest']}"
            elif "newTag" in image:
                container["image"] = f"{name}:{image['newTag']}"
            else:
                container["image"] = name + current[len(image_name(current)):]

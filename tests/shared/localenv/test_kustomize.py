"""draplane.localenv.kustomize: the real `kubectl kustomize`, and its failures named."""

from __future__ import annotations

from pathlib import Path

import pytest

from draplane.localenv import binaries, kustomize
from draplane.localenv.kustomize import KustomizeError

APP = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  template:
    spec:
      containers:
        - {name: a, image: "registry.local:5000/team/draplane:old"}
"""


def _write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


@pytest.mark.integration
def test_a_folder_is_rendered_by_kubectl_with_every_kustomize_feature(tmp_path: Path):
    # A patch: beyond what the hand-written renderer that this replaced could do.
    _write(tmp_path, {
        "kustomization.yaml": "namespace: prod\nresources: [app.yaml]\n"
                              "images: [{name: registry.local:5000/team/draplane, newName: mirror/draplane, newTag: '2'}]\n"
                              "patches: [{path: replicas.yaml}]\n",
        "app.yaml": APP,
        "replicas.yaml": "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\nspec: {replicas: 3}\n",
    })
    (deployment,) = kustomize.build(tmp_path)
    assert deployment["metadata"] == {"name": "web", "namespace": "prod"}
    assert deployment["spec"]["replicas"] == 3
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "mirror/draplane:2"
    assert kustomize.object_id(deployment) == "Deployment prod/web"


@pytest.mark.integration
def test_a_folder_without_a_kustomization_is_named_with_kubectls_reason(tmp_path: Path):
    with pytest.raises(KustomizeError) as refused:
        kustomize.build(tmp_path)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path}: `kubectl kustomize` failed: ")
    assert "unable to find one of 'kustomization.yaml'" in message


@pytest.mark.integration
def test_a_missing_resource_is_named_with_kubectls_reason(tmp_path: Path):
    _write(tmp_path, {"kustomization.yaml": "resources: [gone.yaml]\n"})
    with pytest.raises(KustomizeError, match=rf"^{tmp_path}: `kubectl kustomize` failed: .*gone\.yaml"):
        kustomize.build(tmp_path)


def test_kubectl_not_built_yet_points_at_make_servers(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("DRAPLANE_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv(binaries.KUBECTL.env_override, raising=False)
    with pytest.raises(binaries.BinaryError, match=rf"cannot render {tmp_path} with `kubectl kustomize`: kubectl v1\.37\.\d+ is not built yet.*make servers"):
        kustomize.build(tmp_path)

"""A kustomization folder rendered by the real `kubectl kustomize`, as `kubectl apply -k` sends it.

The kubectl is the one built into the server cache (`make servers`), at the apiserver's version,
so what the tests read is what a cluster would be given: every Kustomize feature, with Kustomize's
own ordering, namespace rules and errors, and nothing a hand-written renderer could get wrong.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from draplane.api.codec import load_yaml_documents
from draplane.localenv import binaries

# Rendering reads local files only; a slow disk, not a hung network, is the worst case.
TIMEOUT_S = 60


class KustomizeError(RuntimeError):
    """`kubectl kustomize` refused the folder. The message names the folder and quotes kubectl."""


def build(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` prints, in its order.

    Raises BinaryError (naming `make servers`) when kubectl is not built yet, and KustomizeError
    when kubectl fails.
    """
    directory = Path(directory)
    try:
        kubectl = binaries.require(binaries.KUBECTL)
    except binaries.BinaryError as exc:
        raise binaries.BinaryError(f"cannot render {directory} with `kubectl kustomize`: {exc}") from None
    try:
        done = subprocess.run(
            [str(kubectl), "kustomize", str(directory)],
            capture_output=True, text=True, timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise KustomizeError(f"{directory}: `kubectl kustomize` did not finish in {TIMEOUT_S}s") from None
    if done.returncode != 0:
        reason = done.stderr.strip() or f"exit status {done.returncode}, nothing on stderr"
        raise KustomizeError(f"{directory}: `kubectl kustomize` failed: {reason}")
    try:
        documents = load_yaml_documents(done.stdout)
    except yaml.YAMLError as exc:  # kubectl printed something that is not YAML: a bug, named anyway
        raise KustomizeError(f"{directory}: `kubectl kustomize` printed invalid YAML: {exc}") from None
    return documents


def object_id(obj: dict[str, Any]) -> str:
    """`Kind namespace/name` (or `Kind name` for cluster-scoped objects), for messages."""
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{obj.get('kind')} {namespace + '/' if namespace else ''}{meta.get('name')}"

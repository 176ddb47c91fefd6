"""kube-scheduler's framework as an oracle: build main.go into the server cache, keep one process,
and send it cases (one JSON line each way).

main.go is built in a wrapper module made as draplane.localenv.binaries makes the one for the
Kubernetes binaries (k8s.io/kubernetes at the same version, its staging modules mapped to their
releases), with the same flags, so the Go build cache that built kube-scheduler is reused: on a
warm cache only main.go compiles and links. The binary is named after a hash of main.go and the
version, so an edit rebuilds it and an unchanged checkout reuses it.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

from draplane.localenv import binaries
from go_oracle import JsonLinesProcess, build_once

HERE = Path(__file__).resolve().parent


def binary_path() -> Path:
    digest = hashlib.sha256((HERE / "main.go").read_bytes() + binaries.KUBERNETES_VERSION.encode())
    return binaries.cache_dir() / "bin" / f"kube-scheduler-oracle-{digest.hexdigest()[:12]}"


def build(*, progress=print) -> Path:
    """The oracle binary, built unless already cached. Safe to run concurrently. Raises BinaryError."""

    def compile_into(go: Path, out: Path, log: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="draplane-build-scheduler-oracle-") as tmp:
            workdir = Path(tmp)
            lines = ["module draplane.local/build/kube-scheduler-oracle", "", "go 1.26", "",
                     f"require k8s.io/kubernetes {binaries.KUBERNETES_VERSION}", ""]
            (workdir / "go.mod").write_text("\n".join(lines) + "\n")
            release = "v0." + binaries.KUBERNETES_VERSION.split(".", 1)[1]
            for module in binaries._staging_modules(go, workdir, log):
                lines.append(f"replace {module} => {module} {release}")
            (workdir / "go.mod").write_text("\n".join(lines) + "\n")
            shutil.copy(HERE / "main.go", workdir / "main.go")
            binaries._run_go(go, ["mod", "tidy"], workdir, log, "the kube-scheduler oracle")
            binaries._run_go(go, ["build", "-trimpath", "-o", str(out), "."], workdir, log, "the kube-scheduler oracle")

    return build_once(binary_path(), f"the kube-scheduler framework oracle ({HERE.name}/main.go)", compile_into,
                      progress=progress)


class KubeScheduler(JsonLinesProcess):
    """One long-running oracle process. `filter(case)` -> {"feasible", "reasons", "message", "error"}."""

    def __init__(self, path: Path | None = None):
        super().__init__(path or build())

    def filter(self, case: dict[str, Any]) -> dict[str, Any]:
        """A case of Kubernetes JSON objects: {"nodes", "pods" (bound), "pod" (pending)}."""
        return self.ask(case)

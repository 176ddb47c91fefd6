"""kube-scheduler's framework as an oracle: build main.go into the server cache, keep one process,
and send it cases (one JSON line each way).

main.go is built in a wrapper module made as draplane.localenv.binaries makes the one for the
Kubernetes binaries (k8s.io/kubernetes at the same version, its staging modules mapped to their
releases), with the same flags, so the Go build cache that built kube-scheduler is reused: on a
warm cache only main.go compiles and links. The binary is named after a hash of main.go and the
version, so an edit rebuilds it and an unchanged checkout reuses it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from draplane.localenv import binaries

HERE = Path(__file__).resolve().parent


def binary_path() -> Path:
    digest = hashlib.sha256((HERE / "main.go").read_bytes() + binaries.KUBERNETES_VERSION.encode())
    return binaries.cache_dir() / "bin" / f"kube-scheduler-oracle-{digest.hexdigest()[:12]}"


def build(*, progress=print) -> Path:
    """The oracle binary, built unless already cached. Safe to run concurrently. Raises BinaryError."""
    target = binary_path()
    if target.is_file():
        return target
    go = binaries._go_executable()
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / ".kube-scheduler-oracle.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        logs = binaries.cache_dir() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"build-{target.name}.log"
        log.write_text("")
        started = time.monotonic()
        progress(f"building the kube-scheduler framework oracle ({HERE.name}/main.go)")
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
            out = workdir / "oracle"
            binaries._run_go(go, ["build", "-trimpath", "-o", str(out), "."], workdir, log, "the kube-scheduler oracle")
            os.replace(out, target)  # atomic: a half-written binary is never found
        progress(f"built {target.name} in {time.monotonic() - started:.1f}s")
    return target


class OracleError(RuntimeError):
    """The oracle process died or answered garbage."""


class KubeScheduler:
    """One long-running oracle process. `filter(case)` -> {"feasible", "reasons", "message", "error"}."""

    def __init__(self, path: Path | None = None):
        self.path = path or build()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [str(self.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, bufsize=1,
            )
        return self._proc

    def filter(self, case: dict[str, Any]) -> dict[str, Any]:
        """A case of Kubernetes JSON objects: {"nodes", "pods" (bound), "pod" (pending)}."""
        line = json.dumps(case, separators=(",", ":"))
        proc = self._start()
        try:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            answer = proc.stdout.readline()
        except (BrokenPipeError, OSError) as exc:
            self.close()
            raise OracleError(f"the oracle process failed: {exc}") from None
        if not answer:
            code = proc.poll()
            self.close()
            raise OracleError(f"the oracle process exited ({code}) on: {line[:500]}")
        try:
            return json.loads(answer)
        except json.JSONDecodeError:
            raise OracleError(f"the oracle answered garbage: {answer[:500]}") from None

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def __enter__(self) -> "KubeScheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

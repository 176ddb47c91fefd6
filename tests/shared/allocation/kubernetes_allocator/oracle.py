"""Kubernetes' structured allocator as an oracle: build main.go into the server cache, keep one
process, and send it cases (one JSON line each way).

The binary is named after a hash of main.go, go.mod and go.sum, so an edit rebuilds it and an
unchanged checkout reuses it. Built with the flags of draplane.localenv.binaries, so the Go build
cache that built kube-apiserver is reused (incremental builds take seconds).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from draplane.localenv import binaries

HERE = Path(__file__).resolve().parent
SOURCES = ("main.go", "go.mod", "go.sum")


def binary_path() -> Path:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    return binaries.cache_dir() / "bin" / f"dra-allocator-oracle-{digest.hexdigest()[:12]}"


def build(*, progress=print) -> Path:
    """The oracle binary, built unless already cached. Safe to run concurrently. Raises BinaryError."""
    target = binary_path()
    if target.is_file():
        return target
    go = binaries._go_executable()
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / ".dra-allocator-oracle.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        logs = binaries.cache_dir() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"build-{target.name}.log"
        log.write_text("")
        started = time.monotonic()
        progress(f"building the Kubernetes allocator oracle ({HERE.name}/main.go)")
        with tempfile.TemporaryDirectory(prefix="draplane-build-allocator-oracle-") as tmp:
            out = Path(tmp) / "oracle"
            binaries._run_go(go, ["build", "-trimpath", "-o", str(out), "."], HERE, log, "the allocator oracle")
            os.replace(out, target)  # atomic: a half-written binary is never found
        progress(f"built {target.name} in {time.monotonic() - started:.1f}s")
    return target


class OracleError(RuntimeError):
    """The oracle process died or answered garbage."""


class KubernetesAllocator:
    """One long-running oracle process. `allocate(case)` -> {"outcome", "message", "allocations"}."""

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

    def allocate(self, case: dict[str, Any] | str) -> dict[str, Any]:
        """A case as a dict of Kubernetes JSON objects, or already as one line of JSON."""
        line = case if isinstance(case, str) else json.dumps(case, separators=(",", ":"))
        proc = self._start()
        try:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            answer = proc.stdout.readline()
        except (BrokenPipeError, OSError) as exc:
            self.close()
            raise OracleError(f"oracle process failed: {exc}") from None
        if not answer:
            code = proc.wait()
            self._proc = None
            raise OracleError(f"oracle process exited with {code} on a case")
        return json.loads(answer)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "KubernetesAllocator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

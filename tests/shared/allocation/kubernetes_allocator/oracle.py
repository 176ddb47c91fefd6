"""Kubernetes' structured allocator as an oracle: build main.go into the server cache, keep one
process, and send it cases (one JSON line each way).

The binary is named after a hash of main.go, go.mod and go.sum, so an edit rebuilds it and an
unchanged checkout reuses it. Built with the flags of draplane.localenv.binaries, so the Go build
cache that built kube-apiserver is reused (incremental builds take seconds).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from draplane.localenv import binaries
from go_oracle import JsonLinesProcess, build_once

HERE = Path(__file__).resolve().parent
SOURCES = ("main.go", "go.mod", "go.sum")


def binary_path() -> Path:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    return binaries.cache_dir() / "bin" / f"dra-allocator-oracle-{digest.hexdigest()[:12]}"


def build(*, progress=print) -> Path:
    """The oracle binary, built unless already cached. Safe to run concurrently. Raises BinaryError."""

    def compile_into(go: Path, out: Path, log: Path) -> None:
        binaries._run_go(go, ["build", "-trimpath", "-o", str(out), "."], HERE, log, "the allocator oracle")

    return build_once(binary_path(), f"the Kubernetes allocator oracle ({HERE.name}/main.go)", compile_into,
                      progress=progress)


class KubernetesAllocator(JsonLinesProcess):
    """One long-running oracle process. `allocate(case)` -> {"outcome", "message", "allocations"}."""

    def __init__(self, path: Path | None = None):
        super().__init__(path or build())

    def allocate(self, case: dict[str, Any] | str) -> dict[str, Any]:
        """A case as a dict of Kubernetes JSON objects, or already as one line of JSON."""
        return self.ask(case)

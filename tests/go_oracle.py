"""What the Go oracles share (tests/shared/allocation/kubernetes_allocator,
tests/shared/scheduling/kube_scheduler_oracle): a binary built once into the server cache under a
lock, and one long-running process that answers one JSON line with one JSON line."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draplane.localenv import binaries


class OracleError(RuntimeError):
    """The oracle process died or answered garbage."""


def build_once(target: Path, what: str, compile_into: Callable[[Path, Path, Path], None], *,
               progress=print) -> Path:
    """`target`, built unless already cached: `compile_into(go, out, log)` writes the binary to
    `out`. Safe to run concurrently (a lock beside the binary); the binary appears atomically, so a
    half-written one is never found. Raises binaries.BinaryError."""
    if target.is_file():
        return target
    go = binaries._go_executable()
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        logs = binaries.cache_dir() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"build-{target.name}.log"
        log.write_text("")
        started = time.monotonic()
        progress(f"building {what}")
        with tempfile.TemporaryDirectory(prefix="draplane-build-oracle-") as tmp:
            out = Path(tmp) / "oracle"
            compile_into(go, out, log)
            os.replace(out, target)
        progress(f"built {target.name} in {time.monotonic() - started:.1f}s")
    return target


class JsonLinesProcess:
    """One long-running oracle process, started on the first question and again after it died."""

    def __init__(self, path: Path):
        self.path = path
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [str(self.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, bufsize=1,
            )
        return self._proc

    def ask(self, case: dict[str, Any] | str) -> dict[str, Any]:
        """A case as a dict, or already as one line of JSON; the answer as a dict."""
        line = case if isinstance(case, str) else json.dumps(case, separators=(",", ":"))
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
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

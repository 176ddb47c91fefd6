"""Build the real servers from Go modules into a cache outside the repo, and find them again.

Nothing here needs the project's virtualenv: `python -m draplane.localenv.binaries` runs on a
bare interpreter, so `make` can build the servers before anything else is installed.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KUBERNETES_VERSION = "v1.37.2"
ETCD_VERSION = "v3.7.3"
NATS_SERVER_VERSION = "v2.15.3"
KWOK_VERSION = "v0.8.0"
CONTAINERD_VERSION = "v2.4.2"
KUEUE_VERSION = "v0.17.0"


class BinaryError(RuntimeError):
    """A server binary is missing and could not be built. The message says what to do."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServerBinary:
    name: str  # file name in the cache: kube-apiserver, etcd, nats-server
    version: str
    env_override: str  # variable that may name an existing binary instead
    module: str  # Go module that is required by the wrapper
    package: str  # Go package built into the binary
    ldflags: str = ""

    @property
    def cache_path(self) -> Path:
        return cache_dir() / "bin" / f"{self.name}-{self.version}"


def _kube_ldflags(version: str) -> str:
    # Without these the binary reports v0.0.0, which clients and the discovery document show.
    pkg = "k8s.io/component-base/version"
    major, minor = version.lstrip("v").split(".")[:2]
    return " ".join(
        [
            "-s -w",
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    )


KUBE_APISERVER = ServerBinary(
    name="kube-apiserver",
    version=KUBERNETES_VERSION,
    env_override="DRAPLANE_KUBE_APISERVER",
    module="k8s.io/kubernetes",
    package="k8s.io/kubernetes/cmd/kube-apiserver",
    ldflags=_kube_ldflags(KUBERNETES_VERSION),
)
KUBECTL = ServerBinary(
    name="kubectl",
    version=KUBERNETES_VERSION,
    env_override="DRAPLANE_KUBECTL",
    module="k8s.io/kubernetes",
    package="k8s.io/kubernetes/cmd/kubectl",
    ldflags=_kube_ldflags(KUBERNETES_VERSION),
)
ETCD = ServerBinary(
    name="etcd",
    version=ETCD_VERSION,
    env_override="DRAPLANE_ETCD",
    module="go.etcd.io/etcd/server/v3",
    package="go.etcd.io/etcd/server/v3",
    ldflags="-s -w",
)
NATS_SERVER = ServerBinary(
    name="nats-server",
    version=NATS_SERVER_VERSION,
    env_override="DRAPLANE_NATS_SERVER",
    module="github.com/nats-io/nats-server/v2",
    package="github.com/nats-io/nats-server/v2",
    ldflags="-s -w",
)
KUBE_CONTROLLER_MANAGER = ServerBinary(
    name="kube-controller-manager",
    version=KUBERNETES_VERSION,
    env_override="DRAPLANE_KUBE_CONTROLLER_MANAGER",
    module="k8s.io/kubernetes",
    package="k8s.io/kubernetes/cmd/kube-controller-manager",
    ldflags=_kube_ldflags(KUBERNETES_VERSION),
)
# Not run by draplane itself: bench/vs_kube_scheduler.py runs it on the same cluster setup as the
# comparison, and tests can show what it does where draplane differs.
KUBE_SCHEDULER = ServerBinary(
    name="kube-scheduler",
    version=KUBERNETES_VERSION,
    env_override="DRAPLANE_KUBE_SCHEDULER",
    module="k8s.io/kubernetes",
    package="k8s.io/kubernetes/cmd/kube-scheduler",
    ldflags=_kube_ldflags(KUBERNETES_VERSION),
)
KWOK = ServerBinary(
    name="kwok",
    version=KWOK_VERSION,
    env_override="DRAPLANE_KWOK",
    module="sigs.k8s.io/kwok",
    package="sigs.k8s.io/kwok/cmd/kwok",
    ldflags="-s -w",
)
# The real node of the local cluster (draplane.localenv.realnode): a kubelet, and containerd with
# CDI. runc and the CNI plugins come from Debian's packages (the real node's README section).
KUBELET = ServerBinary(
    name="kubelet",
    version=KUBERNETES_VERSION,
    env_override="DRAPLANE_KUBELET",
    module="k8s.io/kubernetes",
    package="k8s.io/kubernetes/cmd/kubelet",
    ldflags=_kube_ldflags(KUBERNETES_VERSION),
)
_CONTAINERD_LDFLAGS = f"-s -w -X github.com/containerd/containerd/v2/version.Version={CONTAINERD_VERSION}"
CONTAINERD = ServerBinary(
    name="containerd",
    version=CONTAINERD_VERSION,
    env_override="DRAPLANE_CONTAINERD",
    module="github.com/containerd/containerd/v2",
    package="github.com/containerd/containerd/v2/cmd/containerd",
    ldflags=_CONTAINERD_LDFLAGS,
)
CONTAINERD_SHIM = ServerBinary(
    name="containerd-shim-runc-v2",
    version=CONTAINERD_VERSION,
    env_override="DRAPLANE_CONTAINERD_SHIM",
    module="github.com/containerd/containerd/v2",
    package="github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
    ldflags=_CONTAINERD_LDFLAGS,
)
CTR = ServerBinary(
    name="ctr",
    version=CONTAINERD_VERSION,
    env_override="DRAPLANE_CTR",
    module="github.com/containerd/containerd/v2",
    package="github.com/containerd/containerd/v2/cmd/ctr",
    ldflags=_CONTAINERD_LDFLAGS,
)
# Kueue, the job queueing controller many GPU clusters run in front of their scheduler. Not run by
# draplane: the tests run it on the local cluster (draplane.localenv.kueue) to show that draplane
# places what Kueue admits. Its own go.mod decides its dependencies (Kubernetes 1.35 libraries).
KUEUE = ServerBinary(
    name="kueue",
    version=KUEUE_VERSION,
    env_override="DRAPLANE_KUEUE",
    module="sigs.k8s.io/kueue",
    package="sigs.k8s.io/kueue/cmd/kueue",
    ldflags="-s -w",
)
ALL_BINARIES = (ETCD, NATS_SERVER, KUBE_APISERVER, KUBECTL, KUBE_CONTROLLER_MANAGER, KUBE_SCHEDULER, KUBELET, KWOK,
                CONTAINERD, CONTAINERD_SHIM, CTR)
# Built by `make test` only (`--with-test-servers`): what the tests run beside draplane.
TEST_BINARIES = (KUEUE,)
# The Kubernetes binaries share most of their packages: one wrapper module and one `go build`
# compiles those once for all of them. Only the missing ones are built; the Go build cache keys
# packages by their inputs, not by the wrapper, so adding one to a warm cache compiles only the
# packages that the others do not share and links it.
KUBERNETES_BINARIES = (KUBE_APISERVER, KUBECTL, KUBE_CONTROLLER_MANAGER, KUBE_SCHEDULER, KUBELET)
CONTAINERD_BINARIES = (CONTAINERD, CONTAINERD_SHIM, CTR)


def _build_group(binary: ServerBinary) -> tuple[ServerBinary, ...]:
    for group in (KUBERNETES_BINARIES, CONTAINERD_BINARIES):
        if binary in group:
            return group
    return (binary,)


def cache_dir() -> Path:
    configured = os.environ.get("DRAPLANE_CACHE")
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "draplane"


def find(binary: ServerBinary) -> Path | None:
    """The binary to run: the environment override if set, else the cached build, else None."""
    override = os.environ.get(binary.env_override)
    if override:
        path = Path(override).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BinaryError(
                f"{binary.env_override}={override} does not name an executable file; "
                f"unset it to build {binary.name} {binary.version} from Go modules instead"
            )
        return path
    return binary.cache_path if binary.cache_path.is_file() else None


def require(binary: ServerBinary) -> Path:
    path = find(binary)
    if path is None:
        raise BinaryError(
            f"{binary.name} {binary.version} is not built yet (looked for {binary.cache_path}); "
            f"run `make servers` or `python -m draplane.localenv.binaries`, "
            f"or set {binary.env_override} to an existing binary"
        )
    return path


def _go_executable() -> str:
    go = os.environ.get("GO") or shutil.which("go")
    if not go:
        raise BinaryError(
            "the Go toolchain is not installed (no `go` on PATH and $GO is unset); "
            "install Go >= 1.26 to build kube-apiserver, etcd and nats-server, "
            "or point DRAPLANE_KUBE_APISERVER, DRAPLANE_ETCD and DRAPLANE_NATS_SERVER at binaries"
        )
    return go


def _run_go(go: str, args: list[str], workdir: Path, log: Path, what: str) -> str:
    env = dict(os.environ, GOTOOLCHAIN="local", CGO_ENABLED="0", GOFLAGS="-mod=mod")
    with log.open("a") as out:
        out.write(f"$ go {' '.join(args)}\n")
        out.flush()
        proc = subprocess.run(
            [go, *args], cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=out, text=True
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise BinaryError(f"building {what} failed at `go {' '.join(args)}` (full log: {log}):\n{tail}")
    return proc.stdout


def _staging_modules(go: str, workdir: Path, log: Path) -> list[str]:
    """The k8s.io/<staging> modules that k8s.io/kubernetes replaces with ./staging/src paths."""
    import json

    out = _run_go(
        go, ["mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"], workdir, log,
        "kube-apiserver",
    )
    gomod = Path(json.loads(out)["GoMod"]).read_text()
    modules = []
    for line in gomod.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "=>" and parts[2].startswith("./staging/src/"):
            modules.append(parts[0])
    return modules


def build(binary: ServerBinary, *, progress=print) -> Path:
    """Build a binary into the cache unless it is already there, together with the other binaries
    of its module that are missing (one `go build`). Safe to run concurrently."""
    target = binary.cache_path
    if target.is_file():
        return target
    go = _go_executable()
    target.parent.mkdir(parents=True, exist_ok=True)
    group = _build_group(binary)
    lock_path = target.parent / f".{group[0].module.replace('/', '_')}-{binary.version}.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # someone else built it while we waited
            return target
        wanted = [b for b in group if not b.cache_path.is_file()]
        names = ", ".join(b.name for b in wanted)
        started = time.monotonic()
        progress(f"building {names} {binary.version} from Go modules (first run only; can take minutes)")
        logs = cache_dir() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"build-{wanted[0].name}-{binary.version}.log"
        log.write_text("")
        with tempfile.TemporaryDirectory(prefix=f"draplane-build-{binary.name}-") as tmp:
            workdir = Path(tmp)
            # A wrapper module: requiring the server's module from our own go.mod lets one
            # `go build` resolve it, and for Kubernetes lets us map staging paths to releases.
            lines = [f"module draplane.local/build/{wanted[0].name}", "", "go 1.26", "",
                     f"require {binary.module} {binary.version}", ""]
            if binary.module == "k8s.io/kubernetes":
                (workdir / "go.mod").write_text("\n".join(lines))
                release = "v0." + KUBERNETES_VERSION.split(".", 1)[1]
                for module in _staging_modules(go, workdir, log):
                    lines.append(f"replace {module} => {module} {release}")
            (workdir / "go.mod").write_text("\n".join(lines) + "\n")
            imports = "".join(f'import _ "{b.package}"\n' for b in wanted)
            (workdir / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\n{imports}")
            _run_go(go, ["mod", "tidy"], workdir, log, names)
            out = workdir / "out"
            out.mkdir()
            # With -o naming a folder, one `go build` of several main packages writes one binary
            # per package, named after its last path element (cmd/kubectl -> kubectl).
            output = f"{out}/" if len(wanted) > 1 else str(out / wanted[0].name)
            _run_go(go, ["build", "-trimpath", "-ldflags", binary.ldflags, "-o", output, *(b.package for b in wanted)],
                    workdir, log, names)
            for b in wanted:
                built = out / (b.package.rsplit("/", 1)[1] if len(wanted) > 1 else b.name)
                os.replace(built, b.cache_path)  # atomic: a half-written binary is never found
        progress(f"built {names} {binary.version} in {time.monotonic() - started:.0f}s -> {target.parent}")
    return target


def ensure_all(*, progress=print, with_test_servers: bool = False) -> dict[str, Path]:
    found = {}
    for binary in ALL_BINARIES + (TEST_BINARIES if with_test_servers else ()):
        path = find(binary)
        found[binary.name] = path if path is not None else build(binary, progress=progress)
    return found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    unknown = [a for a in args if a != "--with-test-servers"]
    if unknown:
        print(f"usage: python -m draplane.localenv.binaries [--with-test-servers] (not: {' '.join(unknown)})",
              file=sys.stderr)
        return 2
    try:
        for name, path in ensure_all(progress=lambda msg: print(f"draplane: {msg}", flush=True),
                                     with_test_servers="--with-test-servers" in args).items():
            print(f"draplane: {name}: {path}", flush=True)
    except BinaryError as exc:
        print(f"draplane: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

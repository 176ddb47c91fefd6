"""Bad setup gets a clear message, not a traceback."""

import os
from pathlib import Path

import pytest

from draplane.localenv import binaries


def test_missing_go_toolchain_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAPLANE_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("GO", raising=False)
    with pytest.raises(binaries.BinaryError, match=r"Go toolchain is not installed.*Go >= 1.26"):
        binaries.build(binaries.NATS_SERVER, progress=lambda _: None)


def test_failed_build_reports_the_go_error_and_log(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAPLANE_CACHE", str(tmp_path))
    fake_go = tmp_path / "go"
    fake_go.write_text("#!/bin/sh\necho 'go: module example.com/x: not found' >&2\nexit 1\n")
    fake_go.chmod(0o755)
    monkeypatch.setenv("GO", str(fake_go))
    with pytest.raises(binaries.BinaryError) as caught:
        binaries.build(binaries.NATS_SERVER, progress=lambda _: None)
    message = str(caught.value)
    assert "building nats-server failed at `go mod tidy`" in message
    assert "module example.com/x: not found" in message
    assert "build-nats-server" in message  # the full log's path
    assert not binaries.NATS_SERVER.cache_path.exists()


def test_env_override_must_name_an_executable(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAPLANE_ETCD", str(tmp_path / "nope"))
    with pytest.raises(binaries.BinaryError, match="DRAPLANE_ETCD=.*does not name an executable"):
        binaries.find(binaries.ETCD)


def test_env_override_is_used(monkeypatch, tmp_path):
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("DRAPLANE_ETCD", str(fake))
    assert binaries.find(binaries.ETCD) == fake


def test_missing_binary_names_the_command_that_builds_it(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAPLANE_CACHE", str(tmp_path))
    monkeypatch.delenv("DRAPLANE_KUBE_APISERVER", raising=False)
    with pytest.raises(binaries.BinaryError, match=r"kube-apiserver v1\.37\.\d+ is not built yet.*make servers"):
        binaries.require(binaries.KUBE_APISERVER)


def test_cache_is_outside_the_repo():
    repo = Path(__file__).resolve().parents[3]
    assert repo not in binaries.cache_dir().resolve().parents


def test_kube_scheduler_is_built_in_the_kubernetes_binaries_go_build(monkeypatch, tmp_path):
    """The Kubernetes binaries share one wrapper module and `go build`: building kube-scheduler
    builds the others that are missing in the same command, and leaves the cached ones alone."""
    monkeypatch.setenv("DRAPLANE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DRAPLANE_KUBE_SCHEDULER", raising=False)
    cached = (binaries.KUBE_APISERVER, binaries.KUBE_CONTROLLER_MANAGER)
    for present in cached:
        present.cache_path.parent.mkdir(parents=True, exist_ok=True)
        present.cache_path.write_text("cached")
    gomod = tmp_path / "kubernetes.mod"
    gomod.write_text("module k8s.io/kubernetes\n\nreplace (\n\tk8s.io/api => ./staging/src/k8s.io/api\n)\n")
    calls = tmp_path / "calls"
    fake_go = tmp_path / "go"
    # `go mod download -json` names the module's go.mod; `go build -o DIR/ PKG...` writes one
    # binary per package into DIR, named after the package's last element
    fake_go.write_text(f"""#!/bin/sh
echo "$@" >> {calls}
case "$1 $2" in
  "mod download") echo '{{"GoMod": "{gomod}"}}' ;;
  "build "*) while [ "$1" != "-o" ]; do shift; done; out="$2"; shift 2
    for pkg in "$@"; do echo built > "$out${{pkg##*/}}"; done ;;
esac
""")
    fake_go.chmod(0o755)
    monkeypatch.setenv("GO", str(fake_go))

    assert binaries.build(binaries.KUBE_SCHEDULER, progress=lambda _: None) == binaries.KUBE_SCHEDULER.cache_path
    assert binaries.require(binaries.KUBE_SCHEDULER).read_text() == "built\n"
    assert binaries.require(binaries.KUBECTL).read_text() == "built\n"
    build = [line for line in calls.read_text().splitlines() if line.startswith("build ")]
    assert len(build) == 1
    assert build[0].endswith(" k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet")
    assert binaries.require(binaries.KUBELET).read_text() == "built\n"
    assert "gitVersion=v1.37.2" in build[0]
    for present in cached:
        assert present.cache_path.read_text() == "cached"


def test_kube_scheduler_override_is_used(monkeypatch, tmp_path):
    fake = tmp_path / "kube-scheduler"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("DRAPLANE_KUBE_SCHEDULER", str(fake))
    assert binaries.require(binaries.KUBE_SCHEDULER) == fake


def test_the_test_servers_are_built_only_when_asked(monkeypatch, tmp_path, capsys):
    """`make demo` builds the servers draplane runs; `make test` adds Kueue (--with-test-servers)."""
    monkeypatch.setenv("DRAPLANE_CACHE", str(tmp_path))
    for binary in binaries.ALL_BINARIES + binaries.TEST_BINARIES:
        fake = tmp_path / binary.name
        fake.write_text("#!/bin/sh\n")
        fake.chmod(0o755)
        monkeypatch.setenv(binary.env_override, str(fake))
    assert "kueue" not in binaries.ensure_all(progress=lambda _: None)
    assert binaries.ensure_all(progress=lambda _: None, with_test_servers=True)["kueue"] == tmp_path / "kueue"
    assert binaries.main(["--with-test-servers"]) == 0
    assert binaries.main(["--with-tests"]) == 2
    assert "usage: python -m draplane.localenv.binaries [--with-test-servers]" in capsys.readouterr().err

import json
import os
import signal
import socket
import time

import pytest

from draplane.kube import KubeClient  # here, not in an async test: see tests/cli/test_up.py
from draplane.localenv import binaries
from draplane.localenv.controlplane import ControlPlane, Ports
from draplane.localenv.processes import ServerProcess, StartupError


def _nats_available() -> bool:
    try:
        return binaries.find(binaries.NATS_SERVER) is not None
    except binaries.BinaryError:
        return False


needs_nats = pytest.mark.skipif(not _nats_available(), reason="nats-server not built (make servers)")


@needs_nats
def test_port_in_use_is_named(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartupError, match=rf"nats-server: port {port} on 127.0.0.1 is already in use"):
            ControlPlane.start(tmp_path, ports=Ports(nats=port), with_kubernetes=False)


def test_server_that_dies_at_start_shows_its_log(tmp_path):
    process = ServerProcess("fake-server", ["/bin/sh", "-c", "echo 'flag provided but not defined: -bogus'; exit 3"], tmp_path / "fake.log")
    process.start()
    with pytest.raises(StartupError) as caught:
        process.wait_ready(lambda: False, timeout=10)
    assert "fake-server exited with code 3 while starting" in str(caught.value)
    assert "flag provided but not defined: -bogus" in str(caught.value)


def test_missing_executable_is_a_startup_error(tmp_path):
    process = ServerProcess("ghost", [str(tmp_path / "no-such-binary")], tmp_path / "ghost.log")
    with pytest.raises(StartupError, match="ghost: cannot execute"):
        process.start()


def test_a_server_ignoring_sigterm_is_killed(tmp_path):
    process = ServerProcess("stubborn", ["/bin/sh", "-c", "trap '' TERM; while true; do sleep 0.1; done"], tmp_path / "s.log")
    process.start()
    time.sleep(0.2)
    started = time.monotonic()
    process.stop(timeout=1)
    assert not process.alive()
    assert time.monotonic() - started < 5


@needs_nats
def test_stop_leaves_no_process(tmp_path):
    plane = ControlPlane.start(tmp_path, with_kubernetes=False)
    pid = plane.process("nats-server").pid
    plane.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.integration
def test_control_plane_serves_dra_v1_with_gates(control_plane):
    import json
    import urllib.request

    with urllib.request.urlopen(f"{control_plane.apiserver_url}/apis/resource.k8s.io/v1", context=control_plane.ssl_context()) as r:
        resources = {res["name"] for res in json.load(r)["resources"]}
    assert {"deviceclasses", "resourceslices", "resourceclaims", "resourceclaims/status", "resourceclaimtemplates"} <= resources
    assert control_plane.feature_gates, "no DRA feature gates were found in kube-apiserver --help"
    assert control_plane.kubeconfig.is_file()


@pytest.mark.integration
async def test_kubeconfig_authenticates_with_a_token_as_cluster_admin(control_plane):
    # A token, not the admin certificate: the apiserver caches token authentication but checks a
    # client certificate's signature on every request (12 % of its CPU under bench/e2e.py).
    user = json.loads(control_plane.kubeconfig.read_text())["users"][0]["user"]
    assert set(user) == {"token"}
    async with await KubeClient.from_kubeconfig(control_plane.kubeconfig) as kube:
        review = json.loads(await kube.request(
            "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        ))
    identity = review["status"]["userInfo"]
    assert identity["username"] == "draplane-admin"
    assert "system:masters" in identity["groups"]


@pytest.mark.integration
async def test_control_plane_serves_the_workload_api(control_plane, kubectl):
    # KEP-4671's gang API, as gangs are read from it: `kubectl api-resources` lists Workload and
    # PodGroup in scheduling.k8s.io/v1beta1, and a pod keeps its spec.schedulingGroup and a
    # PodGroup its gang minCount and topology key (each dropped silently if its gate were off).
    listed = await kubectl("api-resources", "--api-group=scheduling.k8s.io", "-o", "name")
    assert {"workloads.scheduling.k8s.io", "podgroups.scheduling.k8s.io"} <= set(listed.split())
    namespace = "workload-api-check"
    await kubectl("create", "namespace", namespace)
    try:
        await kubectl.apply(f"""
apiVersion: scheduling.k8s.io/v1beta1
kind: PodGroup
metadata: {{name: workers, namespace: {namespace}}}
spec:
  schedulingPolicy: {{gang: {{minCount: 2}}}}
  schedulingConstraints: {{topology: [{{key: topology.kubernetes.io/rack}}]}}
---
apiVersion: v1
kind: Pod
metadata: {{name: worker-0, namespace: {namespace}}}
spec:
  schedulerName: nobody
  schedulingGroup: {{podGroupName: workers}}
  containers: [{{name: c, image: registry.k8s.io/pause:3.10}}]
""")
        group = json.loads(await kubectl("get", "podgroup", "workers", "-n", namespace, "-o", "json"))
        assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 2}}
        assert group["spec"]["schedulingConstraints"] == {"topology": [{"key": "topology.kubernetes.io/rack"}]}
        pod = json.loads(await kubectl("get", "pod", "worker-0", "-n", namespace, "-o", "json"))
        assert pod["spec"]["schedulingGroup"] == {"podGroupName": "workers"}
    finally:
        await kubectl("delete", "namespace", namespace, "--wait=false")

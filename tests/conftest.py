"""Fixtures shared by the whole suite: real servers, started once per session, and per-test names.

Unit tests of the pure cores use none of these and run in milliseconds; integration tests get a
real etcd + kube-apiserver + NATS JetStream on free loopback ports, shut down at the end.
"""

from __future__ import annotations

import inspect
import os
import re
import uuid
from pathlib import Path

import pytest
import uvloop
from blockbuster import blockbuster_ctx

from draplane.localenv import binaries
from draplane.localenv.controllermanager import controller_manager
from draplane.localenv.controlplane import ControlPlane

SHARED = Path(os.environ.get("DRAPLANE_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared"))


def pytest_asyncio_loop_factories(config, item):
    # The services run on uvloop in production, so the tests do too.
    return {"uvloop": uvloop.new_event_loop}


# The seed article's example as it wrote it, shipped with the repo (examples/seed-vllm).
SEED_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "seed-vllm"


@pytest.fixture(scope="session")
def seed_example_dir() -> Path:
    return SEED_EXAMPLE


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The read-only ../shared folder next to the repo (seed example, trace data)."""
    if not (SHARED / "examples").is_dir():
        message = f"the shared folder with examples and data is not at {SHARED}; set DRAPLANE_SHARED_DIR"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI always has it: a skip there would hide a broken path
        pytest.skip(message)
    return SHARED


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory) -> ControlPlane:
    binaries.ensure_all(progress=lambda msg: print(f"\n{msg}", flush=True))
    # Its NATS takes any client on loopback, without TLS: every test runs under a subject prefix
    # of its own, which fixed per-role permissions cannot follow. Tests that start a service as a
    # process on it pass --insecure-dev; TLS and credentials are tested on servers of their own
    # (tests/deploy/test_nats_permissions.py, the inventory entry points, and draplane up).
    plane = ControlPlane.start(tmp_path_factory.mktemp("controlplane"))
    # The cluster's controllers, as in a real cluster: the resourceclaim controller makes claims
    # from templates and cleans up reservedFor; garbage collection and namespaces work. The node
    # lifecycle controller stays off: no kubelet or KWOK renews the hand-made nodes' leases.
    manager = controller_manager(plane, plane.workdir / "kube-controller-manager.log",
                                 controllers="*,-node-lifecycle-controller")
    manager.start()
    try:
        yield plane
    finally:
        manager.stop()
        plane.stop()


@pytest.fixture(scope="session")
async def kube(control_plane):
    from draplane.kube import KubeClient

    client = await KubeClient.from_kubeconfig(control_plane.kubeconfig)
    yield client
    await client.close()


def _test_name(request, limit: int) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:limit].strip("-")
    return f"{base}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
async def namespace(kube, request) -> str:
    """A fresh namespace per test, so tests never see each other's objects."""
    name = _test_name(request, 50)
    await kube.create_namespace(name)
    return name


@pytest.fixture(scope="session")
async def nats(control_plane):
    import nats as nats_py

    client = await nats_py.connect(control_plane.nats_url, name="draplane-tests")
    yield client
    await client.drain()
    await _cancel_leftover_tasks()


@pytest.fixture(scope="session")
async def follow_nats(control_plane):
    """A second connection whose reads are paced as `draplane-allocator --follow-pace-ms 150`'s
    following connection (draplane.jetstream.paced_reading), for in-process shards to watch through."""
    from draplane.jetstream.paced_reading import connect_paced

    client = await connect_paced(0.15, servers=[control_plane.nats_url], name="draplane-tests-follow")
    yield client
    await client.drain()


async def _cancel_leftover_tasks(timeout: float = 15.0) -> None:
    """Cancel the tasks tests left running, while the servers are still up.

    At the end of the session pytest-asyncio cancels whatever still runs on the loop and waits for
    it, after the control plane has stopped: a leftover task whose cleanup talks to NATS or the
    apiserver (a connection's close, a service's stop) then waits for ever for a server that is
    gone, and the session hangs. Here they are cancelled before that, with a bound, and named."""
    import asyncio
    import sys

    current = asyncio.current_task()
    leftovers = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    if not leftovers:
        return
    print(f"\n{len(leftovers)} task(s) left running by tests, cancelled at the end of the session: "
          + ", ".join(sorted(t.get_name() for t in leftovers)[:20]), file=sys.stderr)
    for task in leftovers:
        task.cancel()
    _, pending = await asyncio.wait(leftovers, timeout=timeout)
    for task in pending:
        print(f"still running {timeout:.0f} s after its cancellation: {task!r}", file=sys.stderr)


@pytest.fixture
def subject_prefix(request) -> str:
    """A NATS subject prefix of this test's own, e.g. `t.test-foo-1a2b3c.`; streams made under it do not clash."""
    return "t." + _test_name(request, 40) + "."


class Kubectl:
    """The real kubectl, built at the apiserver's version, against the session's control plane."""

    def __init__(self, binary: Path, kubeconfig: Path):
        self.binary = binary
        self.kubeconfig = kubeconfig

    async def __call__(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        import asyncio

        proc = await asyncio.create_subprocess_exec(
            str(self.binary), f"--kubeconfig={self.kubeconfig}", *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin is not None else None), 60)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {proc.returncode}: {err.decode().strip()}")
        return out.decode()

    async def apply(self, manifest: str) -> str:
        return await self("apply", "-f", "-", stdin=manifest)


@pytest.fixture(scope="session")
def kubectl(control_plane) -> Kubectl:
    return Kubectl(binaries.require(binaries.KUBECTL), control_plane.kubeconfig)


# --- no test's code may block the event loop -------------------------------------------------------
#
# As aiohttp's suite does with blockbuster: during every async test, a blocking call (a file read,
# time.sleep, a socket call without the loop) made from draplane's code on the event loop's thread
# fails the test with BlockingError, naming the call. One such call stalls every task of a
# service: its watches, its heartbeats, its placements.
BLOCKING_SCANNED = ["draplane", "draplane_allocator", "draplane_binder", "draplane_inventory",
                    "draplane_node_agent", "draplane_audit"]
# Harness code, not service code: starting servers and running one-shot commands block by design.
BLOCKING_EXCLUDED = ["draplane.localenv", "draplane.cli"]
# Blocking calls allowed, each bounded and made once at start-up, which tests make from their
# async bodies too:
# - kubernetes_asyncio reads the kubeconfig (and writes its certificates to temporary files)
#   synchronously inside its async loader, which has no other form;
# - nats-py reads the nkey seed file when it connects (and to sign the server's nonce);
# - a node agent's hardware profile is read before its loop starts (draplane.nodes.profile);
# - argparse looks for its messages' translations (gettext) when a parser is built.
BLOCKING_ALLOWED = {
    "kubernetes_asyncio/config/kube_config.py": {
        "load_kube_config", "load_kube_config_from_dict", "_get_kube_config_loader_for_yaml_file", "load_and_set",
    },
    "nats/aio/client.py": {"_get_nkeys_seed", "user_cb", "sig_cb", "_read_creds_user_nkey", "_read_creds_user_jwt"},
    "draplane/nodes/profile.py": {"load_profile"},
    "gettext.py": {"find"},
}


@pytest.fixture(autouse=True)
def no_blocking_calls(request):
    if not inspect.iscoroutinefunction(getattr(request.node, "function", None)):
        yield None
        return
    with blockbuster_ctx(BLOCKING_SCANNED, excluded_modules=BLOCKING_EXCLUDED) as buster:
        for function in buster.functions.values():
            for path, names in BLOCKING_ALLOWED.items():
                function.can_block_in(path, names)
        yield buster

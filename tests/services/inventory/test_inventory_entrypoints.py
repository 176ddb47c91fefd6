"""The two entry points, as a deployment runs them: draplane-inventory and draplane-node-agent --nodes N."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid

import pytest

from draplane.localenv.processes import free_port
from draplane_inventory.__main__ import parse_args

from test_inventory_integration import create_nodes, eventually, node_slices

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


async def test_inventory_and_simulated_agents_as_processes(kube, control_plane, subject_prefix, tmp_path):
    node_prefix = f"ep-{uuid.uuid4().hex[:6]}"
    nodes = [f"{node_prefix}-{i:04d}" for i in range(3)]
    await create_nodes(kube, nodes)
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig)}
    inventory = subprocess.Popen(
        # The session's NATS takes any client: said explicitly, as a service needs.
        [sys.executable, "-m", "draplane_inventory", "--nats", control_plane.nats_url, "--insecure-dev", "--prefix", subject_prefix,
         "--listen", f"127.0.0.1:{port}", "--taint-after", "20", "--remove-after", "60", "--log-format", "json"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "inventory.log", "wb"),
    )
    agents = None
    try:
        await eventually(lambda: _ready(port), timeout=60, interval=0.3)
        agents = subprocess.Popen(
            [sys.executable, "-m", "draplane_node_agent", "--nats", control_plane.nats_url, "--insecure-dev", "--prefix", subject_prefix,
             "--profile", "mixed", "--nodes", "3", "--node-prefix", node_prefix, "--heartbeat-interval", "1"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "agents.log", "wb"),
        )

        async def all_nodes():
            for node in nodes:
                if len(await node_slices(kube, node)) != 3:  # counters, GPUs, NICs
                    return False
            return True

        await eventually(all_nodes, timeout=60, interval=0.5)
        status, metrics = _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        assert 'draplane_inventory_slice_writes_total{verb="create"} 9.0' in metrics
        assert 'draplane_inventory_messages_received_total{kind="heartbeat"}' in metrics
        assert 'draplane_apiserver_requests_total{resource="resourceslices",verb="create"} 9.0' in metrics
    finally:
        for process in (agents, inventory):
            if process is not None:
                # Ctrl-C, as `draplane up` and a user at a terminal stop it
                process.send_signal(signal.SIGINT) if process is inventory else process.terminate()
                process.wait(15)
    log = (tmp_path / "inventory.log").read_text()
    assert inventory.returncode == 0, log[-2000:]
    # a clean shutdown: nothing left unretrieved, no traceback
    assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]
    # --log-format json: every line one JSON object
    lines = [json.loads(line) for line in log.splitlines()]
    assert lines and all({"time", "level", "logger", "message"} <= line.keys() for line in lines)


async def _ready(port: int) -> bool:
    return (await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/healthz"))[0] == 200


def test_inventory_arguments_are_checked():
    with pytest.raises(SystemExit):
        parse_args(["--taint-after", "60", "--remove-after", "30"])
    assert parse_args(["--taint-after", "5", "--remove-after", "9"]).remove_after == 9
    for listen in ("", "127.0.0.1", "host:http", "0.0.0.0:99999"):
        with pytest.raises(SystemExit):
            parse_args(["--listen", listen])


async def test_entry_points_authenticate_with_nkey_seeds_as_deployed(kube, control_plane, tmp_path):
    """DRAPLANE_NATS_NKEY_SEED and DRAPLANE_NATS_CA, as deploy/ sets them: over TLS, the inventory
    with its role's key and permissions (draplane.nats_roles), one real-style agent (--node, probes
    on --listen) with its node's key, which only allows its own subjects."""
    from draplane.localenv import binaries, natssecurity
    from draplane.localenv.controlplane import Ports, nats_config
    from draplane.localenv.processes import ServerProcess

    node = f"nk-{uuid.uuid4().hex[:6]}"
    await create_nodes(kube, [node])
    security = natssecurity.create(tmp_path / "nats-auth", prefix="draplane.",
                                   agents=[natssecurity.NodeAgentIdentity("agent", (node,))])
    nats_port, monitor = free_port(), free_port()
    (tmp_path / "nats.conf").write_text(nats_config(Ports(nats=nats_port, nats_monitor=monitor), tmp_path / "js",
                                                    security.server_config()))
    server = ServerProcess("nats-server", [str(binaries.require(binaries.NATS_SERVER)), "-c", str(tmp_path / "nats.conf")],
                           tmp_path / "nats.log")
    server.start()
    server.wait_ready(lambda: _get(f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true")[0] == 200, 30)
    url = f"nats://127.0.0.1:{nats_port}"
    inventory_port, agent_port = free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig)}
    inventory = subprocess.Popen(
        [sys.executable, "-m", "draplane_inventory", "--nats", url, "--listen", f"127.0.0.1:{inventory_port}"],
        env={**env, **security.environment("inventory")},
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "inventory.log", "wb"),
    )
    agent = None
    try:
        await eventually(lambda: _ready(inventory_port), timeout=60, interval=0.3)
        agent = subprocess.Popen(
            [sys.executable, "-m", "draplane_node_agent", "--nats", url, "--node", node, "--profile", "dgx-h100",
             "--listen", f"127.0.0.1:{agent_port}"],
            env={**env, **security.environment("agent")},
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "agent.log", "wb"),
        )
        await eventually(lambda: _ready(agent_port), timeout=60, interval=0.3)
        assert (await asyncio.to_thread(_get, f"http://127.0.0.1:{agent_port}/healthz"))[0] == 200
        # A dgx-h100 node has two drivers, so two slices, written one after the other: wait for both.
        async def both_slices():
            return len(await node_slices(kube, node)) == 2

        await eventually(both_slices, timeout=60, interval=0.5)
    finally:
        for process in (agent, inventory):
            if process is not None:
                process.terminate()
                process.wait(15)
        server.stop()
    assert agent.returncode == 0, (tmp_path / "agent.log").read_text()[-2000:]
    # Each did its whole job within its role's permissions: the server refused them nothing.
    assert "Violation" not in (tmp_path / "nats.log").read_text()

"""The two entry points, as a deployment runs them: draplane-inventory and draplane-node-agent --nodes N."""

from __future__ import annotations

import asyncio
import os
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
        [sys.executable, "-m", "draplane_inventory", "--nats", control_plane.nats_url, "--prefix", subject_prefix,
         "--listen", f"127.0.0.1:{port}", "--taint-after", "20", "--remove-after", "60"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "inventory.log", "wb"),
    )
    agents = None
    try:
        await eventually(lambda: _ready(port), timeout=60, interval=0.3)
        agents = subprocess.Popen(
            [sys.executable, "-m", "draplane_node_agent", "--nats", control_plane.nats_url, "--prefix", subject_prefix,
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
        assert 'draplane_inventory_apiserver_writes_total{verb="create"} 9' in metrics
        assert 'draplane_inventory_messages_received_total{kind="heartbeat"}' in metrics
    finally:
        for process in (agents, inventory):
            if process is not None:
                process.terminate()
                process.wait(15)
    assert inventory.returncode == 0, (tmp_path / "inventory.log").read_text()[-2000:]


async def _ready(port: int) -> bool:
    return (await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/healthz"))[0] == 200


def test_inventory_arguments_are_checked():
    with pytest.raises(SystemExit):
        parse_args(["--taint-after", "60", "--remove-after", "30"])
    assert parse_args(["--taint-after", "5", "--remove-after", "9"]).remove_after == 9

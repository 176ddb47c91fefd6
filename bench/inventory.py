"""Inventory benchmark: simulated nodes -> NATS JetStream -> inventory service -> kube-apiserver.

Case 1 (inventory_<N>x8): N simulated DGX H100-like nodes (8 GPUs + 8 NICs: two pools, two slices
per node) start in one node-agent process; measured from starting that process until every slice is
in the apiserver, with the number of apiserver writes (the target is one per slice).
Case 2 (inventory_steady_<S>s): then S seconds of heartbeats only; apiserver writes must stay 0.
The agents' CPU is read from /proc for their process, per node.

    .venv/bin/python bench/inventory.py                 # 1000 nodes, 60 s steady state
    .venv/bin/python bench/inventory.py --nodes 200 --seconds 15
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid

import nats
import uvloop

from draplane.api.core import Node
from draplane.api.meta import ObjectMeta
from draplane.api.resource import ResourceSlice
from draplane.kube import KubeClient
from draplane.localenv import binaries
from draplane.localenv.controlplane import ControlPlane
from draplane_inventory.service import InventoryService, InventorySettings
from draplane_node_agent.__main__ import simulated_node_names


def process_cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def create_nodes(kube: KubeClient, names: list[str]) -> None:
    semaphore = asyncio.Semaphore(32)

    async def one(name: str) -> None:
        async with semaphore:
            await kube.create(Node(metadata=ObjectMeta(name=name)))

    await asyncio.gather(*(one(n) for n in names))


async def run(args: argparse.Namespace, plane: ControlPlane) -> None:
    kube = await KubeClient.from_kubeconfig(plane.kubeconfig)
    node_prefix = f"bench-{uuid.uuid4().hex[:4]}"
    nodes = simulated_node_names(node_prefix, args.nodes)
    started = time.monotonic()
    await create_nodes(kube, nodes)
    print(f"created {len(nodes)} Node objects in {time.monotonic() - started:.1f}s", flush=True)

    prefix = "bench."
    connection = await nats.connect(plane.nats_url, max_reconnect_attempts=-1)
    service = InventoryService(kube, connection, InventorySettings(prefix=prefix, workers=args.workers,
                                                                   taint_after=120, remove_after=600))
    await service.start()
    expected = 2 * args.nodes

    cpu_start = time.process_time()
    t0 = time.monotonic()
    agents = subprocess.Popen(
        [sys.executable, "-m", "draplane_node_agent", "--nats", plane.nats_url, "--insecure-dev", "--prefix", prefix,
         "--profile", "dgx-h100", "--nodes", str(args.nodes), "--node-prefix", node_prefix,
         "--heartbeat-interval", str(args.heartbeat_interval)],
        stdout=subprocess.DEVNULL, stderr=open(os.path.join(args.workdir, "agents.log"), "wb"),
    )
    snapshots_in = None
    try:
        while service.metrics.total("apiserver_writes_total") < expected:
            if snapshots_in is None and service.metrics.total("snapshots_applied_total") >= args.nodes:
                snapshots_in = time.monotonic() - t0
            if agents.poll() is not None:
                raise SystemExit(f"node agents exited with {agents.returncode}; see {args.workdir}/agents.log")
            if time.monotonic() - t0 > args.fill_timeout:
                raise SystemExit(f"only {service.metrics.total('apiserver_writes_total')} of {expected} writes after {args.fill_timeout}s")
            await asyncio.sleep(0.05)
        await service.wait_idle(120)
        fill_seconds = time.monotonic() - t0
        writes = service.metrics.total("apiserver_writes_total")
        service_cpu_fill = time.process_time() - cpu_start
        items, _ = await kube.list(ResourceSlice, label_selector="app.kubernetes.io/managed-by=draplane-inventory")
        ours = [s for s in items if s.spec.node_name and s.spec.node_name.startswith(node_prefix)]
        assert len(ours) == expected, f"{len(ours)} slices in the apiserver, expected {expected}"
        print(f"fill: {len(ours)} slices for {args.nodes} nodes in {fill_seconds:.2f}s, {writes} writes, "
              f"inventory CPU {service_cpu_fill:.1f}s; every snapshot received by {snapshots_in or fill_seconds:.2f}s; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)

        # Steady state: heartbeats only.
        writes_before = writes
        agent_cpu_before = process_cpu_seconds(agents.pid)
        service_cpu_before = time.process_time()
        heartbeats_before = service.metrics.get("messages_received_total", kind="heartbeat")
        await asyncio.sleep(args.seconds)
        steady_writes = service.metrics.total("apiserver_writes_total") - writes_before
        agent_cpu = process_cpu_seconds(agents.pid) - agent_cpu_before
        service_cpu = time.process_time() - service_cpu_before
        heartbeats = service.metrics.get("messages_received_total", kind="heartbeat") - heartbeats_before
        agent_ms_per_node_per_s = 1000 * agent_cpu / args.nodes / args.seconds
        print(f"steady: {args.seconds}s, {heartbeats} heartbeats received, {steady_writes} writes, agents CPU "
              f"{agent_cpu:.2f}s ({agent_ms_per_node_per_s:.3f} ms CPU per node per second), inventory CPU {service_cpu:.2f}s",
              flush=True)
    finally:
        agents.terminate()
        agents.wait(10)
        await service.stop()
        await connection.close()
        await kube.close()

    print(f"BENCH name=inventory_{args.nodes}x8 seconds={fill_seconds:.2f} writes={writes} nodes={args.nodes} "
          f"devices={args.nodes * 16} slices={len(ours)}")
    print(f"BENCH name=inventory_steady_{args.seconds:g}s writes={steady_writes} nodes={args.nodes} "
          f"seconds={args.seconds:g} agent_cpu_ms_per_node_s={agent_ms_per_node_per_s:.4f} heartbeats={heartbeats}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60.0, help="steady-state duration")
    parser.add_argument("--workers", type=int, default=32, help="inventory write workers")
    parser.add_argument("--heartbeat-interval", type=float, default=5.0)
    parser.add_argument("--fill-timeout", type=float, default=300.0)
    args = parser.parse_args()
    binaries.ensure_all()
    with tempfile.TemporaryDirectory(prefix="draplane-bench-") as workdir:
        args.workdir = workdir
        with ControlPlane.start(os.path.join(workdir, "plane")) as plane:
            uvloop.run(run(args, plane))


if __name__ == "__main__":
    main()

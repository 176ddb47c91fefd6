"""A shard's cold start and memory at scale, without Kubernetes: what it costs to rebuild state.

A real nats-server with JetStream; the inventory feed bucket filled as the inventory fills it
(`--nodes` nodes of the shipped dgx-h100 profile with `--gpus-per-node` GPUs and no NICs, the
slices the inventory would write for them), and the cluster bucket as the binder fills it (the
Nodes, `--claims` ResourceClaims of 1-8 GPUs, none allocated, as the scale run's pending pods
have them, `--allocated` of them allocated, the synced marker and a heartbeat). Then one shard,
`python -m draplane_allocator`, starts on them:

- `cold_start_s`: process start to /readyz (imports, the three bucket replays, the state built);
- `ready_rss_mb`: its RSS then; `peak_rss_mb`: VmHWM then;
- `cpu_s`: the CPU seconds it spent to get there.

Usage: .venv/bin/python bench/shard_cold_start.py [--nodes 5000] [--claims 50000] [--rounds 2]
Prints one `BENCH name=shard_cold_start ...` line per round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "services" / "node-agent"), str(ROOT / "services" / "inventory")]

PREFIX = "cold."
GPU_CLASS = "gpu.nvidia.com"


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def feed_values(nodes: int, gpus: int) -> list[tuple[str, bytes]]:
    """The inventory's feed entries for `nodes` dgx-h100 nodes, as it encodes them."""
    from draplane.nodes.slices import desired_specs
    from draplane.nodes.hardware import driver_devices
    from draplane.nodes.profile import load_profile, profile_hardware

    from draplane.api.meta import ObjectMeta
    from draplane.api.resource import ResourceSlice
    from draplane.messages.inventory import SCHEMA_VERSION, FeedEntry, encode

    profile = load_profile("dgx-h100")
    roots = min(profile.pcie_roots, gpus)
    profile = msgspec.structs.replace(profile, pcie_roots=roots, numa_nodes=min(profile.numa_nodes, roots),
                                      gpus=[msgspec.structs.replace(profile.gpus[0], count=gpus)], nics=[])
    values = []
    for i in range(nodes):
        node = f"cold-{i:05d}"
        slices = [ResourceSlice(metadata=ObjectMeta(name=f"{node}-{d}-{j}", uid=f"uid-{node}-{d}-{j}",
                                                    resource_version=str(i + 1)), spec=spec)
                  for d, entry in enumerate(driver_devices(profile_hardware(profile, node)))
                  for j, spec in enumerate(desired_specs(node, entry))]
        key = f"node.{node}"
        values.append((key, encode(FeedEntry(schema_version=SCHEMA_VERSION, key=key, node=node, slices=slices))))
    return values


def cluster_values(nodes: int, claims: int, allocated: int, gpus: int) -> list[tuple[str, bytes]]:
    """The binder's cluster bucket for them: the Nodes and the claims (trimmed as it trims)."""
    from draplane.api.resource import (
        AllocationResult,
        DeviceAllocationResult,
        DeviceClass,
        DeviceRequestAllocationResult,
        ResourceClaimStatus,
    )
    from draplane.localenv import environment
    from draplane.scheduling import cluster_feed
    from draplane.simulation import scenario

    values = []
    for raw in environment.standard_device_classes():
        if raw["metadata"]["name"] == GPU_CLASS:
            device_class = msgspec.convert(raw, DeviceClass)
            values.append((cluster_feed.key_of(device_class), cluster_feed.encode(cluster_feed.trimmed(device_class))))
    for i in range(nodes):
        node = scenario.gpu_node(f"cold-{i:05d}")
        node.metadata.uid = f"node-uid-{i}"
        values.append((cluster_feed.key_of(node), cluster_feed.encode(cluster_feed.trimmed(node))))
    for i in range(claims):
        size = 1 + i % gpus
        claim = scenario.claim("cold", f"c-{i:05d}", GPU_CLASS, count=size)
        claim.metadata.uid = f"claim-uid-{i:06d}"
        if i < allocated:
            node = f"cold-{i % nodes:05d}"
            claim.status = ResourceClaimStatus(allocation=AllocationResult(devices=DeviceAllocationResult(results=[
                DeviceRequestAllocationResult(request="gpu", driver=GPU_CLASS, pool=node, device=f"gpu-{g}")
                for g in range(size)])))
        values.append((cluster_feed.key_of(claim), cluster_feed.encode(cluster_feed.trimmed(claim))))
    marker = cluster_feed.encode_synced(cluster_feed.Synced(binder="bench", at=time.time()))
    values += [(cluster_feed.SYNCED_KEY, marker), (cluster_feed.HEARTBEAT_KEY, marker)]
    return values


async def fill(nats_url: str, feed: list, cluster: list) -> None:
    import nats
    from nats.js.api import KeyValueConfig

    from draplane.messages.inventory import InventoryNames
    from draplane.jetstream import streams
    from draplane.scheduling.messages import Subjects

    client = await nats.connect(nats_url)
    js = client.jetstream()
    subjects = Subjects(prefix=PREFIX)
    await streams.ensure_streams(js, subjects)
    await streams.reservation_bucket(js, subjects)
    feed_kv = await js.create_key_value(KeyValueConfig(bucket=InventoryNames(prefix=PREFIX).feed_bucket, history=1))
    cluster_kv = await streams.cluster_bucket(js, subjects)
    for kv, values in ((feed_kv, feed), (cluster_kv, cluster)):
        for start in range(0, len(values), 500):
            await asyncio.gather(*(kv.put(key, value) for key, value in values[start:start + 500]))
    await client.close()


def one_round(nats_url: str, workdir: Path, round_number: int) -> dict:
    from draplane.localenv.processes import ServerProcess, free_port

    port = free_port()
    shard = ServerProcess(f"shard-{round_number}", [
        sys.executable, "-m", "draplane_allocator", "--nats", nats_url, "--insecure-dev", "--prefix", PREFIX,
        "--shards=1", "--shard-index=0", f"--port={port}"], workdir / "logs" / f"shard-{round_number}.log",
        env=dict(os.environ, PYTHONUNBUFFERED="1"))
    started = time.monotonic()
    shard.start()
    try:
        shard.wait_ready(lambda: ready(port), 600)
        cold_start = time.monotonic() - started
        return {"cold_start_s": cold_start, "ready_rss_mb": rss_mb(shard.pid), "peak_rss_mb": rss_mb(shard.pid, "VmHWM"),
                "cpu_s": cpu_seconds(shard.pid)}
    finally:
        shard.stop(timeout=20.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--claims", type=int, default=50_000)
    parser.add_argument("--allocated", type=int, default=0, help="of the claims, how many are allocated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, JetStream)")
    args = parser.parse_args()

    from draplane.localenv import binaries
    from draplane.localenv.controlplane import Ports, _start_nats

    workdir = Path(tempfile.mkdtemp(prefix="draplane-cold-"))
    (workdir / "logs").mkdir()
    ports = Ports().resolve()
    nats_server = _start_nats(binaries.require(binaries.NATS_SERVER), workdir, ports, 30.0)
    nats_url = f"nats://127.0.0.1:{ports.nats}"
    try:
        started = time.monotonic()
        feed = feed_values(args.nodes, args.gpus_per_node)
        cluster = cluster_values(args.nodes, args.claims, args.allocated, args.gpus_per_node)
        asyncio.run(fill(nats_url, feed, cluster))
        print(f"# filled: {len(feed)} feed entries ({sum(len(v) for _, v in feed) / 2**20:.1f} MB), "
              f"{len(cluster)} cluster entries ({sum(len(v) for _, v in cluster) / 2**20:.1f} MB) "
              f"in {time.monotonic() - started:.1f} s", flush=True)
        for round_number in range(args.rounds):
            result = one_round(nats_url, workdir, round_number)
            print(f"BENCH name=shard_cold_start nodes={args.nodes} devices={args.nodes * args.gpus_per_node} "
                  f"claims={args.claims} allocated={args.allocated} round={round_number} "
                  + " ".join(f"{k}={v:.1f}" if k != "cold_start_s" else f"{k}={v:.2f}" for k, v in result.items()),
                  flush=True)
    finally:
        nats_server.stop(timeout=10.0)
        if args.keep:
            print(f"# kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`draplane up`: the local environment in one command. Ctrl-C stops everything."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="start a local control plane, the four services and simulated nodes")
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes, dealt over the shipped profiles (default 4)")
    parser.add_argument("--shards", type=int, default=2, help="allocator shards (default 2)")
    parser.add_argument("--workdir", type=Path, default=None, help="state and logs (default ~/.local/state/draplane/up)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.nodes < 1 or args.shards < 1:
        print("draplane up: --nodes and --shards must be at least 1", file=sys.stderr)
        return 2
    return asyncio.run(_up(args))


async def _up(args: argparse.Namespace) -> int:
    from draplane.localenv import binaries, environment
    from draplane.localenv.processes import StartupError

    try:
        env = await environment.start(
            node_count=args.nodes, shards=args.shards, workdir=args.workdir,
            progress=lambda message: print(f"draplane up: {message}", flush=True),
        )
    except (environment.AlreadyRunning, binaries.BinaryError, StartupError) as exc:
        print(f"draplane up: {exc}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"\ndraplane is up: {sum(len(n) for n in env.nodes.values())} nodes, {env.shards} allocator shards.\n"
        f"  kubeconfig: {env.kubeconfig}\n"
        f"  try:        kubectl --kubeconfig {env.kubeconfig} get nodes,resourceslices,deviceclasses\n"
        f"  logs:       tail -f {env.logs}/*.log\n"
        f"Ctrl-C stops everything.",
        flush=True,
    )
    try:
        while not stop.is_set():
            for process in env.services:
                if not process.alive():
                    print(f"draplane up: {process.name} exited (log: {process.log_path}):\n{process.log_tail()}", file=sys.stderr)
                    stop.set()
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
    finally:
        print("draplane up: stopping", flush=True)
        await asyncio.to_thread(env.stop)
    return 0

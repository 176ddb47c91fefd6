"""draplane-node-agent: stream this node's devices (or a thousand simulated nodes') to NATS.

    draplane-node-agent --backend nvml --node "$NODE_NAME"                 # a real node
    draplane-node-agent --profile dgx-h100 --nodes 1000 --node-prefix sim  # simulated nodes
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import sys
from pathlib import Path

from draplane.entrypoints import add_nats_arguments, nats_servers, nats_tls_context, require_nats_credentials
from draplane.nats_roles import fleet_inbox_prefix
from draplane.structured_logs import add_log_format_argument, configure_logging
from draplane.messages.inventory import DEFAULT_PREFIX, InventoryNames
from draplane_node_agent.agent import AgentFleet, SimulatedAgent
from draplane_node_agent.hardware import driver_devices
from draplane_node_agent.profile import ProfileError, load_profile, profile_names


class ProfileDiscovery:
    """Discovery from a profile file, re-read when the file changes (so tests can edit hardware)."""

    __slots__ = ("source", "node", "_mtime", "_devices")

    def __init__(self, source: str, node: str):
        self.source, self.node = source, node
        self._mtime: float | None = None
        self._devices = None

    def __call__(self):
        path = Path(self.source)
        mtime = path.stat().st_mtime if path.exists() else 0.0
        if self._devices is None or mtime != self._mtime:
            self._devices = driver_devices(_load_profile_cached(self.source, mtime).hardware(self.node))
            self._mtime = mtime
        return self._devices


@functools.lru_cache(maxsize=16)
def _load_profile_cached(source: str, mtime: float):
    # A thousand simulated nodes share one profile: parse the YAML once per version of the file.
    return load_profile(source)


def nvml_discovery():
    from draplane_node_agent import nvml

    return driver_devices(nvml.discover())


def simulated_node_names(prefix: str, count: int) -> list[str]:
    width = max(4, len(str(count - 1)))
    return [f"{prefix}-{i:0{width}d}" for i in range(count)]


def parse_args(argv: list[str] | None, *, check_credentials: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="draplane-node-agent", description=__doc__.splitlines()[0])
    add_nats_arguments(parser)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="NATS subject prefix (default %(default)s)")
    parser.add_argument("--backend", choices=["nvml", "profile"], default=None)
    parser.add_argument("--profile", help=f"profile name ({', '.join(profile_names())}) or YAML path")
    parser.add_argument("--node", default=os.environ.get("NODE_NAME"), help="node name (one agent)")
    parser.add_argument("--nodes", type=int, default=0, help="run this many simulated agents in one process")
    parser.add_argument("--node-prefix", default="sim", help="simulated node names: <prefix>-0000, ...")
    parser.add_argument("--heartbeat-interval", type=float, default=5.0)
    parser.add_argument("--rescan-interval", type=float, default=10.0)
    parser.add_argument("--listen", default=None,
                        help="host:port for /metrics, /readyz and /healthz; default 0.0.0.0:8080 for one node, "
                             "off for --nodes; '' turns it off")
    parser.add_argument("--print", action="store_true", help="print the discovered devices as JSON and exit")
    add_log_format_argument(parser)
    args = parser.parse_args(argv)
    backend = args.backend or ("profile" if args.profile else "nvml")
    if backend == "profile" and not args.profile:
        parser.error("--backend profile needs --profile")
    if args.nodes and backend != "profile":
        parser.error("--nodes simulates nodes from a --profile")
    if not args.nodes and not args.node:
        parser.error("name the node with --node (or NODE_NAME), or simulate with --nodes N")
    args.backend = backend
    if check_credentials and not args.print:
        require_nats_credentials(parser, args)
    if args.listen is None:
        args.listen = "" if args.nodes else "0.0.0.0:8080"
    return args


async def run(args: argparse.Namespace) -> int:
    nodes = simulated_node_names(args.node_prefix, args.nodes) if args.nodes else [args.node]
    if args.backend == "profile":
        agents = [SimulatedAgent(node, ProfileDiscovery(args.profile, node)) for node in nodes]
    else:
        agents = [SimulatedAgent(nodes[0], nvml_discovery)]
    names = InventoryNames(args.prefix)
    # A node's credentials (a fleet's: its nodes') only let it read replies under its own inbox
    # prefix (draplane.nats_roles.node_agent_permissions).
    inbox_prefix = fleet_inbox_prefix(args.node_prefix) if args.nodes else names.agent_inbox_prefix(nodes[0])
    options: dict = {"name": "draplane-node-agent", "inbox_prefix": inbox_prefix}
    if args.nkey_seed:
        options["nkeys_seed"] = args.nkey_seed
    if args.nats_ca:
        options["tls"] = nats_tls_context(args.nats_ca)
    fleet = AgentFleet(nats_servers(args.nats), agents, names=names, heartbeat_interval=args.heartbeat_interval,
                       rescan_interval=args.rescan_interval, connect_options=options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await fleet.start()
    runner = await serve_probes(fleet, args.listen) if args.listen else None
    logging.info("node agents for %d node(s) started against %s", len(agents), args.nats)
    await stop.wait()
    if runner is not None:
        await runner.cleanup()
    await fleet.stop()
    return 0


async def serve_probes(fleet: AgentFleet, listen: str):
    """/readyz: connected and every snapshot acknowledged; /healthz: no loop has died; /metrics."""
    from aiohttp import web

    from draplane.metrics import metrics_handler
    from draplane_node_agent.metrics import fleet_registry

    async def readyz(request: web.Request) -> web.Response:
        ready = fleet.connected.is_set() and not any(a.state.snapshot_due for a in fleet.agents)
        return web.Response(text="ok\n" if ready else "not ready\n", status=200 if ready else 503)

    async def healthz(request: web.Request) -> web.Response:
        dead = fleet.dead_tasks()
        return web.Response(text=f"dead: {', '.join(dead)}\n" if dead else "ok\n", status=500 if dead else 200)

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(fleet_registry(fleet)))
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    host, _, port = listen.rpartition(":")
    await web.TCPSite(runner, host or "0.0.0.0", int(port)).start()
    return runner


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, check_credentials=True)
    configure_logging(args.log_format)
    try:
        if args.print:
            import msgspec

            discover = ProfileDiscovery(args.profile, args.node or "node") if args.backend == "profile" else nvml_discovery
            sys.stdout.write(msgspec.json.format(msgspec.json.encode(discover()).decode(), indent=2) + "\n")
            return 0
        import uvloop

        return uvloop.run(run(args))
    except ProfileError as exc:
        print(f"draplane-node-agent: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if type(exc).__module__ == "pynvml" or type(exc).__name__.startswith("NVMLError"):
            print(f"draplane-node-agent: NVML discovery failed: {exc} (no NVIDIA driver or GPU here?)", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

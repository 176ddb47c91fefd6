"""draplane-node-agent: stream this node's devices (or a thousand simulated nodes') to NATS.

    draplane-node-agent --backend nvml --node "$NODE_NAME"                 # a real node
    draplane-node-agent --profile dgx-h100 --nodes 1000 --node-prefix sim  # simulated nodes
    draplane-node-agent --backend nvml --node "$NODE_NAME" --kubelet-plugin  # and prepare devices for the kubelet
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
from draplane.nodes.hardware import GPU_DRIVER, driver_devices
from draplane_node_agent.health import HealthBoard, HealthReport, with_health_taints
from draplane_node_agent.claim_store import CheckpointError
from draplane_node_agent.kubelet_api import KubeletApiMissing
from draplane.nodes.profile import ProfileError, load_profile, profile_names


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
    plugin = parser.add_argument_group("kubelet plugin (one node only)")
    plugin.add_argument("--kubelet-plugin", action="store_true",
                        help="also be the kubelet's DRA plugin for the drivers this node publishes: register with "
                             "the kubelet, prepare claims' devices and write their CDI specs")
    plugin.add_argument("--kubelet-dir", default="/var/lib/kubelet",
                        help="the kubelet's root folder; sockets go in its plugins_registry/ and plugins/<driver>/ "
                             "(default %(default)s)")
    plugin.add_argument("--cdi-dir", default="/var/run/cdi",
                        help="where the container runtime reads CDI specs (default %(default)s)")
    plugin.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"),
                        help="to read ResourceClaims (default $KUBECONFIG, else the pod's service account)")
    plugin.add_argument("--health-switch", action="store_true",
                        help="simulated devices only: serve PUT /devices/<driver>/<device>/health on --listen, "
                             "to mark a device unhealthy in tests")
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
    if args.kubelet_plugin and args.nodes:
        parser.error("--kubelet-plugin serves one node's kubelet; it cannot be used with --nodes")
    if args.health_switch and backend != "profile":
        parser.error("--health-switch marks simulated devices; a real GPU's health comes from NVML")
    if check_credentials and not args.print:
        require_nats_credentials(parser, args)
    if args.listen is None:
        args.listen = "" if args.nodes else "0.0.0.0:8080"
    if args.health_switch and not args.listen:
        parser.error("--health-switch is served on --listen, which is off")
    return args


async def run(args: argparse.Namespace) -> int:
    nodes = simulated_node_names(args.node_prefix, args.nodes) if args.nodes else [args.node]
    board = HealthBoard()
    if args.backend == "profile":
        agents = [SimulatedAgent(node, ProfileDiscovery(args.profile, node)) for node in nodes]
    else:
        agents = [SimulatedAgent(nodes[0], nvml_discovery)]
    if not args.nodes:
        # One node: its devices' health shows in its slices (an unhealthy device is tainted).
        discover = agents[0].discover
        agents[0].discover = lambda: with_health_taints(discover(), board)
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
    plugins, kube = [], None
    if args.kubelet_plugin:
        # Before NATS: a plugin that cannot start (its sockets, its checkpoint) stops the agent at
        # once, and the node publishes no device that nothing could prepare.
        agents[0].state.observe(agents[0].discover())
        kube, plugins = await start_kubelet_plugins(args, agents[0], board)
    await fleet.start()
    try:
        if args.backend == "nvml" and not args.nodes:
            start_xid_watch(board, fleet, stop)
        runner = await serve_probes(fleet, args.listen, board=board if args.health_switch else None) if args.listen else None
        logging.info("node agents for %d node(s) started against %s", len(agents), args.nats)
        await stop.wait()
        if runner is not None:
            await runner.cleanup()
    finally:
        for plugin in plugins:
            await plugin.stop()
        if kube is not None:
            await kube.close()
        await fleet.stop()
    return 0


async def start_kubelet_plugins(args: argparse.Namespace, agent: SimulatedAgent, board: HealthBoard):
    """One kubelet plugin per driver the node publishes."""
    from draplane.api.resource import ResourceClaim
    from draplane.kube.client import KubeClient
    from draplane_node_agent.claim_store import ClaimStore
    from draplane_node_agent.kubelet_api import load
    from draplane_node_agent.kubelet_plugin import DriverPlugin, DriverPreparer

    load()  # fail now, with the build command, if the stubs are missing
    kube = await KubeClient.from_environment(args.kubeconfig)

    async def read_claim(ref):
        try:
            return await kube.get(ResourceClaim, ref.name, ref.namespace)
        except Exception as exc:
            if getattr(exc, "is_not_found", lambda: False)():
                return None
            raise

    def published_by(driver: str):
        def published():
            for entry in agent.state.drivers or []:
                if entry.driver == driver:
                    return {device.name: device for device in entry.devices}
            return {}
        return published

    kubelet_dir = Path(args.kubelet_dir)
    plugins = []
    try:
        for entry in agent.state.drivers or []:
            plugin_dir = kubelet_dir / "plugins" / entry.driver
            store = ClaimStore(driver=entry.driver, node=agent.state.node, plugin_dir=plugin_dir, cdi_dir=Path(args.cdi_dir))
            preparer = DriverPreparer(driver=entry.driver, node=agent.state.node, store=store, read_claim=read_claim,
                                      published=published_by(entry.driver), real_gpus=args.backend == "nvml")
            plugin = DriverPlugin(preparer=preparer, board=board, registry_dir=kubelet_dir / "plugins_registry",
                                  plugin_dir=plugin_dir)
            await plugin.start()
            plugins.append(plugin)
    except BaseException:
        for plugin in plugins:
            await plugin.stop()
        await kube.close()
        raise
    return kube, plugins


def start_xid_watch(board: HealthBoard, fleet: AgentFleet, stop: asyncio.Event) -> None:
    """Real GPUs: NVML's XID events mark a GPU unhealthy (and so tainted in its slice)."""
    from draplane_node_agent import nvml

    loop = asyncio.get_running_loop()
    rescans: set[asyncio.Task] = set()  # the rescans in progress, kept until done

    def _rescan_done(task: asyncio.Task) -> None:
        rescans.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logging.error("device discovery after an XID failed; keeping the last snapshot", exc_info=task.exception())

    def unhealthy(gpu_index: int, message: str) -> None:
        # The GPU and every MIG placement on it (hardware.py names them gpu-<index>-mig-...).
        names = [d.name for a in fleet.agents for e in (a.state.drivers or []) if e.driver == GPU_DRIVER
                 for d in e.devices if d.name == f"gpu-{gpu_index}" or d.name.startswith(f"gpu-{gpu_index}-mig-")]
        if sum(board.report(GPU_DRIVER, name, healthy=False, message=message) for name in names):
            logging.warning("GPU %d is unhealthy (%s): tainted NoSchedule, %d device(s)", gpu_index, message, len(names))
            rescan = loop.create_task(fleet.rescan(), name=f"rescan after gpu {gpu_index}'s xid")
            rescans.add(rescan)
            rescan.add_done_callback(_rescan_done)

    nvml.start_xid_watch(lambda index, message: loop.call_soon_threadsafe(unhealthy, index, message), stop_flag=stop)


async def serve_probes(fleet: AgentFleet, listen: str, *, board: HealthBoard | None = None):
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
    if board is not None:
        import msgspec

        async def device_health(request: web.Request) -> web.Response:
            driver, device = request.match_info["driver"], request.match_info["device"]
            known = {(e.driver, d.name) for a in fleet.agents for e in (a.state.drivers or []) for d in e.devices}
            if (driver, device) not in known:
                return web.Response(status=404, text=f"device {driver}/{device} is not published by this node\n")
            try:
                report = msgspec.json.decode(await request.read(), type=HealthReport)
            except msgspec.DecodeError as exc:
                return web.Response(status=400, text=f"body: {exc}; send {{\"healthy\": false, \"message\": \"...\"}}\n")
            if board.report(driver, device, healthy=report.healthy, message=report.message):
                logging.warning("device %s/%s marked %s through the health switch: %s", driver, device,
                                "healthy" if report.healthy else "unhealthy", report.message)
                await fleet.rescan()
            return web.Response(text="ok\n")

        app.router.add_put("/devices/{driver}/{device}/health", device_health)
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
    except (KubeletApiMissing, CheckpointError) as exc:
        print(f"draplane-node-agent: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the kubelet plugin's sockets or files: a path we cannot use
        print(f"draplane-node-agent: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if type(exc).__module__ == "pynvml" or type(exc).__name__.startswith("NVMLError"):
            print(f"draplane-node-agent: NVML discovery failed: {exc} (no NVIDIA driver or GPU here?)", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

"""`draplane dashboard`: the live device map in a browser, from NATS.

Serves one page (draplane.dashboard): each node a row of its devices coloured free, allocated,
shared, tainted or blocked, the claim, pod and policy score of a device on hover, and the pods
still pending with kube-scheduler's reason, updated live over server-sent events. It reads NATS
only (the running `draplane up`'s by default) and writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from draplane.cli.free import add_nats_source_arguments, nats_url, no_up_hint, reader_connect_options

DEFAULT_PORT = 8090


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dashboard", help="a live map of the devices and the pending pods, in a browser")
    add_nats_source_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to serve the page on (default %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="port to serve the page on (0: any free port; default %(default)s)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import uvloop

    try:
        uvloop.run(_serve(args))
    except OSError as exc:  # the port is taken, say
        print(f"draplane dashboard: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    from draplane.dashboard.server import Dashboard, build_app

    url = nats_url(args)
    dashboard = Dashboard(reader_connect_options(args, name="draplane-dashboard"), args.prefix)
    runner = web.AppRunner(build_app(dashboard), shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    print(f"draplane dashboard: http://{host}:{port}/  (NATS {url}, prefix {args.prefix}; Ctrl-C stops it)",
          flush=True)
    hint = no_up_hint(args)
    if hint:
        # it keeps trying NATS (the page says so); the likely cause is said once, here
        print(f"draplane dashboard: warning{hint}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()

"""draplane-inventory: node-agent snapshots from JetStream become ResourceSlices and the inventory feed.

    draplane-inventory --nats nats://127.0.0.1:4222 --kubeconfig ~/.kube/config --taint-after 30 --remove-after 120

Serves /metrics (draplane_inventory.metrics, with its apiserver and NATS figures), /readyz (started
and reconciled) and /healthz (no task died) on --listen.
"""

from __future__ import annotations

import asyncio
import argparse
import logging
import os
import sys

from aiohttp import web

from draplane.entrypoints import (
    add_nats_arguments, add_stream_replicas_argument, require_nats_credentials, role_connect_options,
    tune_garbage_collector,
)
from draplane.messages.inventory import DEFAULT_PREFIX
from draplane.metrics import metrics_handler
from draplane.structured_logs import add_log_format_argument, configure_logging
from draplane_inventory.metrics import InventoryMetrics
from draplane_inventory.service import InventoryService, InventorySettings

SERVICE = web.AppKey("service", InventoryService)
METRICS = web.AppKey("metrics", InventoryMetrics)


def parse_args(argv: list[str] | None, *, check_credentials: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="draplane-inventory", description=__doc__.splitlines()[0])
    add_nats_arguments(parser)
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    add_stream_replicas_argument(parser)
    parser.add_argument("--taint-after", type=float, default=30.0, help="seconds without heartbeats before tainting")
    parser.add_argument("--remove-after", type=float, default=120.0, help="seconds without heartbeats before deleting")
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--listen", default="127.0.0.1:8081", help="host:port for /metrics, /healthz and /readyz")
    add_log_format_argument(parser)
    args = parser.parse_args(argv)
    if not 0 < args.taint_after < args.remove_after:
        parser.error("--taint-after must be positive and smaller than --remove-after")
    host, _, port = args.listen.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        # The service runs inside its HTTP server: it cannot be turned off, as the node agent's can.
        parser.error(f"--listen {args.listen!r}: expected host:port, e.g. 127.0.0.1:8081")
    if check_credentials:
        require_nats_credentials(parser, args)
    return args


def build_app(args: argparse.Namespace) -> web.Application:
    app = web.Application()
    app[METRICS] = InventoryMetrics()

    async def service_ctx(app: web.Application):
        import nats

        from draplane.kube import KubeClient
        from draplane.kube.metrics import ApiserverMetrics

        kube = await KubeClient.from_environment(args.kubeconfig)
        kube.metrics = ApiserverMetrics(app[METRICS].registry)
        log = logging.getLogger("draplane_inventory")

        async def on_error(exc: Exception) -> None:
            log.info("NATS: %s", exc)  # nats-py would log a traceback for every failed reconnect

        async def on_disconnected() -> None:
            log.warning("NATS connection lost; reconnecting")

        async def on_reconnected() -> None:
            log.info("NATS connection back")

        # A comma-separated --nats names every server of a cluster, as for the allocator and binder.
        connection = await nats.connect(reconnect_time_wait=0.5, error_cb=on_error, disconnected_cb=on_disconnected,
                                        reconnected_cb=on_reconnected,
                                        **role_connect_options(args, "inventory", name="draplane-inventory"))
        service = InventoryService(kube, connection, InventorySettings(
            prefix=args.prefix, taint_after=args.taint_after, remove_after=args.remove_after, workers=args.workers,
            stream_replicas=args.stream_replicas), metrics=app[METRICS])
        await service.start()
        app[SERVICE] = service
        yield
        await service.stop()
        # Not drain(): a subscription whose handler was cancelled mid-message never finishes its
        # queue, and drain() then waits nats-py's 30 s (seen on a stop under load). Every write
        # that matters was acknowledged by JetStream already; flush what is buffered, and close.
        try:
            await asyncio.wait_for(connection.flush(), 5)
        except (asyncio.TimeoutError, nats.errors.Error):
            pass
        await connection.close()
        await kube.close()

    async def readyz(request: web.Request) -> web.Response:
        ready = request.app[SERVICE].ready.is_set()
        return web.Response(text="ok\n" if ready else "starting\n", status=200 if ready else 503)

    async def healthz(request: web.Request) -> web.Response:
        dead = request.app[SERVICE].dead_tasks()
        return web.Response(text=f"dead: {', '.join(dead)}\n" if dead else "ok\n", status=500 if dead else 200)

    app.cleanup_ctx.append(service_ctx)
    app.router.add_get("/metrics", metrics_handler(app[METRICS].registry))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, check_credentials=True)
    configure_logging(args.log_format)
    host, _, port = args.listen.rpartition(":")
    import uvloop

    uvloop.install()
    tune_garbage_collector()  # it holds every node's slices, as the shards hold every claim
    web.run_app(build_app(args), host=host or "127.0.0.1", port=int(port), print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

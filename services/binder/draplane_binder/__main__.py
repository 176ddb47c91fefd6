"""`draplane-binder`: the writer to the Kubernetes API (see draplane_binder.service).

The NATS connection and the Kubernetes client live in an aiohttp cleanup_ctx generator, the binder
in another; /healthz answers while the process runs, /readyz once its caches have synced.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

import nats
from aiohttp import web

from draplane.kube import KubeClient
from draplane.scheduling.messages import DEFAULT_PREFIX
from draplane.scheduling.reservations import DEFAULT_LEASE_SECONDS
from draplane_binder.service import Binder
from draplane_binder.settings import BinderSettings

BINDER = web.AppKey("binder", Binder)
SETTINGS = web.AppKey("settings", BinderSettings)
KUBE = web.AppKey("kube", KubeClient)
NATS = web.AppKey("nats", object)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draplane-binder", description="draplane binder")
    parser.add_argument("--nats", default=os.environ.get("DRAPLANE_NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--kubeconfig", type=Path, default=os.environ.get("KUBECONFIG"))
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="NATS subject prefix (default %(default)s)")
    parser.add_argument("--scheduler-name", action="append", dest="scheduler_names",
                        help="schedule pods with this spec.schedulerName (repeatable; default: draplane)")
    parser.add_argument("--shards", type=int, default=1, help="number of allocator shards to partition for")
    parser.add_argument("--manage-claims", action=argparse.BooleanOptionalAction, default=True,
                        help="create template claims and deallocate unused ones (off where "
                             "kube-controller-manager does it)")
    parser.add_argument("--lease-seconds", type=float, default=DEFAULT_LEASE_SECONDS)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--port", type=int, default=8082, help="HTTP port for /healthz and /readyz")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    return parser


async def clients(app: web.Application):
    settings = app[SETTINGS]
    app[NATS] = await nats.connect(settings.nats_url, name="draplane-binder", max_reconnect_attempts=-1)
    app[KUBE] = await KubeClient.from_environment(settings.kubeconfig)
    yield
    await app[KUBE].close()
    await app[NATS].drain()


async def binder(app: web.Application):
    app[BINDER] = Binder(app[SETTINGS], app[KUBE], app[NATS])
    await app[BINDER].start()
    yield
    await app[BINDER].stop()


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    if not request.app[BINDER].ready:
        return web.Response(status=503, text="caches not synced\n")
    return web.Response(text="ok\n")


def settings_from(args: argparse.Namespace) -> BinderSettings:
    return BinderSettings(
        nats_url=args.nats,
        kubeconfig=args.kubeconfig,
        prefix=args.prefix,
        scheduler_names=tuple(args.scheduler_names or ("draplane",)),
        manage_claims=args.manage_claims,
        shards=args.shards,
        concurrency=args.concurrency,
        lease_seconds=args.lease_seconds,
        http_port=args.port,
    )


def build_app(settings: BinderSettings) -> web.Application:
    app = web.Application()
    app[SETTINGS] = settings
    app.cleanup_ctx.extend([clients, binder])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.shards < 1:
        print("draplane-binder: --shards must be at least 1", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO - 10 * min(args.verbose, 1),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvloop

    uvloop.install()
    settings = settings_from(args)
    if settings.http_port:
        web.run_app(build_app(settings), host="127.0.0.1", port=settings.http_port, print=None)
    else:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        web.run_app(build_app(settings), sock=sock, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`draplane-audit`: the audit and metrics subscriber.

It reads NATS only. The audit stream becomes an append-only log of JSON lines (draplane_audit.
subscriber; `draplane audit` reads it back), and the inventory feed and reservation buckets become
cluster-wide DRA metrics on /metrics (draplane_audit.metrics). /healthz answers while its loops
run, /readyz once the consumer is bound and both buckets were read.

The NATS connection lives in an aiohttp cleanup_ctx generator, the subscriber and the cluster
follower in another, as in the other services.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

import nats
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from draplane.allocation.free_capacity import free_capacity
from draplane.audit_log import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES
from draplane.device_view import DeviceView, follow_cluster
from draplane.entrypoints import (
    add_http_arguments, add_nats_arguments, add_stream_replicas_argument, require_nats_credentials,
    role_connect_options, serve,
)
from draplane.messages.audit import DEFAULT_PREFIX
from draplane.structured_logs import add_log_format_argument
from draplane.tasks import guarded_task
from draplane_audit.metrics import AuditMetrics, ClusterMetrics
from draplane_audit.subscriber import AuditSubscriber

log = logging.getLogger("draplane_audit")

ARGS = web.AppKey("args", argparse.Namespace)
NATS = web.AppKey("nats", object)
REGISTRY = web.AppKey("registry", CollectorRegistry)
SUBSCRIBER = web.AppKey("subscriber", AuditSubscriber)
CLUSTER_SYNCED = web.AppKey("cluster synced", asyncio.Event)
TASKS = web.AppKey("tasks", list)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draplane-audit", description="draplane audit log and cluster metrics")
    add_nats_arguments(parser)
    add_stream_replicas_argument(parser)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="NATS subject prefix (default %(default)s)")
    parser.add_argument("--log-dir", type=Path, default=Path(os.environ.get("DRAPLANE_AUDIT_DIR", "audit")),
                        help="folder of the audit log, audit.jsonl (default %(default)s)")
    parser.add_argument("--max-bytes", type=_positive_int, default=DEFAULT_MAX_BYTES,
                        help="rotate audit.jsonl once it would pass this size, in bytes (default %(default)s)")
    parser.add_argument("--backups", type=_positive_int, default=DEFAULT_BACKUPS,
                        help="rotated files kept, audit.jsonl.1 (newest) to .N (default %(default)s)")
    parser.add_argument("--metrics-interval", type=float, default=5.0,
                        help="seconds between recomputations of the cluster metrics while NATS changes")
    add_http_arguments(parser, default_port=8083)
    add_log_format_argument(parser)
    parser.add_argument("-v", "--verbose", action="count", default=0)
    return parser


async def clients(app: web.Application):
    args = app[ARGS]
    app[NATS] = await nats.connect(**role_connect_options(args, "audit", name="draplane-audit"))
    yield
    await app[NATS].drain()


async def subscribers(app: web.Application):
    args = app[ARGS]
    js = app[NATS].jetstream()
    cluster = ClusterMetrics(app[REGISTRY])
    subscriber = AuditSubscriber(js, args.log_dir, prefix=args.prefix, metrics=AuditMetrics(app[REGISTRY]),
                                 stream_replicas=args.stream_replicas, max_bytes=args.max_bytes, backups=args.backups,
                                 on_batch=lambda batch: cluster.count(batch.events))
    await subscriber.start()
    app[SUBSCRIBER] = subscriber
    app[CLUSTER_SYNCED] = asyncio.Event()
    view = DeviceView()
    changed = asyncio.Event()
    app[TASKS] = [
        _guarded(subscriber.run, "audit subscriber"),
        _guarded(lambda: follow_cluster(js, args.prefix, view, changed.set, app[CLUSTER_SYNCED]), "cluster follower"),
        _guarded(lambda: _recompute(view, changed, cluster, args.metrics_interval), "cluster metrics"),
    ]
    yield
    for task in app[TASKS]:
        task.cancel()
    await asyncio.wait(app[TASKS], timeout=10)
    await subscriber.stop()


async def _recompute(view: DeviceView, changed: asyncio.Event, cluster: ClusterMetrics, interval: float) -> None:
    """The free-capacity answer again after a change, at most once per `interval`: a burst of
    placements costs one computation, not one each."""
    while True:
        await changed.wait()
        changed.clear()
        # Inputs are gathered here, on the loop, so the thread never sees the view change under it.
        slices, classes, allocations = view.slices(), view.classes(), view.allocations()
        started = time.monotonic()
        cluster.latest = await asyncio.to_thread(free_capacity, slices, classes, allocations)
        cluster.claims_reserved = len(allocations)
        cluster.stale_nodes = len(view.stale_nodes())
        cluster.computations.inc()
        log.debug("cluster metrics recomputed in %.2f s", time.monotonic() - started)
        await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))


def _guarded(loop, name: str) -> asyncio.Task:
    return guarded_task(loop, name, log)


async def healthz(request: web.Request) -> web.Response:
    dead = [t.get_name() for t in request.app[TASKS] if t.done()]
    if dead:
        return web.Response(status=500, text=f"stopped: {', '.join(dead)}\n")
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    waiting = []
    if not request.app[SUBSCRIBER].ready.is_set():
        waiting.append("audit consumer")
    if not request.app[CLUSTER_SYNCED].is_set():
        waiting.append("inventory feed and reservations")
    if waiting:
        return web.Response(status=503, text=f"waiting for: {', '.join(waiting)}\n")
    return web.Response(text="ok\n")


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(args: argparse.Namespace) -> web.Application:
    app = web.Application()
    app[ARGS] = args
    app[REGISTRY] = CollectorRegistry()
    app.cleanup_ctx.extend([clients, subscribers])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.metrics_interval <= 0:
        print("draplane-audit: --metrics-interval must be positive", file=sys.stderr)
        return 2
    require_nats_credentials(parser, args)
    serve(build_app(args), host=args.host, port=args.port, verbose=args.verbose, log_format=args.log_format)
    return 0


if __name__ == "__main__":
    sys.exit(main())

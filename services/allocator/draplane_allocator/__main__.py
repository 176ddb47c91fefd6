"""`draplane-allocator`: N shards in one process (or one shard per process with --shard-index).

A shard talks to NATS only (its view of Kubernetes is the binder's cluster bucket), so the process
needs no kubeconfig and no Kubernetes rights. Resources live in aiohttp cleanup_ctx generators: the
NATS connection is opened before the shards start and drained after they stop. /healthz answers
while the process runs; /readyz once every shard has synced its state; /metrics serves the shards'
metrics (one registry for the process, a `shard` label on each).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import nats
from aiohttp import web

from draplane.entrypoints import (
    add_http_arguments, add_nats_arguments, add_stream_replicas_argument, require_nats_credentials,
    role_connect_options, serve,
)
from draplane.jetstream.paced_reading import MAX_PACE_SECONDS, connect_paced
from draplane.metrics import metrics_handler
from draplane.scheduling.messages import DEFAULT_PREFIX
from draplane.scheduling.reservations import DEFAULT_LEASE_SECONDS
from draplane.structured_logs import add_log_format_argument
from draplane_allocator.metrics import AllocatorMetrics
from draplane_allocator.shard import Shard

log = logging.getLogger("draplane_allocator")

# See --follow-pace-ms. Off: with a pace, a pod created right after a change (a DeviceTaintRule, a
# release its retry was woken by) can be placed from a view up to a pace old.
DEFAULT_FOLLOW_PACE_MS = 0.0

SHARDS = web.AppKey("shards", list)
ARGS = web.AppKey("args", argparse.Namespace)
NATS = web.AppKey("nats", object)
FOLLOW_NATS = web.AppKey("follow_nats", object)
METRICS = web.AppKey("metrics", AllocatorMetrics)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draplane-allocator", description="draplane allocator shards")
    add_nats_arguments(parser)
    add_stream_replicas_argument(parser)
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="NATS subject prefix (default %(default)s)")
    parser.add_argument("--shards", type=int, default=1, help="total number of shards in the deployment")
    parser.add_argument("--shard-index", type=int, action="append",
                        help="the shard(s) this process runs (repeatable); default: all of them")
    parser.add_argument("--policy", default=None, help="scoring policy (default: the core's default)")
    parser.add_argument("--lease-seconds", type=float, default=DEFAULT_LEASE_SECONDS)
    parser.add_argument("--follow-pace-ms", type=float,
                        # a string default goes through `type` too: a bad DRAPLANE_FOLLOW_PACE_MS exits 2
                        default=os.environ.get("DRAPLANE_FOLLOW_PACE_MS", str(DEFAULT_FOLLOW_PACE_MS)),
                        help="the shards follow the cluster (reservations, the cluster bucket, the feed) on a "
                             "connection of their own that, under load, reads at most once per this many "
                             "milliseconds, taking what came meanwhile at once: less CPU per pod, but a pod "
                             "created right after a change may be placed from a view that old; 0: follow on "
                             "the one connection, reading every message as it comes (0 to "
                             f"{MAX_PACE_SECONDS * 1000:g}; default %(default)s, or DRAPLANE_FOLLOW_PACE_MS)")
    parser.add_argument("--no-gang-scheduling", dest="gang_scheduling", action="store_false",
                        help="place every pod alone as it comes, as kube-scheduler without the Workload API "
                             "does, even one naming a PodGroup (default: a PodGroup's gang is placed all or none)")
    add_http_arguments(parser, default_port=8081)
    parser.add_argument("-v", "--verbose", action="count", default=0)
    add_log_format_argument(parser)
    return parser


async def clients(app: web.Application):
    args = app[ARGS]
    app[NATS] = await nats.connect(**role_connect_options(args, "allocator", name="draplane-allocator"))
    app[FOLLOW_NATS] = None
    if args.follow_pace_ms > 0:
        app[FOLLOW_NATS] = await connect_paced(args.follow_pace_ms / 1000, **role_connect_options(
            args, "allocator", name="draplane-allocator-follow"))
    yield
    if app[FOLLOW_NATS] is not None:
        await app[FOLLOW_NATS].drain()
    await app[NATS].drain()


async def shards(app: web.Application):
    args = app[ARGS]
    indexes = args.shard_index or list(range(args.shards))
    app[SHARDS] = [
        Shard(app[NATS], index=i, prefix=args.prefix, policy=args.policy, lease_seconds=args.lease_seconds,
              stream_replicas=args.stream_replicas, metrics=app[METRICS], gang_scheduling=args.gang_scheduling,
              follow_nc=app[FOLLOW_NATS])
        for i in indexes
    ]
    for shard in app[SHARDS]:
        await shard.start()
    yield
    for shard in app[SHARDS]:
        await shard.stop()


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    not_ready = [s.index for s in request.app[SHARDS] if not s.ready]
    if not_ready:
        return web.Response(status=503, text=f"shards not synced: {not_ready}\n")
    return web.Response(text="ok\n")


def build_app(args: argparse.Namespace) -> web.Application:
    for i in args.shard_index or ():
        if not 0 <= i < args.shards:
            raise SystemExit(f"draplane-allocator: --shard-index {i} is outside 0..{args.shards - 1}")
    app = web.Application()
    app[ARGS] = args
    app[METRICS] = AllocatorMetrics()
    app.cleanup_ctx.extend([clients, shards])
    app.router.add_get("/metrics", metrics_handler(app[METRICS].registry))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.shards < 1:
        print("draplane-allocator: --shards must be at least 1", file=sys.stderr)
        return 2
    if not 0 <= args.follow_pace_ms <= MAX_PACE_SECONDS * 1000:
        print(f"draplane-allocator: --follow-pace-ms {args.follow_pace_ms:g} is outside 0..{MAX_PACE_SECONDS * 1000:g}",
              file=sys.stderr)
        return 2
    require_nats_credentials(parser, args)
    serve(build_app(args), host=args.host, port=args.port, verbose=args.verbose, log_format=args.log_format)
    return 0


if __name__ == "__main__":
    sys.exit(main())

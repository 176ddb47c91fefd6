"""`draplane-binder`: the writer to the Kubernetes API (see draplane_binder.service).

The NATS connection and the Kubernetes client live in an aiohttp cleanup_ctx generator, the binder
in another; /healthz answers while the process runs, /readyz once its caches have synced, and
/metrics serves its metrics (draplane_binder.metrics) with its apiserver and NATS figures.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nats
from aiohttp import web

from draplane.entrypoints import (
    add_http_arguments, add_kube_rate_arguments, add_nats_arguments, add_stream_replicas_argument,
    check_kube_rate_arguments, nats_connect_options, require_nats_credentials, serve,
)
from draplane.kube import KubeClient
from draplane.kube.metrics import ApiserverMetrics
from draplane.metrics import metrics_handler
from draplane.scheduling.messages import DEFAULT_PREFIX
from draplane.nats_roles import service_inbox_prefix
from draplane.scheduling.reservations import DEFAULT_LEASE_SECONDS
from draplane.structured_logs import add_log_format_argument
from draplane_binder.metrics import BinderMetrics
from draplane_binder.service import Binder
from draplane_binder.settings import BinderSettings

BINDER = web.AppKey("binder", Binder)
SETTINGS = web.AppKey("settings", BinderSettings)
KUBE = web.AppKey("kube", KubeClient)
NATS = web.AppKey("nats", object)
METRICS = web.AppKey("metrics", BinderMetrics)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draplane-binder", description="draplane binder")
    add_nats_arguments(parser)
    add_stream_replicas_argument(parser)
    parser.add_argument("--kubeconfig", type=Path, default=os.environ.get("KUBECONFIG"))
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="NATS subject prefix (default %(default)s)")
    parser.add_argument("--scheduler-name", action="append", dest="scheduler_names",
                        help="schedule pods with this spec.schedulerName (repeatable; default: draplane)")
    parser.add_argument("--shards", type=int, default=1, help="number of allocator shards to partition for")
    parser.add_argument("--manage-claims", action=argparse.BooleanOptionalAction, default=False,
                        help="also do the resourceclaim controller's work: create template claims, "
                             "clean reservedFor, deallocate (only for a cluster with no "
                             "kube-controller-manager; default off)")
    parser.add_argument("--lease-seconds", type=float, default=DEFAULT_LEASE_SECONDS)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--gang-wait-warning-seconds", type=float, default=BinderSettings().gang_wait_warning_seconds,
                        help="a gang member waiting for its gang's minCount gets a Warning Event only after this "
                             "long (the PodScheduled condition says it at once; default %(default)s)")
    parser.add_argument("--volume-bind-timeout-seconds", type=float,
                        default=BinderSettings().volume_bind_timeout_seconds,
                        help="how long binding waits for a pod's PersistentVolumeClaims to be bound or provisioned "
                             "on its node before it tries the pod again (kube-scheduler's bindTimeoutSeconds; "
                             "default %(default)s)")
    parser.add_argument("--binding-timeout-seconds", type=float, default=BinderSettings().binding_timeout_seconds,
                        help="how long binding waits for a device's binding conditions after its claim is allocated, "
                             "before the claim is deallocated and the pod tried again (kube-scheduler's "
                             "DynamicResources bindingTimeout; default %(default)s)")
    parser.add_argument("--feed-coalesce-ms", type=float, default=BinderSettings().feed_coalesce_seconds * 1000,
                        help="how long writes to the cluster bucket gather before they go out together; every "
                             "shard follows the bucket and receives a burst for less than lone messages "
                             "(0: each at once; a key a pending pod waits on goes at once anyway; "
                             "default %(default)s)")
    parser.add_argument("--feed-new-claim-hold-seconds", type=float,
                        default=BinderSettings().feed_new_claim_hold_seconds,
                        help="how long a new claim that is not allocated waits for its allocation before it is "
                             "written to the cluster bucket as it is (pending pods carry their claims to the "
                             "shards, so usually only the allocation is written; 0: at once; default %(default)s)")
    add_kube_rate_arguments(parser, qps=BinderSettings().kube_api_qps, burst=BinderSettings().kube_api_burst)
    add_http_arguments(parser, default_port=8082)
    parser.add_argument("-v", "--verbose", action="count", default=0)
    add_log_format_argument(parser)
    return parser


async def clients(app: web.Application):
    settings = app[SETTINGS]
    app[NATS] = await nats.connect(**nats_connect_options(
        settings.nats_url, settings.nats_nkey_seed, name="draplane-binder", ca_file=settings.nats_ca,
        inbox_prefix=service_inbox_prefix("binder")))
    app[KUBE] = await KubeClient.from_environment(settings.kubeconfig)
    app[KUBE].metrics = ApiserverMetrics(app[METRICS].registry)
    app[KUBE].limit_rate(settings.kube_api_qps, settings.kube_api_burst)
    yield
    await app[KUBE].close()
    await app[NATS].drain()


async def binder(app: web.Application):
    app[BINDER] = Binder(app[SETTINGS], app[KUBE], app[NATS], metrics=app[METRICS])
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
        nats_nkey_seed=args.nkey_seed,
        nats_ca=args.nats_ca,
        kubeconfig=args.kubeconfig,
        prefix=args.prefix,
        scheduler_names=tuple(args.scheduler_names or ("draplane",)),
        manage_claims=args.manage_claims,
        shards=args.shards,
        concurrency=args.concurrency,
        lease_seconds=args.lease_seconds,
        gang_wait_warning_seconds=args.gang_wait_warning_seconds,
        volume_bind_timeout_seconds=args.volume_bind_timeout_seconds,
        binding_timeout_seconds=args.binding_timeout_seconds,
        feed_coalesce_seconds=args.feed_coalesce_ms / 1000,
        feed_new_claim_hold_seconds=args.feed_new_claim_hold_seconds,
        stream_replicas=args.stream_replicas,
        kube_api_qps=args.kube_api_qps,
        kube_api_burst=args.kube_api_burst,
        http_host=args.host,
        http_port=args.port,
    )


def build_app(settings: BinderSettings) -> web.Application:
    app = web.Application()
    app[SETTINGS] = settings
    app[METRICS] = BinderMetrics()
    app.cleanup_ctx.extend([clients, binder])
    app.router.add_get("/metrics", metrics_handler(app[METRICS].registry))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.shards < 1:
        print("draplane-binder: --shards must be at least 1", file=sys.stderr)
        return 2
    if not 0 <= args.feed_coalesce_ms <= 1000:
        print(f"draplane-binder: --feed-coalesce-ms must be between 0 and 1000, got {args.feed_coalesce_ms:g}",
              file=sys.stderr)
        return 2
    if not 0 <= args.feed_new_claim_hold_seconds <= 3600:
        print("draplane-binder: --feed-new-claim-hold-seconds must be between 0 and 3600, got "
              f"{args.feed_new_claim_hold_seconds:g}", file=sys.stderr)
        return 2
    if problem := check_kube_rate_arguments(args):
        print(f"draplane-binder: {problem}", file=sys.stderr)
        return 2
    require_nats_credentials(parser, args)
    settings = settings_from(args)
    serve(build_app(settings), host=settings.http_host, port=settings.http_port, verbose=args.verbose,
          log_format=args.log_format)
    return 0


if __name__ == "__main__":
    sys.exit(main())

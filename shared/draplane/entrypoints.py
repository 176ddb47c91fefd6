"""What the services' entry points share: how they reach NATS and how they serve their probes.

In a pod the probe server must listen on the pod's address (`--host 0.0.0.0`, as deploy/ sets it);
on a developer's machine it stays on loopback by default. NATS credentials are an nkey seed file
issued by `draplane nats-auth issue` (deploy/ mounts it and names it in DRAPLANE_NATS_NKEY_SEED).
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
from typing import Any

from aiohttp import web


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", default=os.environ.get("DRAPLANE_NATS_URL", "nats://127.0.0.1:4222"),
                        help="NATS server URL(s), comma-separated for a cluster")
    parser.add_argument("--nkey-seed", default=os.environ.get("DRAPLANE_NATS_NKEY_SEED"),
                        help="file with this service's NATS nkey seed (draplane nats-auth issue)")


def nats_servers(url: str) -> list[str]:
    """`--nats` as nats.connect() wants it: a list (a comma-separated string is one bad URL to it)."""
    return [server.strip() for server in url.split(",") if server.strip()]


def nats_connect_options(url: str, nkey_seed: str | None, *, name: str) -> dict[str, Any]:
    """Keyword arguments for nats.connect(): servers, identity, credentials, endless reconnects."""
    options: dict[str, Any] = {
        "servers": nats_servers(url),
        "name": name,
        "max_reconnect_attempts": -1,
    }
    if nkey_seed:
        options["nkeys_seed"] = nkey_seed
    return options


def add_stream_replicas_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stream-replicas", type=int, choices=(1, 3, 5),
                        default=int(os.environ.get("DRAPLANE_STREAM_REPLICAS", "1")),
                        help="replicas of the JetStream streams and buckets this service creates: 3 on a "
                             "3-server NATS cluster, so one server can fail without loss (default %(default)s)")


def add_kube_rate_arguments(parser: argparse.ArgumentParser, *, qps: float, burst: int) -> None:
    """client-go's flags for the client-side rate limit of the service's apiserver requests."""
    parser.add_argument("--kube-api-qps", type=float, default=qps,
                        help="apiserver requests a second on average, retries and watches included "
                             "(0: no client-side limit; default %(default)g)")
    parser.add_argument("--kube-api-burst", type=int, default=burst,
                        help="apiserver requests allowed at once above --kube-api-qps (default %(default)s)")


def check_kube_rate_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with --kube-api-qps/--kube-api-burst, said for the user; None when they are fine."""
    if args.kube_api_qps > 0 and args.kube_api_burst < 1:
        return f"--kube-api-burst must be at least 1 when --kube-api-qps is {args.kube_api_qps:g}"
    return None


def add_http_arguments(parser: argparse.ArgumentParser, *, default_port: int) -> None:
    parser.add_argument("--host", default=os.environ.get("DRAPLANE_HTTP_HOST", "127.0.0.1"),
                        help="address for /metrics, /healthz and /readyz (0.0.0.0 in a pod; default %(default)s)")
    parser.add_argument("--port", type=int, default=default_port,
                        help="port for /metrics, /healthz and /readyz (0: any free port; default %(default)s)")


def serve(app: web.Application, *, host: str, port: int, verbose: int = 0, log_format: str = "text") -> None:
    """Run a service until SIGINT/SIGTERM: its logging, uvloop, and the probe server around the app."""
    import logging

    import uvloop

    from draplane.structured_logs import configure_logging

    configure_logging(log_format, logging.INFO - 10 * min(verbose, 1))
    uvloop.install()
    tune_garbage_collector()
    run_http(app, host=host, port=port)


# Collect the young generation every 10,000 net allocations instead of CPython's 700, and the
# older ones as before relative to it. The services hold every watched object (the binder ~465,000
# tracked objects at 5,000 pods) and allocate per event, so with the defaults a full collection
# ran every few seconds: in bench/e2e.py 5000x500 the binder spent 6.2 s of its 19.2 s of CPU in
# the collector and the shard 3.2 s of 12.1; with these thresholds 1.6 s of 16.0 and 1.2 s of
# 10.5. Memory stays bounded: cyclic garbage still meets a full collection every ~10^6 allocations.
GC_THRESHOLDS = (10_000, 10, 10)


def tune_garbage_collector() -> None:
    """Freeze what start-up made (modules, parsers: never garbage) out of every later collection,
    then set `GC_THRESHOLDS`."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run_http(app: web.Application, *, host: str, port: int) -> None:
    if port:
        web.run_app(app, host=host, port=port, print=None)
        return
    # Port 0: any free port, for several processes of one service on one machine (tests, benchmarks).
    sock = socket.socket()
    sock.bind((host, 0))
    web.run_app(app, sock=sock, print=None)

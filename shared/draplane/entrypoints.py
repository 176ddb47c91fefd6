"""What the services' entry points share: how they reach NATS and how they serve their probes.

In a pod the probe server must listen on the pod's address (`--host 0.0.0.0`, as deploy/ sets it);
on a developer's machine it stays on loopback by default.

NATS: every service authenticates with an nkey seed file issued by `draplane nats-auth issue`
(deploy/ mounts it and names it in DRAPLANE_NATS_NKEY_SEED) and connects over TLS, verifying the
server with a CA file (`--nats-ca`, DRAPLANE_NATS_CA) or the system's CAs for a `tls://` URL. A
service given neither refuses to start (exit 2, naming the flags), unless `--insecure-dev` says
plainly that this is a development NATS without authentication.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import ssl
from typing import Any

from aiohttp import web


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", default=os.environ.get("DRAPLANE_NATS_URL", "nats://127.0.0.1:4222"),
                        help="NATS server URL(s), comma-separated for a cluster")
    parser.add_argument("--nkey-seed", default=os.environ.get("DRAPLANE_NATS_NKEY_SEED"),
                        help="file with this process' NATS nkey seed (draplane nats-auth issue); "
                             "env DRAPLANE_NATS_NKEY_SEED")
    parser.add_argument("--nats-ca", default=os.environ.get("DRAPLANE_NATS_CA"),
                        help="CA certificate (PEM) that signed the NATS servers' TLS certificates; "
                             "env DRAPLANE_NATS_CA (a tls:// URL without it uses the system's CAs)")
    parser.add_argument("--insecure-dev", action="store_true",
                        help="connect without credentials or TLS (a development NATS only)")


def nats_credentials_problem(args: argparse.Namespace) -> str | None:
    """Why the process must not start with these NATS settings, or None.

    Without `--insecure-dev` a process needs its nkey seed and TLS (a CA file, or tls:// URLs);
    the message names the flags and environment variables that would fix it."""
    if args.insecure_dev:
        return None
    missing = []
    if not args.nkey_seed:
        missing.append("credentials: --nkey-seed FILE (or DRAPLANE_NATS_NKEY_SEED)")
    elif not os.path.isfile(args.nkey_seed) or not os.access(args.nkey_seed, os.R_OK):
        return f"--nkey-seed {args.nkey_seed}: no readable file there (DRAPLANE_NATS_NKEY_SEED names the same)"
    tls_urls = all(url.startswith("tls://") for url in nats_servers(args.nats))
    if not args.nats_ca and not tls_urls:
        missing.append("TLS: --nats-ca FILE (or DRAPLANE_NATS_CA), or tls:// URLs in --nats")
    elif args.nats_ca and not os.path.isfile(args.nats_ca):
        return f"--nats-ca {args.nats_ca}: no file there (DRAPLANE_NATS_CA names the same)"
    if not missing:
        return None
    return ("refusing to connect to NATS without " + " and ".join(missing)
            + "; pass --insecure-dev to run against a development NATS without them")


def require_nats_credentials(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 with the parser's usage and the reason when `nats_credentials_problem` finds one."""
    problem = nats_credentials_problem(args)
    if problem:
        parser.error(problem)


def nats_servers(url: str) -> list[str]:
    """`--nats` as nats.connect() wants it: a list (a comma-separated string is one bad URL to it)."""
    return [server.strip() for server in url.split(",") if server.strip()]


def nats_tls_context(ca_file: str) -> ssl.SSLContext:
    _drop_tls_eof_warning()
    return ssl.create_default_context(cafile=ca_file)


def _drop_tls_eof_warning() -> None:
    # nats-py reads TLS through asyncio's StreamReaderProtocol, whose eof_received() returns True;
    # asyncio's SSL transport then logs "returning true from eof_received() has no effect when
    # using ssl" as a WARNING each time a server closes a connection (every `draplane free`). It
    # is harmless (the connection closes all the same), so it is not shown.
    import logging

    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _TlsEofFilter) for f in asyncio_log.filters):
        asyncio_log.addFilter(_TlsEofFilter())


class _TlsEofFilter:
    def filter(self, record) -> bool:
        return not str(record.msg).startswith("returning true from eof_received() has no effect when using ssl")


def nats_connect_options(url: str, nkey_seed: str | None, *, name: str, ca_file: str | None = None,
                         inbox_prefix: str | None = None) -> dict[str, Any]:
    """Keyword arguments for nats.connect(): servers, identity, credentials, TLS, endless reconnects.

    `inbox_prefix` is the role's (draplane.nats_roles): its credentials allow replies there only."""
    options: dict[str, Any] = {
        "servers": nats_servers(url),
        "name": name,
        "max_reconnect_attempts": -1,
    }
    if nkey_seed:
        options["nkeys_seed"] = nkey_seed
    if ca_file:
        options["tls"] = nats_tls_context(ca_file)
    if inbox_prefix:
        options["inbox_prefix"] = inbox_prefix
    return options


def role_connect_options(args: argparse.Namespace, role: str, *, name: str) -> dict[str, Any]:
    """`nats_connect_options` from the arguments of `add_nats_arguments`, as service role `role`."""
    from draplane.nats_roles import service_inbox_prefix

    return nats_connect_options(args.nats, args.nkey_seed, name=name, ca_file=args.nats_ca,
                                inbox_prefix=service_inbox_prefix(role))


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

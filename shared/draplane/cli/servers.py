"""`draplane servers`: build (or find) etcd, kube-apiserver and nats-server in the cache."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "servers", help="build or locate the real etcd, kube-apiserver and nats-server binaries"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from draplane.localenv import binaries

    return binaries.main([])

"""`draplane`: the one command-line entry point.

Each subcommand lives in its own module here and exposes `register(subparsers)`, which adds its
parser and sets `handler` to a function (args) -> exit code. Modules are imported lazily by name so
that `draplane --help` stays fast and one broken optional dependency cannot take down the rest.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# Module names under draplane.cli, in the order `--help` lists them.
SUBCOMMANDS = ("up", "demo", "allocate", "simulate", "lint", "explain", "free", "audit", "dashboard", "servers", "nats_auth")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draplane",
        description="A Dynamic Resource Allocation control plane for Kubernetes.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (repeat for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"draplane.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"draplane.cli.{name}":
                continue  # not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _reader_went_away()


def _reader_went_away() -> int:
    """The reader of our output closed it (`draplane audit | head -1`): not an error of ours, so no
    traceback. What Python still holds for stdout is dropped, or its flush at exit would raise the
    same error again; 141 is what a shell reports for a command ended by SIGPIPE."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass  # stdout is not a file descriptor (a test's capture): nothing is flushed at exit
    return 141


if __name__ == "__main__":
    sys.exit(main())

"""`draplane audit`: the audit log read back, filtered by claim, pod, node, kind and time.

The log is the one `draplane-audit` writes (JSON lines, draplane.audit_log); under `draplane up`
it is the run's `audit.jsonl` next to the services' logs. The file is read line by line, so a log
of any size is filtered in constant memory.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

from draplane.audit_log import LOG_NAME, AuditLine, Filter, line_json, log_files, parse_since, read_lines
from draplane.messages.audit import KINDS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("audit", help="read the audit log: placements, releases, rejections, taints")
    parser.add_argument("--log", type=Path, default=None,
                        help=f"the log (default: $DRAPLANE_AUDIT_LOG, else the running `draplane up`'s {LOG_NAME})")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="the `draplane up` whose log to read (default ~/.local/state/draplane/up)")
    parser.add_argument("--claim", help="events about this claim (NAME or NAMESPACE/NAME)")
    parser.add_argument("--pod", help="events about this pod (NAME or NAMESPACE/NAME)")
    parser.add_argument("--node", help="events on this node")
    parser.add_argument("--since", help="events since a duration ago (30s, 10m, 2h, 1d) or a time (RFC 3339)")
    parser.add_argument("--kind", action="append", choices=(*KINDS, "unreadable"),
                        help="only these kinds (repeatable)")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text",
                        help="json: the log's own lines, one JSON object per line")
    parser.set_defaults(handler=run)


def log_path(args: argparse.Namespace) -> Path:
    if args.log is not None:
        return args.log
    if os.environ.get("DRAPLANE_AUDIT_LOG"):
        return Path(os.environ["DRAPLANE_AUDIT_LOG"])
    from draplane.localenv.environment import running_up, state_dir

    workdir = args.workdir or state_dir() / "up"
    info = running_up(workdir)
    if info and info.get("audit_log"):
        return Path(info["audit_log"])
    return workdir / "logs" / "latest" / LOG_NAME


def run(args: argparse.Namespace) -> int:
    try:
        since = parse_since(args.since) if args.since else None
    except ValueError as exc:
        print(f"draplane audit: {exc}", file=sys.stderr)
        return 2
    where = Filter(claim=args.claim, pod=args.pod, node=args.node, since=since,
                   kinds=frozenset(args.kind or ()))
    path = log_path(args)
    try:
        files = [f.open("rb") for f in log_files(path) if f != path]  # rotated ones, oldest first
        handle = path.open("rb")
    except OSError as exc:
        hint = ("; if `draplane up` was started with --workdir DIR, give the same --workdir DIR here"
                if args.log is None and args.workdir is None and not os.environ.get("DRAPLANE_AUDIT_LOG") else "")
        print(f"draplane audit: cannot read the audit log {path}: {exc.strerror}; is draplane-audit running "
              f"(it is part of `draplane up`), or give --log{hint}", file=sys.stderr)
        return 1
    files.append(handle)
    try:
        for line in read_lines(itertools.chain.from_iterable(files), where):
            if args.output == "json":
                sys.stdout.write(line_json(line).decode() + "\n")
            else:
                print(describe(line))
    finally:
        for f in files:
            f.close()
    return 0


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"


def describe(line: AuditLine) -> str:
    """One event in one line of text: when, what, about whom, where, which devices, why, by whom."""
    parts = [_when(line.at), f"{line.kind:<10}"]
    if line.pod is not None:
        parts.append(f"pod {line.pod.key()}")
    if line.node:
        parts.append(f"node {line.node}")
    for claim in line.claims:
        devices = ", ".join(d.text() for d in claim.devices)
        parts.append(f"resourceclaim {claim.key()}" + (f": {devices}" if devices else ""))
    if line.devices:
        shown = ", ".join(d.text() for d in line.devices[:4])
        more = (line.device_count or len(line.devices)) - min(4, len(line.devices))
        parts.append(f"devices {shown}" + (f" and {more} more" if more > 0 else ""))
    if line.score is not None:
        parts.append(f"score {line.score:g} ({line.policy})")
    if line.reason:
        parts.append(f"why: {line.reason}")
    parts.append(f"by {', '.join(line.by)}")
    parts.append(f"[seq {line.seq}]")
    return "  ".join(parts)

"""`draplane free`: free capacity by DeviceClass and by node, from NATS.

It reads the inventory feed bucket (slices and DeviceClasses, as the inventory publishes them) and
the reservation bucket (what draplane allocated), never Kubernetes, and asks the allocator core
what still fits (draplane.allocation.free_capacity): whole devices, shared capacity left, and the
MIG placements of each profile that the GPUs' counters still allow. Claims allocated by another
scheduler are recorded only in Kubernetes and are not seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from draplane.allocation.free_capacity import (
    ALLOCATED, BLOCKED, SHARED, TAINTED, ClassOnNode, ClassTotals, FreeCapacity, SharedCapacity, class_totals,
)


CONNECT_SECONDS = 5.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("free", help="free devices by DeviceClass and node, from NATS")
    add_nats_source_arguments(parser)
    parser.add_argument("--class", dest="device_class", help="only this DeviceClass")
    parser.add_argument("--node", help="only this node")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text")
    parser.set_defaults(handler=run)


def add_nats_source_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", default=None,
                        help="NATS URL (default: $DRAPLANE_NATS_URL, else the running `draplane up`'s, "
                             "else nats://127.0.0.1:4222)")
    parser.add_argument("--nkey-seed", default=os.environ.get("DRAPLANE_NATS_NKEY_SEED"),
                        help="file with a NATS nkey seed of the reader role (draplane nats-auth issue service "
                             "reader; default: the running `draplane up`'s)")
    parser.add_argument("--nats-ca", default=os.environ.get("DRAPLANE_NATS_CA"),
                        help="CA certificate of the NATS servers' TLS (default: the running `draplane up`'s)")
    parser.add_argument("--prefix", default="draplane.", help="NATS subject prefix (default %(default)s)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="the `draplane up` to read (default ~/.local/state/draplane/up)")


def nats_url(args: argparse.Namespace) -> str:
    return nats_source(args)[0]


def nats_source(args: argparse.Namespace) -> tuple[str, str | None, str | None]:
    """(URL, nkey seed file, CA file) to read NATS with: the ones given, else the running `draplane
    up`'s (its reader credentials, which may read the feed, the reservations and the audit stream
    and write nothing), else an open local NATS."""
    url = args.nats or os.environ.get("DRAPLANE_NATS_URL")
    info: dict = {}
    if not url or not (args.nkey_seed and args.nats_ca):
        from draplane.localenv.environment import running_up, state_dir

        found = running_up(args.workdir or state_dir() / "up") or {}
        if not url or url == found.get("nats_url"):
            info = found
    return (url or info.get("nats_url") or "nats://127.0.0.1:4222", args.nkey_seed or info.get("nats_reader_seed"),
            args.nats_ca or info.get("nats_ca"))


def no_up_hint(args: argparse.Namespace) -> str:
    """What a "cannot read NATS" error adds when no URL was given and no `draplane up` runs in the
    workdir looked at: most often, `up` was started with --workdir and this command was not."""
    if args.nats or os.environ.get("DRAPLANE_NATS_URL"):
        return ""
    from draplane.localenv.environment import running_up, state_dir

    workdir = args.workdir or state_dir() / "up"
    if running_up(workdir):
        return ""
    if args.workdir is not None:
        return f"; no `draplane up` is running with --workdir {workdir}"
    return (f"; no `draplane up` is running in the default workdir {workdir}: if it was started with "
            "--workdir DIR, give the same --workdir DIR here (or --nats URL for another NATS)")


def reader_connect_options(args: argparse.Namespace, *, name: str) -> dict:
    from draplane.entrypoints import nats_connect_options
    from draplane.nats_roles import service_inbox_prefix

    url, seed, ca = nats_source(args)
    return nats_connect_options(url, seed, name=name, ca_file=ca, inbox_prefix=service_inbox_prefix("reader"))


def run(args: argparse.Namespace) -> int:
    import nats.errors
    import nats.js.errors

    try:
        free = asyncio.run(_read(args))
    except asyncio.TimeoutError:
        print(f"draplane free: cannot read NATS at {nats_url(args)}: no answer within {CONNECT_SECONDS:.0f} s"
              f"{no_up_hint(args)}", file=sys.stderr)
        return 1
    except (OSError, nats.errors.Error, nats.js.errors.Error) as exc:
        print(f"draplane free: cannot read NATS at {nats_url(args)}: {exc!r}{no_up_hint(args)}", file=sys.stderr)
        return 1
    free = _only(free, args.device_class, args.node)
    if args.output == "json":
        json.dump(free_json(free), sys.stdout, indent=2)
        print()
    else:
        print_tables(free)
    return 0


async def _read(args: argparse.Namespace) -> FreeCapacity:
    import nats

    from draplane.device_view import read_cluster

    async def quiet(exc: Exception) -> None:
        pass  # the failed connect is reported once, below, not as a traceback per attempt

    options = reader_connect_options(args, name="draplane-free")
    options.update(connect_timeout=2, allow_reconnect=False, error_cb=quiet)
    # nats-py retries a refused first connect on its own: the answer is bounded here instead.
    nc = await asyncio.wait_for(nats.connect(**options), CONNECT_SECONDS)
    try:
        view = await read_cluster(nc.jetstream(), args.prefix)
    finally:
        await nc.close()
    return view.free()


def _only(free: FreeCapacity, device_class: str | None, node: str | None) -> FreeCapacity:
    if device_class is None and node is None:
        return free
    rows = [r for r in free.nodes if (device_class is None or r.device_class == device_class)
            and (node is None or r.node == node)]
    classes = [c for c in free.classes if device_class is None or c.device_class == device_class]
    if node is not None:
        classes = [class_totals(c.device_class, [r for r in rows if r.device_class == c.device_class]) for c in classes]
        classes = [c for c in classes if c.nodes]
    return FreeCapacity(classes=classes, nodes=rows)


# --- output ----------------------------------------------------------------------------------------


def _shared_json(shared: list[SharedCapacity]) -> list[dict]:
    return [{"capacity": s.capacity, "devices": s.devices, "total": s.text(s.total), "left": s.text(s.left)}
            for s in shared]


def _row_json(row: ClassOnNode | ClassTotals) -> dict:
    out = {"deviceClass": row.device_class}
    if isinstance(row, ClassOnNode):
        out["node"] = row.node
    else:
        out["nodes"] = row.nodes
    out.update(devices=row.devices, freeWhole=row.whole_free, states=row.states,
               sharedCapacity=_shared_json(row.shared), partitionsFree=row.partitions)
    if isinstance(row, ClassOnNode) and row.error:
        out["error"] = row.error
    return out


def free_json(free: FreeCapacity) -> dict:
    return {"byClass": [_row_json(c) for c in free.classes], "byNode": [_row_json(r) for r in free.nodes]}


def _partitions_text(partitions: dict[str, int]) -> str:
    # count×profile, no space inside, so that a narrow table wraps between profiles, not in one
    return "  ".join(f"{count}×{profile}" for profile, count in partitions.items()) or "-"


def _shared_text(shared: list[SharedCapacity]) -> str:
    return "  ".join(f"{s.capacity} {s.text(s.left)} of {s.text(s.total)}" for s in shared) or "-"


def _in_use_text(states: dict[str, int]) -> str:
    parts = [f"{states[ALLOCATED]} allocated"] if states[ALLOCATED] else []
    if states[SHARED]:
        parts.append(f"{states[SHARED]} shared")
    if states[BLOCKED]:
        parts.append(f"{states[BLOCKED]} blocked")
    return ", ".join(parts) or "-"


def print_tables(free: FreeCapacity, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if not free.nodes:
        console.print("No devices: the inventory feed has no slices (is the inventory service running?).")
        return
    # Class and node names are what a user types into a claim or a selector: never cut, however
    # narrow the terminal (piped output is 80 columns): the other columns give way to them.
    class_width = max([len("DeviceClass")] + [len(c.device_class) for c in free.classes])
    node_width = max([len("node")] + [len(r.node) for r in free.nodes])
    by_class = Table(title="Free devices by DeviceClass", title_justify="left")
    by_class.add_column("DeviceClass", justify="left", no_wrap=True, min_width=class_width)
    for column, justify in (("nodes", "right"), ("devices", "right"),
                            ("free whole", "right"), ("in use", "left"), ("tainted", "right"),
                            ("MIG placements still possible", "left"), ("shared capacity left", "left")):
        by_class.add_column(column, justify=justify)
    for c in free.classes:
        by_class.add_row(c.device_class, str(c.nodes), str(c.devices), _free_cell(c.whole_free, c.devices),
                         _in_use_text(c.states), str(c.states[TAINTED] or "-"), _partitions_text(c.partitions),
                         _shared_text(c.shared))
    console.print(by_class)
    by_node = Table(title="By node", title_justify="left")
    by_node.add_column("node", justify="left", no_wrap=True, min_width=node_width)
    by_node.add_column("DeviceClass", justify="left", no_wrap=True, min_width=class_width)
    for column, justify in (("devices", "right"),
                            ("free whole", "right"), ("in use", "left"), ("tainted", "right"),
                            ("MIG placements still possible", "left"), ("shared capacity left", "left")):
        by_node.add_column(column, justify=justify)
    previous = None
    for r in free.nodes:
        by_node.add_row(r.node if r.node != previous else "", r.device_class, str(r.devices),
                        _free_cell(r.whole_free, r.devices), _in_use_text(r.states), str(r.states[TAINTED] or "-"),
                        _partitions_text(r.partitions) if not r.error else f"[red]{r.error}[/red]",
                        _shared_text(r.shared))
        previous = r.node
    console.print(by_node)
    console.print("free whole: one-device claims of the class that still fit at once; blocked: partitionable "
                  "devices whose counters other partitions use. Read from NATS; claims allocated by other "
                  "schedulers are not in it.", style="dim")


def _free_cell(free: int, devices: int) -> str:
    if free == 0:
        return "[red]0[/red]"
    return f"[green]{free}[/green]" if free == devices else str(free)


"""`draplane simulate`: replay the Alibaba GPU trace through the allocator, policies side by side.

    draplane simulate --nodes openb_node_list_all_node.csv --pods openb_pod_list_default.csv \\
        --policy first-fit --policy fgd --policy draplane --seeds 42-51 --inflate 1.3 --out DIR

Writes DIR/allocation.csv (policy,seed,arrived_pct,allocated_pct), DIR/allocation.png, and prints
one line per policy: the mean unallocated GPU % at the last point and the failed pods. With several
--pods files, each gets its own folder DIR/<file stem>/ and its own table.
Exit 0 done; 2 bad input (the message names file, line and column).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

from draplane.simulation.experiment import EXTRA_POLICIES, POLICIES, RunResult, run_many
from draplane.simulation.trace import TraceError, read_nodes, read_pods


def parse_seeds(text: str) -> list[int]:
    """`42-51`, `42,45`, or a mix: `1,5-7`."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part[1:]:
                cut = part.index("-", 1)
                low, high = int(part[:cut]), int(part[cut + 1:])
                if high < low:
                    raise argparse.ArgumentTypeError(f"seed range {part!r} runs backwards")
                seeds.extend(range(low, high + 1))
            else:
                seeds.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad seed list {text!r}: use e.g. 42-51 or 1,2,5-7") from None
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds given")
    return seeds


def _inflate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--inflate must be a number, got {text!r}") from None
    if not 0 < value <= 10:
        raise argparse.ArgumentTypeError(f"--inflate must be in (0, 10], got {value}")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="replay a GPU cluster trace through the allocator and compare scoring policies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", required=True, type=Path, help="node list CSV (sn,cpu_milli,memory_mib,gpu,model)")
    p.add_argument("--pods", required=True, type=Path, action="append",
                   help="pod list CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec]); repeat for several traces")
    p.add_argument("--policy", action="append", choices=POLICIES + EXTRA_POLICIES, dest="policies",
                   help=f"scoring policy, repeat to compare (default: all of {', '.join(POLICIES)})")
    p.add_argument("--seeds", type=parse_seeds, default=parse_seeds("42-51"), help="seeds, e.g. 42-51 (default) or 1,3,5-9")
    p.add_argument("--inflate", type=_inflate, default=1.3, help="arrived GPU demand as a multiple of capacity (default 1.3)")
    p.add_argument("--processes", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.set_defaults(handler=run)


def write_csv(path: Path, results: list[RunResult]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["policy", "seed", "arrived_pct", "allocated_pct"])
        for r in results:
            for arrived, allocated in r.points:
                writer.writerow([r.policy, r.seed, arrived, f"{allocated:.4f}"])


def mean_curves(results: list[RunResult], policies: list[str]) -> dict[str, list[tuple[int, float]]]:
    curves: dict[str, list[tuple[int, float]]] = {}
    for policy in policies:
        by_x: dict[int, list[float]] = {}
        for r in results:
            if r.policy == policy:
                for x, y in r.points:
                    by_x.setdefault(x, []).append(y)
        curves[policy] = [(x, statistics.fmean(ys)) for x, ys in sorted(by_x.items())]
    return curves


def write_plot(path: Path, results: list[RunResult], policies: list[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for policy, points in mean_curves(results, policies).items():
        ax.plot([x for x, _ in points], [y for _, y in points], label=policy, linewidth=1.4)
    ax.plot([0, 100], [0, 100], color="grey", linestyle=":", linewidth=0.8, label="demand")
    ax.set_xlabel("arrived GPU demand, % of capacity")
    ax.set_ylabel("allocated GPUs, % of capacity")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summary(results: list[RunResult], policies: list[str]) -> list[tuple[str, float, float, float, float]]:
    """(policy, mean unallocated %, min, max, mean failed pods) per policy."""
    rows = []
    for policy in policies:
        runs = [r for r in results if r.policy == policy]
        unallocated = [r.unallocated_pct for r in runs]
        rows.append((policy, statistics.fmean(unallocated), min(unallocated), max(unallocated),
                     statistics.fmean(r.failed for r in runs)))
    return rows


def format_table(trace: str, rows, seeds: list[int], inflate: float) -> str:
    seed_text = f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))
    lines = [
        f"{trace}: {len(seeds)} seeds ({seed_text}), inflate {inflate}",
        f"  {'policy':<10} {'unallocated GPU %':>18} {'(min - max)':>16} {'failed pods':>12}",
    ]
    for policy, mean, low, high, failed in rows:
        lines.append(f"  {policy:<10} {mean:>18.2f} {f'({low:.2f} - {high:.2f})':>16} {failed:>12.1f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    policies = list(dict.fromkeys(args.policies or POLICIES))
    try:
        nodes = read_nodes(args.nodes)
        traces = [(path, read_pods(path)) for path in args.pods]
    except TraceError as exc:
        print(f"draplane simulate: {exc}", file=sys.stderr)
        return 2
    if not nodes:
        print(f"draplane simulate: {args.nodes}: no GPU nodes", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    several = len(traces) > 1
    started = time.monotonic()
    for path, pods in traces:
        out = args.out / path.stem if several else args.out
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        results = run_many(nodes, pods, policies, args.seeds, args.inflate, processes=args.processes)
        write_csv(out / "allocation.csv", results)
        write_plot(out / "allocation.png", results, policies, f"{path.stem}, seeds {args.seeds[0]}-{args.seeds[-1]}")
        print(format_table(path.stem, summary(results, policies), args.seeds, args.inflate))
        print(f"  ({time.monotonic() - t0:.1f} s; {out / 'allocation.csv'}, {out / 'allocation.png'})")
        sys.stdout.flush()
    if several:
        print(f"total {time.monotonic() - started:.1f} s")
    return 0

"""`draplane simulate`: replay the Alibaba GPU trace through the allocator, policies side by side.

    draplane simulate --nodes openb_node_list_all_node.csv --pods openb_pod_list_default.csv \\
        --policy first-fit --policy fgd --policy draplane --seeds 42-51 --inflate 1.3 --out DIR

Writes DIR/allocation.csv (policy,seed,arrived_pct,allocated_pct), DIR/allocation.png, and prints
one line per policy: the mean unallocated GPU % at the last point and the failed pods. With several
--pods files, each gets its own folder DIR/<file stem>/ and its own table.

    draplane simulate --mig --mig-profile h100-mig --policy first-fit --policy draplane --seeds 1-5 --out DIR

replays a seeded MIG workload instead (1g/2g/3g/4g/7g requests arriving and leaving on nodes of a
MIG node profile, a100-mig by default, see draplane.simulation.mig): DIR/mig.csv, a table of refused
requests and stranded memory slices per policy, the offline bound on refusals (--bound), and one
BENCH line per policy. With several --mig-profile each gets its own table and DIR/<profile>/mig.csv.
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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


MIG_POLICIES = ("first-fit", "draplane")
# The node profiles with MIG GPUs (draplane.simulation.mig.NODE_PROFILES, named here so that
# `draplane --help` does not import the simulation); the first is the default.
MIG_NODE_PROFILES = ("a100-mig", "h100-mig")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="replay a GPU cluster trace through the allocator and compare scoring policies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=Path, help="node list CSV (sn,cpu_milli,memory_mib,gpu,model); required without --mig")
    p.add_argument("--pods", type=Path, action="append",
                   help="pod list CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec]); repeat for several traces")
    mig = p.add_argument_group("MIG workload (--mig)")
    mig.add_argument("--mig", action="store_true", help="replay the seeded MIG workload instead of a trace")
    mig.add_argument("--mig-profile", action="append", choices=MIG_NODE_PROFILES, dest="mig_profiles",
                     help="node profile whose GPUs the requests land on; repeat to run both (default a100-mig)")
    mig.add_argument("--mig-nodes", type=_positive, default=4, help="nodes of the MIG profile, 8 GPUs each (default 4)")
    mig.add_argument("--mig-requests", type=_positive, default=600, help="requests per seed (default 600)")
    mig.add_argument("--mig-load", type=_inflate, default=1.0,
                     help="offered memory slices as a multiple of the cluster's (default 1.0)")
    mig.add_argument("--bound", action="store_true", help="also solve the offline bound on refusals (HiGHS)")
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
    if args.mig:
        return run_mig(args)
    if args.nodes is None or not args.pods:
        print("draplane simulate: --nodes and --pods are required (or --mig)", file=sys.stderr)
        return 2
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


def run_mig(args: argparse.Namespace) -> int:
    policies = list(dict.fromkeys(args.policies or MIG_POLICIES))
    unknown = [p for p in policies if p not in MIG_POLICIES]
    if unknown:
        print(f"draplane simulate --mig: policies {', '.join(unknown)} place trace pods only; use {', '.join(MIG_POLICIES)}",
              file=sys.stderr)
        return 2
    node_profiles = list(dict.fromkeys(args.mig_profiles or MIG_NODE_PROFILES[:1]))
    several = len(node_profiles) > 1
    for node_profile in node_profiles:
        out = args.out / node_profile if several else args.out
        out.mkdir(parents=True, exist_ok=True)
        print(run_mig_profile(node_profile, policies, args, out))
        sys.stdout.flush()
    return 0


def run_mig_profile(node_profile: str, policies: list[str], args: argparse.Namespace, out: Path) -> str:
    """One node profile's runs, every seed and policy, written to out/mig.csv; returns the table."""
    from draplane.simulation import mig

    gpus = args.mig_nodes * mig.gpu_shape(node_profile).gpus_per_node
    results: list = []
    bounds: dict[int, object] = {}
    with open(out / "mig.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["policy", "seed", "requests", "refused", "fragmentation_refusals", "stranded_slices"])
        for seed in args.seeds:
            requests = mig.mig_requests(seed, args.mig_requests, gpus, args.mig_load, node_profile=node_profile)
            for policy in policies:
                result = mig.replay(requests, args.mig_nodes, policy, seed, node_profile=node_profile)
                results.append(result)
                writer.writerow([policy, seed, result.requests, result.refused, result.fragmentation_refusals,
                                 f"{result.stranded_slices:.2f}"])
            if args.bound:
                bounds[seed] = bound = mig.placement_bound(requests, gpus, node_profile=node_profile)
                writer.writerow(["bound", seed, bound.requests, bound.fewest_refused, "", ""])
    return format_mig_table(results, bounds, args, node_profile, gpus)


def format_mig_table(results, bounds, args, node_profile: str, gpus: int) -> str:
    seeds = args.seeds
    seed_text = f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))
    # BENCH names keep their a100 form, so earlier records still line up; other GPUs add theirs.
    suffix = "" if node_profile == MIG_NODE_PROFILES[0] else "_" + node_profile.split("-")[0]
    lines = [
        f"MIG workload: {args.mig_nodes} {node_profile} nodes ({gpus} GPUs), {args.mig_requests} requests "
        f"per seed, load {args.mig_load}, {len(seeds)} seeds ({seed_text})",
        f"  {'policy':<10} {'refused %':>10} {'refused':>8} {'by fragmentation':>17} {'stranded slices':>16}  refused by profile",
    ]
    bench = []
    for policy in dict.fromkeys(r.policy for r in results):
        runs = [r for r in results if r.policy == policy]
        by_profile: dict[str, float] = {}
        for r in runs:
            for name, count in r.refused_by_profile:
                by_profile[name] = by_profile.get(name, 0) + count / len(runs)
        refused_pct = statistics.fmean(r.refused_pct for r in runs)
        refused = statistics.fmean(r.refused for r in runs)
        fragmentation = statistics.fmean(r.fragmentation_refusals for r in runs)
        stranded = statistics.fmean(r.stranded_slices for r in runs)
        profiles = "  ".join(f"{name} {count:.1f}" for name, count in sorted(by_profile.items()))
        lines.append(f"  {policy:<10} {refused_pct:>10.2f} {refused:>8.1f} {fragmentation:>17.1f} {stranded:>16.1f}  {profiles}")
        bench.append(f"BENCH name=simulate_mig{suffix}_{policy} refused_pct={refused_pct:.2f} refused={refused:.1f} "
                     f"fragmentation_refusals={fragmentation:.1f} stranded_slices={stranded:.1f} "
                     f"seconds={sum(r.seconds for r in runs):.1f}")
    if bounds:
        fewest = statistics.fmean(b.fewest_refused for b in bounds.values())
        requests = statistics.fmean(b.requests for b in bounds.values())
        proven = sum(b.proven_optimal for b in bounds.values())
        lines.append(f"  {'bound':<10} {100 * fewest / requests:>10.2f} {fewest:>8.1f}  (fewest refusals any policy could have; "
                     f"optimal on {proven} of {len(bounds)} seeds, else the solver's dual bound)")
        bench.append(f"BENCH name=simulate_mig{suffix}_bound refused_pct={100 * fewest / requests:.2f} refused={fewest:.1f}")
    lines.append("  refused: no placement of the profile left anywhere; by fragmentation: some GPU had enough free memory slices,")
    lines.append("  but in no position the profile may take; stranded slices: free memory slices of the cluster at a refusal, mean")
    return "\n".join(lines + bench)

"""The shard tier's throughput model beside what it measures (issue 26).

With N shards on cores of their own, each shard follows every pod (F ms of CPU per pod: receiving
and decoding what the binder and the other shards publish) and places its own 1/N of them (O ms
per pod it places), so the tier tops out at 1000 / (F + O/N) pods/s. This measures F and O and
sets the modelled ceiling per shard count beside the pods/s measured at that count.

Each shard count runs bench/e2e.py's setup case (its `previous` setup: hand-made nodes, the binder
makes the template claims, no KWOK) on a fresh local control plane, with one more shard process
handed no pod (`--follower`): its CPU per measured pod is F. The shards' summed CPU per measured
pod is N*F + O, so O is that sum less N*F. Rounds alternate nothing (one setup); the median over
`--rounds` is reported.

    .venv/bin/python bench/shard_model.py                        # 1, 2 and 4 shards, small shape
    .venv/bin/python bench/shard_model.py --shards 1 2 --nodes 100 --pods 1500 --warmup 500 --rounds 3
    .venv/bin/python bench/shard_model.py --shards 1 4 --feed-coalesce-ms 0 5   # side by side

`--feed-coalesce-ms` sets how long the binder gathers its cluster-bucket writes
(draplane_binder.cluster_publisher); with several values each round runs every value in turn, and
the lines carry `coalesce_ms=`.

Prints, per round and shard count, `BENCH name=shard_model_run shards=N round=R pods_per_s=...
follow_ms=... own_ms=... shard_cpu_ms_per_pod=...`, then `BENCH name=shard_model follow_ms=F
own_ms=O` (medians, O from the 1-shard runs, or the fewest shards run) and per shard count
`BENCH name=shard_model shards=N ceiling_pods_per_s=... measured_pods_per_s=... cores=...`, where
the ceiling assumes one core per shard (this machine's `cores` say how far that holds here).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _e2e():
    spec = importlib.util.spec_from_file_location("draplane_bench_e2e", HERE / "e2e.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def shard_cpu(cpu_ms: dict[str, float]) -> float:
    """The placing shards' CPU per measured pod, summed (the follower and the binder left out)."""
    return sum(v for k, v in cpu_ms.items() if k.startswith("shard-"))


def split_costs(shards: int, cpu_ms: dict[str, float]) -> tuple[float, float]:
    """(F, O) of one run: the follower's CPU per pod, and the shards' summed CPU per pod less N*F."""
    follow = cpu_ms.get("follower")
    if follow is None:
        raise ValueError("no `follower` component in the run: it must run with follower=True")
    return follow, shard_cpu(cpu_ms) - shards * follow


def ceiling(follow_ms: float, own_ms: float, shards: int) -> float:
    """Pods/s the tier can place with `shards` shards, each on a core of its own."""
    per_pod = follow_ms + own_ms / shards
    return 1000.0 / per_pod if per_pod > 0 else float("inf")


def _label(coalesce: float | None) -> str:
    return "" if coalesce is None else f" coalesce_ms={coalesce:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--nodes", type=int, default=60)
    parser.add_argument("--gpus", type=int, default=10, help="devices per node")
    parser.add_argument("--pods", type=int, default=600, help="pods, warm-up included")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--feed-coalesce-ms", type=float, nargs="+", default=[None],
                        help="the binder's --feed-coalesce-ms, one run per value (default: the binder's own)")
    args = parser.parse_args(argv)
    if not 0 < args.warmup < args.pods:
        parser.error("--warmup must be between 0 and --pods")
    if args.pods > args.nodes * args.gpus:
        parser.error("--pods must be at most --nodes x --gpus")
    if any(n < 1 for n in args.shards):
        parser.error("--shards must be at least 1")
    e2e = _e2e()
    import uvloop

    uvloop.install()
    runs: dict[tuple[float | None, int], list[dict]] = {(c, n): [] for c in args.feed_coalesce_ms for n in args.shards}
    for round_ in range(args.rounds):
        for coalesce in args.feed_coalesce_ms:
            for shards in args.shards:
                case = argparse.Namespace(
                    setup_shards=shards, setup_nodes=args.nodes, setup_pods=args.pods, setup_warmup=args.warmup,
                    setup_idle_seconds=0.0, gpus=args.gpus, timeout=args.timeout, follower=True, keep=False,
                    kcm_api_qps=None,
                    binder_args=() if coalesce is None else ("--feed-coalesce-ms", f"{coalesce:g}"))
                r = asyncio.run(e2e.setup_case(case, "previous"))
                follow, own = split_costs(shards, r["cpu_ms"])
                runs[coalesce, shards].append({"pods_per_s": r["pods_per_s"], "follow": follow, "own": own,
                                               "shard_cpu": shard_cpu(r["cpu_ms"])})
                print(f"BENCH name=shard_model_run{_label(coalesce)} shards={shards} round={round_ + 1} "
                      f"pods_per_s={r['pods_per_s']:.1f} follow_ms={follow:.3f} own_ms={own:.3f} "
                      f"shard_cpu_ms_per_pod={shard_cpu(r['cpu_ms']):.3f}", flush=True)
    cores = os.cpu_count() or 1
    base = min(args.shards)
    for coalesce in args.feed_coalesce_ms:
        follow_ms = statistics.median(run["follow"] for n in args.shards for run in runs[coalesce, n])
        own_ms = statistics.median(run["own"] for run in runs[coalesce, base])
        print(f"BENCH name=shard_model{_label(coalesce)} follow_ms={follow_ms:.3f} own_ms={own_ms:.3f} "
              f"own_from_shards={base} cores={cores}", flush=True)
        rows = []
        for shards in args.shards:
            measured = statistics.median(run["pods_per_s"] for run in runs[coalesce, shards])
            summed = statistics.median(run["shard_cpu"] for run in runs[coalesce, shards])
            modelled = ceiling(follow_ms, own_ms, shards)
            rows.append((shards, modelled, measured, summed))
            print(f"BENCH name=shard_model{_label(coalesce)} shards={shards} ceiling_pods_per_s={modelled:.1f} "
                  f"measured_pods_per_s={measured:.1f} shard_cpu_ms_per_pod={summed:.3f} cores={cores}", flush=True)
        print(f"\nfeed coalescing {'default' if coalesce is None else f'{coalesce:g} ms'}: F (following) "
              f"{follow_ms:.3f} ms/pod, O (placing own pods) {own_ms:.3f} ms/pod; "
              f"ceiling = 1000 / (F + O/N), one core per shard ({cores} cores here)")
        print(f"{'shards':>8}{'ceiling pods/s':>18}{'measured pods/s':>18}{'shard CPU ms/pod':>18}")
        for shards, modelled, measured, summed in rows:
            print(f"{shards:>8}{modelled:>18.1f}{measured:>18.1f}{summed:>18.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How low could the unallocated GPU % go? An LP upper bound on what any policy can allocate.

    .venv/bin/python bench/simulate_bound.py [--seeds 42-51] [--traces default,gpushare100,multigpu20]

For each trace and seed, the arrivals are exactly the simulator's (`arrival_sequence`), and the bound
is `draplane.simulation.bound.allocation_bound`: no policy, not even an offline one, allocates more.
The simulator's figure of merit (100 − the mean allocated share over the pods of the last arrived
percent) is at least 100 − the final allocated share, so it is bounded too. first-fit is run on the
same seeds for the comparison with the issue's target (draplane ≤ 0.6 × first-fit).

Ends with one line per trace:
BENCH name=simulate_bound trace=<t> min_unallocated_pct=... first_fit=... target_0.6x=... seconds=...
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from draplane.simulation.bound import allocation_bound
from draplane.simulation.experiment import core_inventory, run_one
from draplane.simulation.trace import read_nodes, read_pods
from draplane.simulation.workload import arrival_sequence

DATA = Path("/work/shared/data/alibaba-gpu-v2023")
if not DATA.exists():
    DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "alibaba-gpu-v2023"


def seed_range(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--inflate", type=float, default=1.3)
    parser.add_argument("--traces", default="default,gpushare100,multigpu20")
    args = parser.parse_args()
    nodes = read_nodes(DATA / "openb_node_list_all_node.csv")
    capacity = sum(n.gpus for n in nodes) * 1000
    core_inventory(nodes)
    lines = []
    for trace in args.traces.split(","):
        pods = read_pods(DATA / f"openb_pod_list_{trace}.csv")
        bounds, first_fit = [], []
        start = time.process_time()
        for seed in seed_range(args.seeds):
            bound = allocation_bound(nodes, arrival_sequence(pods, capacity, seed, args.inflate))
            bounds.append(bound.min_unallocated_pct)
            first_fit.append(run_one(nodes, pods, "first-fit", seed, args.inflate).unallocated_pct)
            print(f"{trace} seed={seed} min_unallocated_pct={bounds[-1]:.2f} first_fit={first_fit[-1]:.2f}", flush=True)
        seconds = time.process_time() - start
        ff = statistics.mean(first_fit)
        lines.append(
            f"BENCH name=simulate_bound trace={trace} min_unallocated_pct={statistics.mean(bounds):.2f} "
            f"first_fit={ff:.2f} target_0.6x={0.6 * ff:.2f} seconds={seconds:.1f}"
        )
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()

"""Trace replay speed and quality: one run per (trace, policy) on one seed, through the allocator core.

    .venv/bin/python bench/simulate_trace.py [--seed 42] [--traces default,gpushare100,multigpu20]

Ends with one line per run: BENCH name=simulate_<trace>_<policy> seconds=... pods_per_s=... unallocated_pct=...
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from draplane.simulation.experiment import POLICIES, core_inventory, run_one
from draplane.simulation.trace import read_nodes, read_pods

DATA = Path("/work/shared/data/alibaba-gpu-v2023")
if not DATA.exists():
    DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "alibaba-gpu-v2023"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--traces", default="default,gpushare100,multigpu20")
    args = parser.parse_args()
    nodes = read_nodes(DATA / "openb_node_list_all_node.csv")
    core_inventory(nodes)  # built once per process, as in `draplane simulate`
    lines = []
    for trace in args.traces.split(","):
        pods = read_pods(DATA / f"openb_pod_list_{trace}.csv")
        for policy in POLICIES:
            start = time.process_time()
            result = run_one(nodes, pods, policy, args.seed, 1.3)
            seconds = time.process_time() - start
            lines.append(
                f"BENCH name=simulate_{trace}_{policy} seconds={seconds:.2f} "
                f"pods_per_s={result.pods / seconds:.0f} unallocated_pct={result.unallocated_pct:.2f}"
            )
            print(lines[-1], flush=True)


if __name__ == "__main__":
    main()

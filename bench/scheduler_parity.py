"""Differential bench: draplane's pod filters against kube-scheduler's framework.

Runs N random cases (tests/shared/scheduling/kube_scheduler_oracle/generate.py, the generator of
test_kube_scheduler_parity.py) through both: draplane's SchedulingState.filter_nodes, and
kube-scheduler v1.37.2's framework (default profile) through the oracle program built from
tests/shared/scheduling/kube_scheduler_oracle/main.go (needs Go; built once into the cache).

Prints one BENCH line: agreement (% of cases with the same feasible nodes, the same reasons on
every refused node, and, where none is feasible, the same message), the cases where no node was
feasible, kube-scheduler's reasons seen (distinct), then per disagreement category its count, and
with --examples FILE the first example of each category as JSON (case, both answers).
Usage: .venv/bin/python bench/scheduler_parity.py [--cases 5000] [--seed 1] [--examples FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

SCHEDULING_TESTS = Path(__file__).resolve().parents[1] / "tests" / "shared" / "scheduling"
sys.path.insert(0, str(SCHEDULING_TESTS))
sys.path.insert(0, str(SCHEDULING_TESTS.parents[1]))  # tests/: go_oracle, the oracles' shared part

from kube_scheduler_oracle import generate  # noqa: E402
from kube_scheduler_oracle.oracle import KubeScheduler  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--examples", help="write the first example per category here")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    categories: collections.Counter[str] = collections.Counter()
    examples: dict[str, dict] = {}
    reasons: set[str] = set()
    none_feasible = 0
    started = time.monotonic()
    with KubeScheduler() as kube_scheduler:
        for _ in range(args.cases):
            case = generate.case(rng.randint)
            kube = kube_scheduler.filter(case)
            ours = generate.draplane_filter(case)
            none_feasible += not kube.get("feasible")
            reasons.update(r for rs in kube.get("reasons", {}).values() for r in rs)
            disagreement = generate.compare(kube, ours)
            if disagreement is not None:
                category = disagreement.split(":", 1)[0]
                categories[category] += 1
                examples.setdefault(category, {"case": case, "kube-scheduler": kube, "draplane": ours})
    seconds = time.monotonic() - started
    agreement = 100.0 * (args.cases - sum(categories.values())) / args.cases
    print(f"BENCH name=scheduler_parity cases={args.cases} seed={args.seed} agreement={agreement:.2f} "
          f"disagreements={sum(categories.values())} none_feasible={none_feasible} reasons_seen={len(reasons)} "
          f"seconds={seconds:.1f}")
    for category, count in categories.most_common():
        print(f"# {count} {category}")
    if args.examples and examples:
        Path(args.examples).write_text(json.dumps(examples, indent=1, sort_keys=True))
    return 0 if not categories else 1


if __name__ == "__main__":
    sys.exit(main())

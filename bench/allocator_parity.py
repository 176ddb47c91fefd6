"""Differential bench: draplane's allocator core against Kubernetes' structured allocator.

Runs N random one-node cases (tests/shared/allocation/kubernetes_allocator/generate.py, the
generator of test_allocator_kubernetes_parity.py) through both: draplane with the first-fit policy,
Kubernetes v1.37.2's k8s.io/dynamic-resource-allocation/structured through the oracle program built
from tests/shared/allocation/kubernetes_allocator/main.go (needs Go; built once into the cache).

Prints one BENCH line: outcome_agreement (% of cases with the same allocated/unallocatable/error
class), device_agreement (% of the cases both allocated where first-fit chose the same devices),
details_agreement (% of those where the rest of the results matched too: config, consumed
capacity, binding conditions, tolerations, node selector),
then per disagreement category its count, and, with --examples FILE (default: stderr), the smallest
example of each category as JSON (case, both answers). Cases matching a KNOWN_DIVERGENCES predicate
of the test are counted under `matching[<name>]` (whether they disagree or not), and the
disagreements such an entry excuses under `known:<name>:<category>`; all other categories fail the test.
Usage: .venv/bin/python bench/allocator_parity.py [--cases 5000] [--seed 1] [--examples FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

ALLOCATION_TESTS = Path(__file__).resolve().parents[1] / "tests" / "shared" / "allocation"
sys.path.insert(0, str(ALLOCATION_TESTS))
sys.path.insert(0, str(ALLOCATION_TESTS.parents[1]))  # tests/: go_oracle, the oracles' shared part

from kubernetes_allocator import generate  # noqa: E402
from kubernetes_allocator.oracle import KubernetesAllocator  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--examples", help="write the smallest example per category here (default: stderr)")
    args = parser.parse_args(argv)

    from test_allocator_kubernetes_parity import known_divergence, matching_divergences

    rng = random.Random(args.seed)
    counts: collections.Counter[str] = collections.Counter()
    outcomes: collections.Counter[str] = collections.Counter()
    excluded: collections.Counter[str] = collections.Counter()  # cases a KNOWN_DIVERGENCES predicate matches
    examples: dict[str, tuple[int, dict]] = {}
    invalid = agree_outcome = both_allocated = agree_devices = agree_details = 0
    started = time.monotonic()
    with KubernetesAllocator() as kubernetes:
        for _ in range(args.cases):
            case = generate.case(generate.RandomSource(rng))
            if not generate.valid(case):
                invalid += 1
                continue
            kube = kubernetes.allocate(case)
            ours = generate.draplane_outcome(case)
            for name in matching_divergences(case):
                excluded[name] += 1
            outcomes[f"{ours['outcome']}/{kube['outcome']}"] += 1
            category = generate.compare(case, kube, ours)
            if kube["outcome"] == ours["outcome"]:
                agree_outcome += 1
                if ours["outcome"] == "allocated":
                    both_allocated += 1
                    agree_devices += generate.chosen_devices(kube) == generate.chosen_devices(ours)
                    agree_details += category is None
            if category is None:
                continue
            known = known_divergence(case, category)
            if known:
                category = f"known:{known}:{category}"
            counts[category] += 1
            size = len(json.dumps(case))
            if category not in examples or size < examples[category][0]:
                examples[category] = (size, {"category": category, "case": case, "kubernetes": kube, "draplane": ours})
    seconds = time.monotonic() - started
    valid = args.cases - invalid
    pct = lambda a, b: f"{100.0 * a / b:.2f}" if b else "n/a"  # noqa: E731
    fields = [f"cases={valid}", f"invalid_skipped={invalid}", f"outcome_agreement={pct(agree_outcome, valid)}",
              f"device_agreement={pct(agree_devices, both_allocated)}",
              f"details_agreement={pct(agree_details, both_allocated)}", f"both_allocated={both_allocated}",
              f"seconds={seconds:.1f}"]
    fields += [f"outcomes[{k}]={v}" for k, v in sorted(outcomes.items())]
    fields += [f"matching[{k}]={v}" for k, v in sorted(excluded.items())]
    fields += [f"disagree[{k}]={v}" for k, v in sorted(counts.items())]
    print("BENCH name=allocator_parity " + " ".join(fields))
    out = open(args.examples, "w") if args.examples else sys.stderr
    try:
        for category in sorted(examples):
            print(json.dumps(examples[category][1], sort_keys=True), file=out)
    finally:
        if out is not sys.stderr:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

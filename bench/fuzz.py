"""A long fuzz run: every fuzz target of the suite (tests/**/test_fuzz_*.py) with many examples.

    .venv/bin/python bench/fuzz.py [--examples N] [--seed S] [-k EXPR]

In CI each target runs a few hundred derandomized examples; here every target runs N (default
2,000) fresh random ones (DRAPLANE_FUZZ_EXAMPLES; --seed makes the draws repeatable). Prints one line
per target:

    BENCH name=fuzz target=<test> examples=<run> failures=<0 or 1> seconds=<wall>

`examples` counts every call of the test body (explicit examples and shrinking included);
`failures` is 1 when the target found a failing input, which pytest's output above shows with the
decorator that reproduces it. Exit 1 if any target failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Outcomes:
    """A pytest plugin that keeps each test's outcome and duration."""

    def __init__(self) -> None:
        self.results: dict[str, tuple[str, float]] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.results[report.nodeid] = (report.outcome, report.duration)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2_000, help="examples per target (default 2000)")
    parser.add_argument("--seed", type=int, help="hypothesis seed, for a repeatable run")
    parser.add_argument("-k", dest="select", help="only the targets pytest -k selects")
    args = parser.parse_args()

    os.environ["DRAPLANE_FUZZ_EXAMPLES"] = str(args.examples)
    import pytest

    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_fuzz_*.py"))
    argv = [*files, "-q", "-p", "no:cacheprovider", "-m", "not integration", "-o", "timeout=0"]
    if args.seed is not None:
        argv.append(f"--hypothesis-seed={args.seed}")
    if args.select:
        argv += ["-k", args.select]
    outcomes = Outcomes()
    os.chdir(ROOT)
    started = time.monotonic()
    pytest.main(argv, plugins=[outcomes])
    counts = sys.modules["fuzzing"].COUNTS if "fuzzing" in sys.modules else {}

    failed = 0
    for nodeid, (outcome, seconds) in sorted(outcomes.results.items()):
        name = nodeid.split("::")[-1]
        if name not in counts:
            continue  # a plain test beside the fuzz targets (a regression case, a limit)
        failed += outcome != "passed"
        print(f"BENCH name=fuzz target={nodeid} examples={counts[name]} failures={int(outcome != 'passed')} "
              f"seconds={seconds:.1f}")
    print(f"BENCH name=fuzz_total targets={sum(1 for n in outcomes.results if n.split('::')[-1] in counts)} "
          f"examples={sum(counts.values())} failures={failed} seconds={time.monotonic() - started:.0f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

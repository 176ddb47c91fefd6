"""Differential fuzzing of draplane.cel against Kubernetes' DRA CEL compiler.

Generates random, mostly well-typed selectors over the devices of kubernetes_cases.py, has the Go
oracle in this folder evaluate them, evaluates them with draplane.cel, and prints the differences
by kind (outcome, value, message, cost). Not a test: a tool for finding the next difference, whose
interesting finds go into kubernetes_cases.py.

    (cd tests/shared/cel/kubernetes_oracle && go build -o /tmp/celoracle .)
    .venv/bin/python tests/shared/cel/kubernetes_oracle/fuzz_selectors.py --oracle /tmp/celoracle --count 1500 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kubernetes_cases import DEVICES  # noqa: E402
from test_cel_kubernetes_parity import _ours, _theirs  # noqa: E402

from draplane.cel import compile_selector  # noqa: E402

G = 'device.attributes["gpu.nvidia.com"]'
X = 'device.attributes["x.io"]'


class SelectorGenerator:
    """A small typed grammar: strings, ints, doubles, lists, quantities, versions, bools."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)

    def pick(self, *options):
        return self.r.choice(options)

    def string(self, depth: int = 0) -> str:
        if depth > 2 or self.r.random() < 0.4:
            return self.pick(f"{G}.type", f"{G}.productName", f"{G}.uuid", "device.driver", '"gpu"', '""', '"a,b"',
                             '"ÄÖü"', f'device.attributes[device.driver][?"model"].orValue("m")')
        d = depth + 1
        return self.pick(
            lambda: f"{self.string(d)}.lowerAscii()", lambda: f"{self.string(d)}.trim()",
            lambda: f"{self.string(d)}.replace({self.string(d)}, {self.string(d)})",
            lambda: f"{self.string(d)}.substring({self.pick('0', '1', '3')})",
            lambda: f"{self.string(d)}.substring({self.pick('0', '1')}, {self.pick('1', '2', '3')})",
            lambda: f"{self.string(d)}.charAt({self.pick('0', '2')})", lambda: f"string({self.integer(d)})",
            lambda: f"{self.string(d)} + {self.string(d)}", lambda: f"{self.strings(d)}[0]",
            lambda: f"({self.boolean(d)} ? {self.string(d)} : {self.string(d)})",
        )()

    def integer(self, depth: int = 0) -> str:
        if depth > 2 or self.r.random() < 0.4:
            return self.pick(f"{G}.index", "0", "1", "-3", "9223372036854775807", "device.attributes.size()",
                             f'device.capacity["gpu.nvidia.com"].memory.asInteger()', f"{G}.driverVersion.major()")
        d = depth + 1
        return self.pick(
            lambda: f"{self.integer(d)} {self.pick('+', '-', '*', '/', '%')} {self.integer(d)}",
            lambda: f"{self.string(d)}.size()", lambda: f"{self.string(d)}.indexOf({self.string(d)})",
            lambda: f"{self.string(d)}.lastIndexOf({self.string(d)}, {self.pick('0', '2', '9')})",
            lambda: f"{self.quantity(d)}.compareTo({self.quantity(d)})", lambda: f"sign({self.quantity(d)})",
            lambda: f"cel.bind(v, {self.integer(d)}, v * 2)", lambda: f"[1, 2, 3].map(x, x * {self.integer(d)}).sum()",
        )()

    def quantity(self, depth: int = 0) -> str:
        base = self.pick('device.capacity["gpu.nvidia.com"].memory', 'device.capacity[device.driver].fraction',
                         'quantity("1.5")', 'quantity("1000m")', 'quantity("40Gi")', 'quantity("1k")', 'quantity("0")')
        if depth > 1 or self.r.random() < 0.6:
            return base
        return f"{base}.{self.pick('add', 'sub')}({self.pick(self.quantity(depth + 1), self.integer(depth + 1))})"

    def strings(self, depth: int = 0) -> str:
        if depth > 2 or self.r.random() < 0.4:
            return self.pick('["a", "b"]', f"[{G}.type, {G}.uuid]", '"a,b,c".split(",")')
        d = depth + 1
        return self.pick(lambda: f"{self.string(d)}.split({self.string(d)})", lambda: f"{self.strings(d)}.sort()",
                         lambda: f"{self.strings(d)}.map(x, x + \"!\")", lambda: f"{self.strings(d)}.distinct()")()

    def boolean(self, depth: int = 0) -> str:
        if depth > 2 or self.r.random() < 0.2:
            return self.pick("true", f"{G}.mig", f"has({G}.nosuch)", f'"type" in {G}', "device.allowMultipleAllocations",
                             'has(' + X + '.y)')
        d = depth + 1
        return self.pick(
            lambda: f"{self.string(d)} == {self.string(d)}",
            lambda: f"{self.integer(d)} {self.pick('<', '>=', '==', '!=')} {self.integer(d)}",
            lambda: f"{self.quantity(d)}.{self.pick('isGreaterThan', 'isLessThan')}({self.quantity(d)})",
            lambda: f"{self.quantity(d)} {self.pick('==', '!=')} {self.quantity(d)}",
            lambda: f"{self.quantity(d)}.isInteger()",
            lambda: f"{G}.driverVersion.{self.pick('isGreaterThan', 'isLessThan')}(semver('{self.pick('1.0.0', '550.54.15', 'v8', '1.0.0-rc.1')}', true))",
            lambda: f"{self.boolean(d)} {self.pick('&&', '||')} {self.boolean(d)}", lambda: f"!{self.boolean(d)}",
            lambda: f"{self.string(d)}.{self.pick('startsWith', 'contains', 'matches')}({self.string(d)})",
            lambda: f"{self.strings(d)}.exists(x, x == {self.string(d)})",
            lambda: f"{G}.{self.pick('all', 'exists')}(k, k.size() > {self.integer(d)})",
            lambda: f"cel.bind(b, {self.string(d)}, b.size() > {self.integer(d)} && {self.boolean(d)})",
            lambda: f"({self.boolean(d)} ? {self.boolean(d)} : {self.boolean(d)})",
            lambda: f"{self.pick(G + '.type', G + '.index', G + '.driverVersion', X + '.y')} == {self.pick(self.string(d), self.integer(d))}",
        )()


def compare(records: list[dict]) -> collections.Counter:
    differences: collections.Counter = collections.Counter()
    for record in records:
        expression = record["expression"]
        ours_kind, ours_value = _ours(expression, record["device"])
        theirs_kind, theirs_value = _theirs(record)
        if theirs_kind == "runtime" and "actual cost limit exceeded" in theirs_value or (
            theirs_kind != "compile" and record["maxCost"] > 1_000_000
        ):
            theirs_kind, theirs_value = "compile", "too complex"
        kind = None
        if ours_kind != theirs_kind:
            kind = f"outcome {theirs_kind} -> {ours_kind}"
        elif ours_kind == "result" and ours_value != theirs_value:
            kind = "value"
        elif ours_kind != "result" and ours_value != theirs_value and not (
            theirs_value == "too complex" and "too complex" in ours_value
        ):
            kind = "message"
        elif ours_kind != "compile" and compile_selector(expression).max_cost != record["maxCost"]:
            kind = "cost"
        if kind:
            differences[kind] += 1
            if differences[kind] <= 5:
                print(f"[{kind}] {record['device']}: {expression}\n    draplane:   {ours_value}\n    kubernetes: {theirs_value}")
    return differences


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--oracle", required=True, help="the built Go oracle (see this file's docstring)")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    generator = SelectorGenerator(args.seed)
    names = sorted(DEVICES)
    cases = [{"expression": generator.boolean(), "device": generator.r.choice(names)} for _ in range(args.count)]
    completed = subprocess.run(
        [args.oracle], input=json.dumps({"devices": DEVICES, "cases": cases}), capture_output=True, text=True, check=True
    )
    differences = compare(json.loads(completed.stdout))
    print(f"{args.count} selectors, differences: {dict(differences) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

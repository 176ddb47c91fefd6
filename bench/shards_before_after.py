"""Two versions of draplane side by side at 1, 2 and 4 allocator shards: pods/s and what it costs.

`--before` is a git revision, checked out with `git worktree add --detach` into a temporary folder
(removed at the end, also on failure or Ctrl-C); `--after` is the working tree as it is (or a
revision too). Each version runs its own `bench/e2e.py` in the `previous` setup (`--only-setups
--setups previous --setup-rounds 1`: a fresh local control plane, hand-made nodes, the binder and
each shard its own process), with this same Python; the before version's packages come first on
PYTHONPATH, so that they are imported instead of the editable install's (checked before anything
runs: every draplane package must be imported from that version's folders). Each (version, shards)
is its own e2e.py process; the shard counts run one after the other, both versions at each, the
versions' order alternating from round to round (the machine is shared and noisy).

From each run's `BENCH name=e2e_setups_...` lines: pods/s and create-to-bound p99 of the measured
pods, and the CPU ms per measured pod (utime+stime over the measured window) of the shards summed
over their processes, of kube-apiserver, of the binder and of the NATS server. The targets it is
for: shard CPU per pod at 4 shards within 1.2x of 1 shard's, pods/s at 2 and 4 shards at least
1 shard's, apiserver CPU per pod not growing with the shards.

    .venv/bin/python bench/shards_before_after.py --before 12b9756      # 12 runs of about a minute on 2 cores
    .venv/bin/python bench/shards_before_after.py --before 12b9756 --shards 1 2 --rounds 1 --nodes 40 --pods 300 --warmup 100

Prints per run `BENCH name=shards_before_after version=before|after round=R shards=N pods_per_s=...
p99_ms=... shard_cpu_ms_per_pod=... apiserver_cpu_ms_per_pod=... binder_cpu_ms_per_pod=...
nats_cpu_ms_per_pod=... cpu_ms_per_pod=... follow_ms=...` (cpu_ms_per_pod: every component, the bench's client
included; follow_ms: with `--follower`, the CPU per pod of one more shard dealt no pod, else nan)
then the same with `round=median` per (version, shards), then per version
`BENCH name=shards_before_after_ratios version=V shard_cpu_N_over_1=... pods_per_s_N_over_1=...
apiserver_cpu_N_over_1=...` for each shard count N above the smallest (named `_over_1` when that is 1),
and a side-by-side table. Each e2e.py run's whole output is kept in `--log-dir`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERSIONS = ("before", "after")
# every folder pyproject.toml's packages.find searches, each holding one package
PACKAGE_DIRS = {
    "draplane": "shared",
    "draplane_allocator": "services/allocator",
    "draplane_binder": "services/binder",
    "draplane_inventory": "services/inventory",
    "draplane_audit": "services/audit",
    "draplane_node_agent": "services/node-agent",
}
FIGURES = ("pods_per_s", "p99_ms", "shard_cpu_ms_per_pod", "apiserver_cpu_ms_per_pod", "binder_cpu_ms_per_pod",
           "nats_cpu_ms_per_pod", "cpu_ms_per_pod", "follow_ms")
# (ratio name, figure): the three targets read off these
RATIOS = (("shard_cpu", "shard_cpu_ms_per_pod"), ("pods_per_s", "pods_per_s"), ("apiserver_cpu", "apiserver_cpu_ms_per_pod"))
_FIELD_RE = re.compile(r"(\S+?)=(\S+)")
_SHARD_COMPONENT_RE = re.compile(r"shard-\d+")


# --- the pure part: e2e.py's lines in, figures out --------------------------------------------------

def bench_fields(line: str) -> dict[str, str]:
    """`BENCH a=1 b=x` -> {"a": "1", "b": "x"}; {} for a line that is not a BENCH line."""
    if not line.startswith("BENCH "):
        return {}
    return dict(_FIELD_RE.findall(line[len("BENCH "):]))


def run_figures(output: str, shards: int) -> dict[str, float]:
    """The figures of one `e2e.py --only-setups --setups previous --setup-rounds 1` run, from its
    round-1 lines (the median lines of one round say the same again)."""
    main = cpu = None
    for line in output.splitlines():
        fields = bench_fields(line)
        name = fields.get("name", "")
        if not name.startswith("e2e_setups_") or fields.get("setup") != "previous" or fields.get("round") != "1":
            continue
        if name.endswith("_cpu"):
            cpu = fields
        elif re.fullmatch(r"e2e_setups_\d+x\d+", name):
            main = fields
    if main is None or cpu is None:
        raise ValueError("no round-1 `e2e_setups_...` and `..._cpu` BENCH lines of the previous setup in e2e.py's output")
    if int(main["shards"]) != shards:
        raise ValueError(f"e2e.py ran {main['shards']} shard(s), not {shards}")
    shard_cpu = [float(v) for k, v in cpu.items() if _SHARD_COMPONENT_RE.fullmatch(k)]
    if len(shard_cpu) != shards:
        # the sum would leave shards out (or count a component twice): say so rather than print it
        raise ValueError(f"{len(shard_cpu)} shard component(s) in the _cpu line, {shards} expected: {sorted(cpu)}")
    return {
        "pods_per_s": float(main["pods_per_s"]),
        "p99_ms": float(main["p99_ms"]),
        "shard_cpu_ms_per_pod": sum(shard_cpu),
        "apiserver_cpu_ms_per_pod": float(cpu["kube-apiserver"]),
        "binder_cpu_ms_per_pod": float(cpu["binder"]),
        "nats_cpu_ms_per_pod": float(cpu.get("nats", "nan")),
        "cpu_ms_per_pod": float(main["cpu_ms_per_pod"]),
        # F: the CPU per pod of a shard dealt no pod (`--follower`); nan without one
        "follow_ms": float(cpu.get("follower", "nan")),
    }


def median_figures(runs: list[dict[str, float]]) -> dict[str, float]:
    return {figure: statistics.median(run[figure] for run in runs) for figure in FIGURES}


def ratios(medians: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each shard count's figures over the smallest shard count's, of one version's medians:
    `<ratio>_<N>_over_<smallest>`."""
    base = min(medians)
    out = {}
    for name, figure in RATIOS:
        for shards in sorted(medians):
            if shards != base:
                below = medians[base][figure]
                out[f"{name}_{shards}_over_{base}"] = medians[shards][figure] / below if below else float("nan")
    return out


def run_order(round_index: int) -> tuple[str, ...]:
    """before/after in the first round, after/before in the next, and so on."""
    return VERSIONS if round_index % 2 == 0 else tuple(reversed(VERSIONS))


def run_line(version: str, round_: str, shards: int, figures: dict[str, float]) -> str:
    return (f"BENCH name=shards_before_after version={version} round={round_} shards={shards} "
            f"pods_per_s={figures['pods_per_s']:.1f} p99_ms={figures['p99_ms']:.0f} "
            + " ".join(f"{f}={figures[f]:.2f}" for f in FIGURES[2:]))


def ratio_line(version: str, values: dict[str, float]) -> str:
    return f"BENCH name=shards_before_after_ratios version={version} " + " ".join(
        f"{k}={v:.2f}" for k, v in values.items())


def table(medians: dict[str, dict[int, dict[str, float]]]) -> str:
    columns = [(v, s) for v in VERSIONS for s in sorted(medians[v])]
    lines = [f"{'':28}" + "".join(f"{f'{v} {s}':>12}" for v, s in columns)]
    for figure in FIGURES:
        fmt = "{:.1f}" if figure == "pods_per_s" else "{:.0f}" if figure == "p99_ms" else "{:.2f}"
        lines.append(f"{figure:28}" + "".join(f"{fmt.format(medians[v][s][figure]):>12}" for v, s in columns))
    return "\n".join(lines)


# --- the shell: worktrees and e2e.py processes ------------------------------------------------------

class Version:
    """Where one version's code is, and the environment that makes Python import it."""

    def __init__(self, label: str, root: Path, describe: str, *, on_pythonpath: bool):
        self.label, self.root, self.describe = label, root, describe
        self.env = dict(os.environ)
        if on_pythonpath:
            # PYTHONPATH's folders come before the editable install's finder (which sits at the end of
            # sys.meta_path), so this version's packages win; the services e2e.py starts inherit it
            paths = [str(root / folder) for folder in PACKAGE_DIRS.values()]
            self.env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])

    def check_imports(self) -> None:
        """Fail loudly unless every draplane package (and the shard module) comes from self.root."""
        code = ("import importlib, sys\n"
                f"for name in {sorted(PACKAGE_DIRS)!r} + ['draplane_allocator.shard']:\n"
                "    print(name, importlib.import_module(name).__file__)\n")
        out = subprocess.run([sys.executable, "-c", code], env=self.env, cwd=self.root, capture_output=True,
                             text=True, timeout=120)
        if out.returncode != 0:
            raise SystemExit(f"{self.label}: importing its packages failed:\n{out.stderr[-3000:]}")
        for line in out.stdout.splitlines():
            name, path = line.split(" ", 1)
            if not Path(path).resolve().is_relative_to(self.root.resolve()):
                raise SystemExit(f"{self.label}: {name} is imported from {path}, not from {self.root}")
            if name == "draplane_allocator.shard":
                print(f"# {self.label}: draplane_allocator.shard from {path}", flush=True)


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def describe_working_tree() -> str:
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"working tree {REPO} (HEAD {git('rev-parse', '--short', 'HEAD')}" + (", with uncommitted changes)" if dirty else ")")


def add_worktree(rev: str, label: str) -> Path:
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = Path(tempfile.mkdtemp(prefix=f"draplane-{label}-"))
    git("worktree", "add", "--detach", str(path), sha)
    return path


def remove_worktree(path: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True)


def e2e_command(version: Version, args, shards: int) -> list[str]:
    return [sys.executable, str(version.root / "bench" / "e2e.py"), "--only-setups", "--setups", "previous",
            "--setup-shards", str(shards), "--setup-rounds", "1", "--setup-nodes", str(args.nodes),
            "--setup-pods", str(args.pods), "--setup-warmup", str(args.warmup), "--gpus", str(args.gpus),
            "--setup-idle-seconds", f"{args.idle_seconds:g}", "--timeout", f"{args.timeout:g}",
            *(["--follower"] if args.follower else [])]


def run_e2e(version: Version, args, shards: int, log: Path) -> dict[str, float]:
    """One e2e.py process; on an interrupt it gets SIGINT, and time to take its control plane down."""
    with open(log, "w") as out:
        proc = subprocess.Popen(e2e_command(version, args, shards), env=version.env, cwd=version.root,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait()
        except BaseException:
            proc.send_signal(signal.SIGINT)  # KeyboardInterrupt in its asyncio.run: its finally blocks run
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    output = log.read_text()
    if rc != 0:
        raise RuntimeError(f"{version.label} e2e.py at {shards} shard(s) exited {rc} (log {log}):\n{output[-3000:]}")
    return run_figures(output, shards)


def interrupted(signum, frame) -> None:
    # SIGTERM as Ctrl-C: the running e2e.py is stopped and the worktrees removed either way
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git revision of the version before")
    parser.add_argument("--after", default=None, help="git revision of the version after (default: the working tree as it is)")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=2, help="runs of each (version, shards), alternating the versions' order")
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=10, help="devices per node")
    parser.add_argument("--pods", type=int, default=1500, help="pods per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--idle-seconds", type=float, default=0.0, help="e2e.py's --setup-idle-seconds (0: skip)")
    parser.add_argument("--timeout", type=float, default=600.0, help="e2e.py's --timeout, per wait for pods")
    parser.add_argument("--follower", action="store_true",
                        help="one more shard process dealt no pod in each run (e2e.py --follower): its CPU per pod is "
                             "what following the cluster costs a shard (follow_ms, F in bench/shard_model.py)")
    parser.add_argument("--log-dir", type=Path, default=None, help="where each e2e.py run's output goes (default: a temporary folder)")
    args = parser.parse_args(argv)
    if not 0 < args.warmup < args.pods:
        parser.error("--warmup must be between 0 and --pods")
    if args.pods > args.nodes * args.gpus:
        parser.error("--pods must be at most --nodes x --gpus")
    if min(args.shards) < 1 or args.rounds < 1:
        parser.error("--shards and --rounds must be at least 1")
    shard_counts = sorted(set(args.shards))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="draplane-shards-before-after-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    signal.signal(signal.SIGTERM, interrupted)
    worktrees: list[Path] = []
    try:
        before_root = add_worktree(args.before, "before")
        worktrees.append(before_root)
        versions = {"before": Version("before", before_root, f"{args.before} ({git('rev-parse', '--short', args.before)})",
                                      on_pythonpath=True)}
        if args.after is None:
            versions["after"] = Version("after", REPO, describe_working_tree(), on_pythonpath=False)
        else:
            after_root = add_worktree(args.after, "after")
            worktrees.append(after_root)
            versions["after"] = Version("after", after_root, f"{args.after} ({git('rev-parse', '--short', args.after)})",
                                        on_pythonpath=True)
        for version in versions.values():
            print(f"# {version.label}: {version.describe} at {version.root}", flush=True)
            version.check_imports()
        print(f"# {args.nodes} nodes x {args.gpus} GPUs, {args.pods} pods ({args.warmup} warm-up), shards "
              f"{' '.join(map(str, shard_counts))}, {args.rounds} round(s); e2e.py logs in {log_dir}", flush=True)

        results: dict[str, dict[int, list[dict[str, float]]]] = {v: {s: [] for s in shard_counts} for v in VERSIONS}
        started = time.monotonic()
        for round_index in range(args.rounds):
            for shards in shard_counts:
                for label in run_order(round_index):
                    log = log_dir / f"{label}-round{round_index + 1}-shards{shards}.log"
                    figures = run_e2e(versions[label], args, shards, log)
                    results[label][shards].append(figures)
                    print(run_line(label, str(round_index + 1), shards, figures), flush=True)
        medians = {v: {s: median_figures(results[v][s]) for s in shard_counts} for v in VERSIONS}
        for label in VERSIONS:
            for shards in shard_counts:
                print(run_line(label, "median", shards, medians[label][shards]), flush=True)
        if len(shard_counts) > 1:
            for label in VERSIONS:
                print(ratio_line(label, ratios(medians[label])), flush=True)
        print(f"\nmedians over {args.rounds} round(s), {time.monotonic() - started:.0f} s in all\n" + table(medians), flush=True)
    finally:
        for path in worktrees:
            remove_worktree(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

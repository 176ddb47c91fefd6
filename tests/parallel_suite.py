"""`make test`: the whole suite as three pytest processes side by side, each with its own output.

Integration tests spend most of their time waiting on servers (a serial run here: 18 min 32 s wall,
13 min of CPU on 2 cores), so the suite is split where no two groups share anything but the
machine:

- the pure-core tests (`-m "not integration"`), one CPU-bound process;
- the tests that run whole environments: `draplane up`, the demo, the chaos run, kube-scheduler
  beside draplane, and the real node, whose kubelet owns host paths (/var/lib/kubelet, iptables
  chains, cgroups) that only one may hold at a time;
- every other integration test, on its own control plane and NATS.

Each group gets its own pytest base temporary folder. Every group's output is printed when all
are done, in the order above, and the run fails if any group fails. Ctrl-C stops all three.

    python tests/parallel_suite.py [pytest arguments for every group]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The paths of the environment group: they start servers that take host-wide resources.
ENVIRONMENTS = ("tests/cli", "tests/bench", "tests/services/node-agent", "tests/services/test_two_schedulers.py",
                "tests/shared/localenv")

GROUPS = {
    "pure core": ["-m", "not integration", "-p", "no:cacheprovider"],
    "environments": ["-m", "integration", "-p", "no:cacheprovider", *ENVIRONMENTS],
    "services and the rest": ["-m", "integration", *(f"--ignore={path}" for path in ENVIRONMENTS)],
}


def main(argv: list[str]) -> int:
    runs = []
    with tempfile.TemporaryDirectory(prefix="draplane-suite-") as scratch:
        started = time.monotonic()
        for index, (name, arguments) in enumerate(GROUPS.items()):
            log_path = Path(scratch) / f"{index}.log"
            base = Path(scratch) / f"tmp-{index}"
            command = [sys.executable, "-m", "pytest", *arguments, f"--basetemp={base}", *argv]
            log = open(log_path, "w")
            process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            runs.append((name, process, log, log_path, command))
            print(f"suite: started {name}: {' '.join(command[2:])}", flush=True)

        def stop_all(signum, frame) -> None:
            for _, process, *_ in runs:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGINT)

        signal.signal(signal.SIGINT, stop_all)
        signal.signal(signal.SIGTERM, stop_all)
        codes = {}
        for name, process, log, _, _ in runs:
            codes[name] = process.wait()
            log.close()
            print(f"suite: {name} ended with exit {codes[name]} after {time.monotonic() - started:.0f}s", flush=True)
        for name, _, _, log_path, command in runs:
            print(f"\n=== {name}: {' '.join(command[2:])} (exit {codes[name]}) ===", flush=True)
            sys.stdout.write(log_path.read_text(errors="replace"))
        print(f"\n=== suite: {', '.join(f'{n} exit {c}' for n, c in codes.items())}; "
              f"{time.monotonic() - started:.0f}s wall ===", flush=True)
    # pytest's 5 (no tests collected) is a failure here too: every group must run something
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

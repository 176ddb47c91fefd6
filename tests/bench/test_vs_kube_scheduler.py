"""bench/vs_kube_scheduler.py at a tiny size, so that it cannot rot: both schedulers bind every
pod of the template case on their own fresh cluster, and the report has the figures of each."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from draplane.localenv import binaries

BENCH = Path(__file__).resolve().parents[2] / "bench" / "vs_kube_scheduler.py"


def bench_fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\S+?)=(\S+)", line))


@pytest.mark.integration
def test_both_schedulers_bind_the_template_workload_and_report_their_cost():
    binaries.ensure_all(progress=lambda msg: print(msg, flush=True))
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--cases", "template", "--rounds", "1", "--nodes", "3", "--gpus", "4",
         "--pods", "12", "--warmup", "4", "--stall-seconds", "10", "--timeout", "120"],
        capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [bench_fields(line) for line in proc.stdout.splitlines() if line.startswith("BENCH ")]
    runs = {f["scheduler"]: f for f in lines if f["name"] == "vs_kube_scheduler" and f["round"] == "1"}
    assert set(runs) == {"kube-scheduler", "draplane"}
    for scheduler, run in runs.items():
        # 12 pods: the probe and 3 more warm up, 8 are measured
        assert (run["case"], run["measured"], run["unbound"]) == ("template_12x3", "8", "0"), scheduler
        assert float(run["pods_per_s"]) > 0 and float(run["p99_ms"]) >= float(run["p50_ms"]) > 0
        # at least the pod's create, the claim's create and the binding
        assert float(run["requests_per_pod"]) >= float(run["writes_per_pod"]) >= 3
        assert float(run["cpu_s_per_pod"]) > 0
    cpu = {f["scheduler"]: f for f in lines if f["name"] == "vs_kube_scheduler_cpu" and f["round"] == "1"}
    assert {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"} <= set(cpu["kube-scheduler"])
    assert {"etcd", "kube-apiserver", "kube-controller-manager", "shard-0", "binder", "nats"} <= set(cpu["draplane"])
    assert "kube-scheduler" not in cpu["draplane"]
    for scheduler, run in runs.items():  # the sum is of the components listed
        components = {k: float(v) for k, v in cpu[scheduler].items() if k not in ("name", "case", "scheduler", "round")}
        assert sum(components.values()) == pytest.approx(float(run["cpu_s_per_pod"]), abs=1e-3)
    ratio = next(f for f in lines if f["name"] == "vs_kube_scheduler_ratio")
    assert float(ratio["pods_per_s"]) == pytest.approx(
        float(runs["draplane"]["pods_per_s"]) / float(runs["kube-scheduler"]["pods_per_s"]), rel=0.1)
    assert "template: draplane" in proc.stdout  # the targets' verdicts

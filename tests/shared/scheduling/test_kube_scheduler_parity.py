"""Differential test: draplane's pod filters against kube-scheduler's own framework.

The oracle is kube-scheduler v1.37.2's framework with its default profile, run over a snapshot by
the Go program in kube_scheduler_oracle/main.go (built once into the server cache, from the same
module graph as kube-scheduler; needs Go, hence `integration`). Random apiserver-valid cases
(kube_scheduler_oracle/generate.py: nodes, bound pods, one pending pod with any of the constraints
draplane reads) must give, from both, the same feasible nodes, the same reasons on every refused
node, and, where no node is feasible, the same `0/N nodes are available: ...` message.

Hypothesis (300 examples, derandomized, shrinking) plus a fixed sweep of 3,000 cases of the
generator's own distribution, the one bench/scheduler_parity.py measures. Volumes go through the
binder's PreFilter (volume_binding.pre_filter, where the binder calls it) and the shard's Filter.
CSI attach limits (NodeVolumeLimits) go through the binder's evaluation (node_volume_limits), and
the default spreading of a pod without constraints among the pods its Services and controller
select through the selector the binder finds (pod_topology_spread.default_selector). Not
compared: the other scores (draplane ranks by its devices), PostFilter's preemption note, claims
(the allocator parity test's), storage capacity (not read yet), namespaceSelectors with labels
(draplane refuses them in affinity terms).
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kube_scheduler_oracle import generate

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def kube_scheduler():
    # Go is needed anyway (the servers are built with it): a failed build fails here, with its log
    from kube_scheduler_oracle.oracle import KubeScheduler

    with KubeScheduler() as oracle:
        yield oracle


def check(case: dict, kube_scheduler) -> None:
    kube = kube_scheduler.filter(case)
    ours = generate.draplane_filter(case)
    disagreement = generate.compare(kube, ours)
    if disagreement is not None:
        detail = json.dumps({"case": case, "kube-scheduler": kube, "draplane": ours}, sort_keys=True)
        pytest.fail(f"draplane and kube-scheduler disagree ({disagreement}): {detail}", pytrace=False)


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_filters_match_kube_scheduler(kube_scheduler, data):
    check(generate.case(lambda lo, hi: data.draw(st.integers(lo, hi))), kube_scheduler)


@pytest.mark.parametrize("seed", range(3))
def test_filters_match_kube_scheduler_random_sweep(kube_scheduler, seed):
    """Hypothesis' draws lean towards small values; the generator's own distribution (the
    bench's) covers the rest, deterministically."""
    rng = random.Random(2000 + seed)
    for _ in range(1000):
        check(generate.case(rng.randint), kube_scheduler)


def test_generator_reaches_every_filter(kube_scheduler):
    """The comparison is worth its time only if kube-scheduler refuses nodes for every reason the
    generator is there to provoke, and finds nodes feasible too."""
    rng = random.Random(5)
    seen: set[str] = set()
    feasible = refused_everywhere = 0
    scores_vary: set[str] = set()
    default_spreading = 0  # cases where kube-scheduler's default constraints tell the nodes apart
    for _ in range(1500):
        case = generate.case(rng.randint)
        kube = kube_scheduler.filter(case)
        feasible += bool(kube["feasible"])
        refused_everywhere += not kube["feasible"]
        if len(kube["feasible"]) == len(case["nodes"]):
            for plugin in ("InterPodAffinity", "PodTopologySpread"):
                if len({scores.get(plugin) for scores in kube["scores"].values()}) > 1:
                    scores_vary.add(plugin)
                    default_spreading += plugin == "PodTopologySpread" and "services" in case
        seen.update(reason for reasons in kube["reasons"].values() for reason in reasons)
    wanted = {
        "node(s) were unschedulable", "node(s) had untolerated taint(s)",
        "node(s) didn't match Pod's node affinity/selector", "node(s) didn't satisfy plugin(s) [NodeAffinity]",
        "pod affinity terms conflict", "node(s) didn't have free ports for the requested pod ports",
        "Insufficient cpu", "Insufficient memory", "Insufficient example.com/foo", "Too many pods",
        "node(s) didn't match pod topology spread constraints",
        "node(s) didn't match pod topology spread constraints (missing required label)",
        "node(s) didn't match pod affinity rules", "node(s) didn't match pod anti-affinity rules",
        "node(s) didn't satisfy existing pods anti-affinity rules",
        "pod has unbound immediate PersistentVolumeClaims", 'persistentvolumeclaim "missing" not found',
        "node(s) didn't find available persistent volumes to bind",
        "node(s) didn't match PersistentVolume's node affinity", "node(s) had no available volume zone",
        "node(s) unavailable due to PersistentVolumeClaim with ReadWriteOncePod access mode already in-use by "
        "another pod",
        "node(s) exceed max volume count", "strict.csi.example.com CSI driver is not installed on the node",
        "node(s) didn't match Pod's required features", "node(s) didn't satisfy plugin(s) [NodeName]",
    }
    assert wanted <= seen, f"never provoked: {sorted(wanted - seen)}"
    assert feasible > 100 and refused_everywhere > 100
    assert scores_vary == {"InterPodAffinity", "PodTopologySpread"}  # compared where every node is feasible
    assert default_spreading > 20, default_spreading


def test_the_framework_runs_the_default_profiles_filters_in_its_order(kube_scheduler):
    """draplane's runtime names kube-scheduler's Filter plugins in the order its default profile
    runs them (the first to refuse a node is the one counted), and gates pods as its PreEnqueue does."""
    from draplane.scheduling.framework.plugins import scheduling_gates
    from draplane.scheduling.framework.runtime import DEFAULT_FILTERS

    listed = kube_scheduler.filter({"nodes": [], "pods": [], "pod": generate.case(random.Random(1).randint)["pod"],
                                    "listPlugins": True})
    assert listed["plugins"]["Filter"] == list(DEFAULT_FILTERS)
    assert scheduling_gates.NAME in listed["plugins"]["PreEnqueue"]

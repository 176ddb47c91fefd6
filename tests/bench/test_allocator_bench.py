"""bench/allocator.py's constrained shard case, small: what it measures is placements that keep
their anti-affinity and topology spread."""

from __future__ import annotations

import collections

from bench_scripts import load  # tests/bench/bench_scripts.py

bench = load("allocator")


def test_the_constrained_case_places_every_pod_within_its_anti_affinity_and_spread():
    pods, _, _ = bench.place_constrained("draplane", nodes=60, gpus_wanted=300)
    zone = {f"gpu-node-{i:04d}": f"zone-{i % 10}" for i in range(60)}
    by_app_nodes = collections.defaultdict(list)
    by_app_zones = collections.defaultdict(collections.Counter)
    anti, spread = 0, 0
    for pod in pods:
        assert pod.spec.node_name
        if not pod.metadata.labels:
            continue
        app = pod.metadata.labels["app"]
        if pod.spec.affinity is not None:
            anti += 1
            by_app_nodes[app].append(pod.spec.node_name)
        else:
            spread += 1
            by_app_zones[app][zone[pod.spec.node_name]] += 1
    assert anti and spread
    for app, nodes in by_app_nodes.items():
        assert len(nodes) == len(set(nodes)), f"{app}: two replicas on one node: {nodes}"
    for app, zones in by_app_zones.items():
        counts = [zones.get(f"zone-{z}", 0) for z in range(10)]
        # placed one by one, each within maxSkew 1 of the emptiest zone at its turn
        assert max(counts) - min(counts) <= 1, f"{app}: {counts}"

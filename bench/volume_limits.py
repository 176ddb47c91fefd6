"""What NodeVolumeLimits costs the binder per pending pod with a CSI claim.

A cluster of N nodes, each with a CSINode limiting one CSI driver to `--limit` volumes and
`--per-node` bound pods of one CSI volume each: the binder evaluates the Filter over every node
when it publishes such a pod (draplane.scheduling.framework.plugins.node_volume_limits.nodes_over_limit). Printed
side by side, in one process: counting every node's volumes, and with the binder's bound on the
volumes in use (its per-node count of mounted claims), which passes nodes far from the limit
unread. Both must refuse the same nodes; the script fails if they do not.

Usage: .venv/bin/python bench/volume_limits.py [--nodes 5000] [--per-node 10] [--limit 25] [--rounds 5]
Prints: BENCH name=volume_limits mode=<count_all|bounded> nodes=N ms_per_pod=<CPU ms> refused=<nodes>
"""

from __future__ import annotations

import argparse
import sys
import time

from draplane.api.core import PersistentVolumeClaimVolumeSource, Pod, PodSpec, Volume
from draplane.api.meta import ObjectMeta
from draplane.api.storage import (
    CSINode, CSINodeDriver, CSINodeSpec, CSIPersistentVolumeSource, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeSpec, VolumeNodeResources,
)
from draplane.scheduling.framework.plugins import node_volume_limits as nvl

DRIVER = "ebs.csi.aws.com"


def pod_mounting(name: str, claim: str, node: str | None = None) -> Pod:
    return Pod(metadata=ObjectMeta(name=name, namespace="ns", uid=f"uid-{name}"),
               spec=PodSpec(node_name=node, volumes=[
                   Volume(name="data", persistent_volume_claim=PersistentVolumeClaimVolumeSource(claim_name=claim))]))


def cluster(nodes: int, per_node: int, limit: int):
    claims: dict[str, PersistentVolumeClaim] = {}
    volumes: dict[str, PersistentVolume] = {}
    pods_on: dict[str, list[Pod]] = {}
    csinodes: dict[str, CSINode] = {}

    def volume_for(name: str) -> None:
        claims[name] = PersistentVolumeClaim(metadata=ObjectMeta(name=name, namespace="ns"),
                                             spec=PersistentVolumeClaimSpec(volume_name=f"pv-{name}"))
        volumes[f"pv-{name}"] = PersistentVolume(metadata=ObjectMeta(name=f"pv-{name}"), spec=PersistentVolumeSpec(
            csi=CSIPersistentVolumeSource(driver=DRIVER, volume_handle=f"vol-{name}")))

    for n in range(nodes):
        node = f"node-{n}"
        csinodes[node] = CSINode(metadata=ObjectMeta(name=node), spec=CSINodeSpec(drivers=[
            CSINodeDriver(name=DRIVER, node_id=node, allocatable=VolumeNodeResources(count=limit))]))
        # every 100th node is full: the Filter refuses it
        for i in range(limit if n % 100 == 0 else per_node):
            name = f"data-{n}-{i}"
            volume_for(name)
            pods_on.setdefault(node, []).append(pod_mounting(f"p-{n}-{i}", name, node))
    volume_for("new")
    objects = nvl.VolumeObjects(claims=lambda namespace: claims, volumes=volumes, classes={}, csinodes=csinodes,
                                drivers=[], pods_on=lambda node: pods_on.get(node, ()), attachments_on=lambda node: ())
    mounted = {node: len(pods) for node, pods in pods_on.items()}
    return objects, list(csinodes), mounted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--per-node", type=int, default=10)
    parser.add_argument("--limit", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.rounds < 1 or args.per_node < 0 or args.limit < 1:
        parser.error("--nodes, --rounds and --limit must be at least 1, --per-node at least 0")
    objects, nodes, mounted = cluster(args.nodes, args.per_node, args.limit)
    pending = pod_mounting("pending", "new")
    answers = {}
    for mode, at_most in (("count_all", None), ("bounded", lambda node: mounted.get(node, 0))):
        started = time.process_time()
        for _ in range(args.rounds):
            answers[mode] = nvl.nodes_over_limit(pending, nodes, objects, at_most=at_most)
        ms = (time.process_time() - started) / args.rounds * 1000
        print(f"BENCH name=volume_limits mode={mode} nodes={args.nodes} per_node={args.per_node} limit={args.limit} "
              f"ms_per_pod={ms:.2f} refused={len(answers[mode])}", flush=True)
    if answers["count_all"] != answers["bounded"]:
        print("volume_limits: the bound changed a verdict", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

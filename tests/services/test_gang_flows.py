"""Gangs through the live services, with kubectl: what is wired so far is the partitioning, so a
PodGroup's members all reach one shard. (Placing them all or none there is not wired yet; each is
placed as it comes.)"""

import pytest

from draplane.scheduling.messages import shard_for
from test_user_flows import claim_yaml, get_json, gpu_cluster, no_races_or_errors, pod_yaml, wait_bound

pytestmark = pytest.mark.integration


def member_yaml(namespace: str, name: str, scheduler: str, claim: str, group: str) -> str:
    return pod_yaml(namespace, name, scheduler, claim=claim).replace(
        f"  schedulerName: {scheduler}", f"  schedulerName: {scheduler}\n  schedulingGroup: {{podGroupName: {group}}}")


async def test_the_members_of_a_pod_group_are_placed_by_one_shard(scheduling, kube, kubectl, namespace):
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=2)
    await scheduling.start(shards=3)
    manifest = f"""
apiVersion: scheduling.k8s.io/v1beta1
kind: PodGroup
metadata: {{name: workers, namespace: {namespace}}}
spec:
  schedulingPolicy: {{gang: {{minCount: 6}}}}
"""
    claims = [f"w-{i}-gpus" for i in range(6)]
    while len({shard_for(f"{namespace}/{c}", 3) for c in claims}) == 1:
        claims[-1] += "-x"  # so that keyed by their claims, the pods would not all go to one shard
    for i, claim in enumerate(claims):
        manifest += "---" + claim_yaml(namespace, claim, class_name, count=2)
        manifest += "---" + member_yaml(namespace, f"w-{i}", scheduling.scheduler_name, claim, "workers")
    await kubectl.apply(manifest)
    bound = [await wait_bound(scheduling, kubectl, namespace, f"w-{i}") for i in range(6)]
    assert {p["spec"]["nodeName"] for p in bound} <= set(nodes)
    assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "workers"} for p in bound)
    placed = [shard.counters["placed"] for shard in scheduling.shards]
    # Keyed by their claims the pods would go to two or three shards; keyed by the PodGroup, one has all.
    assert sorted(placed) == [0, 0, 6], placed
    group = await get_json(kubectl, "podgroup", "workers", "-n", namespace)
    assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 6}}
    no_races_or_errors(scheduling)

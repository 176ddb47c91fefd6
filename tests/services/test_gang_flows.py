"""Gangs through the live services, with kubectl: a PodGroup's members all reach one shard, wait
for the gang's minCount, and are placed all or none (two gangs that cannot both fit: one runs
whole, the other waits whole, where per-pod placement deadlocks both), within one rack when the
PodGroup asks for it; kubernetes#138765's whole-or-half pair, which kube-scheduler 1.37.2 leaves
unbound, binds with a half each. kill -9 of a shard in the middle of a gang's commit is in
tests/services/allocator/test_allocator_crashes.py."""

import asyncio

import msgspec
import pytest

from draplane.api.resource import ResourceClaim
from draplane.scheduling.messages import shard_for
from test_user_flows import (
    claim_yaml, get_json, gpu_cluster, no_races_or_errors, pod_yaml, wait_bound, wait_unschedulable,
)

pytestmark = pytest.mark.integration


def member_yaml(namespace: str, name: str, scheduler: str, claim: str, group: str) -> str:
    return pod_yaml(namespace, name, scheduler, claim=claim).replace(
        f"  schedulerName: {scheduler}", f"  schedulerName: {scheduler}\n  schedulingGroup: {{podGroupName: {group}}}")


def pod_group_yaml(namespace: str, name: str, min_count: int, topology_key: str | None = None) -> str:
    constraints = f"\n  schedulingConstraints: {{topology: [{{key: {topology_key}}}]}}" if topology_key else ""
    return f"""
apiVersion: scheduling.k8s.io/v1beta1
kind: PodGroup
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  schedulingPolicy: {{gang: {{minCount: {min_count}}}}}{constraints}
"""


def gang_yaml(namespace: str, group: str, scheduler: str, class_name: str, pods: int, gpus: int) -> list[str]:
    """One document per member: its claim and its pod."""
    return [claim_yaml(namespace, f"{group}-{i}-gpus", class_name, count=gpus) + "---"
            + member_yaml(namespace, f"{group}-{i}", scheduler, f"{group}-{i}-gpus", group) for i in range(pods)]


async def nodes_of(kubectl, namespace: str, prefix: str) -> dict[str, str | None]:
    """pod name -> its node (None: not bound), for the pods whose name starts with `prefix`."""
    pods = await get_json(kubectl, "pods", "-n", namespace)
    return {p["metadata"]["name"]: p["spec"].get("nodeName") for p in pods["items"]
            if p["metadata"]["name"].startswith(prefix)}


async def allocated_claims(kubectl, namespace: str, prefix: str) -> list[str]:
    claims = await get_json(kubectl, "resourceclaims", "-n", namespace)
    return [c["metadata"]["name"] for c in claims["items"]
            if c["metadata"]["name"].startswith(prefix) and (c.get("status") or {}).get("allocation")]


async def test_the_members_of_a_pod_group_are_placed_by_one_shard(scheduling, kube, kubectl, namespace):
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=2)
    await scheduling.start(shards=3)
    manifest = pod_group_yaml(namespace, "workers", 6)
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


async def test_members_wait_for_the_gangs_min_count_then_bind_together(scheduling, kube, kubectl, namespace):
    class_name, _ = await gpu_cluster(scheduling, kube, nodes=2)
    await scheduling.start()
    members = gang_yaml(namespace, "trio", scheduling.scheduler_name, class_name, pods=3, gpus=4)
    await kubectl.apply(pod_group_yaml(namespace, "trio", 3) + "---" + "---".join(members[:2]))
    for name in ("trio-0", "trio-1"):
        # the first member may have said "1 of 3" first: each says the count when it is retried
        message = await wait_unschedulable(scheduling, kubectl, namespace, name, "2 of 3")
        assert message == f"waiting for the gang's minimum count: 2 of 3 pods of PodGroup {namespace}/trio exist"
    assert await allocated_claims(kubectl, namespace, "trio") == [], "no device is held for a gang still waiting"
    await kubectl.apply(members[2])
    bound = [await wait_bound(scheduling, kubectl, namespace, f"trio-{i}") for i in range(3)]
    assert len({p["spec"]["nodeName"] for p in bound}) == 2  # 3 x 4 GPUs on two 8-GPU nodes
    # waiting a moment for the gang's last member is no failure: a condition, never a Warning
    assert await warnings(kubectl, namespace) == [], "a gang that bound within seconds got Warning events"
    no_races_or_errors(scheduling)


async def warnings(kubectl, namespace: str) -> list[tuple[str, str, str]]:
    events = await get_json(kubectl, "events", "-n", namespace)
    return sorted((e["involvedObject"]["name"], e["reason"], e["message"]) for e in events["items"]
                  if e["type"] == "Warning")


async def test_a_gang_that_keeps_waiting_is_warned_once_the_wait_has_lasted(scheduling, kube, kubectl, namespace):
    class_name, _ = await gpu_cluster(scheduling, kube, nodes=1)
    await scheduling.start(gang_wait_warning_seconds=4.0)
    members = gang_yaml(namespace, "pair", scheduling.scheduler_name, class_name, pods=2, gpus=1)
    await kubectl.apply(pod_group_yaml(namespace, "pair", 2) + "---" + members[0])
    message = await wait_unschedulable(scheduling, kubectl, namespace, "pair-0", "1 of 2")
    assert await warnings(kubectl, namespace) == []  # told by the condition only, at first

    async def warned():
        return await warnings(kubectl, namespace)

    # the binder retries the pod (1, 2, 4, 8 s apart): past 4 s of waiting, one Warning with the same words
    assert await scheduling.wait_for(warned, 30, "a Warning once the gang waited 4 s", interval=0.5) == [
        ("pair-0", "FailedScheduling", message)]
    await asyncio.sleep(3.0)
    assert len(await warnings(kubectl, namespace)) == 1, "warned again for the same wait"
    no_races_or_errors(scheduling)


def two_gangs_interleaved(namespace: str, scheduler: str, class_name: str) -> str:
    """Two 8-pod x 8-GPU gangs, their members applied in turns (a-0, b-0, a-1, b-1, ...)."""
    a = gang_yaml(namespace, "train-a", scheduler, class_name, pods=8, gpus=8)
    b = gang_yaml(namespace, "train-b", scheduler, class_name, pods=8, gpus=8)
    documents = [pod_group_yaml(namespace, "train-a", 8), pod_group_yaml(namespace, "train-b", 8)]
    for x, y in zip(a, b):
        documents += [x, y]
    return "---".join(documents)


async def test_two_8_by_8_gpu_gangs_on_12_nodes_one_runs_whole_the_other_waits_whole(
        scheduling, kube, kubectl, namespace):
    class_name, _ = await gpu_cluster(scheduling, kube, nodes=12)
    await scheduling.start(policy="first-fit")
    await kubectl.apply(two_gangs_interleaved(namespace, scheduling.scheduler_name, class_name))

    async def one_gang_whole():
        placed = await nodes_of(kubectl, namespace, "train-")
        bound = {g: sum(1 for name, node in placed.items() if name.startswith(g) and node)
                 for g in ("train-a", "train-b")}
        return bound if sorted(bound.values()) == [0, 8] else None

    bound = await scheduling.wait_for(one_gang_whole, 90, "one gang bound whole")
    running, waiting = sorted(bound, key=lambda g: -bound[g])
    placed = await nodes_of(kubectl, namespace, running)
    assert len(set(placed.values())) == 8, "an 8-GPU member per node"
    message = await wait_unschedulable(scheduling, kubectl, namespace, f"{waiting}-0", "do not fit together")
    assert message.startswith(f"the gang's 8 pods do not fit together: gang {namespace}/{waiting}: 8 members, "
                              f"placed none of them; "), message
    assert "fit alone on 4 node(s)" in message and "too few free" in message, message
    # Whole or nothing: no claim of the waiting gang is allocated, nor reserved in the bucket,
    # and it stays so (a second look after the binder's retries).
    await asyncio.sleep(3)
    assert await allocated_claims(kubectl, namespace, waiting) == []
    assert not any(node for node in (await nodes_of(kubectl, namespace, waiting)).values())
    reserved = {r.claim_name for shard in scheduling.shards for _, entry in shard.store.entries.values()
                for r in entry.claims.values()}
    assert not {c for c in reserved if c.startswith(waiting)}, reserved
    assert len(await allocated_claims(kubectl, namespace, running)) == 8
    no_races_or_errors(scheduling)


async def test_per_pod_first_fit_deadlocks_the_same_two_gangs(scheduling, kube, kubectl, namespace):
    """The input above placed one pod at a time, as kube-scheduler does without gangs: each gang
    gets part of the 12 nodes, neither can ever run whole, and 96 GPUs sit held by half gangs."""
    class_name, _ = await gpu_cluster(scheduling, kube, nodes=12)
    await scheduling.start(policy="first-fit", gang_scheduling=False)
    await kubectl.apply(two_gangs_interleaved(namespace, scheduling.scheduler_name, class_name))

    async def twelve_bound():
        placed = await nodes_of(kubectl, namespace, "train-")
        return placed if len(placed) == 16 and sum(1 for n in placed.values() if n) == 12 else None

    placed = await scheduling.wait_for(twelve_bound, 90, "12 of the 16 pods bound")
    await wait_unschedulable(scheduling, kubectl, namespace, next(n for n, node in placed.items() if not node))
    bound = {g: sum(1 for name, node in placed.items() if name.startswith(g) and node) for g in ("train-a", "train-b")}
    # deadlock: both gangs hold GPUs, neither has all 8 members running
    assert 0 < bound["train-a"] < 8 and 0 < bound["train-b"] < 8, bound
    assert len(await allocated_claims(kubectl, namespace, "train-")) == 12


async def test_a_gang_with_a_rack_constraint_lands_in_one_rack(scheduling, kube, kubectl, namespace):
    rack = f"example.com/rack-{namespace[-6:]}"
    labels = {0: {rack: "r1"}, 1: {rack: "r1"}, 2: {rack: "r2"}, 3: {rack: "r2"}}
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=4, labels=labels)
    await scheduling.start(policy="first-fit")
    # Half of r1's first node is taken: r1 has 12 GPUs free, r2 16. Four 4-GPU members fit in r2
    # only; first-fit without the constraint would start on r1's nodes.
    await kubectl.apply(claim_yaml(namespace, "busy-gpus", class_name, count=4) + "---"
                        + pod_yaml(namespace, "busy", scheduling.scheduler_name, claim="busy-gpus"))
    assert (await wait_bound(scheduling, kubectl, namespace, "busy"))["spec"]["nodeName"] in nodes[:2]
    await kubectl.apply(pod_group_yaml(namespace, "racked", 4, topology_key=rack) + "---" + "---".join(
        gang_yaml(namespace, "racked", scheduling.scheduler_name, class_name, pods=4, gpus=4)))
    bound = [await wait_bound(scheduling, kubectl, namespace, f"racked-{i}") for i in range(4)]
    assert {p["spec"]["nodeName"] for p in bound} == set(nodes[2:]), "all four in rack r2"
    group = await get_json(kubectl, "podgroup", "racked", "-n", namespace)
    assert group["spec"]["schedulingConstraints"] == {"topology": [{"key": rack}]}
    no_races_or_errors(scheduling)


async def test_a_claim_two_members_share_is_allocated_once_and_reserved_for_both(scheduling, kube, kubectl, namespace):
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=2)
    await scheduling.start()
    shared = claim_yaml(namespace, "duo-shared-gpus", class_name, count=2)
    members = [member_yaml(namespace, f"duo-{i}", scheduling.scheduler_name, "duo-shared-gpus", "duo")
               for i in range(2)]
    await kubectl.apply("---".join([pod_group_yaml(namespace, "duo", 2), shared, *members]))
    bound = [await wait_bound(scheduling, kubectl, namespace, f"duo-{i}") for i in range(2)]
    (node,) = {p["spec"]["nodeName"] for p in bound}  # one claim's devices: one node for both
    claim = await get_json(kubectl, "resourceclaim", "duo-shared-gpus", "-n", namespace)
    assert sorted(c["name"] for c in claim["status"]["reservedFor"]) == ["duo-0", "duo-1"]
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len({r["device"] for r in results}) == 2 and {r["pool"] for r in results} == {node}
    no_races_or_errors(scheduling)


def _kube_scheduler_case():
    """case_138765 from tests/shared/localenv/test_kube_scheduler_gang.py, where kube-scheduler
    runs the very same objects (loaded by path: that directory is not on this one's import path)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "shared" / "localenv" / "test_kube_scheduler_gang.py"
    spec = importlib.util.spec_from_file_location("kube_scheduler_gang_case", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.case_138765


async def test_kubernetes_138765_both_whole_or_half_members_get_a_half(scheduling, kube, kubectl, namespace):
    """kubernetes#138765 through the services: each member asks a whole GPU or half of one, and
    the one GPU can be given as two halves. kube-scheduler 1.37.2 binds neither pod (it gives the
    first the whole GPU: tests/shared/localenv/test_kube_scheduler_gang.py); the joint search
    gives each a half, and both bind."""
    case = _kube_scheduler_case()(namespace, namespace[-6:], scheduler_name=scheduling.scheduler_name)
    (node,) = case["node"]
    for device_class in case["classes"]:
        await kube.create(device_class)
    await scheduling.put_node(node, case["slices"])
    await scheduling.start()
    # applied with kubectl, as JSON documents (JSON is YAML)
    await kubectl.apply("\n---\n".join(msgspec.json.encode(obj).decode()
                                       for obj in case["podgroups"] + case["claims"] + case["pods"]))
    bound = [await scheduling.bound_pod(namespace, pod.metadata.name, timeout=45) for pod in case["pods"]]
    assert {p.spec.node_name for p in bound} == {node.metadata.name}
    claims = [await kube.get(ResourceClaim, c.metadata.name, namespace) for c in case["claims"]]
    results = sorted((r.request, r.device) for c in claims for r in c.status.allocation.devices.results)
    assert results == [("gpu/half", "gpu-0-half-0"), ("gpu/half", "gpu-0-half-1")]
    no_races_or_errors(scheduling)


async def test_pods_beyond_min_count_do_not_keep_the_gang_from_running(scheduling, kube, kubectl, namespace):
    """minCount 2 of 3 eight-GPU pods, room for two: the two run, the third waits for room (all
    three together would never fit)."""
    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=2)
    await scheduling.start()
    await kubectl.apply(pod_group_yaml(namespace, "job", 2) + "---" + "---".join(
        gang_yaml(namespace, "job", scheduling.scheduler_name, class_name, pods=3, gpus=8)))

    async def two_bound():
        placed = await nodes_of(kubectl, namespace, "job-")
        return placed if sum(1 for n in placed.values() if n) == 2 else None

    placed = await scheduling.wait_for(two_bound, 45, "two of the three members bound")
    assert {n for n in placed.values() if n} == set(nodes)
    (waiting,) = [name for name, node in placed.items() if not node]
    await wait_unschedulable(scheduling, kubectl, namespace, waiting)
    await asyncio.sleep(2)
    assert sum(1 for n in (await nodes_of(kubectl, namespace, "job-")).values() if n) == 2
    no_races_or_errors(scheduling)


def claim_sharing_group_yaml(namespace: str, name: str, min_count: int) -> str:
    """A PodGroup whose members share one claim made from the template `one-gpu`
    (DRAWorkloadResourceClaims): reserved for the group, not for each pod."""
    return pod_group_yaml(namespace, name, min_count) + "  resourceClaims: [{name: gpu, resourceClaimTemplateName: one-gpu}]\n"


def claim_sharing_member_yaml(namespace: str, name: str, scheduler: str, group: str) -> str:
    return pod_yaml(namespace, name, scheduler, template="one-gpu").replace(
        f"  schedulerName: {scheduler}", f"  schedulerName: {scheduler}\n  schedulingGroup: {{podGroupName: {group}}}"
    ).replace("claims: [{name: devices}]", "claims: [{name: gpu}]").replace("- name: devices", "- name: gpu")


@pytest.mark.parametrize("members", [4, 300])
async def test_a_pod_groups_claim_template_gives_one_claim_its_members_share(scheduling, kube, kubectl, namespace,
                                                                             members):
    """A PodGroup with a claim template (DRAWorkloadResourceClaims): kube-controller-manager makes
    one claim, owned by the group; every member binds on it, and the claim is reserved for the
    group, once, so 300 members pass the 256-entry reservedFor limit a claim per pod would hit."""
    from draplane.simulation import scenario
    from test_user_flows import one_gpu_template_yaml

    class_name, nodes = await gpu_cluster(scheduling, kube, nodes=1)
    await kube.patch(type(scenario.gpu_node("x")), nodes[0], {"status": {"allocatable": {
        "cpu": "64", "memory": "512Gi", "pods": "400"}, "capacity": {"cpu": "64", "memory": "512Gi", "pods": "400"}}},
        subresource="status")
    await scheduling.start(shards=2)
    pods = [claim_sharing_member_yaml(namespace, f"worker-{i}", scheduling.scheduler_name, "group-1")
            for i in range(members)]
    await kubectl.apply("---".join([one_gpu_template_yaml(namespace, class_name),
                                    claim_sharing_group_yaml(namespace, "group-1", members), *pods]))

    async def all_bound():
        got = await nodes_of(kubectl, namespace, "worker-")
        return got if len(got) == members and all(got.values()) else None

    bound = await scheduling.wait_for(all_bound, 120, f"the {members} members bound", interval=1.0)
    claims = (await get_json(kubectl, "resourceclaims", "-n", namespace))["items"]
    assert len(claims) == 1, [c["metadata"]["name"] for c in claims]
    (claim,) = claims
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "PodGroup"
    reserved = claim["status"]["reservedFor"]
    assert reserved == [{"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": "group-1",
                         "uid": reserved[0]["uid"]}], reserved
    assert len(set(bound.values())) == 1  # one device, one node
    no_races_or_errors(scheduling)


async def test_a_member_that_fails_before_binding_turns_its_gang_back_whole(scheduling, kube, kubectl, nats,
                                                                           namespace):
    """The binder passes a gang's members placed together through Permit all or none
    (draplane_binder.gang_permits): here one member's pod goes after its shard placed the gang and
    before the binder writes it. Without the barrier the other two were bound: a gang partly bound,
    which its workload cannot use."""
    from draplane.scheduling.messages import Subjects
    from draplane_allocator.shard import Shard
    from draplane_binder.service import Binder

    class_name, _ = await gpu_cluster(scheduling, kube, nodes=2)
    await scheduling.start()
    subjects = Subjects(prefix=scheduling.prefix)
    js = nats.jetstream()
    await scheduling.shards[0].stop()  # the PendingPods wait in its queue
    members = gang_yaml(namespace, "trio", scheduling.scheduler_name, class_name, pods=3, gpus=2)
    await kubectl.apply(pod_group_yaml(namespace, "trio", 3) + "---" + "---".join(members))

    async def published():
        return sum(1 for sent in scheduling.binder.pending.in_flight.values() if sent.sequence is not None) == 3

    await scheduling.wait_for(published, what="the three members' PendingPods")
    settings = scheduling.binder.settings
    await scheduling.binder.stop()  # the shard's answers wait in the results stream
    scheduling.shards[0] = Shard(nats, index=0, prefix=scheduling.prefix, lease_seconds=30.0)
    await scheduling.shards[0].start()

    async def placed():
        return (await js.stream_info(subjects.results_stream)).state.messages >= 3

    await scheduling.wait_for(placed, what="the gang's three Placements")
    await kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/trio-2", query={"gracePeriodSeconds": 0})
    scheduling.binder = Binder(settings, kube, nats)
    await scheduling.binder.start()
    await scheduling.binder.wait_ready()

    async def all_turned_back():
        return scheduling.binder.counters["placements_abandoned"] >= 3

    await scheduling.wait_for(all_turned_back, what="the three placements abandoned")
    for name in ("trio-0", "trio-1"):
        message = await wait_unschedulable(scheduling, kubectl, namespace, name, "2 of 3")
        assert message == f"waiting for the gang's minimum count: 2 of 3 pods of PodGroup {namespace}/trio exist"
    assert await nodes_of(kubectl, namespace, "trio") == {"trio-0": None, "trio-1": None}
    assert await allocated_claims(kubectl, namespace, "trio") == []
    assert scheduling.binder.counters["pods_bound"] == 0

"""Reading a gang from the Workload API's PodGroup, and members waiting for the minimum count."""

from __future__ import annotations

import pytest

from draplane.allocation.gang import DomainKind, GangTopology
from draplane.api.codec import decode_json
from draplane.api.core import PodSchedulingGroup, PodSpec
from draplane.api.scheduling import PodGroup
from draplane.scheduling.gangs import GangSpec, GangSpecError, GangWaitingRoom, gang_spec, pod_group_key

# As kube-apiserver v1.37.2 returned it (kubectl get podgroup -o json), gates on.
SERVED = b"""{"apiVersion":"scheduling.k8s.io/v1beta1","kind":"PodGroup","metadata":{"name":"train-workers",
"namespace":"default","finalizers":["scheduling.k8s.io/podgroup-protection"],"uid":"fc5020b7"},
"spec":{"disruptionMode":{"single":{}},"priority":0,"schedulingConstraints":{"topology":[{"key":"topology.kubernetes.io/rack"}]},
"schedulingPolicy":{"gang":{"minCount":2}},"workloadRef":{"templateName":"workers","workloadName":"train"}},"status":{}}"""


def group(policy: str = '{"gang":{"minCount":4}}', annotations: str = "{}", constraints: str = "null") -> PodGroup:
    return decode_json(f'''{{"metadata":{{"name":"g","namespace":"ns","annotations":{annotations}}},
        "spec":{{"schedulingPolicy":{policy},"schedulingConstraints":{constraints}}}}}''', PodGroup)


def test_a_served_pod_group_is_a_gang_with_its_rack():
    spec = gang_spec(decode_json(SERVED, PodGroup))
    assert spec == GangSpec("default/train-workers", 2, GangTopology("topology.kubernetes.io/rack", DomainKind.NODE_LABEL))


def test_basic_policy_is_no_gang_and_device_domains_are_annotations():
    assert gang_spec(group('{"basic":{}}')) is None
    assert gang_spec(group()) == GangSpec("ns/g", 4)
    spec = gang_spec(group(annotations='{"draplane.io/gang-device-domain":"gpu.nvidia.com/cliqueId",'
                                       '"draplane.io/gang-topology":"preferred"}'))
    assert spec.topology == GangTopology("gpu.nvidia.com/cliqueId", DomainKind.DEVICE_ATTRIBUTE, required=False)


@pytest.mark.parametrize("policy, annotations, constraints, message", [
    ('{}', "{}", "null", "PodGroup ns/g: spec.schedulingPolicy: one of basic or gang must be set"),
    ('{"gang":{"minCount":0}}', "{}", "null", "spec.schedulingPolicy.gang.minCount: must be a positive integer, got 0"),
    ('{"gang":{}}', "{}", "null", "minCount: must be a positive integer, got None"),
    ('{"gang":{"minCount":2}}', '{"draplane.io/gang-topology":"often"}', "null", "must be required or preferred, got 'often'"),
    ('{"gang":{"minCount":2}}', '{"draplane.io/gang-device-domain":"cliqueId"}', "null", "a fully qualified device attribute"),
    ('{"gang":{"minCount":2}}', "{}", '{"topology":[{"key":"a"},{"key":"b"}]}', "topology: at most one constraint, got 2"),
    ('{"gang":{"minCount":2}}', "{}", '{"topology":[{}]}', "topology[0].key: required"),
])
def test_bad_pod_groups_name_the_field(policy, annotations, constraints, message):
    with pytest.raises(GangSpecError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        gang_spec(group(policy, annotations, constraints))


def test_pod_group_key():
    assert pod_group_key("ns", PodSpec(scheduling_group=PodSchedulingGroup(pod_group_name="g"))) == "ns/g"
    assert pod_group_key("ns", PodSpec()) is None
    assert pod_group_key("ns", None) is None


def test_members_wait_until_the_minimum_count_exists():
    room = GangWaitingRoom()
    spec = GangSpec("ns/g", 3)
    room.join("ns/g", "ns/w-0", "p0")
    room.join("ns/g", "ns/w-1", "p1")
    assert room.ready(spec) is None
    assert room.waiting_for(spec) == "waiting for the gang's minimum count: 2 of 3 pods of PodGroup ns/g exist"
    room.join("ns/g", "ns/w-1", "p1-again")  # a retry replaces, it does not count twice
    assert room.ready(spec) is None
    room.join("ns/g", "ns/w-2", "p2")
    assert room.ready(spec) == ["p0", "p1-again", "p2"]
    # Members already running count toward the minimum; placed ones leave the room.
    for m in ("ns/w-0", "ns/w-1", "ns/w-2"):
        room.leave(m)
    assert len(room) == 0
    room.join("ns/g", "ns/w-3", "p3")
    assert room.ready(spec, placed=2) == ["p3"]


def test_the_room_is_bounded():
    room = GangWaitingRoom(max_gangs=2, max_members=2)
    for g in range(5):
        for m in range(3):
            room.join(f"ns/g{g}", f"ns/g{g}-{m}", m)
    assert len(room) == 2
    assert room.members("ns/g0") == [] and room.members("ns/g4") == [1, 2]
    room.leave("ns/g0-0")  # forgotten already: nothing to do


def test_a_gang_larger_than_the_member_bound_gets_room_for_its_minimum_count():
    room = GangWaitingRoom(max_members=4)
    spec = GangSpec("ns/big", 6)
    for m in range(6):
        room.join("ns/big", f"ns/big-{m}", m, spec.min_count)
    assert room.ready(spec) == list(range(6))  # with the bound alone it waited for ever
    room.join("ns/big", "ns/big-6", 6, spec.min_count)
    assert len(room.members("ns/big")) == 6  # bounded still: minCount at the most

import msgspec
import pytest

from draplane.component_helpers.errors import SpecError
from draplane.component_helpers.resource import pod_requests, sum_requests
from draplane.scheduling.framework.plugins.node_affinity import REASON as REASON_AFFINITY
from draplane.scheduling.framework.plugins.node_resources_fit import REASON_TOO_MANY_PODS
from draplane.scheduling.framework.plugins.node_unschedulable import REASON as REASON_UNSCHEDULABLE
from draplane.scheduling.framework.runtime import node_fit
from draplane.api.core import Node, Pod


def make_node(name="n1", allocatable=None, labels=None, taints=None, unschedulable=None) -> Node:
    raw = {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"taints": taints or [], **({"unschedulable": unschedulable} if unschedulable is not None else {})},
        "status": {"allocatable": allocatable or {"cpu": "4", "memory": "8Gi", "pods": "110"}},
    }
    return msgspec.convert(raw, Node)


def make_pod(name="p", containers=None, init=None, overhead=None, **spec) -> Pod:
    raw_spec = {
        "containers": [
            {"name": f"c{i}", "resources": {"requests": r}} for i, r in enumerate(containers or [{}])
        ],
        **spec,
    }
    if init is not None:
        raw_spec["initContainers"] = [{"name": f"i{i}", "resources": {"requests": r}} for i, r in enumerate(init)]
    if overhead is not None:
        raw_spec["overhead"] = overhead
    return msgspec.convert({"metadata": {"name": name}, "spec": raw_spec}, Pod)


def test_fits_and_insufficient_cpu_memory_scalar():
    node = make_node(allocatable={"cpu": "4", "memory": "8Gi", "pods": "110", "example.com/foo": "2"})
    assert node_fit(make_pod(containers=[{"cpu": "4", "memory": "8Gi"}]), node).fits
    bound = [make_pod("b", containers=[{"cpu": "3", "memory": "1Gi", "example.com/foo": "1"}])]
    fit = node_fit(make_pod(containers=[{"cpu": "1001m", "memory": "7169Mi", "example.com/foo": "2"}]), node, bound)
    assert fit.reasons == ("Insufficient cpu", "Insufficient memory", "Insufficient example.com/foo")
    assert not fit.fits
    assert "n1: Insufficient cpu" in str(fit)


def test_unknown_scalar_resource_and_zero_request():
    node = make_node()
    assert node_fit(make_pod(containers=[{"example.com/bar": "1"}]), node).reasons == ("Insufficient example.com/bar",)
    assert node_fit(make_pod(containers=[{"example.com/bar": "0"}]), node).fits


def test_too_many_pods():
    node = make_node(allocatable={"cpu": "4", "memory": "8Gi", "pods": "2"})
    bound = [make_pod("a"), make_pod("b")]
    assert node_fit(make_pod(), node, bound).reasons == (REASON_TOO_MANY_PODS,)
    assert node_fit(make_pod(), node, bound[:1]).fits


def test_precomputed_requests_match_bound_pods():
    node = make_node()
    bound = [make_pod("b", containers=[{"cpu": "3"}])]
    pod = make_pod(containers=[{"cpu": "2"}])
    assert node_fit(pod, node, in_use=sum_requests(bound), requests=pod_requests(pod)) == node_fit(pod, node, bound)


def test_node_selector():
    node = make_node(labels={"zone": "a"})
    assert node_fit(make_pod(nodeSelector={"zone": "a"}), node).fits
    assert node_fit(make_pod(nodeSelector={"zone": "b"}), node).reasons == (REASON_AFFINITY,)
    assert node_fit(make_pod(nodeSelector={"other": "a"}), node).reasons == (REASON_AFFINITY,)


def affinity(*terms):
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


def expr(key, op, *values):
    r = {"key": key, "operator": op}
    if values:
        r["values"] = list(values)
    return r


@pytest.mark.parametrize(
    "requirement, fits",
    [
        (expr("zone", "In", "a", "b"), True),
        (expr("zone", "In", "b"), False),
        (expr("zone", "NotIn", "b"), True),
        (expr("zone", "NotIn", "a"), False),
        (expr("missing", "NotIn", "a"), True),
        (expr("zone", "Exists"), True),
        (expr("missing", "Exists"), False),
        (expr("missing", "DoesNotExist"), True),
        (expr("zone", "DoesNotExist"), False),
        (expr("gpus", "Gt", "7"), True),
        (expr("gpus", "Gt", "8"), False),
        (expr("gpus", "Lt", "9"), True),
        (expr("gpus", "Lt", "8"), False),
        (expr("zone", "Gt", "1"), False),  # label is not a number
        (expr("missing", "Lt", "1"), False),
    ],
)
def test_required_affinity_operators(requirement, fits):
    node = make_node(labels={"zone": "a", "gpus": "8"})
    pod = make_pod(affinity=affinity({"matchExpressions": [requirement]}))
    assert node_fit(pod, node).fits is fits


def test_affinity_terms_are_ored_requirements_anded_and_fields_match_name():
    node = make_node(name="gpu-7", labels={"zone": "a"})
    both = {"matchExpressions": [expr("zone", "In", "a"), expr("zone", "In", "b")]}
    by_name = {"matchFields": [expr("metadata.name", "In", "gpu-7")]}
    assert not node_fit(make_pod(affinity=affinity(both)), node).fits
    assert node_fit(make_pod(affinity=affinity(both, by_name)), node).fits
    assert not node_fit(make_pod(affinity=affinity({"matchFields": [expr("metadata.name", "NotIn", "gpu-7")]})), node).fits
    # An empty term selects nothing.
    assert not node_fit(make_pod(affinity=affinity({})), node).fits
    # nodeSelector and affinity must both hold.
    assert not node_fit(make_pod(nodeSelector={"zone": "b"}, affinity=affinity(by_name)), node).fits


@pytest.mark.parametrize(
    "requirement, message",
    [
        (expr("zone", "In"), "operator In needs at least one value"),
        (expr("zone", "Exists", "a"), "operator Exists takes no values"),
        (expr("zone", "Gt", "1", "2"), "operator Gt needs exactly one value"),
        (expr("zone", "Lt", "x"), "needs an integer value"),
        (expr("zone", "Near", "a"), "unknown operator 'Near'"),
    ],
)
def test_bad_affinity_is_reported_with_its_field(requirement, message):
    pod = make_pod(name="web", affinity=affinity({"matchExpressions": [requirement]}))
    with pytest.raises(SpecError, match=message) as err:
        node_fit(pod, make_node(labels={"zone": "a"}))
    assert "pod web: spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution" \
        ".nodeSelectorTerms[0].matchExpressions[0]" in str(err.value)


def test_bad_match_field_key():
    pod = make_pod(affinity=affinity({"matchFields": [expr("metadata.uid", "In", "x")]}))
    with pytest.raises(SpecError, match="only metadata.name"):
        node_fit(pod, make_node())


def test_taints_and_tolerations():
    taints = [
        {"key": "gpu", "value": "true", "effect": "NoSchedule"},
        {"key": "soft", "effect": "PreferNoSchedule"},
    ]
    node = make_node(taints=taints)
    assert node_fit(make_pod(), node).reasons == ("node(s) had untolerated taint {gpu: true}",)
    assert node_fit(make_pod(tolerations=[{"key": "gpu", "operator": "Equal", "value": "true"}]), node).fits
    assert node_fit(make_pod(tolerations=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}]), node).fits
    assert node_fit(make_pod(tolerations=[{"key": "gpu", "operator": "Exists"}]), node).fits
    assert node_fit(make_pod(tolerations=[{"operator": "Exists"}]), node).fits
    assert not node_fit(make_pod(tolerations=[{"key": "gpu", "value": "false"}]), node).fits
    assert not node_fit(make_pod(tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoExecute"}]), node).fits
    no_exec = make_node(taints=[{"key": "dead", "effect": "NoExecute"}])
    assert node_fit(make_pod(), no_exec).reasons == ("node(s) had untolerated taint {dead}",)


def test_unschedulable_node():
    node = make_node(unschedulable=True)
    assert node_fit(make_pod(), node).reasons == (REASON_UNSCHEDULABLE,)
    tolerant = make_pod(tolerations=[{"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}])
    assert node_fit(tolerant, node).fits


def test_all_reasons_are_reported_together_in_the_profiles_order():
    node = make_node(unschedulable=True, labels={"zone": "a"}, taints=[{"key": "k", "effect": "NoSchedule"}])
    fit = node_fit(make_pod(nodeSelector={"zone": "b"}, containers=[{"cpu": "5"}]), node)
    assert fit.reasons == (
        REASON_UNSCHEDULABLE,
        "node(s) had untolerated taint {k}",
        REASON_AFFINITY,
        "Insufficient cpu",
    )
    assert fit.plugins == ("NodeUnschedulable", "TaintToleration", "NodeAffinity", "NodeResourcesFit")
    # kube-scheduler stops at the first plugin that refuses the node, and counts only its reason
    assert fit.scheduler_reasons == (REASON_UNSCHEDULABLE,)
    tainted_only = node_fit(make_pod(nodeSelector={"zone": "b"}),
                            make_node(labels={"zone": "a"}, taints=[{"key": "k", "effect": "NoSchedule"}]))
    assert tainted_only.scheduler_reasons == ("node(s) had untolerated taint(s)",)


def ported_pod(name: str, *ports: dict, sidecar_ports: tuple = (), init_ports: tuple = ()) -> Pod:
    spec = {"containers": [{"name": "main", "ports": list(ports)}]}
    init = []
    if sidecar_ports:
        init.append({"name": "sidecar", "restartPolicy": "Always", "ports": list(sidecar_ports)})
    if init_ports:
        init.append({"name": "setup", "ports": list(init_ports)})
    if init:
        spec["initContainers"] = init
    return msgspec.convert({"metadata": {"name": name}, "spec": spec}, Pod)


def test_host_ports_are_read_as_kube_scheduler_reads_them():
    from draplane.scheduling.framework.interface import HostPort
    from draplane.scheduling.framework.plugins.node_ports import pod_host_ports

    pod = ported_pod("p", {"containerPort": 80, "hostPort": 8080}, {"containerPort": 9090},
                     {"containerPort": 53, "hostPort": 53, "protocol": "UDP", "hostIP": "10.0.0.1"},
                     sidecar_ports=({"containerPort": 15001, "hostPort": 15001},),
                     init_ports=({"containerPort": 1, "hostPort": 1},))
    # a container port with no host port holds nothing; an init container that ends holds nothing
    assert pod_host_ports(pod.spec) == (HostPort("TCP", "0.0.0.0", 15001), HostPort("TCP", "0.0.0.0", 8080),
                                        HostPort("UDP", "10.0.0.1", 53))


@pytest.mark.parametrize("held, wanted, conflict", [
    (("TCP", "0.0.0.0", 8080), ("TCP", "0.0.0.0", 8080), True),
    (("TCP", "0.0.0.0", 8080), ("UDP", "0.0.0.0", 8080), False),  # another protocol
    (("TCP", "0.0.0.0", 8080), ("TCP", "0.0.0.0", 8081), False),
    (("TCP", "10.0.0.1", 8080), ("TCP", "10.0.0.2", 8080), False),  # two IPs of the node
    (("TCP", "10.0.0.1", 8080), ("TCP", "10.0.0.1", 8080), True),
    (("TCP", "10.0.0.1", 8080), ("TCP", "0.0.0.0", 8080), True),  # every IP takes the one held
    (("TCP", "0.0.0.0", 8080), ("TCP", "10.0.0.1", 8080), True),  # held on every IP
])
def test_host_port_conflicts_as_check_conflict_decides(held, wanted, conflict):
    from draplane.scheduling.framework.interface import HostPort
    from draplane.scheduling.framework.plugins.node_ports import ports_conflict

    assert ports_conflict([HostPort(*wanted)], [HostPort(*held)]) is conflict


def test_a_host_port_taken_on_the_node_is_kube_schedulers_node_ports_reason():
    from draplane.scheduling.framework.plugins.node_ports import REASON as REASON_NODE_PORTS
    from draplane.scheduling.framework.plugins.taint_toleration import REASON as REASON_TAINTS

    first = ported_pod("first", {"containerPort": 80, "hostPort": 8080})
    second = ported_pod("second", {"containerPort": 8080, "hostPort": 8080})
    node = make_node()
    assert node_fit(second, node, [first]).reasons == (REASON_NODE_PORTS,)
    assert node_fit(second, node, [ported_pod("other", {"containerPort": 80, "hostPort": 8081})]).fits
    # NodePorts runs after TaintToleration and NodeAffinity, before NodeResourcesFit: the first to
    # reject the node is the one counted; 1.37 no longer names the taint
    tainted = make_node(taints=[{"key": "k", "effect": "NoSchedule"}])
    fit = node_fit(second, tainted, [first])
    assert fit.reasons == ("node(s) had untolerated taint {k}", REASON_NODE_PORTS)
    assert fit.scheduler_reasons == (REASON_TAINTS,) == ("node(s) had untolerated taint(s)",)
    busy = make_node(allocatable={"cpu": "1", "memory": "1Gi", "pods": "110"})
    hungry = msgspec.convert({"metadata": {"name": "h"}, "spec": {"containers": [
        {"name": "c", "ports": [{"containerPort": 1, "hostPort": 8080}], "resources": {"requests": {"cpu": "2"}}}]}}, Pod)
    fit = node_fit(hungry, busy, [first])
    assert fit.reasons == (REASON_NODE_PORTS, "Insufficient cpu") and fit.scheduler_reasons == (REASON_NODE_PORTS,)


# --- the cycle ---------------------------------------------------------------------------------


def name_affinity(*names):
    """Required node affinity whose terms each name one node."""
    return affinity(*({"matchFields": [expr("metadata.name", "In", n)]} for n in names))


def test_node_affinity_and_node_name_narrow_the_nodes_together():
    from draplane.scheduling.framework.interface import PreFilterRejected
    from draplane.scheduling.framework.runtime import named_nodes

    assert named_nodes(make_pod()) is None
    only_a = named_nodes(make_pod(affinity=name_affinity("a", "b"), nodeName="a"))
    assert only_a.nodes == {"a"} and only_a.plugins == ("NodeAffinity", "NodeName")
    assert only_a.left_out.reasons == ("node(s) didn't satisfy plugin(s) [NodeAffinity NodeName]",)
    assert named_nodes(make_pod(nodeName="c")).left_out.reasons == ("node(s) didn't satisfy plugin(s) [NodeName]",)
    with pytest.raises(PreFilterRejected, match=r"didn't satisfy plugin\(s\) \[NodeAffinity NodeName\] simultaneously"):
        named_nodes(make_pod(affinity=name_affinity("a", "b"), nodeName="c"))
    # one term naming two nodes at once: NodeAffinity's own refusal
    conflicting = affinity({"matchFields": [expr("metadata.name", "In", "a"), expr("metadata.name", "In", "b")]})
    with pytest.raises(PreFilterRejected, match="pod affinity terms conflict"):
        named_nodes(make_pod(affinity=conflicting))


def test_the_first_filter_to_refuse_names_the_node_and_node_declared_features_comes_last():
    from draplane.scheduling.framework.runtime import DEFAULT_FILTERS, Cycle

    assert DEFAULT_FILTERS[0] == "NodeName" and DEFAULT_FILTERS[-1] == "NodeDeclaredFeatures"
    needs_feature = make_pod(hostNetwork=True, hostUsers=False, containers=[{"cpu": "1"}])
    plain = make_node("plain")
    cordoned = make_node("cordoned", unschedulable=True)
    cycle = Cycle(pod=needs_feature, node_local=lambda node: node_fit(needs_feature, node), pinned=("elsewhere",))
    # NodeUnschedulable runs before, and refuses first
    assert cycle.filter_node(cordoned).plugin == "NodeUnschedulable"
    # the node lacks the feature, but the claims' node (DynamicResources) is named before it
    assert cycle.filter_node(plain).plugin == "DynamicResources"
    unpinned = Cycle(pod=needs_feature, node_local=lambda node: node_fit(needs_feature, node))
    refused = unpinned.filter_node(plain)
    assert refused.plugin == "NodeDeclaredFeatures" and unpinned.rejections == {"plain": refused}
    declared = msgspec.convert({"metadata": {"name": "ok"}, "status": {
        "allocatable": {"cpu": "4", "memory": "8Gi", "pods": "110"},
        "declaredFeatures": ["UserNamespacesHostNetworkSupport"]}}, Node)
    assert unpinned.filter_node(declared) is None


def test_a_node_named_elsewhere_runs_no_filter():
    from draplane.scheduling.framework.runtime import Cycle, named_nodes

    pod = make_pod(nodeName="n2")
    asked = []
    cycle = Cycle(pod=pod, node_local=lambda node: asked.append(node.metadata.name) or node_fit(pod, node),
                  named=named_nodes(pod))
    assert cycle.filter_node(make_node("n1", unschedulable=True)).reasons == (
        "node(s) didn't satisfy plugin(s) [NodeName]",)
    assert cycle.filter_node(make_node("n2")) is None
    assert asked == ["n2"]

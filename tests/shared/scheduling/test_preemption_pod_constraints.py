"""Preemption for what other pods hold, as kube-scheduler's: with each trial set of victims gone,
the filters that read other pods (NodePorts, InterPodAffinity, PodTopologySpread) are run again on
the node, so the pod that holds the port or the anti-affinity is evicted, and only it; a refusal
no eviction cures (the pod's own required affinity, a missing topology label) evicts nobody."""

from __future__ import annotations

import msgspec

from draplane.api.core import Affinity, ContainerPort, NodeSpec, TopologySpreadConstraint
from draplane.api.policy import LabelSelector
from draplane.scheduling.placing import NotPlaced, SchedulingState
from draplane.scheduling.preemption import NoPreemption, PreemptionPlan
from draplane.simulation import scenario
from scheduling_builders import bind_where_placed

ZONE = "topology.kubernetes.io/zone"


def with_uid(obj, uid):
    obj.metadata.uid = uid
    return obj


def cluster(nodes: dict[str, dict]) -> SchedulingState:
    """Nodes of 2 GPUs each, with these labels."""
    state = SchedulingState()
    state.set_class(scenario.device_class("gpu.nvidia.com"))
    for name, labels in nodes.items():
        state.set_node(scenario.gpu_node(name, labels={"kubernetes.io/hostname": name, **labels}))
        state.set_feed_entry(f"node.{name}", [scenario.gpu_slice(name, 2, "80Gi")])
    return state


def run(state: SchedulingState, name: str, node: str, *, priority: int = 0, labels=None, port: int | None = None,
        anti_affinity_to: str | None = None):
    """A one-GPU pod bound on `node` (its claim allocated there, as the binder leaves it)."""
    claim = with_uid(scenario.claim("ns", f"{name}-gpu", "gpu.nvidia.com"), f"c-{name}")
    pod = with_uid(scenario.pod("ns", name, claim_name=claim.metadata.name), f"p-{name}")
    pod.metadata.labels = labels or {}
    pod.spec.priority = priority
    pod.spec.node_selector = {"kubernetes.io/hostname": node}
    if port is not None:
        pod.spec.containers[0].ports = [ContainerPort(container_port=80, host_port=port)]
    if anti_affinity_to is not None:
        pod.spec.affinity = anti_affinity(anti_affinity_to)
    bind_where_placed(state, pod, claim, node)


def anti_affinity(app: str, key: str = "kubernetes.io/hostname") -> Affinity:
    return msgspec.convert({"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": key, "labelSelector": {"matchLabels": {"app": app}}}]}}, Affinity)


def urgent(name: str = "urgent", *, labels=None, port: int | None = None, affinity: Affinity | None = None,
           spread: list[TopologySpreadConstraint] | None = None):
    claim = with_uid(scenario.claim("ns", f"{name}-gpu", "gpu.nvidia.com"), f"c-{name}")
    pod = with_uid(scenario.pod("ns", name, claim_name=claim.metadata.name), f"p-{name}")
    pod.metadata.labels = labels or {}
    pod.spec.priority = 1000
    if port is not None:
        pod.spec.containers[0].ports = [ContainerPort(container_port=80, host_port=port)]
    pod.spec.affinity = affinity
    pod.spec.topology_spread_constraints = spread
    return pod, claim


def plan_for(state: SchedulingState, pod, claim):
    assert isinstance(state.place_pod(pod, [claim]), NotPlaced)
    return state.preemption_for(pod, [claim])


def test_the_holder_of_a_host_port_is_evicted_and_only_it():
    state = cluster({"n1": {}})
    run(state, "web", "n1", port=8080)
    run(state, "batch", "n1")  # the node's second GPU: nothing else free
    # room for the GPU but not the port: evicting batch would not help; web holds the port and a GPU
    pod, claim = urgent(port=8080)
    plan = plan_for(state, pod, claim)
    assert isinstance(plan, PreemptionPlan), plan
    assert [v.name for v in plan.victims] == ["web"]


def test_a_pod_whose_anti_affinity_a_running_pod_breaks_evicts_that_pod():
    state = cluster({"n1": {}})
    run(state, "db", "n1", labels={"app": "db"})
    pod, claim = urgent(labels={"app": "web"}, affinity=anti_affinity("db"))
    plan = plan_for(state, pod, claim)  # a GPU is free: only db's presence refuses the node
    assert isinstance(plan, PreemptionPlan), plan
    assert [v.name for v in plan.victims] == ["db"]


def test_a_running_pods_anti_affinity_against_the_pod_evicts_the_running_pod():
    state = cluster({"n1": {}})
    run(state, "loner", "n1", labels={"app": "loner"}, anti_affinity_to="web")
    run(state, "other", "n1", labels={"app": "other"})
    pod, claim = urgent(labels={"app": "web"})
    plan = plan_for(state, pod, claim)
    assert isinstance(plan, PreemptionPlan), plan
    assert [v.name for v in plan.victims] == ["loner"]  # other frees the GPU too, but loner must go anyway


def test_anti_affinity_held_in_the_zone_by_a_pod_on_another_node_evicts_nobody_here():
    state = cluster({"n1": {ZONE: "a"}, "n2": {ZONE: "a"}})
    run(state, "db", "n2", labels={"app": "db"})
    run(state, "fill", "n1")
    run(state, "fill2", "n1")
    pod, claim = urgent(labels={"app": "web"}, affinity=anti_affinity("db", ZONE))
    plan = plan_for(state, pod, claim)
    # on n2, db itself goes (it is the refusal, and frees a GPU); on n1, evicting its pods leaves
    # db in the zone: no plan there
    assert isinstance(plan, PreemptionPlan) and plan.node == "n2", plan
    assert [v.name for v in plan.victims] == ["db"]


def test_a_spread_skew_is_cured_by_evicting_a_matching_pod_from_the_crowded_domain():
    state = cluster({"a1": {ZONE: "a"}, "b1": {ZONE: "b"}})
    state.set_node(_cordoned("b1", ZONE, "b"))
    run(state, "web-0", "a1", labels={"app": "web"})
    constraint = TopologySpreadConstraint(max_skew=1, topology_key=ZONE, when_unsatisfiable="DoNotSchedule",
                                          label_selector=LabelSelector(match_labels={"app": "web"}))
    pod, claim = urgent(labels={"app": "web"}, spread=[constraint])
    plan = plan_for(state, pod, claim)  # zone a would hold 2, zone b 0 (b1 is cordoned)
    assert isinstance(plan, PreemptionPlan) and plan.node == "a1", plan
    assert [v.name for v in plan.victims] == ["web-0"]


def _cordoned(name: str, key: str, value: str):
    node = scenario.gpu_node(name, labels={"kubernetes.io/hostname": name, key: value})
    return msgspec.structs.replace(node, spec=NodeSpec(unschedulable=True))


def test_the_pods_own_required_affinity_is_not_helped_by_evicting_anyone():
    state = cluster({"n1": {}})
    run(state, "fill", "n1")
    run(state, "fill2", "n1")
    affinity = msgspec.convert({"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "cache"}}}]}}, Affinity)
    pod, claim = urgent(labels={"app": "web"}, affinity=affinity)
    plan = plan_for(state, pod, claim)
    assert isinstance(plan, NoPreemption), plan
    assert plan.reason == "preemption: 0/1 nodes are available: 1 Preemption is not helpful for scheduling.", plan.reason


def test_the_hold_for_a_preemptor_is_not_refused_for_the_port_or_anti_affinity_its_victims_hold():
    """In the node's reservation entry, the victims still hold their port and their anti-affinity
    until they go: the preemptor's hold (nominate) passes over them, and over nobody else's."""
    import pytest

    from draplane.scheduling.framework.interface import HostPort
    from draplane.scheduling import reservation_protocol as protocol
    from draplane.scheduling import reservations as rv

    def pod_reservation(uid: str, **extra) -> rv.PodReservation:
        return rv.PodReservation(pod_uid=uid, pod_namespace="ns", pod_name=uid, requests={}, reserved_at=0.0,
                                 expires_at=100.0, **extra)

    port = [HostPort(ip="0.0.0.0", protocol="TCP", port=8080)]
    loner = pod_reservation("loner", labels={"app": "loner"},
                            anti_affinity=list(anti_affinity("web").pod_anti_affinity
                                               .required_during_scheduling_ignored_during_execution))
    entry = rv.NodeReservations(node="n1", pods={"holder": pod_reservation("holder", host_ports=port), "loner": loner})
    preemptor = pod_reservation("urgent", host_ports=port, labels={"app": "web"})
    for victims, refused in (((), True), (("holder",), True), (("loner",), True), (("holder", "loner"), False)):
        step = lambda: protocol.nominate(entry, [], preemptor, [], 10.0, lambda uid: False, victim_pods=victims)  # noqa: E731
        if refused:
            with pytest.raises(rv.ReservationConflict):
                step()
        else:
            assert "urgent" in step().entry.pods

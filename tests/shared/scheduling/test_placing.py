"""The shard's pure core on the seed scenario: nodes with 24, 40 and 80 GiB GPUs."""

import time

import msgspec

from draplane.api.resource import ResourceClaimStatus
from draplane.scheduling import reservations as rv
from draplane.simulation import scenario
from draplane.scheduling.unschedulable import FailureReason
from draplane.scheduling.placing import SchedulingState, NotPlaced, Placed


def seed_state() -> SchedulingState:
    state = SchedulingState()
    state.set_class(scenario.device_class("high-memory-gpu", scenario.HIGH_MEMORY_EXPRESSION))
    for name, memory in (("node-24", "24Gi"), ("node-40", "40Gi"), ("node-80", "80Gi")):
        state.set_node(scenario.gpu_node(name))
        state.set_feed_entry(f"node.{name}", [scenario.gpu_slice(name, 1, memory)])
    return state


def with_uid(obj, uid):
    obj.metadata.uid = uid
    return obj


def test_seed_claim_goes_to_the_gpu_over_40gi():
    state = seed_state()
    claim = with_uid(scenario.claim("ns", "vllm-gpu-claim", "high-memory-gpu"), "c1")
    pod = with_uid(scenario.pod("ns", "vllm", claim_name="vllm-gpu-claim"), "p1")
    placed = state.place_pod(pod, [claim])
    assert isinstance(placed, Placed), placed
    assert placed.node == "node-80" and placed.new_claims == ["c1"]
    (result,) = placed.allocations["c1"].devices.results
    assert (result.request, result.driver, result.pool, result.device) == ("gpu", "gpu.nvidia.com", "node-80", "gpu-0")
    terms = placed.allocations["c1"].node_selector.node_selector_terms
    assert terms[0].match_fields[0].key == "metadata.name" and terms[0].match_fields[0].values == ["node-80"]


def test_a_reserved_device_is_taken_and_the_reason_says_so_per_node():
    state = seed_state()
    first = with_uid(scenario.claim("ns", "a", "high-memory-gpu"), "c1")
    placed = state.place_pod(with_uid(scenario.pod("ns", "p", claim_name="a"), "p1"), [first])
    reservation = rv.Reservation(
        claim_uid="c1", claim_namespace="ns", claim_name="a", pod_uid="p1",
        devices=rv.devices_of(placed.allocations["c1"]), allocation=placed.allocations["c1"],
        reserved_at=time.time(), expires_at=time.time() + 30,
    )
    state.set_reservations("node-80", rv.add(rv.NodeReservations(node="node-80"), [reservation]))
    second = with_uid(scenario.claim("ns", "b", "high-memory-gpu"), "c2")
    outcome = state.place_pod(with_uid(scenario.pod("ns", "q", claim_name="b"), "p2"), [second])
    assert isinstance(outcome, NotPlaced)
    reasons = {f.node: f.reason for f in outcome.failures}
    assert reasons["node-80"] == FailureReason.CAPACITY_EXHAUSTED.value
    assert reasons["node-24"] == FailureReason.NO_MATCHING_DEVICE.value
    assert outcome.message == (
        "0/3 nodes are available: 1 cannot allocate all claims: resourceclaim ns/b, request gpu: capacity exhausted "
        "(too few matching devices are free), 2 cannot allocate all claims: resourceclaim ns/b, request gpu: no device "
        "matches the device class.")
    # the reservation is released: the device is free again
    state.set_reservations("node-80", rv.NodeReservations(node="node-80"))
    assert isinstance(state.place_pod(with_uid(scenario.pod("ns", "q", claim_name="b"), "p2"), [second]), Placed)


def test_a_reservation_turning_into_the_claims_status_leaves_the_nodes_caches_alone():
    state = seed_state()
    claim = with_uid(scenario.claim("ns", "a", "high-memory-gpu"), "c1")
    placed = state.place_pod(with_uid(scenario.pod("ns", "p", claim_name="a"), "p1"), [claim])
    allocation = placed.allocations["c1"]
    reservation = rv.Reservation(claim_uid="c1", claim_namespace="ns", claim_name="a", pod_uid="p1",
                                 devices=rv.devices_of(allocation), allocation=allocation,
                                 reserved_at=time.time(), expires_at=time.time() + 30)
    state.set_reservations("node-80", rv.add(rv.NodeReservations(node="node-80"), [reservation]))
    stamp = state.devices._stamp("node-80")
    # the binder writes the allocation with the time it was made (kube-scheduler's allocationTimestamp)
    claim.status = ResourceClaimStatus(allocation=msgspec.structs.replace(
        allocation, allocation_timestamp="2026-12-07T05:00:00Z"))
    state.set_claim(claim)
    assert state.devices._stamp("node-80") == stamp  # the same devices: nothing to search again
    other = with_uid(scenario.claim("ns", "b", "high-memory-gpu"), "c2")
    assert isinstance(state.place_pod(with_uid(scenario.pod("ns", "q", claim_name="b"), "p2"), [other]), NotPlaced)
    claim.status = None  # deallocated: the devices are free (and the node searched again)
    state.set_claim(claim)
    state.set_reservations("node-80", rv.NodeReservations(node="node-80"))
    assert state.devices._stamp("node-80") != stamp
    assert isinstance(state.place_pod(with_uid(scenario.pod("ns", "q", claim_name="b"), "p2"), [other]), Placed)


def test_a_device_allocated_by_someone_else_is_never_reused():
    state = seed_state()
    theirs = with_uid(scenario.claim("ns", "theirs", "high-memory-gpu"), "t1")
    placed = state.place_pod(with_uid(scenario.pod("ns", "x", claim_name="theirs"), "px"), [theirs])
    theirs.status = ResourceClaimStatus(allocation=placed.allocations["t1"])
    state.set_claim(theirs)
    mine = with_uid(scenario.claim("ns", "mine", "high-memory-gpu"), "m1")
    assert isinstance(state.place_pod(with_uid(scenario.pod("ns", "y", claim_name="mine"), "py"), [mine]), NotPlaced)


def test_node_fit_and_claim_errors():
    state = seed_state()
    claim = with_uid(scenario.claim("ns", "c", "high-memory-gpu"), "c1")
    big = with_uid(scenario.pod("ns", "big", claim_name="c", cpu="1000"), "p1")
    outcome = state.place_pod(big, [claim])
    assert isinstance(outcome, NotPlaced)
    assert {f.reason for f in outcome.failures if f.node == "node-80"} == {FailureReason.NODE_DOES_NOT_FIT.value}
    assert "Insufficient cpu" in outcome.message
    unknown = with_uid(scenario.claim("ns", "u", "no-such-class"), "u1")
    outcome = state.place_pod(with_uid(scenario.pod("ns", "p", claim_name="u"), "p2"), [unknown])
    assert isinstance(outcome, NotPlaced) and "no-such-class" in outcome.claim_error


def _cpu_poor_and_rich_t4_nodes(policy) -> SchedulingState:
    """Two 2-GPU T4 nodes alike but for CPU: a-poor 10 CPUs, b-rich 64."""
    from draplane.simulation.trace import TraceNode, gpu_device_class, node_objects

    state = SchedulingState(policy=policy)
    state.set_class(gpu_device_class())
    for trace_node in (TraceNode("a-poor", 10000, 65536, 2, "T4"), TraceNode("b-rich", 64000, 65536, 2, "T4")):
        node, slice_ = node_objects(trace_node)
        state.set_node(node)
        state.set_feed_entry(f"node.{trace_node.name}", [slice_])
    return state


def test_draplane_sends_a_cpu_heavy_gpu_pod_where_cpu_can_still_feed_the_gpus():
    """The stranding term reaches the shard's core: on the CPU-poor node the pod would leave a GPU
    that the remaining CPU cannot feed at the ratio of the GPU pods seen so far. The device score
    alone (the base policy) ties the two nodes and takes the first by name."""
    from draplane.allocation.fragmentation import FragmentationAwareDraplane
    from draplane.allocation.scoring import DraplanePolicy
    from draplane.simulation.trace import TracePod, pod_objects

    chosen = {}
    for label, policy in (("base", DraplanePolicy()), ("draplane", FragmentationAwareDraplane())):
        if label == "draplane":
            for _ in range(10):  # earlier GPU pods: 2 CPUs and 4 GiB per GPU
                policy.observe_requests(2000, 4 << 30, 1000.0)
        state = _cpu_poor_and_rich_t4_nodes(policy)
        pod, claim = pod_objects(TracePod("heavy", 9000, 4096, 1, 1000))
        placed = state.place_pod(with_uid(pod, "p1"), [with_uid(claim, "c1")])
        assert isinstance(placed, Placed), placed
        chosen[label] = placed.node
    assert chosen == {"base": "a-poor", "draplane": "b-rich"}


def test_the_stranding_term_never_picks_a_node_the_pod_does_not_fit():
    from draplane.allocation.fragmentation import FragmentationAwareDraplane
    from draplane.simulation.trace import TracePod, pod_objects

    policy = FragmentationAwareDraplane()
    policy.observe_requests(2000, 4 << 30, 1000.0)
    state = _cpu_poor_and_rich_t4_nodes(policy)
    state.assume_pod("other", "b-rich", {"cpu": 60000, "memory": 1 << 30})  # b-rich: 4 CPUs left
    pod, claim = pod_objects(TracePod("heavy", 9000, 4096, 1, 1000))
    placed = state.place_pod(with_uid(pod, "p1"), [with_uid(claim, "c1")])
    assert isinstance(placed, Placed) and placed.node == "a-poor"
    pod, claim = pod_objects(TracePod("huge", 12000, 4096, 1, 1000))
    assert isinstance(state.place_pod(with_uid(pod, "p2"), [with_uid(claim, "c2")]), NotPlaced)


def test_pods_reserved_by_another_shard_count_against_the_node_cpu():
    """Node fit across shards: the CPU of pods placed by another shard and not bound yet is in the
    node's reservation entry, and counts like a bound pod's (each pod once)."""
    state = SchedulingState()
    state.set_node(scenario.gpu_node("small", cpu="4"))
    pod = with_uid(scenario.pod("ns", "p", cpu="3"), "mine")
    assert isinstance(state.place_pod(pod, []), Placed)
    other = rv.PodReservation(pod_uid="theirs", pod_namespace="ns", pod_name="theirs", requests={"cpu": 2000},
                              reserved_at=0.0, expires_at=time.time() + 30)
    state.set_reservations("small", rv.add(rv.NodeReservations(node="small"), [], other))
    outcome = state.place_pod(pod, [])
    assert isinstance(outcome, NotPlaced) and "Insufficient cpu" in outcome.message
    # bound now, and seen by the pod watch too: still counted once
    bound = with_uid(scenario.pod("ns", "theirs", cpu="2"), "theirs")
    bound.spec.node_name = "small"
    state.set_pod(bound)
    assert isinstance(state.place_pod(with_uid(scenario.pod("ns", "q", cpu="2"), "q"), []), Placed)
    # the reservation lapsed: the bound pod alone holds its CPU
    state.set_reservations("small", rv.NodeReservations(node="small"))
    assert isinstance(state.place_pod(pod, []), NotPlaced)
    assert isinstance(state.place_pod(with_uid(scenario.pod("ns", "q", cpu="2"), "q"), []), Placed)


def test_a_lapsed_pod_reservation_no_longer_takes_cpu():
    state = SchedulingState()
    state.set_node(scenario.gpu_node("small", cpu="4"))
    lapsed = rv.PodReservation(pod_uid="gone", pod_namespace="ns", pod_name="gone", requests={"cpu": 3000},
                               reserved_at=0.0, expires_at=time.time() - 1)
    state.set_reservations("small", rv.add(rv.NodeReservations(node="small"), [], lapsed))
    assert isinstance(state.place_pod(with_uid(scenario.pod("ns", "p", cpu="3"), "p"), []), Placed)


def eight_gpu_nodes(count: int = 4) -> SchedulingState:
    state = SchedulingState()
    state.set_class(scenario.device_class("gpu.nvidia.com"))
    for i in range(count):
        name = f"node-{i}"
        state.set_node(scenario.gpu_node(name, cpu="64", labels={"pool": "big" if i == 0 else "small"}))
        state.set_feed_entry(f"node.{name}", [scenario.gpu_slice(name, 8, "80Gi")])
    return state


def test_nine_gpus_on_eight_gpu_nodes_is_not_enough_devices_on_every_node():
    state = eight_gpu_nodes()
    claim = with_uid(scenario.claim("ns", "nine", "gpu.nvidia.com", count=9), "c9")
    outcome = state.place_pod(with_uid(scenario.pod("ns", "p", claim_name="nine"), "p9"), [claim])
    assert isinstance(outcome, NotPlaced)
    assert outcome.message == ("0/4 nodes are available: 4 cannot allocate all claims: resourceclaim ns/nine, "
                               "request gpu: not enough devices.")
    assert {f.reason for f in outcome.failures} == {FailureReason.CAPACITY_EXHAUSTED.value}
    assert "8 of 8 devices match the selectors of device class gpu.nvidia.com, 9 needed" in outcome.failures[0].detail


def test_cpu_bound_second_pod_gets_kube_schedulers_message():
    state = eight_gpu_nodes()
    first = with_uid(scenario.pod("ns", "a", claim_name="a", cpu="40"), "pa")
    first.spec.node_selector = {"pool": "big"}
    placed = state.place_pod(first, [with_uid(scenario.claim("ns", "a", "gpu.nvidia.com"), "ca")])
    assert isinstance(placed, Placed) and placed.node == "node-0"
    state.assume_pod("pa", placed.node, placed.requests)
    second = with_uid(scenario.pod("ns", "b", claim_name="b", cpu="40"), "pb")
    second.spec.node_selector = {"pool": "big"}
    outcome = state.place_pod(second, [with_uid(scenario.claim("ns", "b", "gpu.nvidia.com"), "cb")])
    assert outcome.message == ("0/4 nodes are available: 1 Insufficient cpu, "
                               "3 node(s) didn't match Pod's node affinity/selector.")


def test_nodes_the_selector_excludes_are_reported_by_node_fit_not_by_devices():
    state = eight_gpu_nodes()
    state.set_node(scenario.gpu_node("cpu-only", labels={"pool": "small"}))  # no devices at all
    pod = with_uid(scenario.pod("ns", "p", claim_name="nine"), "p9")
    pod.spec.node_selector = {"pool": "big"}
    outcome = state.place_pod(pod, [with_uid(scenario.claim("ns", "nine", "gpu.nvidia.com", count=9), "c9")])
    assert outcome.message == ("0/5 nodes are available: 1 cannot allocate all claims: resourceclaim ns/nine, "
                               "request gpu: not enough devices, 4 node(s) didn't match Pod's node affinity/selector.")
    assert len(outcome.failures) == 5


def test_an_allocation_error_on_one_node_ends_the_attempt_as_kube_schedulers_filter_error_does():
    # An `All` request on a node whose pool is being updated: Kubernetes' allocator errors with
    # the pool's name, and kube-scheduler's DynamicResources Filter returns that error, which
    # ends the pod's attempt (SchedulerError, backoff) although another node would fit.
    state = SchedulingState()
    state.set_class(scenario.device_class("gpu"))
    state.set_node(scenario.gpu_node("node-a"))
    half = scenario.gpu_slice("node-a", 2, "80Gi")
    half.spec.pool.resource_slice_count = 2
    state.set_feed_entry("node.node-a", [half])
    state.set_node(scenario.gpu_node("node-b"))
    state.set_feed_entry("node.node-b", [scenario.gpu_slice("node-b", 2, "80Gi")])
    claim = with_uid(scenario.claim("ns", "all-gpus", "gpu"), "c1")
    claim.spec.devices.requests[0].exactly.count = None
    claim.spec.devices.requests[0].exactly.allocation_mode = "All"
    pod = with_uid(scenario.pod("ns", "p", claim_name="all-gpus"), "p1")
    placed = state.place_pod(pod, [claim])
    assert isinstance(placed, NotPlaced) and placed.scheduler_error and placed.claim_error
    assert placed.message == (
        'running "DynamicResources" filter plugin: ResourceClaim ns/all-gpus: '
        "spec.devices.requests[0].exactly: asks for all devices, but resource pool gpu.nvidia.com/node-a "
        "is currently being updated")
    # a node the other filters rule out is never asked, so its error does not count
    pod.spec.node_selector = {"kubernetes.io/hostname": "node-b"}
    placed = state.place_pod(pod, [claim])
    assert isinstance(placed, Placed) and placed.node == "node-b"


def test_node_fit_answers_kept_per_pod_shape_go_stale_when_the_node_or_its_pods_change():
    """Node fit is remembered per (what of the pod it reads, node) until the node's Node object or
    its pods change: a pod going, a cordon, a pod asking differently each get a fresh answer."""
    from draplane.api.core import NodeSpec, Taint, Toleration

    state = SchedulingState()
    state.set_node(scenario.gpu_node("small", cpu="4"))

    def pod(uid: str, cpu: str = "3"):
        return with_uid(scenario.pod("ns", uid, cpu=cpu), uid)

    placed = state.place_pod(pod("a"), [])
    assert isinstance(placed, Placed)
    state.assume_pod("a", placed.node, placed.requests)
    assert isinstance(state.place_pod(pod("b"), []), NotPlaced)  # full: remembered for this shape
    assert isinstance(state.place_pod(pod("c", cpu="1"), []), Placed)  # another shape, its own answer
    state.forget_pod("a")
    assert isinstance(state.place_pod(pod("b"), []), Placed)  # the pod went: asked again
    cordoned = scenario.gpu_node("small", cpu="4")
    cordoned.spec = NodeSpec(taints=[Taint(key="maintenance", effect="NoSchedule")])
    state.set_node(cordoned)
    assert isinstance(state.place_pod(pod("b"), []), NotPlaced)  # a new Node object: asked again
    tolerant = pod("d")
    tolerant.spec.tolerations = [Toleration(key="maintenance", operator="Exists", effect="NoSchedule")]
    assert isinstance(state.place_pod(tolerant, []), Placed)  # tolerations are part of the shape


def four_gpus_and_four_nics(taken: int = 0) -> SchedulingState:
    """One node: 4 GPUs, two per PCIe root, and 4 NICs of another driver; `taken` GPUs allocated."""
    from draplane.api.meta import ObjectMeta
    from draplane.api.resource import Device, ResourcePool, ResourceSlice, ResourceSliceSpec

    state = SchedulingState()
    state.set_class(scenario.device_class("gpu.nvidia.com"))
    state.set_node(scenario.gpu_node("l4-0"))
    nics = ResourceSlice(metadata=ObjectMeta(name="l4-0-nic"), spec=ResourceSliceSpec(
        driver="nic.example.com", pool=ResourcePool(name="l4-0", generation=1, resource_slice_count=1),
        node_name="l4-0", devices=[Device(name=f"nic-{i}") for i in range(4)]))
    state.set_feed_entry("node.l4-0", [scenario.gpu_slice("l4-0", 4, "24Gi"), nics])
    for i in range(taken):
        held = with_uid(scenario.claim("ns", f"held-{i}", "gpu.nvidia.com"), f"h{i}")
        placed = state.place_pod(with_uid(scenario.pod("ns", f"holder-{i}", claim_name=f"held-{i}"), f"ph{i}"), [held])
        held.status = ResourceClaimStatus(allocation=placed.allocations[f"h{i}"])
        state.set_claim(held)
    return state


def test_too_few_free_is_not_all_in_use_and_counts_only_matching_devices():
    state = four_gpus_and_four_nics(taken=1)
    claim = with_uid(scenario.claim("ns", "four", "gpu.nvidia.com", count=4), "c4")
    outcome = state.place_pod(with_uid(scenario.pod("ns", "p", claim_name="four"), "p4"), [claim])
    assert isinstance(outcome, NotPlaced)
    (failure,) = outcome.failures
    assert failure.reason == FailureReason.CAPACITY_EXHAUSTED.value
    assert "3 of 4 matching devices are free, 4 needed" in failure.detail  # not "of 8": the NICs are no GPUs
    assert outcome.message == ("0/1 nodes are available: 1 cannot allocate all claims: resourceclaim ns/four, "
                               "request gpu: capacity exhausted (too few matching devices are free).")


def test_a_constraint_no_group_of_devices_can_meet_says_so_whatever_is_in_use():
    from draplane.api.resource import DeviceConstraint

    for taken, kind, attribute in ((0, "match", "resource.kubernetes.io/pcieRoot"), (1, "match", "resource.kubernetes.io/pcieRoot"),
                                   (1, "distinct", "productName")):
        state = four_gpus_and_four_nics(taken=taken)
        claim = with_uid(scenario.claim("ns", "four", "gpu.nvidia.com", count=4 if kind == "match" else 2), "c4")
        claim.spec.devices.constraints = [DeviceConstraint(**{f"{kind}_attribute": f"gpu.nvidia.com/{attribute}"
                                                               if "/" not in attribute else attribute})]
        outcome = state.place_pod(with_uid(scenario.pod("ns", "p", claim_name="four"), "p4"), [claim])
        assert isinstance(outcome, NotPlaced)
        (failure,) = outcome.failures
        assert failure.reason == FailureReason.CONSTRAINT_FAILED.value, (taken, kind, failure)
        if kind == "match":
            assert ("matchAttribute resource.kubernetes.io/pcieRoot: at most 2 of the node's 4 matching devices share "
                    "one value, 4 needed") in failure.detail
        else:
            assert ("distinctAttribute gpu.nvidia.com/productName: the node's 4 matching devices have 1 distinct "
                    "values, 2 needed") in failure.detail
        assert "no combination of devices satisfies the claim's constraints" in outcome.message
    # two under one root fit, and the constraint is not blamed when only usage is in the way
    state = four_gpus_and_four_nics(taken=3)
    claim = with_uid(scenario.claim("ns", "two", "gpu.nvidia.com", count=2), "c2")
    claim.spec.devices.constraints = [DeviceConstraint(match_attribute="resource.kubernetes.io/pcieRoot")]
    outcome = state.place_pod(with_uid(scenario.pod("ns", "p", claim_name="two"), "p2"), [claim])
    assert isinstance(outcome, NotPlaced) and outcome.failures[0].reason == FailureReason.CAPACITY_EXHAUSTED.value


def test_devices_tainted_by_a_rule_are_their_own_class_of_failure():
    from draplane.api.meta import ObjectMeta
    from draplane.api.resource import DeviceTaint, DeviceTaintRule, DeviceTaintRuleSpec, DeviceTaintSelector

    state = four_gpus_and_four_nics()
    state.set_taint_rules([DeviceTaintRule(metadata=ObjectMeta(name="maintenance"), spec=DeviceTaintRuleSpec(
        device_selector=DeviceTaintSelector(driver="gpu.nvidia.com", pool="l4-0"),
        taint=DeviceTaint(key="example.com/maintenance", effect="NoSchedule")))])
    claim = with_uid(scenario.claim("ns", "one", "gpu.nvidia.com"), "c1")
    outcome = state.place_pod(with_uid(scenario.pod("ns", "p", claim_name="one"), "p1"), [claim])
    assert isinstance(outcome, NotPlaced)
    assert outcome.failures[0].reason == FailureReason.DEVICES_TAINTED.value
    assert FailureReason.DEVICES_TAINTED.words == "matching devices are tainted (and the request does not tolerate it)"
    assert "matching devices have taints the request does not tolerate" in outcome.message


def test_a_host_port_held_on_a_node_bound_or_reserved_keeps_the_next_pod_off_it():
    import msgspec

    from draplane.api.core import Pod

    def web(name: str, node: str | None = None) -> Pod:
        pod = msgspec.convert({"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}"}, "spec": {
            "schedulerName": "draplane", "nodeName": node,
            "containers": [{"name": "web", "ports": [{"containerPort": 80, "hostPort": 8080}]}]}}, Pod)
        return pod

    state = eight_gpu_nodes(2)
    state.set_pod(web("bound", "node-0"))  # bound there, from the cluster feed
    placed = state.place_pod(web("second"), [])
    assert isinstance(placed, Placed) and placed.node == "node-1"
    # reserved on node-1 by some shard, not bound yet: its port is held all the same
    entry = rv.add(rv.NodeReservations(node="node-1"), [], rv.PodReservation(
        pod_uid="u-second", pod_namespace="ns", pod_name="second", requests=placed.requests,
        reserved_at=time.time(), expires_at=time.time() + 30, host_ports=[rv.HostPort("TCP", "0.0.0.0", 8080)]))
    state.set_reservations("node-1", entry)
    outcome = state.place_pod(web("third"), [])
    assert isinstance(outcome, NotPlaced)
    assert outcome.message == "0/2 nodes are available: 2 node(s) didn't have free ports for the requested pod ports."
    # the pod's own reservation does not count against it (a redelivered placement)
    again = state.place_pod(web("second"), [])
    assert isinstance(again, Placed) and again.node == "node-1"
    # a commit built on an entry that holds the port is refused, as a device taken twice is
    try:
        rv.add(entry, [], rv.PodReservation(pod_uid="u-third", pod_namespace="ns", pod_name="third", requests={},
                                            reserved_at=time.time(), expires_at=time.time() + 30,
                                            host_ports=[rv.HostPort("TCP", "0.0.0.0", 8080)]))
    except rv.ReservationConflict as exc:
        assert "host port" in str(exc) and "node-1" in str(exc)
    else:
        raise AssertionError("the same host port reserved twice on one node")
    # the lease runs out: the port is free again
    state.set_reservations("node-1", rv.NodeReservations(node="node-1"))
    assert state.place_pod(web("third"), []).node == "node-1"


def test_a_pod_deleted_while_its_lease_runs_holds_nothing_any_more():
    import msgspec

    from draplane.api.core import Pod

    state = eight_gpu_nodes(1)
    pod = msgspec.convert({"metadata": {"name": "web", "namespace": "ns", "uid": "u-web"}, "spec": {
        "nodeName": "node-0", "containers": [{"name": "web", "resources": {"requests": {"cpu": "60"}},
                                              "ports": [{"containerPort": 80, "hostPort": 8080}]}]}}, Pod)
    entry = rv.add(rv.NodeReservations(node="node-0"), [], rv.PodReservation(
        pod_uid="u-web", pod_namespace="ns", pod_name="web", requests={"cpu": 60_000},
        reserved_at=time.time(), expires_at=time.time() + 30, host_ports=[rv.HostPort("TCP", "0.0.0.0", 8080)]))
    state.set_reservations("node-0", entry)
    state.set_pod(pod)
    other = msgspec.convert({"metadata": {"name": "next", "namespace": "ns", "uid": "u-next"}, "spec": {
        "containers": [{"name": "web", "resources": {"requests": {"cpu": "60"}},
                        "ports": [{"containerPort": 80, "hostPort": 8080}]}]}}, Pod)
    outcome = state.place_pod(other, [])
    assert isinstance(outcome, NotPlaced) and "free ports" in outcome.message
    state.set_pod(pod, deleted=True)  # its reservation is still in the entry, for 30 s more
    assert state.place_pod(other, []).node == "node-0"


def test_replicas_with_hostname_anti_affinity_land_on_distinct_nodes_reserved_or_bound():
    import msgspec

    from draplane.api.core import Pod

    def replica(i: int) -> tuple[Pod, object]:
        pod = msgspec.convert({"metadata": {"name": f"web-{i}", "namespace": "ns", "uid": f"u{i}",
                                            "labels": {"app": "web"}},
                               "spec": {"containers": [{"name": "c"}], "affinity": {"podAntiAffinity": {
                                   "requiredDuringSchedulingIgnoredDuringExecution": [
                                       {"topologyKey": "kubernetes.io/hostname",
                                        "labelSelector": {"matchLabels": {"app": "web"}}}]}}}}, Pod)
        claim = with_uid(scenario.claim("ns", f"gpu-{i}", "gpu.nvidia.com"), f"c{i}")
        return pod, claim

    state = eight_gpu_nodes(2)
    nodes = []
    for i in range(2):
        pod, claim = replica(i)
        placed = state.place_pod(pod, [claim])
        assert isinstance(placed, Placed), placed
        nodes.append(placed.node)
        # as the shard commits it: the pod reserved in the node's entry, with its labels and terms
        entry = rv.add(
            rv.NodeReservations(node=placed.node, claims=dict(state_entry_claims(state, placed.node))), [],
            rv.PodReservation(pod_uid=f"u{i}", pod_namespace="ns", pod_name=f"web-{i}", requests=placed.requests,
                              reserved_at=time.time(), expires_at=time.time() + 30, labels={"app": "web"},
                              anti_affinity=list(pod.spec.affinity.pod_anti_affinity
                                                 .required_during_scheduling_ignored_during_execution)))
        state.set_reservations(placed.node, entry)
    assert sorted(nodes) == ["node-0", "node-1"]
    pod, claim = replica(2)
    outcome = state.place_pod(pod, [claim])
    assert isinstance(outcome, NotPlaced)
    assert outcome.message == "0/2 nodes are available: 2 node(s) didn't match pod anti-affinity rules."
    # a commit built on an entry that holds web-1 is refused there, whatever the placing view said
    try:
        rv.add(entry, [], rv.PodReservation(
            pod_uid="u2", pod_namespace="ns", pod_name="web-2", requests={}, reserved_at=time.time(),
            expires_at=time.time() + 30, labels={"app": "web"}))
    except rv.ReservationConflict as exc:
        assert "anti-affinity" in str(exc)
    else:
        raise AssertionError("two replicas reserved on one node against their anti-affinity")
    # web-0 deleted: its node takes web-2
    state.set_pod(pod_named("web-0", "u0", nodes[0]), deleted=True)
    assert state.place_pod(pod, [claim]).node == nodes[0]


def state_entry_claims(state: SchedulingState, node: str) -> dict:
    return {uid: r for uid, r in state.reserved.items() if uid in state._reserved_by_node.get(node, set())}


def pod_named(name: str, uid: str, node: str):
    import msgspec

    from draplane.api.core import Pod

    return msgspec.convert({"metadata": {"name": name, "namespace": "ns", "uid": uid, "labels": {"app": "web"}},
                            "spec": {"nodeName": node, "containers": [{"name": "c"}]}}, Pod)


def test_volumes_filter_nodes_after_node_fit_with_kube_schedulers_reasons():
    from draplane.api.meta import NodeSelector, NodeSelectorRequirement, NodeSelectorTerm
    from draplane.scheduling.framework.plugins.volume_binding import BoundVolume, PodVolumes

    def pinned_to(node: str) -> PodVolumes:
        return PodVolumes(bound=(BoundVolume(claim="data", volume="pv", node_affinity=NodeSelector(
            node_selector_terms=[NodeSelectorTerm(match_expressions=[NodeSelectorRequirement(
                key="kubernetes.io/hostname", operator="In", values=[node])])])),))

    state = eight_gpu_nodes()
    pod = with_uid(scenario.pod("ns", "p", claim_name="one"), "p1")
    claim = with_uid(scenario.claim("ns", "one", "gpu.nvidia.com"), "c1")
    placed = state.place_pod(pod, [claim], volumes=pinned_to("node-2"))
    assert isinstance(placed, Placed) and placed.node == "node-2"
    pod.spec.node_selector = {"pool": "small"}  # node fit rejects node-0 first, as kube-scheduler's order does
    outcome = state.place_pod(pod, [claim], volumes=pinned_to("node-0"))
    assert isinstance(outcome, NotPlaced)
    assert outcome.message == ("0/4 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
                               "3 node(s) didn't match PersistentVolume's node affinity.")
    assert {f.reason for f in outcome.failures} == {FailureReason.NODE_DOES_NOT_FIT.value}


def test_topology_spread_sees_a_node_relabelled_into_another_zone_or_tainted():
    """The spread's eligible nodes are kept between pods (NodeDomains): a node's new zone label or a
    taint its policy honours must reach the next pod."""
    import msgspec

    from draplane.api.core import Node, Pod

    state = eight_gpu_nodes(3)
    for i, zone in enumerate(("a", "a", "b")):
        node = scenario.gpu_node(f"node-{i}", cpu="64", labels={"zone": zone})
        state.set_node(node)

    def spread_pod(i: int) -> Pod:
        return msgspec.convert({"metadata": {"name": f"web-{i}", "namespace": "ns", "uid": f"u{i}",
                                             "labels": {"app": "web"}},
                                "spec": {"containers": [{"name": "c"}], "topologySpreadConstraints": [
                                    {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule",
                                     "nodeTaintsPolicy": "Honor",
                                     "labelSelector": {"matchLabels": {"app": "web"}}}]}}, Pod)

    state.set_pod(pod_named("web-0", "u0", "node-2"))  # zone b: 1, zone a: 0
    assert state.place_pod(spread_pod(1), []).node in ("node-0", "node-1")
    # node-2 moves to zone a: a holds 1, the new zone c (node-1) none, so only node-1 may take one
    state.set_node(scenario.gpu_node("node-2", cpu="64", labels={"zone": "a"}))
    state.set_node(scenario.gpu_node("node-1", cpu="64", labels={"zone": "c"}))
    assert state.place_pod(spread_pod(1), []).node == "node-1"
    # node-1 tainted: nodeTaintsPolicy Honor leaves zone c out of the domains, so zone a (1 pod)
    # is the smallest and takes the next one
    tainted = msgspec.convert({**msgspec.to_builtins(scenario.gpu_node("node-1", cpu="64", labels={"zone": "c"})),
                               "spec": {"taints": [{"key": "maintenance", "effect": "NoSchedule"}]}}, Node)
    state.set_node(tainted)
    assert state.place_pod(spread_pod(1), []).node in ("node-0", "node-2")


def test_node_declared_features_names_only_the_nodes_whose_devices_fit():
    """kube-scheduler runs DynamicResources before NodeDeclaredFeatures: a node where the claim does
    not fit is counted under the devices' reason, one where it fits under the missing feature;
    the node that declares it takes the pod."""
    state = seed_state()
    claim = with_uid(scenario.claim("ns", "big", "high-memory-gpu"), "c1")
    pod = with_uid(scenario.pod("ns", "restarter", claim_name="big"), "p1")
    pod.spec.host_network, pod.spec.host_users = True, False  # UserNamespacesHostNetworkSupport
    outcome = state.place_pod(pod, [claim])
    assert isinstance(outcome, NotPlaced)
    assert outcome.message == (
        "0/3 nodes are available: 1 node(s) didn't match Pod's required features, 2 cannot allocate all claims: "
        "resourceclaim ns/big, request gpu: no device matches the device class.")
    declaring = scenario.gpu_node("node-80")  # a new Node object, as a watch delivers it
    declaring.status.declared_features = ["UserNamespacesHostNetworkSupport"]
    state.set_node(declaring)
    placed = state.place_pod(pod, [claim])
    assert isinstance(placed, Placed) and placed.node == "node-80", placed

"""A shard's pure core, shared with `draplane explain`: the cluster as it is known, and where a pod
with its claims can go.

`SchedulingState` is what a shard holds in memory: the inventory (from the inventory feed), device
classes, nodes, pods bound per node, every claim's allocation in the cluster (whoever made it) and
every reservation in the bucket. The allocated set the allocator core searches against is the union
of claim allocations and reservations, per claim UID, so a device reserved by another shard and
not yet written to Kubernetes is as taken as one in a claim status.

`place_pod` asks the core for the best node whose devices fit and which passes node fit, and
returns a `Placed` or a `NotPlaced` whose failures say, per node, which of the four failure classes
applied.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Iterable, Mapping, Sequence

import msgspec

from draplane.allocation.device_allocator import DeviceAllocator, NodeResources, Unallocatable
from draplane.allocation.errors import AllocationError, Reason
from draplane.allocation.fragmented_devices import (
    claim_demands, device_capacity, fragmented_devices, has_partly_used_devices,
)
from draplane.allocation.state import claim_key
from draplane.api.core import Node, Pod
from draplane.api.meta import ObjectMeta
from draplane.api.resource import (
    AllocationResult,
    DeviceClass,
    DeviceTaintRule,
    ResourceClaim,
    ResourceClaimStatus,
    ResourceSlice,
)
from draplane.cel.errors import CELError
from draplane.component_helpers.errors import SpecError
from draplane.component_helpers.resource import CPU, MEMORY, node_allocatable, pod_requests
from draplane.scheduling.framework.interface import HostPort, PreFilterRejected
from draplane.scheduling.framework.plugins import node_declared_features, node_ports
from draplane.scheduling.framework.plugins.dynamic_resources import (
    CANNOT_ALLOCATE, allocation_node, device_reason, failure_class,
)
from draplane.scheduling.framework.runtime import Cycle, named_nodes, node_fit, volume_reasons
from draplane.scheduling import reservations as rv
from draplane.api.policy import LabelSelector, PodDisruptionBudget
from draplane.scheduling.framework.plugins import inter_pod_affinity as ipa
from draplane.scheduling import pod_scores
from draplane.scheduling.framework.plugins import pod_topology_spread as spread
from draplane.scheduling.framework.plugins import volume_binding
from draplane.scheduling import preemption
from draplane.scheduling.messages import NodeFailure
from draplane.scheduling.placed_pods import PlacedPod, PlacedPods
from draplane.scheduling.unschedulable import FailureReason, pre_filter_problem, summarize

@dataclasses.dataclass(slots=True)
class Placed:
    node: str
    # claim UID -> allocation, for every claim of the pod (already allocated ones included)
    allocations: dict[str, AllocationResult]
    # the claims this placement newly allocates (and so must reserve)
    new_claims: list[str]
    # the pod's requests as node fit counted them (the shard reserves them on the node)
    requests: dict[str, int]
    # the scoring policy's score of the chosen placement; None when nothing was newly allocated
    score: float | None = None


@dataclasses.dataclass(slots=True)
class NotPlaced:
    message: str
    failures: list[NodeFailure]
    claim_error: str = ""
    # The attempt ended on an error, as kube-scheduler's does when a filter returns one (an
    # allocation error that holds on one node): the pod says SchedulerError and is retried with
    # backoff; no other node is tried and nobody is preempted.
    scheduler_error: bool = False


def _selects(evaluate, expressions: list[str], record) -> bool:
    """A class selects a device when every selector is true on it; one that fails to compile or
    errs on the device selects nothing there (the search reports those errors, not this)."""
    try:
        return all(evaluate(expression, record) is True for expression in expressions)
    except CELError:
        return False


def _same_devices(a: AllocationResult, b: AllocationResult) -> bool:
    """Whether two allocations hold the same devices on the same nodes, whenever each was made."""
    return a.devices == b.devices and a.node_selector == b.node_selector


class SchedulingState:
    """Everything a shard knows, updated one object at a time by the shell.

    The device search and its per-node caches are the allocator core's `DeviceAllocator`; this adds what a
    shard needs around it: pods per node for node fit, claims by UID, and reservations.
    """

    def __init__(self, policy: str | None = None, *, tie_break: int = 0) -> None:
        self.devices = DeviceAllocator(policy=policy, tie_break=tie_break)
        self.nodes = self.devices.nodes
        # node -> pod uid -> requests, for pods bound there (from the pod watch)
        self.pods_on_node: dict[str, dict[str, dict[str, int]]] = {}
        self._pod_node: dict[str, str] = {}
        # node -> pod uid -> the pod as preemption reads it (priority, labels, claims, start), for
        # pods bound there (from the pod watch only: a reserved pod is not running yet)
        self.running: dict[str, dict[str, preemption.RunningPod]] = {}
        self._running_node: dict[str, str] = {}  # pod uid -> its node in `running`
        self.budgets: dict[str, PodDisruptionBudget] = {}  # "namespace/name" -> PodDisruptionBudget
        self.claims: dict[str, ResourceClaim] = {}  # uid -> claim
        self.reserved: dict[str, rv.Reservation] = {}  # claim uid -> reservation
        # node -> pod uid -> (requests, lease end), for pods reserved there in the bucket (placed
        # by any shard, maybe not bound yet); node fit counts the live ones with the bound pods,
        # each pod once
        self.reserved_pods: dict[str, dict[str, tuple[dict[str, int], float]]] = {}
        # node -> pod uid -> (its reservation in the entry, the PlacedPod made of it): kept while unchanged
        self._reserved_placed: dict[str, dict[str, tuple[rv.PodReservation, PlacedPod]]] = {}
        # node -> pod uid -> host ports, of the pods holding any: bound ones (the pod watch), and
        # (uid -> (ports, lease end)) reserved ones, from the same entries as reserved_pods
        self.ports_on_node: dict[str, dict[str, tuple[HostPort, ...]]] = {}
        self._ports_node: dict[str, str] = {}
        self.reserved_ports: dict[str, dict[str, tuple[tuple[HostPort, ...], float]]] = {}
        # pods seen deleted or finished (uid -> None, oldest first, bounded): a reservation of
        # theirs still in a node's entry holds nothing, though its lease runs on (a replica
        # deleted right after its bind held its host port, CPU and memory for the rest of it)
        self._gone_pods: dict[str, None] = {}
        self._reserved_pod_node: dict[str, str] = {}  # pod uid -> the node whose entry reserves it
        # For InterPodAffinity and PodTopologySpread: the bound pods and those reserved in
        # entries, indexed by what their selectors read; the nodes' domains per constraint
        self.placed = PlacedPods(gone=self._gone_pods)
        self.node_domains = spread.NodeDomains(self.nodes)
        self._reserved_by_node: dict[str, set[str]] = {}
        # claim uid -> (state key it is recorded under, the allocation recorded)
        self._held: dict[str, tuple[str, AllocationResult]] = {}
        self._feed_slices: dict[str, list[str]] = {}  # feed key -> slice names
        # For the node score's CPU/memory term: node -> (Node, allocatable CPU, memory), node ->
        # requests summed over its pods (dropped when a pod comes or goes there).
        self._allocatable: dict[str, tuple[object, int, int]] = {}
        self._used: dict[str, tuple[int, int]] = {}
        # Node fit, remembered per (what of the pod it reads, node) until the node's Node object or
        # its pods change (node -> a count bumped then): busy-first packing puts full nodes at the
        # top, and every pod asked each of them again (53 % of a shard's CPU at 5,000 nodes).
        self._fit_versions: dict[str, int] = {}
        self._fits: dict[tuple[bytes, str], tuple[int, Node, object]] = {}

    # --- updates ---------------------------------------------------------------------------------

    def set_feed_entry(self, key: str, slices: Iterable[ResourceSlice]) -> None:
        for name in self._feed_slices.pop(key, ()):
            self.devices.remove_slice(name)
        names = []
        for s in slices:
            self.devices.apply_slice(s)
            names.append(s.metadata.name or "")
        if names:
            self._feed_slices[key] = names

    def set_taint_rules(self, rules: Iterable[DeviceTaintRule]) -> None:
        self.devices.set_taint_rules(rules)

    def set_taint_rule(self, rule: DeviceTaintRule, deleted: bool = False) -> None:
        rules = {r.metadata.name: r for r in self.devices.inventory.taint_rules}
        if deleted:
            rules.pop(rule.metadata.name, None)
        else:
            rules[rule.metadata.name] = rule
        self.devices.set_taint_rules(rules.values())

    def set_class(self, device_class: DeviceClass, deleted: bool = False) -> None:
        classes = dict(self.devices.classes)
        name = device_class.metadata.name or ""
        if deleted:
            classes.pop(name, None)
        else:
            classes[name] = device_class
        self.devices.set_classes(classes.values())

    def set_node(self, node: Node, deleted: bool = False) -> None:
        name = node.metadata.name or ""
        before = self.nodes.get(name)
        if deleted:
            self.devices.remove_node(name)
        else:
            self.devices.set_node(node)
        # which nodes a spread constraint counts reads their labels and taints only
        if deleted or before is None or (before.metadata.labels or {}) != (node.metadata.labels or {}) or \
                _taints(before) != _taints(node):
            self.node_domains.nodes_changed()

    def set_pod(self, pod: Pod, deleted: bool = False) -> None:
        """Pods bound to a node count against its CPU and memory until they finish."""
        uid = pod.metadata.uid or ""
        phase = pod.status.phase if pod.status else None
        if deleted or phase in ("Succeeded", "Failed"):
            self._pod_gone(uid)
            self.forget_pod(uid)
            self._forget_running(uid)
            return
        if pod.spec.node_name:
            try:
                requests = pod_requests(pod)
                running = preemption.RunningPod.from_pod(pod, requests)
            except SpecError:
                requests, running = {}, None
            self.assume_pod(uid, pod.spec.node_name, requests, node_ports.pod_host_ports(pod.spec))
            self._forget_running(uid)
            self.placed.set_bound(PlacedPod(uid=uid, namespace=pod.metadata.namespace or "default",
                                            labels=pod.metadata.labels or {}, node=pod.spec.node_name,
                                            anti_affinity=ipa.required_anti_affinity(pod.spec),
                                            terminating=pod.metadata.deletion_timestamp is not None,
                                            score_terms=pod_scores.score_terms(pod.spec)))
            if running is not None:
                self.running.setdefault(pod.spec.node_name, {})[uid] = running
                self._running_node[uid] = pod.spec.node_name

    GONE_PODS_REMEMBERED = 65_536

    def pod_is_gone(self, uid: str) -> bool:
        """Seen deleted or finished: a reservation of the pod may be dropped from its node's entry."""
        return uid in self._gone_pods

    def _pod_gone(self, uid: str) -> None:
        if uid in self._gone_pods:
            return
        if len(self._gone_pods) >= self.GONE_PODS_REMEMBERED:
            del self._gone_pods[next(iter(self._gone_pods))]  # forgotten: its lease alone ends it
        self._gone_pods[uid] = None
        node = self._reserved_pod_node.get(uid)
        if node is not None:
            self._resources_changed(node)

    def _forget_running(self, uid: str) -> None:
        # By the pod's node, not a walk over every node: this runs for each pod event a shard sees
        # (7 % of a follower shard's CPU at 300 nodes when it walked them).
        self.placed.forget_bound(uid)
        node = self._running_node.pop(uid, None)
        pods = self.running.get(node) if node is not None else None
        if pods is not None and pods.pop(uid, None) is not None and not pods:
            del self.running[node]

    def set_budget(self, budget: PodDisruptionBudget, deleted: bool = False) -> None:
        key = f"{budget.metadata.namespace}/{budget.metadata.name}"
        if deleted:
            self.budgets.pop(key, None)
        else:
            self.budgets[key] = budget

    def assume_pod(self, uid: str, node: str, requests: dict[str, int], ports: tuple[HostPort, ...] = ()) -> None:
        self.forget_pod(uid)
        self.pods_on_node.setdefault(node, {})[uid] = requests
        self._pod_node[uid] = node
        if ports:
            self.ports_on_node.setdefault(node, {})[uid] = ports
            self._ports_node[uid] = node
        self._resources_changed(node)

    def _resources_changed(self, node: str) -> None:
        self._used.pop(node, None)
        self._fit_versions[node] = self._fit_versions.get(node, 0) + 1
        self.devices.node_resources_changed(node)

    def forget_pod(self, uid: str) -> None:
        node = self._pod_node.pop(uid, None)
        if node is not None:
            self.pods_on_node.get(node, {}).pop(uid, None)
            self._resources_changed(node)
        port_node = self._ports_node.pop(uid, None)
        if port_node is not None:
            held = self.ports_on_node.get(port_node, {})
            held.pop(uid, None)
            if not held:
                self.ports_on_node.pop(port_node, None)

    def set_claim(self, claim: ResourceClaim, deleted: bool = False) -> None:
        uid = claim.metadata.uid or ""
        if deleted:
            self.claims.pop(uid, None)
        else:
            self.claims[uid] = claim
        self._refresh_claim(uid)

    def set_reservations(self, node: str, entry: rv.NodeReservations) -> None:
        before = self._reserved_by_node.get(node, set())
        for uid in before - entry.claims.keys():
            self.reserved.pop(uid, None)
            self._refresh_claim(uid)
        for uid, reservation in entry.claims.items():
            old = self.reserved.get(uid)
            self.reserved[uid] = reservation
            # Most writes to a node's entry renew or confirm one lease and leave the other claims
            # as they were; only a claim reserved anew (or again) can change what is in use.
            if old is not reservation and (old is None or old.reserved_at != reservation.reserved_at
                                           or old.devices != reservation.devices):
                self._refresh_claim(uid)
        self._reserved_by_node[node] = set(entry.claims)
        pods = {uid: (p.requests, p.expires_at) for uid, p in entry.pods.items()}
        ports = {uid: (tuple(p.host_ports), p.expires_at) for uid, p in entry.pods.items() if p.host_ports}
        if pods != self.reserved_pods.get(node, {}) or ports != self.reserved_ports.get(node, {}):
            for uid in self.reserved_pods.get(node, {}).keys() - pods.keys():
                if self._reserved_pod_node.get(uid) == node:
                    del self._reserved_pod_node[uid]
            for uid in pods:
                self._reserved_pod_node[uid] = node
            known = self._reserved_placed.get(node, {})
            placed = {}
            for uid, p in entry.pods.items():
                was = known.get(uid)
                # a write adds or renews one pod and leaves the others as they were
                placed[uid] = was if was is not None and (was[0] is p or was[0] == p) else (p, PlacedPod(
                    uid=uid, namespace=p.pod_namespace, labels=p.labels or {}, node=node,
                    anti_affinity=tuple(p.anti_affinity or ())))
            self.placed.set_reserved(node, {uid: (pp, p.expires_at) for uid, (p, pp) in placed.items()})
            if placed:
                self._reserved_placed[node] = placed
            else:
                self._reserved_placed.pop(node, None)
            if pods:
                self.reserved_pods[node] = pods
            else:
                self.reserved_pods.pop(node, None)
            if ports:
                self.reserved_ports[node] = ports
            else:
                self.reserved_ports.pop(node, None)
            self._resources_changed(node)

    def pods_here(self, node: str, now: float | None = None) -> dict[str, dict[str, int]]:
        """The pods that count against a node's CPU and memory: bound there (from the pod watch)
        and reserved there by any shard under a lease that has not run out."""
        bound = self.pods_on_node.get(node, {})
        reserved = self.reserved_pods.get(node)
        if not reserved:
            return bound
        now = time.time() if now is None else now
        gone = self._gone_pods
        merged = {uid: requests for uid, (requests, expires_at) in reserved.items()
                  if expires_at > now and uid not in gone}
        merged.update(bound)
        return merged

    def ports_here(self, node: str, now: float | None = None, *,
                   without: str | Collection[str] | None = None) -> list[HostPort]:
        """The host ports held on a node: by the pods bound there, and by those reserved there under
        a lease that has not run out (each pod once); `without` the pod (or pods) of that uid."""
        held = dict(self.ports_on_node.get(node, {}))
        reserved = self.reserved_ports.get(node)
        if reserved:
            now = time.time() if now is None else now
            for uid, (ports, expires_at) in reserved.items():
                if expires_at > now and uid not in self._gone_pods:
                    held.setdefault(uid, ports)
        for uid in ((without,) if isinstance(without, str) else without or ()):
            held.pop(uid, None)
        return [port for ports in held.values() for port in ports]

    def _refresh_claim(self, uid: str) -> None:
        """The devices a claim holds: its status' allocation, else its reservation."""
        claim = self.claims.get(uid)
        allocation = claim.status.allocation if claim is not None and claim.status else None
        namespace, name = (claim.metadata.namespace, claim.metadata.name) if claim is not None else (None, None)
        if allocation is None and uid in self.reserved:
            reservation = self.reserved[uid]
            allocation = reservation.allocation
            namespace, name = reservation.claim_namespace, reservation.claim_name
        previous = self._held.get(uid)
        if previous is not None and allocation is not None and (
            previous[1] is allocation or _same_devices(previous[1], allocation)
        ):
            # The same devices as before (a claim's reservedFor or finalizer changed, or its
            # reservation turned into the status it described, which adds the time it was
            # written): releasing and adding them again would only invalidate the nodes' caches.
            return
        if previous is not None:
            del self._held[uid]
            self.devices.release_claim(previous[0])
        if allocation is not None:
            holder = ResourceClaim(
                metadata=ObjectMeta(namespace=namespace, name=name, uid=uid),
                status=ResourceClaimStatus(allocation=allocation),
            )
            self.devices.add_allocated_claim(holder)
            self._held[uid] = (claim_key(holder), allocation)

    def claim_is_allocated(self, uid: str) -> bool:
        claim = self.claims.get(uid)
        return claim is not None and claim.status is not None and claim.status.allocation is not None

    def fragmented_devices(self) -> dict[str, int]:
        """DeviceClass -> devices whose free part no claim of the class seen here can use
        (draplane.allocation.fragmented_devices), over every pool any node sees."""
        cluster = self.devices
        pools = [pool for node in list(cluster.nodes.values()) for pool in cluster.inventory.pools_for_node(node)]
        if not has_partly_used_devices(pools, cluster.state):
            return {name: 0 for name in cluster.classes}
        records = {r.id: r for pool in pools for r in pool.devices}
        selectors = {name: [s.cel.expression for s in (c.spec.selectors if c.spec else None) or () if s.cel]
                     for name, c in cluster.classes.items()}
        evaluate = cluster.allocator.matcher.evaluate
        memo: dict[int, tuple[str, ...]] = {}

        def classes_of(record) -> tuple[str, ...]:
            found = memo.get(id(record))
            if found is None:
                found = memo[id(record)] = tuple(
                    name for name, expressions in selectors.items() if _selects(evaluate, expressions, record))
            return found

        def capacity_of(device_id):
            record = records.get(device_id)
            return device_capacity(record) if record is not None else None

        held = [(claim, self._held[uid][1] if uid in self._held else None) for uid, claim in self.claims.items()]
        demands = claim_demands(held, capacity_of)
        return fragmented_devices(pools, cluster.state, classes_of, demands, class_names=cluster.classes)

    # --- placing ---------------------------------------------------------------------------------

    def _node_fit(self, pod: Pod, requests: dict[str, int], node: Node, fit_key: bytes | None = None):
        """node_fit against the pods bound or reserved there (the pod itself left out). With
        `fit_key` (`_fit_key`), an answer given for the same key is reused while the node's
        Node object and pods stay as they were. A lease that runs out unreported is seen when
        the shard prunes it (a write to the node's entry), as for the CPU/memory term."""
        name = node.metadata.name or ""
        uid = pod.metadata.uid
        if fit_key is not None and uid not in self.pods_on_node.get(name, ()) and uid not in self.reserved_pods.get(name, ()):
            version = self._fit_versions.get(name, 0)
            cached = self._fits.get((fit_key, name))
            if cached is not None and cached[0] == version and cached[1] is node:
                return cached[2]
            fit = self._node_fit(pod, requests, node)
            if len(self._fits) > 200_000:
                self._fits.clear()  # a bound, not an LRU: fits are cheap to recompute
            self._fits[(fit_key, name)] = (version, node, fit)
            return fit
        pods_here = {u: r for u, r in self.pods_here(name).items() if u != pod.metadata.uid}
        used: dict[str, int] = {}
        for other in pods_here.values():
            for resource, amount in other.items():
                used[resource] = used.get(resource, 0) + amount
        ports = self.ports_here(name, without=pod.metadata.uid) if node_ports.pod_host_ports(pod.spec) else ()
        return node_fit(pod, node, requests=requests, in_use=(used, len(pods_here)), ports_in_use=ports)

    def _topology_spread(self, pod: Pod) -> spread.PreFilterState | None:
        """PodTopologySpread's PreFilter for the pod: None without DoNotSchedule constraints."""
        if not any(c.when_unsatisfiable == "DoNotSchedule" for c in pod.spec.topology_spread_constraints or ()):
            return None
        return spread.pre_filter(pod, self.node_domains, self.placed, now=time.time())

    def _inter_pod_affinity(self, pod: Pod) -> ipa.PreFilterState | None:
        """InterPodAffinity's PreFilter for the pod: None when neither its terms nor any placed
        pod's anti-affinity concern it (most pods: then no pod is looked at)."""
        spec = pod.spec
        has_terms = bool(ipa.required_affinity(spec) or ipa.required_anti_affinity(spec))
        if not has_terms and not self.placed.has_anti_affinity():
            return None

        meta = pod.metadata
        return ipa.pre_filter(meta.namespace or "default", meta.labels or {}, spec, self.placed, self._node_labels,
                              where=f"pod {meta.namespace}/{meta.name}", now=time.time(), without=meta.uid)

    def _node_labels(self, name: str) -> Mapping[str, str] | None:
        node = self.nodes.get(name)
        return (node.metadata.labels or {}) if node is not None else None

    def _free_cpu_memory(self, name: str) -> tuple[int, int]:
        """The node's allocatable CPU and memory minus the requests of the pods on it (0 when the
        Node object does not say). Asked for every feasible node per pod, so both halves are kept:
        allocatable per Node object, the pods' sums per node until a pod comes or goes there."""
        node = self.nodes.get(name)
        allocatable = self._allocatable.get(name)
        if allocatable is None or allocatable[0] is not node:
            try:
                parsed = node_allocatable(node) if node is not None else {}
            except SpecError:
                parsed = {}
            allocatable = self._allocatable[name] = (node, parsed.get(CPU, 0), parsed.get(MEMORY, 0))
        used = self._used.get(name)
        if used is None:
            cpu = memory = 0
            for requests in self.pods_here(name).values():
                cpu += requests.get(CPU, 0)
                memory += requests.get(MEMORY, 0)
            used = self._used[name] = (cpu, memory)
        return allocatable[1] - used[0], allocatable[2] - used[1]

    def _not_placed(self, device_failures: dict, cycle: Cycle) -> NotPlaced:
        """One failure per node, as kube-scheduler reports them: the first Filter that refuses the
        node (run here for nodes the device search never reached), else the devices' reason."""
        failures = []
        for name in sorted(self.nodes):
            rejection = cycle.rejections.get(name)
            if rejection is None:
                # The device search skips the other Filters where the devices do not fit;
                # kube-scheduler runs them first, so they are asked here.
                rejection = cycle.filter_node(self.nodes[name])
            if rejection is not None and rejection.plugin == node_declared_features.NAME and name in device_failures:
                # DynamicResources runs before it. The device search asks the other Filters only
                # where the devices fit, so a node it refused is one NodeDeclaredFeatures did not
                # reach in kube-scheduler.
                rejection = None
            if rejection is not None:
                failures.append(NodeFailure(node=name, reason=FailureReason.NODE_DOES_NOT_FIT.value,
                                            detail=", ".join(rejection.details), reasons=list(rejection.reasons)))
            elif name in device_failures:
                f = device_failures[name]
                failures.append(NodeFailure(node=name, reason=failure_class(f.reason).value, detail=f.message,
                                            reasons=[device_reason(f)]))
            else:
                failures.append(NodeFailure(node=name, reason=FailureReason.NO_MATCHING_DEVICE.value,
                                            detail="the node has no devices in usable pools",
                                            reasons=[f"{CANNOT_ALLOCATE}: the node has no devices"]))
        return NotPlaced(message=summarize(failures, len(self.nodes)), failures=failures)

    def preemption_for(self, pod: Pod, claims: Sequence[ResourceClaim], now: float | None = None, *,
                       volumes: volume_binding.PodVolumes | None = None):
        """For a pod `place_pod` could not place: the victims whose eviction lets it fit
        (`preemption.PreemptionPlan`), the terminating pods it waits for, or why preemption cannot
        help (`NoPreemption`). None when no pod anywhere has a lower priority, so preemption has
        nothing to say (most pods: keeps their message as kube-scheduler's fit error alone)."""
        priority = preemption.pod_priority(pod)
        if not any(p.priority < priority for pods in self.running.values() for p in pods.values()):
            return None
        if any((c.metadata.uid or "") in self.reserved for c in claims):
            # Reserved already: held for it by an earlier preemption (place_pod says what it waits
            # for), or placed and on its way to the binder. Evicting more could only over-evict.
            return None
        if any(c.status is not None and c.status.allocation is not None for c in claims):
            # A claim already allocated pins the pod to its devices; freeing others cannot help it.
            return None
        in_use = {}
        for claim in self.claims.values():
            if claim.status is not None and claim.status.allocation is not None:
                in_use[f"{claim.metadata.namespace}/{claim.metadata.name}"] = claim
        running = {node: list(pods.values()) for node, pods in self.running.items()}

        def used(node: str) -> tuple[dict[str, int], int]:
            total: dict[str, int] = {}
            pods = self.pods_here(node, now)
            for requests in pods.values():
                for resource, amount in requests.items():
                    total[resource] = total.get(resource, 0) + amount
            return total, len(pods)

        try:
            spreading = self._topology_spread(pod)
            affinity = self._inter_pod_affinity(pod)
        except (ipa.PodAffinityError, spread.SpreadError):
            return None  # place_pod says why: no node can help

        def blocked(name: str) -> bool:
            """Refused whoever is evicted (UnschedulableAndUnresolvable in kube-scheduler): by the
            pod's volumes, a missing topology label, or its own required pod affinity."""
            node = self.nodes.get(name)
            if node is None:
                return False
            labels = node.metadata.labels or {}
            return (spreading is not None and spread.filter_node(spreading, labels) == spread.REASON_MISSING_LABEL) \
                or (affinity is not None and ipa.filter_node(affinity, labels) == ipa.REASON_AFFINITY) \
                or bool(volume_reasons(volumes, name, labels))

        wanted_ports = node_ports.pod_host_ports(pod.spec)
        meta = pod.metadata

        def refused_without(name: str, gone: frozenset[str]) -> str | None:
            """NodePorts, PodTopologySpread and InterPodAffinity on the node with the pods of the
            uids `gone` evicted: kube-scheduler's filters rerun on the node less its victims."""
            labels = (self.nodes[name].metadata.labels or {}) if name in self.nodes else {}
            if wanted_ports:
                held = self.ports_here(name, now, without=gone)
                if node_ports.ports_conflict(wanted_ports, held):
                    return node_ports.REASON
            if spreading is not None:
                state = spread.pre_filter(pod, self.node_domains, self.placed.without(gone), now=time.time())
                reason = spread.filter_node(state, labels) if state is not None else None
                if reason is not None:
                    return reason
            if affinity is not None:
                state = ipa.pre_filter(meta.namespace or "default", meta.labels or {}, pod.spec,
                                       self.placed.without(gone), self._node_labels,
                                       where=f"pod {meta.namespace}/{meta.name}", now=time.time(), without=meta.uid)
                reason = ipa.filter_node(state, labels) if state is not None else None
                if reason is not None:
                    return reason
            return None

        return preemption.plan_preemption(self.devices, pod, claims, running=running, claims_in_use=in_use,
                                          budgets=list(self.budgets.values()), in_use=used,
                                          ports_in_use=lambda node: self.ports_here(node, now), blocked=blocked,
                                          now=now, refused_without=refused_without)

    def held_elsewhere(self, claims: Sequence[ResourceClaim]) -> NotPlaced | None:
        """A claim reserved (not yet written) on devices another claim still holds: a preemption
        holds them for this pod while its victims go. Placing it now would give Kubernetes two
        claims on one device, so it waits, and says for what."""
        state = self.devices.state
        for claim in claims:
            uid = claim.metadata.uid or ""
            reservation = self.reserved.get(uid)
            if reservation is None or (claim.status is not None and claim.status.allocation is not None):
                continue
            busy = [d for d in reservation.devices if d.exclusive
                    and state.exclusive_holders((d.driver, d.pool, d.device)) > 1]
            if busy:
                node = allocation_node(reservation.allocation) or "?"
                names = ", ".join(f"{d.pool}/{d.device}" for d in busy)
                detail = (f"resourceclaim {claim.metadata.namespace}/{claim.metadata.name}: its devices {names} are "
                          f"held for it while the pods preempted for it go")
                message = f"waiting on node {node}: {detail}"
                return NotPlaced(message=message, failures=[NodeFailure(
                    node=node, reason=FailureReason.CAPACITY_EXHAUSTED.value, detail=detail, reasons=[message])])
        return None

    def _cycle(self, pod: Pod, requests: dict[str, int], *, volumes: volume_binding.PodVolumes | None = None,
               pinned: Collection[str] = ()) -> Cycle:
        """The pod's PreFilters, and its Filters but DynamicResources' device search as one node
        filter (`Cycle.filter_node`), in kube-scheduler's order. Raises PreFilterRejected when a
        PreFilter refuses every node, PodAffinityError or SpreadError for a constraint that cannot
        be evaluated."""
        fit_key = _fit_key(pod, requests)
        return Cycle(
            pod=pod,
            node_local=lambda node: self._node_fit(pod, requests, node, fit_key),
            named=named_nodes(pod),
            volumes=volumes,
            spreading=self._topology_spread(pod),
            affinity=self._inter_pod_affinity(pod),
            pinned=pinned,
        )

    def _preferences(self, pod: Pod, default_spread: LabelSelector | None = None) -> dict[str, float] | None:
        """What the pod's preferred pod affinity and ScheduleAnyway spread (or the default
        spreading among the pods of its services and controller), and the placed pods' terms
        towards it, take off each node's score (pod_scores); None for the pods without any of them."""
        if not pod_scores.has_preferences(pod) and not self.placed.has_score_terms() and (
                default_spread is None or pod.spec.topology_spread_constraints):
            return None
        meta = pod.metadata
        return pod_scores.node_bonus(pod_scores.preferences(pod, self.nodes, self.placed, now=time.time(),
                                                            where=f"pod {meta.namespace}/{meta.name}",
                                                            domains=self.node_domains,
                                                            default_spread=default_spread))

    def filter_nodes(self, pod: Pod, *, volumes: volume_binding.PodVolumes | None = None) -> tuple[list[str], NotPlaced]:
        """Every node through the pod's filters but DynamicResources (a pod without claims is
        placed by these alone): the feasible nodes, sorted, and kube-scheduler's account of the
        others (its message is what it would say if none were feasible). For the differential
        against kube-scheduler's framework, and for tools that show where a pod could go."""
        try:
            requests = pod_requests(pod)
            cycle = self._cycle(pod, requests, volumes=volumes)
        except PreFilterRejected as exc:
            failures = [NodeFailure(node=name, reason=FailureReason.NODE_DOES_NOT_FIT.value, detail=exc.reason,
                                    reasons=[exc.reason]) for name in sorted(self.nodes)]
            return [], NotPlaced(message=pre_filter_problem(len(self.nodes), exc.reason), failures=failures)
        except (SpecError, ipa.PodAffinityError, spread.SpreadError) as exc:
            return [], NotPlaced(message=str(exc), failures=[], claim_error=str(exc))
        feasible = [name for name in sorted(self.nodes) if cycle.filter_node(self.nodes[name]) is None]
        return feasible, self._not_placed({}, cycle)

    def place_pod(self, pod: Pod, claims: Sequence[ResourceClaim], *,
                  volumes: volume_binding.PodVolumes | None = None,
                  dra_extended_resources: Collection[str] = (),
                  default_spread: LabelSelector | None = None) -> Placed | NotPlaced:
        """Where `pod` and its claims can go: node fit first, then the devices, best score wins.
        `volumes` is what the binder's VolumeBinding PreFilter found of the pod's PVCs;
        `dra_extended_resources`, the extended resources a claim made for the pod serves, which
        NodeResourcesFit leaves to DRA (kube-scheduler's shouldDelegateResourceToDRA);
        `default_spread`, the selector of the pods it spreads among by default (pod_scores)."""
        try:
            requests = pod_requests(pod)
        except SpecError as exc:
            return NotPlaced(message=str(exc), failures=[], claim_error=str(exc))
        if dra_extended_resources:
            requests = {r: v for r, v in requests.items() if r not in dra_extended_resources}

        done: dict[str, AllocationResult] = {}
        pending: list[ResourceClaim] = []
        pinned: set[str] = set()
        for claim in claims:
            uid = claim.metadata.uid or ""
            allocation = claim.status.allocation if claim.status else None
            if allocation is None and uid in self.reserved:
                allocation = self.reserved[uid].allocation
            if allocation is not None:
                done[uid] = allocation
                node = allocation_node(allocation)
                if node is not None:
                    pinned.add(node)
            else:
                pending.append(claim)
        if len(pinned) > 1:
            message = f"the pod's claims are allocated on different nodes: {', '.join(sorted(pinned))}"
            return NotPlaced(message=message, failures=[], claim_error=message)
        waiting = self.held_elsewhere(claims)
        if waiting is not None:
            return waiting

        try:
            cycle = self._cycle(pod, requests, volumes=volumes, pinned=pinned)
            bonus = self._preferences(pod, default_spread)
        except PreFilterRejected as exc:
            message = pre_filter_problem(len(self.nodes), exc.reason)
            return NotPlaced(message=message, failures=[], claim_error=message)
        except (SpecError, ipa.PodAffinityError, spread.SpreadError) as exc:
            return NotPlaced(message=str(exc), failures=[], claim_error=str(exc))

        def node_filter(node: Node) -> bool:
            return cycle.filter_node(node) is None

        if not pending:
            candidates = sorted(pinned) if pinned else sorted(self.nodes)
            candidates = self.devices.rank_without_claims(
                candidates, NodeResources(requests.get(CPU, 0), requests.get(MEMORY, 0), self._free_cpu_memory),
                node_bonus=bonus)
            for name in candidates:
                node = self.nodes.get(name)
                if node is not None and node_filter(node):
                    return Placed(node=name, allocations=done, new_claims=[], requests=requests)
            return self._not_placed({}, cycle)

        resources = NodeResources(requests.get(CPU, 0), requests.get(MEMORY, 0), self._free_cpu_memory)
        try:
            outcome = self.devices.allocate(pending, node_filter=node_filter, explain=True, node_resources=resources,
                                            node_bonus=bonus)
        except AllocationError as exc:
            if exc.fatal:
                return NotPlaced(message=exc.message, failures=[], claim_error=exc.message)
            message = f'running "DynamicResources" filter plugin: {exc.message}'
            return NotPlaced(message=message, failures=[], claim_error=message, scheduler_error=True)
        if isinstance(outcome, Unallocatable):
            device_failures = {f.node: f for f in outcome.failures if f.reason is not Reason.NODE_FILTERED}
            return self._not_placed(device_failures, cycle)
        allocations = dict(done)
        new_claims = []
        for claim, allocation in zip(pending, outcome.allocations):
            allocations[claim.metadata.uid or ""] = allocation
            new_claims.append(claim.metadata.uid or "")
        return Placed(node=outcome.node, allocations=allocations, new_claims=new_claims, requests=requests,
                      score=outcome.score)


_FIT_KEY_ENCODER = msgspec.msgpack.Encoder()


def _taints(node: Node) -> list:
    return (node.spec.taints or []) if node.spec is not None else []


def _fit_key(pod: Pod, requests: dict[str, int]) -> bytes:
    """All node fit reads of a pod, besides its name in error messages (errors are not kept)."""
    spec = pod.spec
    return _FIT_KEY_ENCODER.encode((sorted(requests.items()), spec.node_selector, spec.affinity, spec.tolerations,
                                    node_ports.pod_host_ports(spec), spec.node_name,
                                    sorted(node_declared_features.required_features(spec))))

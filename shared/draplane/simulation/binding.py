"""Every placement the simulator makes goes through the allocator core, as the service's would.

The replay engine proposes a node and the GPUs its policy prefers; `CoreBinder` then
1. checks the pod against the node with the framework's `runtime.node_fit` (CPU, memory, pod slots),
2. allocates the pod's ResourceClaim on that node with the core's `NodeAllocator` (selectors, the
   consumable `compute` capacity and its request policy, exclusive whole GPUs), ordering the
   candidate devices so that the preferred GPUs come first, and
3. records the allocation in the core's `AllocatedState`.

The core's answer on a node is a function of the node's devices and what is allocated on them, so
answers are cached per (model, claim shape, preferred devices and their free milli) when the core
took the preferred devices, else per the whole node's free milli: a hit re-issues the same devices as
an AllocationResult and records it, without a new search.
The engine's own bookkeeping follows the devices the core returns.
"""

from __future__ import annotations

from typing import Sequence

from draplane.allocation.allocator import NodeAllocator, NodePlacement, SelectorMatcher
from draplane.allocation.inventory import Inventory
from draplane.component_helpers.resource import pod_requests
from draplane.scheduling.framework.runtime import node_fit
from draplane.allocation.scoring import ScoringPolicy
from draplane.allocation.state import AllocatedState
from draplane.allocation.fragmentation import PodShape
from draplane.api.core import Node, Pod
from draplane.api.resource import AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaim
from draplane.simulation.trace import (
    CLAIM_NAME,
    DRIVER,
    TraceNode,
    TracePod,
    device_name,
    gpu_device_class,
    node_objects,
    pod_objects,
)


class PreferredDevicesFirst(ScoringPolicy):
    """Keeps Kubernetes' device order except that the devices the replay policy chose come first.

    Ordering never changes whether a claim fits (the core's search is exhaustive), only which
    valid placement is found first."""

    name = "simulation-preference"

    def __init__(self) -> None:
        self.preferred: tuple[str, ...] = ()

    def order_candidates(self, request, candidates, view):
        if not self.preferred:
            return candidates
        rank = {name: i for i, name in enumerate(self.preferred)}
        first = sorted((c for c in candidates if c.record.name in rank), key=lambda c: rank[c.record.name])
        return first + [c for c in candidates if c.record.name not in rank]


class CoreInventory:
    """The trace's nodes as the core sees them; built once and shared by every run in a process."""

    def __init__(self, nodes: Sequence[TraceNode]):
        self.nodes = list(nodes)
        self.objects: list[tuple[Node, object]] = [node_objects(n) for n in nodes]
        self.inventory = Inventory([s for _, s in self.objects if s is not None])
        self.classes = {c.metadata.name: c for c in [gpu_device_class()]}
        self.matcher = SelectorMatcher()


class CoreBinder:
    """Confirms and records one run's placements with the allocator core."""

    def __init__(self, core: CoreInventory, order: Sequence[int]):
        self.core = core
        self.state = AllocatedState()
        self.allocator = NodeAllocator(core.inventory, self.state, core.classes, matcher=core.matcher,
                                       share_ids=self._share_id)
        self.preference = PreferredDevicesFirst()
        self.order = list(order)  # engine index -> trace node index
        self.used: list[tuple[dict[str, int], int]] = [({}, 0) for _ in order]
        self.templates: dict[PodShape, tuple[Pod, ResourceClaim | None, dict[str, int]]] = {}
        self.answers: dict[tuple, tuple | None] = {}
        self.gpu_free: list[list[int]] = [[1000] * core.nodes[i].gpus for i in order]
        self.searches = 0
        self.pods = 0
        self._shares = 0

    def _share_id(self) -> str:
        # Deterministic share IDs keep runs repeatable; uniqueness within a run is all that matters.
        self._shares += 1
        return f"00000000-0000-4000-8000-{self._shares:012x}"

    def _template(self, shape: PodShape):
        found = self.templates.get(shape)
        if found is None:
            pod, claim = pod_objects(TracePod("template", shape.cpu_milli, shape.memory_mib, shape.num_gpu, shape.gpu_milli, shape.models))
            found = self.templates[shape] = (pod, claim, pod_requests(pod))
        return found

    def confirm(self, node: int, shape: PodShape, gpus: tuple[int, ...]) -> tuple[int, ...] | None:
        pod, claim, requests = self._template(shape)
        k8s_node, _ = self.core.objects[self.order[node]]
        fit = node_fit(pod, k8s_node, requests=requests, in_use=self.used[node])
        if not fit.fits:
            return None
        chosen: tuple[int, ...] = ()
        if claim is not None:
            free = self.gpu_free[node]
            model = self.core.nodes[self.order[node]].model
            # The core tries the preferred devices first and its search returns the first valid
            # placement, so when they fit, the answer depends on their state alone; only when they
            # do not does the rest of the node matter.
            preferred_key = (model, gpus, tuple(free[g] for g in gpus), shape.num_gpu, shape.gpu_milli, shape.models)
            answer = self.answers.get(preferred_key, False)
            if answer is False:
                answer = self.answers.get((preferred_key, tuple(free)), False)
            if answer is False:
                self.preference.preferred = tuple(device_name(g) for g in gpus)
                outcome = self.allocator.allocate([claim], k8s_node, self.preference, diagnose=False)
                self.searches += 1
                answer = None
                if isinstance(outcome, NodePlacement):
                    # Kept without the pool and share IDs, which differ per node and per allocation.
                    answer = tuple(
                        (int(r.device.rsplit("-", 1)[1]), r.share_id is not None, tuple(sorted((r.consumed_capacity or {}).items())))
                        for r in outcome.allocations[0].devices.results or []
                    )
                took_preferred = answer is not None and tuple(g for g, _, _ in answer) == gpus
                self.answers[preferred_key if took_preferred else (preferred_key, tuple(free))] = answer
            if answer is None:
                return None
            self._record(node, answer)
            chosen = tuple(g for g, _, _ in answer)
            for g in chosen:
                free[g] -= shape.gpu_milli
        used, count = self.used[node]
        for resource, amount in requests.items():
            used[resource] = used.get(resource, 0) + amount
        self.used[node] = (used, count + 1)
        self.pods += 1
        return chosen

    def _record(self, node: int, answer) -> None:
        pool = self.core.nodes[self.order[node]].name
        results = [
            DeviceRequestAllocationResult(
                request=CLAIM_NAME, driver=DRIVER, pool=pool, device=device_name(g),
                share_id=self._share_id() if shared else None, consumed_capacity=dict(consumed) or None,
            )
            for g, shared, consumed in answer
        ]
        self.state.add_claim(f"trace/pod-{self.pods}", AllocationResult(devices=DeviceAllocationResult(results=results)))

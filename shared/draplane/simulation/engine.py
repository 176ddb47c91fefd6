"""Replay one arrival sequence on one cluster with one policy, fast enough for thousands of runs.

Per pod, the candidates are found with whole-cluster array comparisons (CPU, memory, model, and a
per-node summary of the GPUs: the largest free share and the number of whole free GPUs). Scores are
functions of a node's state and the pod's shape; nodes whose states are equivalent for the policy
(same GPUs' free milli as a multiset, same model, and the same side of every CPU/memory threshold
the policy's workload profile compares against, before and after the pod) share one cached score.
So a pod costs a handful of array operations plus a score computation only for states not seen
before; nothing is recomputed for nodes that did not change.

Nodes are kept in the seed's tie order: among equal scores the lowest index wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from draplane.allocation.fragmentation import (
    MILLI,
    MIB,
    BestFit,
    FirstFit,
    FirstNode,
    FragmentationAwareDraplane,
    NodeState,
    Placement,
    PodShape,
    best_fit_scores,
    kube_scheduler_scores,
)

GpuChoice = tuple[int, ...]


class GroupedPolicy(Protocol):
    name: str

    def place(self, state: NodeState, shape: PodShape) -> Placement | None: ...


@dataclass(slots=True)
class PodOutcome:
    node: int | None  # index into the cluster's node list, None when the pod failed
    gpus: GpuChoice = ()


@dataclass(slots=True)
class ClusterArrays:
    """Mutable per-node state, in tie order."""

    names: list[str]
    models: list[str]
    model_ids: np.ndarray
    cpu_free: np.ndarray
    mem_free: np.ndarray
    cpu_alloc: np.ndarray
    mem_alloc: np.ndarray
    gpus: list[list[int]]  # free milli per GPU, in device order
    max_share: np.ndarray  # largest free milli on one GPU
    whole_free: np.ndarray  # GPUs with all 1000 milli free
    gpu_key: np.ndarray  # interned sorted multiset of free milli
    gpu_total: np.ndarray  # free milli over all GPUs
    keys: dict[tuple[int, ...], int] = field(default_factory=dict)
    key_tuples: list[tuple[int, ...]] = field(default_factory=list)

    def intern(self, gpus: Sequence[int]) -> int:
        multiset = tuple(sorted(gpus, reverse=True))
        found = self.keys.get(multiset)
        if found is None:
            found = self.keys[multiset] = len(self.key_tuples)
            self.key_tuples.append(multiset)
        return found


def build_arrays(names: Sequence[str], models: Sequence[str], cpu: Sequence[int], memory: Sequence[int], gpu_counts: Sequence[int]) -> ClusterArrays:
    model_index = {m: i for i, m in enumerate(sorted(set(models)))}
    n = len(names)
    arrays = ClusterArrays(
        names=list(names),
        models=list(models),
        model_ids=np.array([model_index[m] for m in models], dtype=np.int64),
        cpu_free=np.array(cpu, dtype=np.int64),
        mem_free=np.array(memory, dtype=np.int64),
        cpu_alloc=np.array(cpu, dtype=np.int64),
        mem_alloc=np.array(memory, dtype=np.int64),
        gpus=[[MILLI] * g for g in gpu_counts],
        max_share=np.array([MILLI if g else 0 for g in gpu_counts], dtype=np.int64),
        whole_free=np.array(gpu_counts, dtype=np.int64),
        gpu_key=np.zeros(n, dtype=np.int64),
        gpu_total=np.array([MILLI * g for g in gpu_counts], dtype=np.int64),
    )
    for i in range(n):
        arrays.gpu_key[i] = arrays.intern(arrays.gpus[i])
    return arrays


class Replay:
    """One policy on one cluster: `offer(shape)` places a pod or reports failure."""

    def __init__(
        self,
        arrays: ClusterArrays,
        policy: object,
        *,
        cpu_thresholds: Sequence[int] = (),
        memory_thresholds: Sequence[int] = (),
        confirm: Callable[[int, PodShape, GpuChoice], GpuChoice | None] | None = None,
    ):
        self.a = arrays
        self.policy = policy
        self.cpu_thr = np.array(sorted(set(cpu_thresholds)), dtype=np.int64)
        self.mem_thr = np.array(sorted(set(memory_thresholds)), dtype=np.int64)
        self.cpu_levels = len(self.cpu_thr) + 1
        self.mem_levels = len(self.mem_thr) + 1
        self.model_count = int(arrays.model_ids.max()) + 1 if len(arrays.model_ids) else 1
        self.cache: dict[tuple[int, PodShape], tuple[float, tuple[int, ...]] | None] = {}
        self.model_masks: dict[tuple[str, ...], np.ndarray] = {}
        # The allocator core's word on the chosen node: it may refuse (None) or name the devices.
        self.confirm = confirm
        self.evaluations = 0
        self._policy_version = -1
        self._to_learn: PodShape | None = None  # the pod the policy learns from, once

    # --- helpers ---------------------------------------------------------------------------------

    def state(self, i: int) -> NodeState:
        a = self.a
        return NodeState(a.models[i], int(a.cpu_free[i]), int(a.mem_free[i]), tuple(a.gpus[i]))

    def _candidates(self, shape: PodShape) -> np.ndarray:
        a = self.a
        mask = (a.cpu_free >= shape.cpu_milli) & (a.mem_free >= shape.memory_mib)
        if shape.num_gpu:
            if shape.shares_gpu:
                mask &= a.max_share >= shape.gpu_milli
            else:
                mask &= a.whole_free >= shape.num_gpu
            if shape.models:
                mask &= self._model_mask(shape.models)
        return np.flatnonzero(mask)

    def _model_mask(self, models: tuple[str, ...]) -> np.ndarray:
        allowed = self.model_masks.get(models)
        if allowed is None:
            allowed = self.model_masks[models] = np.array([m in models for m in self.a.models], dtype=bool)
        return allowed

    @staticmethod
    def _gpus_for(free_values: Sequence[int], node_gpus: list[int], shape: PodShape) -> GpuChoice:
        """Device indexes on the node for a choice made on the sorted multiset: lowest index first."""
        if shape.num_gpu == 0:
            return ()
        if shape.shares_gpu:
            want = free_values[0]
            return (node_gpus.index(want),)
        return tuple(i for i, free in enumerate(node_gpus) if free >= shape.gpu_milli)[: shape.num_gpu]

    # --- choosing --------------------------------------------------------------------------------

    def _choose_grouped(self, shape: PodShape, idx: np.ndarray) -> tuple[int, GpuChoice]:
        a = self.a
        cpu = a.cpu_free[idx]
        mem = a.mem_free[idx]
        key = a.gpu_key[idx] * self.model_count + a.model_ids[idx]
        if self.cpu_levels > 1:
            key = key * self.cpu_levels + np.searchsorted(self.cpu_thr, cpu, side="right")
            key = key * self.cpu_levels + np.searchsorted(self.cpu_thr, cpu - shape.cpu_milli, side="right")
        if self.mem_levels > 1:
            key = key * self.mem_levels + np.searchsorted(self.mem_thr, mem, side="right")
            key = key * self.mem_levels + np.searchsorted(self.mem_thr, mem - shape.memory_mib, side="right")
        unique, first = np.unique(key, return_index=True)
        best_score = -np.inf
        best_pos = -1
        best_free: tuple[int, ...] = ()
        cache = self.cache
        for k, pos in zip(unique.tolist(), first.tolist()):
            entry = cache.get((k, shape), False)
            if entry is False:
                node = int(idx[pos])
                sorted_state = NodeState(a.models[node], int(a.cpu_free[node]), int(a.mem_free[node]), a.key_tuples[int(a.gpu_key[node])])
                placement = self.policy.place(sorted_state, shape)
                self.evaluations += 1
                entry = None if placement is None else (placement.score, tuple(sorted_state.gpus[g] for g in placement.gpus))
                cache[(k, shape)] = entry
            if entry is None:
                continue
            score = entry[0]
            if score > best_score or (score == best_score and pos < best_pos):
                best_score, best_pos, best_free = score, pos, entry[1]
        if best_pos < 0:
            return -1, ()
        node = int(idx[best_pos])
        return node, self._gpus_for(best_free, a.gpus[node], shape)

    def _choose(self, shape: PodShape, idx: np.ndarray) -> tuple[int, GpuChoice]:
        a = self.a
        if isinstance(self.policy, FirstNode):
            node = int(idx[0])
            placement = self.policy.place(self.state(node), shape)
            return node, placement.gpus if placement else ()
        if isinstance(self.policy, FirstFit):
            scores = kube_scheduler_scores(a.cpu_free[idx], a.cpu_alloc[idx], a.mem_free[idx], a.mem_alloc[idx], shape)
            node = int(idx[int(np.argmax(scores))])
            placement = self.policy.place(self.state(node), shape)
            return node, placement.gpus if placement else ()
        if isinstance(self.policy, BestFit):
            scores = best_fit_scores(a.cpu_free[idx], a.gpu_total[idx], shape)
            node = int(idx[int(np.argmax(scores))])
            placement = self.policy.place(self.state(node), shape)
            return node, placement.gpus if placement else ()
        if isinstance(self.policy, FragmentationAwareDraplane):
            return self._choose_draplane(shape, idx)
        return self._choose_grouped(shape, idx)

    def _device_feasible_anywhere(self, shape: PodShape) -> bool:
        """Whether the pod's GPUs fit some node, CPU and memory aside: the allocator core learns
        from a pod when its claim fits some node's devices, before node fit is asked."""
        a = self.a
        mask = a.max_share >= shape.gpu_milli if shape.shares_gpu else a.whole_free >= shape.num_gpu
        if shape.models:
            mask = mask & self._model_mask(shape.models)
        return bool(mask.any())

    def _choose_draplane(self, shape: PodShape, idx: np.ndarray) -> tuple[int, GpuChoice]:
        """The shipped policy as the shard's core applies it (see FragmentationAwareDraplane): each
        node's device part is computed under what was learned before this pod (the core searches
        first), then the pod is learned from, then its stranding term is added; the lowest total
        wins, ties to the node order."""
        a = self.a
        policy: FragmentationAwareDraplane = self.policy  # type: ignore[assignment]
        workload = policy.workload
        if workload.version != self._policy_version:
            self.cache.clear()  # device parts computed with the old waste table
            self._policy_version = workload.version
        keys = a.gpu_key[idx]
        unique, inverse = np.unique(keys, return_inverse=True)
        device_scores = np.empty(len(unique))
        cache = self.cache
        for j, k in enumerate(unique.tolist()):
            entry = cache.get((k, shape), False)
            if entry is False:
                found = policy.device_choice(a.key_tuples[k], shape)
                self.evaluations += 1
                entry = cache[(k, shape)] = None if found is None else found[0]
            device_scores[j] = np.inf if entry is None else entry
        self._learn()
        taken = shape.gpu_demand
        totals = a.gpu_total[idx]
        cpu = a.cpu_free[idx]
        memory = a.mem_free[idx] * MIB
        stranded = workload.stranded_many
        term = (stranded(totals - taken, cpu - shape.cpu_milli, memory - shape.memory_mib * MIB)
                - stranded(totals, cpu, memory)) / MILLI
        scores = device_scores[inverse] + term
        pos = int(np.argmin(scores))  # first minimum: the node order breaks ties
        if not np.isfinite(scores[pos]):
            return -1, ()
        node = int(idx[pos])
        found = policy.device_choice(a.gpus[node], shape)
        return node, found[1] if found else ()

    # --- the one entry point ---------------------------------------------------------------------

    def offer(self, shape: PodShape) -> PodOutcome:
        idx = self._candidates(shape)
        if isinstance(self.policy, FragmentationAwareDraplane) and shape.num_gpu and self._device_feasible_anywhere(shape):
            self._to_learn = shape
        try:
            return self._offer(shape, idx)
        finally:
            self._learn()

    def _learn(self) -> None:
        shape, self._to_learn = self._to_learn, None
        if shape is not None:
            self.policy.observe_requests(shape.cpu_milli, shape.memory_mib * MIB, shape.gpu_demand)

    def _offer(self, shape: PodShape, idx: np.ndarray) -> PodOutcome:
        while idx.size:
            node, gpus = self._choose(shape, idx)
            if node < 0:
                break
            if self.confirm is not None:
                confirmed = self.confirm(node, shape, gpus)
                if confirmed is None:
                    # The allocator core disagrees with the pre-check: drop the node and look again.
                    idx = idx[idx != node]
                    continue
                gpus = confirmed
            self._bind(node, shape, gpus)
            return PodOutcome(node, gpus)
        return PodOutcome(None)

    def _bind(self, node: int, shape: PodShape, gpus: GpuChoice) -> None:
        a = self.a
        a.cpu_free[node] -= shape.cpu_milli
        a.mem_free[node] -= shape.memory_mib
        if not gpus:
            return
        free = a.gpus[node]
        for g in gpus:
            free[g] -= shape.gpu_milli
            if free[g] < 0:
                raise AssertionError(f"node {a.names[node]} GPU {g} over-allocated")
        a.max_share[node] = max(free)
        a.whole_free[node] = sum(1 for f in free if f == MILLI)
        a.gpu_key[node] = a.intern(free)
        a.gpu_total[node] = sum(free)

"""The binder's part of kube-scheduler's default topology spreading: caches of the selectors of
Services, ReplicationControllers, ReplicaSets and StatefulSets, and the selector each pending pod
without topologySpreadConstraints spreads by (PendingPod.default_spread; the shard scores with it,
draplane.scheduling.pod_scores).

Only selectors are kept: (namespace, name) -> selector, per kind. The decision is
draplane.scheduling.framework.plugins.pod_topology_spread.default_selector's. It only scores, so a pod published
before a watch has listed goes without it rather than waiting; a selector that changes later
applies to the pods published after (kube-scheduler reads its listers at scoring time too).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from draplane.api.apps import ReplicaSet, ReplicationController, Service, StatefulSet
from draplane.api.core import Pod
from draplane.api.policy import LabelSelector
from draplane.kube import KubeClient, watch_objects
from draplane.scheduling.framework.plugins import pod_topology_spread as spread

Key = tuple[str, str]

_KINDS = {Service: "services", ReplicationController: "replicationcontrollers", ReplicaSet: "replicasets",
          StatefulSet: "statefulsets"}


class DefaultSpreading:
    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube
        # namespace -> name -> selector
        self.services: dict[str, dict[str, Service]] = {}
        # namespace -> (kind, name) -> selector (a dict for a ReplicationController)
        self.controllers: dict[str, dict[tuple[str, str], LabelSelector | dict[str, str]]] = {}
        self.synced = {what: asyncio.Event() for what in _KINDS.values()}

    def watches(self) -> list[tuple[str, Callable[[], Awaitable]]]:
        return [(f"{what} watch (default spreading)", lambda model=model, what=what: self._watch(model, what))
                for model, what in _KINDS.items()]

    async def _watch(self, model, what: str) -> None:
        async for event in watch_objects(self.kube, model):
            if event.type == "SYNCED":
                self.synced[what].set()
                continue
            self.apply(event.type, event.object)

    def apply(self, kind: str, obj) -> None:
        namespace, name = obj.metadata.namespace or "", obj.metadata.name or ""
        if isinstance(obj, Service):
            # only the selector is read: kept trimmed, a cluster's services are many
            by_name = self.services.setdefault(namespace, {})
            if kind == "DELETED" or obj.spec.selector is None:
                by_name.pop(name, None)
            else:
                by_name[name] = Service(spec=obj.spec)
            if not by_name:
                self.services.pop(namespace, None)
            return
        key = (type(obj).__name__, name)
        by_key = self.controllers.setdefault(namespace, {})
        if kind == "DELETED" or obj.spec.selector is None:
            by_key.pop(key, None)
        else:
            by_key[key] = obj.spec.selector
        if not by_key:
            self.controllers.pop(namespace, None)

    def selector_for(self, pod: Pod) -> LabelSelector | None:
        """What the pod spreads among by default; None when it has constraints of its own, or
        nothing selects it."""
        if pod.spec.topology_spread_constraints:
            return None
        namespace = pod.metadata.namespace or ""
        return spread.default_selector(pod, self.services.get(namespace, {}).values(),
                                       self.controllers.get(namespace, {}))

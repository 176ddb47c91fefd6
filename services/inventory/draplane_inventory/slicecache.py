"""Every ResourceSlice in the cluster as the inventory service last saw it, indexed by feed key. Pure.

Fed by the service's own writes (their responses) and by its watch, which may deliver an event
that a write has already overtaken: such events are recognised by resourceVersion and dropped.
"""

from __future__ import annotations

import collections

from draplane.api.resource import ResourceSlice
from draplane.messages.inventory import InventoryNames
from draplane.nodes.slices import is_managed


class SliceCache:
    """Every ResourceSlice in the cluster, by name, indexed by feed key."""

    def __init__(self, names: InventoryNames, managed_by: str):
        self.names = names
        self.managed_by = managed_by
        self.by_name: dict[str, ResourceSlice] = {}
        self.by_key: dict[str, set[str]] = collections.defaultdict(set)

    def key_of(self, s: ResourceSlice) -> str:
        if s.spec.node_name:
            return self.names.node_key(s.spec.node_name)
        return self.names.pool_key(s.spec.driver, s.spec.pool.name)

    def put(self, s: ResourceSlice) -> str | None:
        """Store unless older than what is cached; returns the feed key when something changed."""
        name = s.metadata.name
        old = self.by_name.get(name)
        if old is not None and _rv(old) > _rv(s):
            return None  # a watch event that our own write already overtook
        if old is not None:
            self.by_key[self.key_of(old)].discard(name)
        self.by_name[name] = s
        key = self.key_of(s)
        self.by_key[key].add(name)
        return key

    def remove(self, name: str, resource_version: str | None = None) -> str | None:
        old = self.by_name.get(name)
        if old is None:
            return None
        if resource_version is not None and _rv(old) > rv_number(resource_version):
            return None  # the deletion of an earlier incarnation; the name was created again since
        del self.by_name[name]
        key = self.key_of(old)
        self.by_key[key].discard(name)
        return key

    def slices(self, key: str) -> list[ResourceSlice]:
        return [self.by_name[n] for n in sorted(self.by_key.get(key, ()))]

    def managed_for_node(self, node: str) -> list[ResourceSlice]:
        return [s for s in self.slices(self.names.node_key(node)) if is_managed(s, self.managed_by)]

    def managed_nodes(self) -> set[str]:
        return {s.spec.node_name for s in self.by_name.values() if is_managed(s, self.managed_by) and s.spec.node_name}


def _rv(s: ResourceSlice) -> int:
    return rv_number(s.metadata.resource_version)


def rv_number(text: str | None) -> int:
    # etcd revisions: comparable as numbers, which only ordering stale watch events needs.
    try:
        return int(text or 0)
    except ValueError:
        return 0

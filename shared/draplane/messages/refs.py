"""How every message names a Kubernetes object: a pod or a claim, by namespace, name and uid."""

from __future__ import annotations

import msgspec


class ObjectRef(msgspec.Struct, frozen=True, kw_only=True):
    namespace: str
    name: str
    uid: str

    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

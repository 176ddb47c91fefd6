"""How the binder's components name Kubernetes objects and times."""

from __future__ import annotations

from datetime import datetime, timezone

Key = tuple[str, str]  # (namespace, name)


def key_of(obj) -> Key:
    return (obj.metadata.namespace or "", obj.metadata.name or "")


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

"""A small typed async Kubernetes client: kubernetes_asyncio for configuration and transport,
msgspec models for bodies, so objects are decoded once, straight into draplane.api types."""

from draplane.kube.client import KubeApiError, KubeClient, ResourceKind, kind_of
from draplane.kube.watching import WatchEvent, watch_objects

__all__ = ["KubeApiError", "KubeClient", "ResourceKind", "kind_of", "WatchEvent", "watch_objects"]

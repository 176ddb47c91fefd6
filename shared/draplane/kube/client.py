"""Typed requests to the Kubernetes API.

kubernetes_asyncio loads the configuration (kubeconfig or in-cluster) and owns the aiohttp session;
bodies are requested as raw JSON and decoded with msgspec, which is many times faster than the
generated models and keeps every field (the generated v1 models drop fields they do not know).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, AsyncIterator, TypeVar
from urllib.parse import urlencode

import aiohttp
import aiohttp.helpers
import msgspec
import yarl
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config

from draplane.api import apps, core, policy, resource, scheduling, storage
from draplane.api.meta import ListMeta
from draplane.kube.metrics import ApiserverMetrics
from draplane.kube.ratelimit import TokenBucket, retry_after_seconds, retry_delay

log = logging.getLogger(__name__)
T = TypeVar("T", bound=msgspec.Struct)


@dataclasses.dataclass(frozen=True, slots=True)
class ResourceKind:
    group_version: str  # "v1" or "resource.k8s.io/v1"
    plural: str
    namespaced: bool
    model: type[msgspec.Struct] | None = None
    list_model: type[msgspec.Struct] | None = None

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = "/api/v1" if self.group_version == "v1" else f"/apis/{self.group_version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
        return base


KINDS: dict[type[msgspec.Struct], ResourceKind] = {
    resource.DeviceClass: ResourceKind("resource.k8s.io/v1", "deviceclasses", False, resource.DeviceClass, resource.DeviceClassList),
    resource.ResourceSlice: ResourceKind("resource.k8s.io/v1", "resourceslices", False, resource.ResourceSlice, resource.ResourceSliceList),
    resource.ResourceClaim: ResourceKind("resource.k8s.io/v1", "resourceclaims", True, resource.ResourceClaim, resource.ResourceClaimList),
    resource.ResourceClaimTemplate: ResourceKind(
        "resource.k8s.io/v1", "resourceclaimtemplates", True, resource.ResourceClaimTemplate, resource.ResourceClaimTemplateList
    ),
    resource.DeviceTaintRule: ResourceKind(
        "resource.k8s.io/v1", "devicetaintrules", False, resource.DeviceTaintRule, resource.DeviceTaintRuleList
    ),
    core.Pod: ResourceKind("v1", "pods", True, core.Pod, core.PodList),
    core.Node: ResourceKind("v1", "nodes", False, core.Node, core.NodeList),
    policy.PodDisruptionBudget: ResourceKind(
        "policy/v1", "poddisruptionbudgets", True, policy.PodDisruptionBudget, policy.PodDisruptionBudgetList
    ),
    storage.PersistentVolumeClaim: ResourceKind(
        "v1", "persistentvolumeclaims", True, storage.PersistentVolumeClaim, storage.PersistentVolumeClaimList
    ),
    storage.PersistentVolume: ResourceKind(
        "v1", "persistentvolumes", False, storage.PersistentVolume, storage.PersistentVolumeList
    ),
    storage.StorageClass: ResourceKind(
        "storage.k8s.io/v1", "storageclasses", False, storage.StorageClass, storage.StorageClassList
    ),
    storage.CSINode: ResourceKind("storage.k8s.io/v1", "csinodes", False, storage.CSINode, storage.CSINodeList),
    storage.CSIDriver: ResourceKind("storage.k8s.io/v1", "csidrivers", False, storage.CSIDriver, storage.CSIDriverList),
    storage.VolumeAttachment: ResourceKind(
        "storage.k8s.io/v1", "volumeattachments", False, storage.VolumeAttachment, storage.VolumeAttachmentList
    ),
    apps.Service: ResourceKind("v1", "services", True, apps.Service, apps.ServiceList),
    apps.ReplicationController: ResourceKind(
        "v1", "replicationcontrollers", True, apps.ReplicationController, apps.ReplicationControllerList
    ),
    apps.ReplicaSet: ResourceKind("apps/v1", "replicasets", True, apps.ReplicaSet, apps.ReplicaSetList),
    apps.StatefulSet: ResourceKind("apps/v1", "statefulsets", True, apps.StatefulSet, apps.StatefulSetList),
    scheduling.PodGroup: ResourceKind(
        scheduling.API_VERSION, "podgroups", True, scheduling.PodGroup, scheduling.PodGroupList
    ),
}


def kind_of(model: type[msgspec.Struct]) -> ResourceKind:
    try:
        return KINDS[model]
    except KeyError:
        raise TypeError(f"{model.__name__} is not a Kubernetes kind the client knows") from None


class Status(msgspec.Struct, omit_defaults=True):
    """metav1.Status, as the apiserver returns it with every error."""

    message: str = ""
    reason: str = ""
    code: int = 0
    details: dict[str, Any] | None = None


DEADLINE_REASON = "DeadlineExceeded"  # KubeApiError.reason when an attempt was not made in time


class KubeApiError(Exception):
    def __init__(self, status: int, reason: str, message: str, method: str, path: str, details: dict | None = None):
        super().__init__(f"{method} {path}: {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.details = details or {}
        # Set by KubeClient.request when it gave up because the caller's deadline left no time
        # for another attempt (the error is then the last attempt's, or DEADLINE_REASON's).
        self.past_deadline = False

    @property
    def is_conflict(self) -> bool:
        return self.status == 409 and self.reason == "Conflict"

    @property
    def is_already_exists(self) -> bool:
        return self.status == 409 and self.reason == "AlreadyExists"

    @property
    def is_not_found(self) -> bool:
        return self.status == 404

    @property
    def is_gone(self) -> bool:
        return self.status == 410

    @property
    def is_invalid(self) -> bool:
        return self.status == 422

    @property
    def refused_by_disruption_budget(self) -> bool:
        """The Eviction API's answer when a PodDisruptionBudget forbids the eviction: a 429 whose
        cause is DisruptionBudget. It is a verdict, not overload: retrying at once cannot help."""
        causes = self.details.get("causes") or []
        return self.status == 429 and any(c.get("type") == "DisruptionBudget" for c in causes if isinstance(c, dict))

    @property
    def retryable(self) -> bool:
        return self.status in (429, 500, 502, 503, 504) and not self.refused_by_disruption_budget


_encoder = msgspec.json.Encoder()
_status_decoder = msgspec.json.Decoder(Status)


class KubeClient:
    """One connection pool to one apiserver. Use as an async context manager or call close().

    Every attempt, retries and watches included, first takes a token of the client-side rate
    limit (`qps`/`burst`, as client-go's `--kube-api-qps`/`--kube-api-burst`; `qps` 0, the
    default here, is no limit: tests and the CLI; each service sets its own, see `limit_rate`).
    """

    def __init__(self, api_client: k8s_client.ApiClient, *, max_retries: int = 5, qps: float = 0.0, burst: int = 1):
        self._api = api_client
        self._max_retries = max_retries
        self._bucket = TokenBucket(qps, burst, now=time.monotonic())
        # The environment's proxy for the apiserver, looked up by the first request in a worker
        # thread (it reads ~/.netrc: not on the event loop), then kept (_environment_proxy_once).
        self._proxy_lookup: asyncio.Future | None = None
        self._proxy: str | None = None
        self._proxy_auth: aiohttp.BasicAuth | None = None
        # Set by a service to count its requests in its own registry (draplane.kube.metrics).
        self.metrics: ApiserverMetrics | None = None

    def limit_rate(self, qps: float, burst: int) -> None:
        """From now on at most `qps` requests a second on average, `burst` at once (qps <= 0: no limit)."""
        self._bucket = TokenBucket(qps, burst, now=time.monotonic())

    async def environment_proxy(self) -> str | None:
        """The proxy requests to the apiserver go through (None: none), looked up once."""
        if self._proxy_lookup is None:
            self._proxy_lookup = asyncio.ensure_future(asyncio.to_thread(_environment_proxy_once, self._api))
        # shielded: a request cancelled meanwhile must not cancel the lookup the others wait for
        self._proxy, self._proxy_auth = await asyncio.shield(self._proxy_lookup)
        return self._proxy

    async def _throttle(self, method: str, path: str, *, watch: bool) -> None:
        wait = self._bucket.reserve(time.monotonic())
        if self.metrics is not None:
            self.metrics.observe_throttle(method, path, wait, watch=watch)
        if wait > 0:
            await asyncio.sleep(wait)

    @classmethod
    async def from_kubeconfig(cls, path: str | Path | None = None, *, impersonate: str | None = None,
                              max_retries: int = 5) -> "KubeClient":
        configuration = k8s_client.Configuration()
        await k8s_config.load_kube_config(config_file=str(path) if path else None, client_configuration=configuration)
        api = k8s_client.ApiClient(configuration)
        if impersonate:
            api.set_default_header("Impersonate-User", impersonate)
        return cls(api, max_retries=max_retries)

    @classmethod
    def in_cluster(cls) -> "KubeClient":
        configuration = k8s_client.Configuration()
        k8s_config.load_incluster_config(client_configuration=configuration)
        return cls(k8s_client.ApiClient(configuration))

    @classmethod
    async def from_environment(cls, kubeconfig: str | Path | None = None) -> "KubeClient":
        """A kubeconfig if one is named or present, else the in-cluster service account."""
        if kubeconfig or not Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists():
            return await cls.from_kubeconfig(kubeconfig)
        return cls.in_cluster()

    async def close(self) -> None:
        await self._api.close()

    async def __aenter__(self) -> "KubeClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # --- transport ---------------------------------------------------------------------------

    async def _open(
        self, method: str, path: str, *, query: dict[str, Any] | None, body: bytes | None,
        content_type: str, timeout: aiohttp.ClientTimeout | None, extra_headers: dict[str, str] | None = None,
        watch: bool = False,
    ) -> aiohttp.ClientResponse:
        await self._throttle(method, path, watch=watch)
        if self._proxy_lookup is None or not self._proxy_lookup.done():
            await self.environment_proxy()
        headers = dict(self._api.default_headers)
        headers["Content-Type"] = content_type
        headers["Accept"] = "application/json"
        if extra_headers:
            headers.update(extra_headers)
        await self._api.update_params_for_auth(headers, None, ["BearerToken"])
        url = self._api.configuration.host + path
        if query:
            url += "?" + urlencode({k: _query_value(v) for k, v in query.items() if v is not None})
        session: aiohttp.ClientSession = self._api.rest_client.pool_manager
        return await session.request(method, url, data=body, headers=headers, proxy=self._proxy,
                                     proxy_auth=self._proxy_auth, timeout=timeout or aiohttp.ClientTimeout(total=60))

    async def request(
        self, method: str, path: str, *, query: dict[str, Any] | None = None, body: Any = None,
        content_type: str = "application/json", headers: dict[str, str] | None = None,
        deadline: float | None = None,
    ) -> bytes:
        """One request, retried with backoff on 429/5xx and on no answer; raises KubeApiError.

        A 429 or 5xx with Retry-After (API Priority and Fairness sends one with its 429s) waits
        that long, bounded (draplane.kube.ratelimit); without it, jittered exponential backoff. A
        POST whose connection broke after it was sent is not sent again: the apiserver may have
        done it, and a second create of a generateName object would make two. A connection that
        could not be opened is always retried: nothing was sent.
        """
        payload = body if body is None or isinstance(body, bytes) else _encoder.encode(body)
        attempt = 0
        while True:
            started = time.monotonic()
            if deadline is not None and started >= deadline:
                # `deadline` (monotonic): no attempt may start after it. The binder's writes of a
                # reservation's allocation pass the moment its lease could run out: an attempt
                # retried past it, once the apiserver is back, could allocate devices the shards
                # have given to another claim meanwhile.
                error = KubeApiError(504, DEADLINE_REASON, "not sent: its deadline passed", method, path)
                error.past_deadline = True
                raise error
            retry_after = None
            timeout = None if deadline is None else aiohttp.ClientTimeout(total=min(60.0, deadline - started))
            try:
                async with await self._open(
                    method, path, query=query, body=payload, content_type=content_type, timeout=timeout, extra_headers=headers
                ) as response:
                    data = await response.read()
                    if self.metrics is not None:
                        self.metrics.observe(method, path, response.status, time.monotonic() - started)
                    if response.status < 400:
                        return data
                    error = _api_error(response.status, data, method, path)
                    retry_after = retry_after_seconds(response.headers.get("Retry-After"))
                    retryable = error.retryable
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                if self.metrics is not None:
                    self.metrics.observe(method, path, None, time.monotonic() - started)
                error = KubeApiError(503, "Unavailable", f"connection failed: {exc}", method, path)
                retryable = method != "POST" or isinstance(exc, aiohttp.ClientConnectorError)
            if not retryable or attempt >= self._max_retries:
                raise error
            attempt += 1
            delay = retry_delay(attempt, retry_after)
            if deadline is not None and time.monotonic() + delay >= deadline:
                error.past_deadline = True  # no time for another attempt
                raise error
            log.debug("retrying %s %s in %.2fs after %s", method, path, delay, error)
            await asyncio.sleep(delay)

    async def stream_lines(
        self, path: str, *, query: dict[str, Any], timeout: float
    ) -> AsyncIterator[bytes]:
        """Lines of a streaming GET (a watch). Raises KubeApiError for an error status."""
        try:
            opened = await self._open(
                "GET", path, query=query, body=None, content_type="application/json",
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout), watch=True,
            )
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
            if self.metrics is not None:
                self.metrics.observe("GET", path, None, None, watch=True)
            raise
        async with opened as response:
            if self.metrics is not None:
                self.metrics.observe("GET", path, response.status, None, watch=True)
            if response.status >= 400:
                raise _api_error(response.status, await response.read(), "GET", path)
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield line

    # --- typed verbs ---------------------------------------------------------------------------

    async def get(self, model: type[T], name: str, namespace: str | None = None) -> T:
        data = await self.request("GET", kind_of(model).path(namespace, name))
        return msgspec.json.decode(data, type=model)

    async def list(
        self, model: type[T], namespace: str | None = None, *, label_selector: str | None = None,
        field_selector: str | None = None, limit: int = 500,
        undecodable: Callable[[bytes, msgspec.ValidationError], None] | None = None,
    ) -> tuple[list[T], str]:
        """All objects (following `continue`) and the list's resourceVersion to watch from.
        With `undecodable`, an object the model cannot hold (a field of another type than it
        declares) is given to it, with the error, and left out, instead of failing the list."""
        kind = kind_of(model)
        items: list[T] = []
        token = None
        while True:
            data = await self.request(
                "GET", kind.path(namespace),
                query={"labelSelector": label_selector, "fieldSelector": field_selector, "limit": limit, "continue": token},
            )
            try:
                page = msgspec.json.decode(data, type=kind.list_model)
            except msgspec.ValidationError:
                if undecodable is None:
                    raise
                page = msgspec.json.decode(data, type=_RawPage)
                for raw in page.items:
                    try:
                        items.append(msgspec.json.decode(raw, type=model))
                    except msgspec.ValidationError as exc:
                        undecodable(bytes(raw), exc)
                token = page.metadata.continue_ if page.metadata else None
                if not token:
                    return items, (page.metadata.resource_version if page.metadata else "") or ""
                continue
            items.extend(page.items)
            token = page.metadata.continue_ if page.metadata else None
            if not token:
                return items, (page.metadata.resource_version if page.metadata else "") or ""

    async def create(self, obj: T, *, dry_run: bool = False) -> T:
        kind = kind_of(type(obj))
        data = await self.request(
            "POST", kind.path(obj.metadata.namespace), body=obj, query={"dryRun": "All" if dry_run else None}
        )
        return msgspec.json.decode(data, type=type(obj))

    async def update(self, obj: T, *, deadline: float | None = None) -> T:
        kind = kind_of(type(obj))
        data = await self.request("PUT", kind.path(obj.metadata.namespace, obj.metadata.name), body=obj,
                                  deadline=deadline)
        return msgspec.json.decode(data, type=type(obj))

    async def update_status(self, obj: T, *, deadline: float | None = None) -> T:
        kind = kind_of(type(obj))
        data = await self.request("PUT", kind.path(obj.metadata.namespace, obj.metadata.name, "status"), body=obj,
                                  deadline=deadline)
        return msgspec.json.decode(data, type=type(obj))

    async def patch(
        self, model: type[T], name: str, patch: Any, namespace: str | None = None, *,
        patch_type: str = "application/merge-patch+json", subresource: str | None = None,
    ) -> T:
        data = await self.request(
            "PATCH", kind_of(model).path(namespace, name, subresource), body=patch, content_type=patch_type
        )
        return msgspec.json.decode(data, type=model)

    async def delete(self, model: type[msgspec.Struct], name: str, namespace: str | None = None, *, missing_ok: bool = True) -> None:
        try:
            await self.request("DELETE", kind_of(model).path(namespace, name))
        except KubeApiError as exc:
            if not (missing_ok and exc.is_not_found):
                raise

    async def bind_pod(self, namespace: str, pod: str, node: str, pod_uid: str | None = None) -> None:
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": pod, "namespace": namespace, **({"uid": pod_uid} if pod_uid else {})},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        await self.request("POST", f"/api/v1/namespaces/{namespace}/pods/{pod}/binding", body=binding)

    async def evict_pod(self, namespace: str, name: str, uid: str | None = None) -> None:
        """The Eviction API: the pod is deleted with its own grace period unless a
        PodDisruptionBudget forbids it (429). With `uid`, only that pod, not a namesake (409)."""
        eviction: dict[str, Any] = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if uid:
            eviction["deleteOptions"] = {"preconditions": {"uid": uid}}
        await self.request("POST", f"/api/v1/namespaces/{namespace}/pods/{name}/eviction", body=eviction)

    async def create_namespace(self, name: str) -> None:
        try:
            await self.request("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        except KubeApiError as exc:
            if not exc.is_already_exists:
                raise

    async def apply_raw(self, raw: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Create an object of any kind from a plain dict (manifests, Events, RBAC objects)."""
        path = raw_collection_path(raw)
        data = await self.request("POST", path, body=raw, query={"dryRun": "All" if dry_run else None})
        return msgspec.json.decode(data)


def _environment_proxy_once(api_client: k8s_client.ApiClient) -> tuple[str | None, aiohttp.BasicAuth | None]:
    """The proxy the environment names for the apiserver, looked up once; then trust_env goes off.

    kubernetes_asyncio's session trusts the environment, and aiohttp then reads ~/.netrc and the
    proxy variables in a worker thread on every request: two thread hops per apiserver call, a
    fifth of the binder's CPU under load. The answer cannot change while we run, so ask once and
    pass the proxy explicitly. A proxy set in the kubeconfig (proxy-url) wins over the environment.
    """
    configuration = api_client.configuration
    if configuration.proxy:
        return configuration.proxy, None
    session: aiohttp.ClientSession = api_client.rest_client.pool_manager
    if not session.trust_env:
        return None, None
    session._trust_env = False  # no public setter; tests/shared/kube check it takes effect
    try:
        proxy, auth = aiohttp.helpers.get_env_proxy_for_url(yarl.URL(configuration.host))
    except LookupError:
        return None, None
    return str(proxy), auth


def raw_collection_path(raw: dict[str, Any]) -> str:
    api_version, kind = raw["apiVersion"], raw["kind"]
    namespace = (raw.get("metadata") or {}).get("namespace")
    plural = _plural(kind)
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace and kind not in _CLUSTER_SCOPED:
        return f"{base}/namespaces/{namespace}/{plural}"
    return f"{base}/{plural}"


_CLUSTER_SCOPED = {
    "Namespace", "Node", "ClusterRole", "ClusterRoleBinding", "DeviceClass", "ResourceSlice",
    "CustomResourceDefinition", "PriorityClass", "StorageClass", "PersistentVolume", "DeviceTaintRule",
    "CSINode", "CSIDriver", "VolumeAttachment",
    "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
}


def _plural(kind: str) -> str:
    lower = kind.lower()
    if lower.endswith("s"):
        return lower + "es"
    if lower.endswith("y"):
        return lower[:-1] + "ies"
    return lower + "s"


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _api_error(status: int, data: bytes, method: str, path: str) -> KubeApiError:
    try:
        body = _status_decoder.decode(data)
        return KubeApiError(status, body.reason or str(status), body.message or data.decode(errors="replace"), method, path, body.details)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return KubeApiError(status, str(status), data.decode(errors="replace")[:500], method, path)


class _RawPage(msgspec.Struct, rename="camel", kw_only=True):
    """A list page whose items are decoded one by one (KubeClient.list's `undecodable`)."""

    metadata: ListMeta | None = None
    items: list[msgspec.Raw] = msgspec.field(default_factory=list)

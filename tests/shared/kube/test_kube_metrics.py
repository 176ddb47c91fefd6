"""apiserver requests counted by verb and resource, as the KubeClient sends them."""

import pytest
from aiohttp import web
from kubernetes_asyncio import client as k8s_client
from prometheus_client import CollectorRegistry

from draplane.api.core import Pod
from draplane.kube import KubeApiError, KubeClient
from draplane.kube.metrics import ApiserverMetrics, request_labels
from draplane.metrics import sample_value


@pytest.mark.parametrize(("method", "path", "watch", "expected"), [
    ("GET", "/api/v1/namespaces/ns/pods", False, ("list", "pods")),
    ("GET", "/api/v1/pods", True, ("watch", "pods")),
    ("GET", "/api/v1/namespaces/ns/pods/p", False, ("get", "pods")),
    ("POST", "/api/v1/namespaces/ns/pods/p/binding", False, ("create", "pods/binding")),
    ("PATCH", "/api/v1/namespaces/ns/pods/p/status", False, ("patch", "pods/status")),
    ("PUT", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c/status", False, ("update", "resourceclaims/status")),
    ("POST", "/apis/resource.k8s.io/v1/resourceslices", False, ("create", "resourceslices")),
    ("DELETE", "/apis/resource.k8s.io/v1/resourceslices/s", False, ("delete", "resourceslices")),
    ("DELETE", "/apis/resource.k8s.io/v1/resourceslices", False, ("deletecollection", "resourceslices")),
    ("POST", "/api/v1/namespaces", False, ("create", "namespaces")),
    ("GET", "/api/v1/namespaces/ns", False, ("get", "namespaces")),
    ("POST", "/api/v1/namespaces/ns/events", False, ("create", "events")),
    ("GET", "/metrics", False, ("get", "non-resource")),
    ("GET", "/apis", False, ("get", "non-resource")),
])
def test_request_labels(method, path, watch, expected):
    assert request_labels(method, path, watch=watch) == expected


async def test_every_attempt_is_counted_with_its_errors():
    answers = iter([503, 200, 404])

    async def pods(request: web.Request) -> web.Response:
        status = next(answers)
        if status == 200:
            return web.json_response({"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": []}})
        return web.json_response({"kind": "Status", "code": status, "reason": "x", "message": "no"}, status=status)

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/ns/pods/p", pods)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    configuration = k8s_client.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    kube = KubeClient(k8s_client.ApiClient(configuration))
    registry = CollectorRegistry()
    kube.metrics = ApiserverMetrics(registry)
    try:
        await kube.get(Pod, "p", "ns")  # a 503, retried, then the pod
        with pytest.raises(KubeApiError):
            await kube.get(Pod, "p", "ns")
    finally:
        await kube.close()
        await runner.cleanup()
    labels = {"verb": "get", "resource": "pods"}
    assert sample_value(registry, "draplane_apiserver_requests_total", **labels) == 3
    assert sample_value(registry, "draplane_apiserver_request_errors_total", code="503", **labels) == 1
    assert sample_value(registry, "draplane_apiserver_request_errors_total", code="404", **labels) == 1
    assert sample_value(registry, "draplane_apiserver_request_duration_seconds_count", **labels) == 3

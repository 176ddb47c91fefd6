"""Requests to the apiserver, counted by Kubernetes verb and resource, as the KubeClient makes them.

Every HTTP attempt counts (a request retried after a 503 is two requests and one error), so the
figures are what the apiserver saw. The verb is the one RBAC and the apiserver's own
`apiserver_request_total` use (get, list, watch, create, update, patch, delete), the resource its
plural with the subresource (`pods/binding`, `resourceclaims/status`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# The apiserver answers most requests in milliseconds; a slow etcd or a big list takes seconds.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CONNECTION_FAILED = "connection"  # the error code of a request that got no answer

_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def request_labels(method: str, path: str, *, watch: bool = False) -> tuple[str, str]:
    """(verb, resource) of a request: `GET /api/v1/namespaces/ns/pods` is ("list", "pods"),
    `POST /api/v1/namespaces/ns/pods/p/binding` ("create", "pods/binding"). A path outside the
    resource API (/version, /metrics) has the resource "non-resource"."""
    parts = [p for p in path.split("?", 1)[0].split("/") if p]
    if parts[:2] == ["api", "v1"]:
        rest = parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        rest = parts[3:]
    else:
        rest = []
    if not rest:
        return method.lower(), "non-resource"
    if rest[0] == "namespaces" and len(rest) >= 3:
        rest = rest[2:]  # a namespaced resource; /namespaces/<name> itself stays a namespace
    resource = rest[0] if len(rest) < 3 else f"{rest[0]}/{rest[2]}"
    named = len(rest) >= 2
    if method == "GET":
        verb = "watch" if watch else "get" if named else "list"
    elif method == "DELETE":
        verb = "delete" if named else "deletecollection"
    else:
        verb = _VERBS.get(method, method.lower())
    return verb, resource


class ApiserverMetrics:
    __slots__ = ("requests", "errors", "duration", "throttled", "throttled_seconds")

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("draplane_apiserver_requests", "Requests sent to the apiserver, retries included",
                                ["verb", "resource"], registry=registry)
        self.errors = Counter("draplane_apiserver_request_errors",
                              "Requests the apiserver answered with an error status, or that got no answer "
                              "(code=\"connection\")", ["verb", "resource", "code"], registry=registry)
        self.duration = Histogram("draplane_apiserver_request_duration_seconds",
                                  "Time to the apiserver's whole answer (watches are not timed)",
                                  ["verb", "resource"], buckets=DURATION_BUCKETS, registry=registry)
        # client-go's rest_client_rate_limiter_duration_seconds, as two counters: only waits count
        self.throttled = Counter("draplane_apiserver_throttled_requests",
                                 "Requests that waited for the client-side rate limit (--kube-api-qps)",
                                 ["verb", "resource"], registry=registry)
        self.throttled_seconds = Counter("draplane_apiserver_throttled_seconds",
                                         "Seconds requests waited for the client-side rate limit",
                                         ["verb", "resource"], registry=registry)

    def observe(self, method: str, path: str, status: int | None, seconds: float | None, *,
                watch: bool = False) -> None:
        """One attempt: its status (None when it got no answer) and, but for watches, its time."""
        verb, resource = request_labels(method, path, watch=watch)
        self.requests.labels(verb, resource).inc()
        if status is None or status >= 400:
            self.errors.labels(verb, resource, CONNECTION_FAILED if status is None else str(status)).inc()
        if seconds is not None:
            self.duration.labels(verb, resource).observe(seconds)

    def observe_throttle(self, method: str, path: str, seconds: float, *, watch: bool = False) -> None:
        """The wait one attempt had for the rate limit (0: none, and nothing is counted)."""
        if seconds <= 0:
            return
        verb, resource = request_labels(method, path, watch=watch)
        self.throttled.labels(verb, resource).inc()
        self.throttled_seconds.labels(verb, resource).inc(seconds)

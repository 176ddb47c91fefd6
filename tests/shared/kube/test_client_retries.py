"""KubeClient against a small real HTTP server in the test process: 429 with and without
Retry-After, 5xx, broken and refused connections, and the client-side rate limit.

The server answers as an apiserver does (a metav1.Status body with the error); what is checked is
what the server saw: how many attempts, and how far apart.
"""

import asyncio
import socket
import time

import pytest
from aiohttp import web
from kubernetes_asyncio import client as k8s_client
from prometheus_client import CollectorRegistry

from draplane.kube import KubeApiError, KubeClient
from draplane.kube.metrics import ApiserverMetrics
from draplane.metrics import counter_value

PATH = "/api/v1/namespaces/default/pods"


def _status(code: int, reason: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": f"said {code}", "reason": reason, "code": code}


class Apiserver:
    """Answers each request with the next of `answers` ((status, headers)); 200 when they run out."""

    def __init__(self, answers=()):
        self.answers = list(answers)
        self.seen: list[float] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append(time.monotonic())
        if self.answers:
            status, headers = self.answers.pop(0)
            reason = {429: "TooManyRequests", 503: "ServiceUnavailable", 500: "InternalError"}.get(status, "")
            return web.json_response(_status(status, reason), status=status, headers=headers)
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": []})

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.seen, self.seen[1:])]


@pytest.fixture
async def serve():
    runners = []

    async def start(apiserver: Apiserver) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", apiserver.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


def _client(host: str, **kwargs) -> KubeClient:
    configuration = k8s_client.Configuration()
    configuration.host = host
    kube = KubeClient(k8s_client.ApiClient(configuration), **kwargs)
    kube.metrics = ApiserverMetrics(CollectorRegistry())
    return kube


async def test_a_429_with_retry_after_waits_that_long_then_succeeds(serve):
    apiserver = Apiserver([(429, {"Retry-After": "1"})])
    async with _client(await serve(apiserver)) as kube:
        await kube.request("GET", PATH)
        assert len(apiserver.seen) == 2
        assert 1.0 <= apiserver.gaps()[0] < 1.5  # Retry-After and at most 10 % jitter
        assert counter_value(kube.metrics.errors, verb="list", resource="pods", code="429") == 1


async def test_a_429_without_retry_after_backs_off_exponentially(serve):
    apiserver = Apiserver([(429, {})] * 4)
    async with _client(await serve(apiserver)) as kube:
        await kube.request("GET", PATH)
    assert len(apiserver.seen) == 5
    # jittered below 0.2, 0.4, 0.8, 1.6 s, and never at once: no hot loop
    for gap, bound in zip(apiserver.gaps(), (0.2, 0.4, 0.8, 1.6)):
        assert 0.1 * bound <= gap <= bound + 0.15


async def test_a_lasting_503_is_given_up_after_the_retries(serve):
    apiserver = Apiserver([(503, {"Retry-After": "0"})] * 10)
    async with _client(await serve(apiserver), max_retries=3) as kube:
        with pytest.raises(KubeApiError) as raised:
            await kube.request("GET", PATH)
    assert raised.value.status == 503 and raised.value.reason == "ServiceUnavailable"
    assert len(apiserver.seen) == 4


async def test_a_client_error_is_not_retried(serve):
    apiserver = Apiserver([(422, {"Retry-After": "0"})])
    async with _client(await serve(apiserver)) as kube:
        with pytest.raises(KubeApiError) as raised:
            await kube.request("POST", PATH, body={"kind": "Pod"})
    assert raised.value.status == 422 and len(apiserver.seen) == 1


async def test_a_connection_broken_after_sending_retries_a_get_but_not_a_post():
    attempts = 0

    async def read_and_hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal attempts
        attempts += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(read_and_hang_up, "127.0.0.1", 0)
    host = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with _client(host, max_retries=2) as kube:
            with pytest.raises(KubeApiError, match="connection failed"):
                await kube.request("GET", PATH)
            # three attempts of ours (aiohttp itself sends an idempotent request once more on a
            # kept-alive connection that broke, so the server may see more)
            assert counter_value(kube.metrics.errors, verb="list", resource="pods", code="connection") == 3
            assert attempts >= 3
            attempts = 0
            # the apiserver may have created it: a second POST of a generateName object makes two
            with pytest.raises(KubeApiError, match="connection failed"):
                await kube.request("POST", PATH, body={"kind": "Pod"})
            assert attempts == 1
            assert counter_value(kube.metrics.errors, verb="create", resource="pods", code="connection") == 1
    finally:
        server.close()
        await server.wait_closed()


async def test_a_refused_connection_is_retried_even_for_a_post():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    async with _client(f"http://127.0.0.1:{port}", max_retries=2) as kube:
        with pytest.raises(KubeApiError, match="connection failed"):
            await kube.request("POST", PATH, body={"kind": "Pod"})
        assert counter_value(kube.metrics.errors, verb="create", resource="pods", code="connection") == 3


async def test_the_rate_limit_spaces_requests_and_is_counted(serve):
    apiserver = Apiserver()
    async with _client(await serve(apiserver), qps=20.0, burst=2) as kube:
        started = time.monotonic()
        await asyncio.gather(*(kube.request("GET", PATH) for _ in range(12)))
        elapsed = time.monotonic() - started
        # 2 at once, then 10 more at 20 a second
        assert elapsed >= 0.5 - 0.02
        assert len(apiserver.seen) == 12
        assert min(apiserver.gaps()[2:]) >= 0.05 - 0.02
        assert counter_value(kube.metrics.throttled, verb="list", resource="pods") == 10
        assert counter_value(kube.metrics.throttled_seconds, verb="list", resource="pods") == pytest.approx(
            sum(0.05 * i for i in range(1, 11)), rel=0.2)


async def test_retries_take_tokens_too(serve):
    # A 429 retried at once must not get past the limit: APF turned it away for a reason.
    apiserver = Apiserver([(429, {"Retry-After": "0"})] * 3)
    async with _client(await serve(apiserver), qps=5.0, burst=1) as kube:
        started = time.monotonic()
        await kube.request("GET", PATH)
        assert time.monotonic() - started >= 3 * 0.2 - 0.02
    assert len(apiserver.seen) == 4



async def test_no_attempt_starts_after_the_callers_deadline(serve):
    """A write retried while the apiserver is away must not land after the caller's deadline (the
    binder's: its reservation's lease): the client gives up, and says it was the deadline."""
    from draplane.kube.client import DEADLINE_REASON

    apiserver = Apiserver([(503, {})] * 50)
    kube = _client(await serve(apiserver))
    try:
        started = time.monotonic()
        with pytest.raises(KubeApiError) as caught:
            await kube.request("PUT", PATH, body={}, deadline=started + 1.0)
        assert caught.value.past_deadline and caught.value.status == 503
        assert len(apiserver.seen) >= 2 and all(t < started + 1.0 for t in apiserver.seen)
        assert time.monotonic() - started < 1.5
        before = len(apiserver.seen)
        with pytest.raises(KubeApiError) as late:
            await kube.request("PUT", PATH, body={}, deadline=time.monotonic() - 1)
        assert late.value.reason == DEADLINE_REASON and late.value.past_deadline
        assert len(apiserver.seen) == before  # not sent at all
    finally:
        await kube.close()

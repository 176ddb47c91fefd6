"""The apiserver proxy is looked up once from the environment (in a worker thread: it reads ~/.netrc),
not on every request."""

from kubernetes_asyncio import client as k8s_client

from draplane.kube import KubeClient


def _api(host: str, proxy: str | None = None) -> k8s_client.ApiClient:
    configuration = k8s_client.Configuration()
    configuration.host = host
    configuration.proxy = proxy
    return k8s_client.ApiClient(configuration)


async def test_environment_proxy_is_kept_and_per_request_lookups_are_off(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    kube = KubeClient(_api("https://apiserver.example:6443"))
    try:
        assert await kube.environment_proxy() == "http://proxy.example:3128"
        assert await kube.environment_proxy() == "http://proxy.example:3128"  # kept, not looked up again
        # aiohttp would otherwise read ~/.netrc and the proxy variables in a thread per request
        assert kube._api.rest_client.pool_manager.trust_env is False
    finally:
        await kube.close()


async def test_no_proxy_and_kubeconfig_proxy(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", "apiserver.example")
    kube = KubeClient(_api("https://apiserver.example:6443"))
    assert await kube.environment_proxy() is None
    await kube.close()
    kube = KubeClient(_api("https://apiserver.example:6443", proxy="http://from-kubeconfig:8080"))
    assert await kube.environment_proxy() == "http://from-kubeconfig:8080"
    await kube.close()

"""The DRA parts of a Pod against the real kube-apiserver v1.37 (dryRun=All): same fields named."""

from __future__ import annotations

import pytest

from draplane.kube import KubeApiError
from draplane.validation import validate_object

pytestmark = pytest.mark.integration


def pod(claims, refs, init_refs=None):
    spec = {"containers": [{"name": "c", "image": "x", "resources": {"claims": refs}}]}
    if claims is not None:
        spec["resourceClaims"] = claims
    if init_refs is not None:
        spec["initContainers"] = [{"name": "i", "image": "x", "resources": {"claims": init_refs}}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


GPU = {"name": "gpu", "resourceClaimName": "c"}
PODS = {
    "ok": pod([GPU], [{"name": "gpu"}]),
    "ok-request": pod([GPU], [{"name": "gpu", "request": "gpu"}, {"name": "gpu", "request": "nic"}]),
    "unknown-ref": pod([GPU], [{"name": "tpu"}]),
    "no-source": pod([{"name": "gpu"}], []),
    "two-sources": pod([{"name": "gpu", "resourceClaimName": "a", "resourceClaimTemplateName": "b"}], []),
    "dup": pod([GPU, dict(GPU, resourceClaimName="b")], []),
    "bad-name": pod([dict(GPU, name="GPU_0")], []),
    "bad-claim-name": pod([dict(GPU, resourceClaimName="Bad_Claim")], []),
    "dup-ref": pod([GPU], [{"name": "gpu"}, {"name": "gpu"}]),
    "empty-ref": pod([GPU], [{"name": ""}]),
    "init-unknown": pod([GPU], [], [{"name": "x"}]),
    "no-name": pod([{"resourceClaimName": "c"}], []),
}


@pytest.mark.parametrize("case", list(PODS))
async def test_pod_claims_verdict_matches_the_apiserver(case, kube, namespace):
    obj = PODS[case]
    mine = {p.field for p in validate_object(obj)}
    try:
        await kube.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=obj, query={"dryRun": "All"})
        theirs = set()
    except KubeApiError as error:
        assert error.status == 422, error
        theirs = {c.get("field") for c in (error.details or {}).get("causes") or []}
    assert mine == theirs, f"apiserver {sorted(theirs)}; draplane {sorted(mine)}"

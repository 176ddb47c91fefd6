"""KwokProcess's hand-over after a restart: the pods a new KWOK may have passed over are handed to
it again (see KwokProcess), and no other pod is touched. Against the real apiserver, without KWOK
running: what it would do with the annotation is its own business; which pods get it is ours."""

import asyncio
import json
import uuid

import pytest

from draplane.localenv import kwok
from draplane.localenv.kwok import KWOK_ANNOTATION, RESYNC_ANNOTATION, KwokProcess

pytestmark = pytest.mark.integration


class _Alive:
    """Stands in for the new KWOK's Popen: alive, or dead with an exit code."""

    def __init__(self, returncode=None):
        self.returncode = returncode
        self.pid = 4242

    def poll(self):
        return self.returncode


def _node(name: str, kwok_node: bool) -> dict:
    annotations = {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1]} if kwok_node else {}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "annotations": annotations}}


def _pod(name: str, namespace: str, node: str | None, finalizer: bool = False) -> dict:
    meta = {"name": name, "namespace": namespace}
    if finalizer:
        meta["finalizers"] = ["draplane.dev/test-hold"]
    spec = {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def _lease(node: str, holder: str | None) -> dict:
    spec = {"holderIdentity": holder, "leaseDurationSeconds": 40} if holder else {}
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": node, "namespace": "kube-node-lease"}, "spec": spec}


async def _annotated(kubectl, namespace: str) -> set[str]:
    pods = json.loads(await kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
    return {p["metadata"]["name"] for p in pods if RESYNC_ANNOTATION in (p["metadata"].get("annotations") or {})}


async def test_resync_hands_kwok_only_its_bound_pending_pods(control_plane, kubectl, namespace, monkeypatch):
    suffix = uuid.uuid4().hex[:6]
    kwok_node, other_node = f"kwok-node-{suffix}", f"other-node-{suffix}"
    process = KwokProcess("kwok", ["true"], control_plane.workdir / f"kwok-{suffix}.log", control_plane)
    monkeypatch.setattr(kwok, "RESYNC_AFTER_SECONDS", (0.1, 0.2))
    objects = [_node(kwok_node, True), _node(other_node, False),
               _pod("bound-pending", namespace, kwok_node), _pod("running", namespace, kwok_node),
               _pod("on-another-kubelets-node", namespace, other_node), _pod("not-bound", namespace, None),
               _pod("being-deleted", namespace, kwok_node, finalizer=True)]
    await kubectl.apply("\n---\n".join(json.dumps(o) for o in objects))
    try:
        await kubectl("patch", "pod", "running", "-n", namespace, "--subresource=status", "--type=merge",
                      "-p", json.dumps({"status": {"phase": "Running"}}))
        await kubectl("delete", "pod", "being-deleted", "-n", namespace, "--wait=false")

        # a KWOK that does not hold the node's lease yet: nothing is touched, until it dies
        await kubectl.apply(json.dumps(_lease(kwok_node, None)))
        waiting = asyncio.create_task(asyncio.to_thread(process.hand_over, _Alive(returncode=None)))
        await asyncio.sleep(1.5)
        assert not waiting.done() and await _annotated(kubectl, namespace) == set()

        # it holds the lease: the one pod bound to its node and still Pending is handed to it again
        await kubectl.apply(json.dumps(_lease(kwok_node, f"kwok-new-{suffix}")))
        resynced = await asyncio.wait_for(waiting, 10)
        assert resynced == [f"{namespace}/bound-pending"] * 2  # both looks, since no KWOK runs here
        assert await _annotated(kubectl, namespace) == {"bound-pending"}

        # a new KWOK that died again before it took the leases: its hand-over ends, touching nothing
        await kubectl("delete", "lease", kwok_node, "-n", "kube-node-lease")
        assert await asyncio.to_thread(process.hand_over, _Alive(returncode=1)) == []
    finally:
        await kubectl("patch", "pod", "being-deleted", "-n", namespace, "--type=merge",
                      "-p", json.dumps({"metadata": {"finalizers": None}}), check=False)
        await kubectl("delete", "node", kwok_node, other_node, "--wait=false", check=False)
        await kubectl("delete", "lease", kwok_node, "-n", "kube-node-lease", "--ignore-not-found", check=False)

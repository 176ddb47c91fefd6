"""NodeDeclaredFeatures: what a pod's spec calls for, against the node's status.declaredFeatures."""

import msgspec
import pytest

from draplane.api.core import Node, Pod
from draplane.scheduling.framework.interface import NodeInfo
from draplane.scheduling.framework.plugins import node_declared_features as ndf


def pod(**spec) -> Pod:
    spec.setdefault("containers", [{"name": "c"}])
    return msgspec.convert({"metadata": {"name": "p"}, "spec": spec}, Pod)


def node(*declared: str) -> NodeInfo:
    status = {"declaredFeatures": list(declared)} if declared else {}
    return NodeInfo(node=msgspec.convert({"metadata": {"name": "n"}, "status": status}, Node), requested={}, pod_count=0)


@pytest.mark.parametrize("spec, needed", [
    ({}, set()),
    ({"containers": [{"name": "c", "restartPolicyRules": [{"action": "RestartAllContainers"}]}]},
     {ndf.RESTART_ALL_CONTAINERS}),
    ({"initContainers": [{"name": "i", "restartPolicyRules": [{"action": "RestartAllContainers"}]}]},
     {ndf.RESTART_ALL_CONTAINERS}),
    ({"containers": [{"name": "c", "restartPolicyRules": [{"action": "Restart"}]}]}, set()),
    ({"hostNetwork": True, "hostUsers": False}, {ndf.USER_NAMESPACES_HOST_NETWORK}),
    ({"hostNetwork": True}, set()),  # hostUsers unset: the host's user namespace
    ({"hostUsers": False}, set()),
    ({"ephemeralContainers": [{"name": "debug", "volumeMounts": [
        {"name": "v", "mountPath": "/v", "bindMountOptions": ["noexec"]}]}]}, {ndf.VOLUME_BIND_MOUNT_OPTIONS}),
    ({"containers": [{"name": "c", "volumeMounts": [{"name": "v", "mountPath": "/v"}]}]}, set()),
])
def test_the_features_a_spec_calls_for(spec, needed):
    assert ndf.required_features(pod(**spec).spec) == needed
    assert ndf.pre_filter(pod(**spec)) == (frozenset(needed) or None)


def test_a_node_must_declare_every_feature_the_pod_needs():
    needs_both = pod(hostNetwork=True, hostUsers=False,
                     containers=[{"name": "c", "restartPolicyRules": [{"action": "RestartAllContainers"}]}])
    required = ndf.pre_filter(needs_both)
    assert ndf.filter_node(required, node(ndf.RESTART_ALL_CONTAINERS, ndf.USER_NAMESPACES_HOST_NETWORK, "Other")) is None
    refused = ndf.filter_node(required, node(ndf.RESTART_ALL_CONTAINERS))
    assert refused is not None and refused.plugin == ndf.NAME
    assert refused.reasons == ("node(s) didn't match Pod's required features",)
    assert refused.details == (f"node(s) didn't match Pod's required features: {ndf.USER_NAMESPACES_HOST_NETWORK}",)
    assert ndf.filter_node(required, node()) is not None
    assert ndf.filter_node(None, node()) is None  # a pod that needs nothing: Skip

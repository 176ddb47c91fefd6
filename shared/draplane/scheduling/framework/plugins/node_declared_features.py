"""NodeDeclaredFeatures (on by default in kube-scheduler 1.37): a pod that uses a feature some
kubelets lack goes only to nodes whose `status.declaredFeatures` name it. The features a pod's
spec calls for, as component-helpers' nodedeclaredfeatures infers them for scheduling:

- RestartAllContainersOnContainerExits: a container or init container with a restart rule whose
  action is RestartAllContainers;
- UserNamespacesHostNetworkSupport: host networking in a user namespace (`hostUsers: false`);
- VolumeBindMountOptions: a volume mount with `bindMountOptions`.

The other features of its registry are never inferred for scheduling. No eviction gives a node a
feature, so preemption passes over a node it refuses. It is the last Filter of the profile."""

from __future__ import annotations

from draplane.api.core import Pod, PodSpec
from draplane.scheduling.framework.interface import NodeInfo, Rejection

NAME = "NodeDeclaredFeatures"
REASON = "node(s) didn't match Pod's required features"

RESTART_ALL_CONTAINERS = "RestartAllContainersOnContainerExits"
USER_NAMESPACES_HOST_NETWORK = "UserNamespacesHostNetworkSupport"
VOLUME_BIND_MOUNT_OPTIONS = "VolumeBindMountOptions"


def required_features(spec: PodSpec) -> frozenset[str]:
    needed = set()
    if any(rule.action == "RestartAllContainers"
           for c in (*spec.containers, *(spec.init_containers or ())) for rule in c.restart_policy_rules or ()):
        needed.add(RESTART_ALL_CONTAINERS)
    if spec.host_network and spec.host_users is False:
        needed.add(USER_NAMESPACES_HOST_NETWORK)
    if any(m.bind_mount_options
           for c in (*spec.containers, *(spec.init_containers or ()), *(spec.ephemeral_containers or ()))
           for m in c.volume_mounts or ()):
        needed.add(VOLUME_BIND_MOUNT_OPTIONS)
    return frozenset(needed)


def pre_filter(pod: Pod) -> frozenset[str] | None:
    """The features the pod needs; None (Skip) when it needs none."""
    return required_features(pod.spec) or None


def filter_node(required: frozenset[str] | None, node: NodeInfo) -> Rejection | None:
    if not required:
        return None
    status = node.node.status
    declared = set(status.declared_features or ()) if status is not None else set()
    if required <= declared:
        return None
    missing = ", ".join(sorted(required - declared))
    return Rejection(NAME, (REASON,), (f"{REASON}: {missing}",))

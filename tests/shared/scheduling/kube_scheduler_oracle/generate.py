"""Random scheduling cases for the kube-scheduler differential, shared by the test and the bench.

A case is plain Kubernetes JSON, as the oracle (main.go) reads it:
    {"nodes": [Node], "pods": [Pod bound to a node], "pod": the pending Pod}
Only what the apiserver accepts, with the defaults it writes (toleration operators, protocols,
the topologyKey of every term), and none of what the apiserver rewrites before kube-scheduler
sees it (matchLabelKeys in affinity terms are folded into the selector at creation, so they are
not drawn). What is drawn: nodes with hostname, zone and rack labels, taints, unschedulable and
small capacities (an extended resource on some); bound pods with labels, requests, host ports, required anti-affinity, some
terminating, in two namespaces; a pending pod with any of nodeSelector, required node affinity
(matchExpressions and matchFields), tolerations, requests (init containers and overhead
included), host ports, required pod affinity and anti-affinity (namespaces, an empty
namespaceSelector), preferred ones, and DoNotSchedule and ScheduleAnyway topology spread
(minDomains, the inclusion policies, matchLabelKeys); claims on local volumes, and on CSI volumes
with CSINode attach limits, VolumeAttachments and a CSIDriver that must be on the node
(NodeVolumeLimits). Where every node is feasible the two
scoring plugins that read other pods (InterPodAffinity, PodTopologySpread) are compared too,
the latter also for a pod without constraints that Services and a ReplicaSet, StatefulSet or
ReplicationController select (kube-scheduler's default spreading).

`draw(lo, hi)` is the randomness: random.Random.randint for the bench, hypothesis' integers for
the test (so a failure shrinks). `draplane_filter(case)` runs the same case through draplane.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import time
from typing import Any

import msgspec

Draw = Callable[[int, int], int]  # an int in [lo, hi]

HOSTNAME = "kubernetes.io/hostname"
ZONE = "topology.kubernetes.io/zone"
RACK = "example.com/rack"
KEYS = (HOSTNAME, ZONE, RACK)
APPS = ("web", "db", "cache")
NAMESPACES = ("ns", "other")
DEVICE_PLUGIN_RESOURCE = "example.com/foo"  # an extended resource a device plugin offers on some nodes


def choice(draw: Draw, seq: Sequence[Any]) -> Any:
    return seq[draw(0, len(seq) - 1)]


def chance(draw: Draw, percent: int) -> bool:
    """True with about `percent` % probability; shrinks to False."""
    return draw(0, 99) >= 100 - percent


def node(draw: Draw, i: int) -> dict:
    name = f"node-{i}"
    labels = {HOSTNAME: name}
    if chance(draw, 80):
        labels[ZONE] = choice(draw, ("z1", "z2", "z3"))
    if chance(draw, 50):
        labels[RACK] = choice(draw, ("r1", "r2"))
    if chance(draw, 30):
        labels["gpu"] = choice(draw, ("a100", "h100"))
    taints = []
    for key, effect in (("dedicated", "NoSchedule"), ("maintenance", "NoExecute"), ("soft", "PreferNoSchedule")):
        if chance(draw, 7):
            taint = {"key": key, "effect": effect}
            if chance(draw, 50):
                taint["value"] = choice(draw, ("x", "y"))
            taints.append(taint)
    spec: dict = {}
    if taints:
        spec["taints"] = taints
    if chance(draw, 4):
        spec["unschedulable"] = True
    allocatable = {"cpu": choice(draw, ("2", "4", "8")), "memory": choice(draw, ("2Gi", "8Gi")),
                   "pods": choice(draw, ("3", "110", "110"))}
    if chance(draw, 30):
        allocatable[DEVICE_PLUGIN_RESOURCE] = choice(draw, ("1", "2"))
    status: dict = {"allocatable": allocatable, "capacity": allocatable}
    if chance(draw, 25):
        status["declaredFeatures"] = [f for f in DECLARABLE_FEATURES if chance(draw, 50)]
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": spec,
            "status": status}


# What kubelets declare in status.declaredFeatures (NodeDeclaredFeatures); the first three are the
# ones a pod's spec can call for.
DECLARABLE_FEATURES = ("RestartAllContainersOnContainerExits", "UserNamespacesHostNetworkSupport",
                       "VolumeBindMountOptions", "DRAOptionalNodeOperations")


def needs_node_features(draw: Draw, spec: dict) -> None:
    """Now and then, a pod spec that calls for a feature some nodes lack."""
    main = spec["containers"][0]
    if chance(draw, 6):
        main["restartPolicyRules"] = [{"action": "RestartAllContainers",
                                       "exitCodes": {"operator": "In", "values": [42]}}]
    if chance(draw, 6):
        spec["hostNetwork"] = True
        spec["hostUsers"] = choice(draw, (False, False, True))
    if chance(draw, 6):
        main["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch",
                                 "bindMountOptions": [choice(draw, ("noexec", "nodev"))]}]


def selector(draw: Draw) -> dict:
    """A label selector over the apps: matchLabels, matchExpressions, both, or empty."""
    kind = draw(-2, 4)
    if kind <= 0:
        return {"matchLabels": {"app": choice(draw, APPS)}}
    if kind == 1:
        operator = choice(draw, ("In", "NotIn", "Exists", "DoesNotExist"))
        expression: dict = {"key": choice(draw, ("app", "tier")), "operator": operator}
        if operator in ("In", "NotIn"):
            expression["values"] = [choice(draw, APPS)]
        return {"matchExpressions": [expression]}
    if kind == 2:
        return {"matchLabels": {"app": choice(draw, APPS)},
                "matchExpressions": [{"key": "tier", "operator": choice(draw, ("Exists", "DoesNotExist"))}]}
    if kind == 3:
        return {}
    return {"matchLabels": {"tier": choice(draw, ("front", "back"))}}


def pod_labels(draw: Draw) -> dict:
    labels = {}
    if chance(draw, 80):
        labels["app"] = choice(draw, APPS)
    if chance(draw, 40):
        labels["tier"] = choice(draw, ("front", "back"))
    if chance(draw, 30):
        labels["rev"] = choice(draw, ("1", "2"))
    return labels


def affinity_term(draw: Draw) -> dict:
    term: dict = {"topologyKey": choice(draw, KEYS)}
    if chance(draw, 90):
        term["labelSelector"] = selector(draw)
    scope = draw(0, 3)
    if scope == 1:
        term["namespaces"] = [choice(draw, NAMESPACES)]
    elif scope == 2:
        term["namespaceSelector"] = {}
    return term


def container(draw: Draw, name: str, *, ports: bool) -> dict:
    requests = {}
    if chance(draw, 70):
        requests["cpu"] = choice(draw, ("100m", "500m", "1", "2"))
    if chance(draw, 50):
        requests["memory"] = choice(draw, ("256Mi", "1Gi", "3Gi"))
    if chance(draw, 15):
        requests[DEVICE_PLUGIN_RESOURCE] = choice(draw, ("1", "2"))
    c: dict = {"name": name, "image": "busybox"}
    if requests:
        # an extended resource is requested with an equal limit, as the apiserver requires
        c["resources"] = {"requests": requests}
        if DEVICE_PLUGIN_RESOURCE in requests:
            c["resources"]["limits"] = {DEVICE_PLUGIN_RESOURCE: requests[DEVICE_PLUGIN_RESOURCE]}
    if ports and chance(draw, 25):
        port = {"containerPort": 80, "hostPort": choice(draw, (8080, 9090)), "protocol": choice(draw, ("TCP", "UDP"))}
        if chance(draw, 20):
            port["hostIP"] = "10.0.0.1"
        c["ports"] = [port]
    return c


def bound_pod(draw: Draw, i: int, nodes: list[dict]) -> dict:
    spec: dict = {"nodeName": choice(draw, nodes)["metadata"]["name"],
                  "containers": [container(draw, "c", ports=True)]}
    if chance(draw, 30):
        spec["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                                                [affinity_term(draw)]}}
    metadata: dict = {"name": f"bound-{i}", "namespace": choice(draw, NAMESPACES), "uid": f"uid-bound-{i}",
                      "labels": pod_labels(draw)}
    if chance(draw, 10):
        metadata["deletionTimestamp"] = "2026-12-06T10:00:00Z"
        metadata["deletionGracePeriodSeconds"] = 30
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec,
            "status": {"phase": "Running"}}


def node_affinity(draw: Draw, nodes: list[dict]) -> dict:
    terms = []
    for _ in range(draw(1, 2)):
        expressions = []
        for _ in range(draw(0, 2)):
            operator = choice(draw, ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"))
            if operator in ("Gt", "Lt"):
                expressions.append({"key": "cores", "operator": operator, "values": [choice(draw, ("2", "8"))]})
                continue
            key = choice(draw, (ZONE, RACK, "gpu"))
            expression: dict = {"key": key, "operator": operator}
            if operator in ("In", "NotIn"):
                expression["values"] = [choice(draw, ("z1", "z2", "r1", "a100"))]
            expressions.append(expression)
        term: dict = {}
        if expressions:
            term["matchExpressions"] = expressions
        if not expressions or chance(draw, 20):
            term["matchFields"] = [{"key": "metadata.name", "operator": choice(draw, ("In", "NotIn")),
                                    "values": [choice(draw, nodes)["metadata"]["name"]]}
                                   for _ in range(draw(1, 2))]
        terms.append(term)
    return {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}


def spread_constraint(draw: Draw) -> dict:
    constraint: dict = {"maxSkew": draw(1, 2), "topologyKey": choice(draw, (ZONE, ZONE, HOSTNAME, RACK)),
                        "whenUnsatisfiable": "DoNotSchedule"}
    if chance(draw, 90):
        constraint["labelSelector"] = selector(draw)
    if chance(draw, 25):
        constraint["minDomains"] = draw(1, 4)
    if chance(draw, 30):
        constraint["nodeAffinityPolicy"] = choice(draw, ("Honor", "Ignore"))
    if chance(draw, 30):
        constraint["nodeTaintsPolicy"] = choice(draw, ("Honor", "Ignore"))
    if chance(draw, 20):
        constraint["matchLabelKeys"] = ["rev"]
    return constraint


# --- volumes ---------------------------------------------------------------------------------------

STORAGE_CLASSES = [
    {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "local"},
     "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer"},
    {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "zonal"},
     "provisioner": "example.com/csi", "volumeBindingMode": "WaitForFirstConsumer",
     "allowedTopologies": [{"matchLabelExpressions": [{"key": ZONE, "values": ["z1", "z2"]}]}]},
    {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "fast"},
     "provisioner": "example.com/csi", "volumeBindingMode": "Immediate"},
]


def volume(draw: Draw, i: int, nodes: list[dict]) -> dict:
    """A local PersistentVolume on one node (or a zone's nodes), Available until a claim binds it."""
    if chance(draw, 70):
        term = {"key": HOSTNAME, "operator": "In", "values": [choice(draw, nodes)["metadata"]["name"]]}
    else:
        term = {"key": ZONE, "operator": "In", "values": [choice(draw, ("z1", "z2", "z3"))]}
    metadata: dict = {"name": f"pv-{i}"}
    if chance(draw, 25):
        metadata["labels"] = {ZONE: choice(draw, ("z1", "z2", "z3"))}
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": metadata,
            "spec": {"capacity": {"storage": choice(draw, ("1Gi", "10Gi"))},
                     "accessModes": [choice(draw, ("ReadWriteOnce", "ReadWriteOncePod"))],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "local",
                     "volumeMode": "Filesystem", "local": {"path": f"/mnt/disk-{i}"},
                     "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [term]}]}}},
            "status": {"phase": "Available"}}


def claim(draw: Draw, i: int, volumes: list[dict]) -> dict:
    """A PersistentVolumeClaim of namespace ns: bound to a free volume (both sides written, as the
    PV controller leaves them), or unbound in a WaitForFirstConsumer or Immediate class."""
    name = f"data-{i}"
    free = [v for v in volumes if v["status"]["phase"] == "Available"]
    spec: dict = {"accessModes": [choice(draw, ("ReadWriteOnce", "ReadWriteOncePod"))],
                  "resources": {"requests": {"storage": choice(draw, ("1Gi", "5Gi"))}}, "volumeMode": "Filesystem"}
    metadata: dict = {"name": name, "namespace": "ns", "uid": f"uid-{name}"}
    status: dict = {"phase": "Pending"}
    kind = draw(0, 3)
    if kind <= 1 and free:
        pv = choice(draw, free)
        pv["spec"]["claimRef"] = {"kind": "PersistentVolumeClaim", "namespace": "ns", "name": name,
                                  "uid": metadata["uid"], "apiVersion": "v1"}
        pv["status"]["phase"] = "Bound"
        spec["storageClassName"] = "local"
        spec["volumeName"] = pv["metadata"]["name"]
        spec["accessModes"] = pv["spec"]["accessModes"]
        metadata["annotations"] = {"pv.kubernetes.io/bind-completed": "yes"}
        status = {"phase": "Bound", "accessModes": pv["spec"]["accessModes"],
                  "capacity": pv["spec"]["capacity"]}
    else:
        spec["storageClassName"] = choice(draw, ("local", "local", "zonal", "fast"))
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata, "spec": spec,
            "status": status}


# NodeVolumeLimits: block volumes of two CSI drivers, limited per node by CSINodes; the second
# driver's CSIDriver keeps its pods off nodes that do not register it (VolumeLimitScaling).
CSI_DRIVER, STRICT_DRIVER, EBS_DRIVER = "block.csi.example.com", "strict.csi.example.com", "ebs.csi.aws.com"
CSI_STORAGE_CLASSES = [
    {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "block"},
     "provisioner": CSI_DRIVER, "volumeBindingMode": "WaitForFirstConsumer"},
    {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "strict"},
     "provisioner": STRICT_DRIVER, "volumeBindingMode": "WaitForFirstConsumer"},
    # an in-tree provisioner kube-scheduler counts as its CSI driver (migration)
    {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "gp2"},
     "provisioner": "kubernetes.io/aws-ebs", "volumeBindingMode": "WaitForFirstConsumer"},
]
CSI_DRIVERS = [
    {"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": STRICT_DRIVER},
     "spec": {"attachRequired": True, "podInfoOnMount": False, "preventPodSchedulingIfMissing": True}},
]


def csi_volume(draw: Draw, i: int) -> dict:
    """A CSI block volume of either driver, or an in-tree EBS disk, reachable from every node."""
    driver, class_name = choice(draw, ((CSI_DRIVER, "block"), (CSI_DRIVER, "block"), (STRICT_DRIVER, "strict"),
                                       (EBS_DRIVER, "gp2")))
    source = {"awsElasticBlockStore": {"volumeID": f"vol-0{i:016x}", "fsType": "ext4"}} if driver == EBS_DRIVER \
        else {"csi": {"driver": driver, "volumeHandle": f"vol-{i}"}}
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"csi-pv-{i}"},
            "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"],
                     "persistentVolumeReclaimPolicy": "Delete", "storageClassName": class_name,
                     "volumeMode": "Filesystem", **source},
            "status": {"phase": "Available"}}


def csi_claim(draw: Draw, i: int, volumes: list[dict]) -> dict:
    """A claim bound to a free CSI volume, or waiting for its first consumer in a CSI class."""
    name = f"block-{i}"
    free = [v for v in volumes if v["status"]["phase"] == "Available"]
    metadata: dict = {"name": name, "namespace": "ns", "uid": f"uid-{name}"}
    spec: dict = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                  "volumeMode": "Filesystem"}
    if free and chance(draw, 75):
        pv = choice(draw, free)
        pv["spec"]["claimRef"] = {"kind": "PersistentVolumeClaim", "namespace": "ns", "name": name,
                                  "uid": metadata["uid"], "apiVersion": "v1"}
        pv["status"]["phase"] = "Bound"
        spec.update(storageClassName=pv["spec"]["storageClassName"], volumeName=pv["metadata"]["name"])
        metadata["annotations"] = {"pv.kubernetes.io/bind-completed": "yes"}
        status = {"phase": "Bound", "accessModes": ["ReadWriteOnce"], "capacity": pv["spec"]["capacity"]}
    else:
        spec["storageClassName"] = choice(draw, ("block", "block", "strict", "gp2"))
        status = {"phase": "Pending"}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata, "spec": spec,
            "status": status}


def csi_node(draw: Draw, node_name: str) -> dict:
    """The node's CSINode: the drivers it registers, the first with an attach limit (mostly)."""
    drivers = []
    for driver in (CSI_DRIVER, STRICT_DRIVER, EBS_DRIVER):
        if chance(draw, 75):
            entry: dict = {"name": driver, "nodeID": node_name, "topologyKeys": None}
            if chance(draw, 80):
                entry["allocatable"] = {"count": draw(0, 3)}
            drivers.append(entry)
    return {"apiVersion": "storage.k8s.io/v1", "kind": "CSINode", "metadata": {"name": node_name},
            "spec": {"drivers": drivers}}


def attachment(draw: Draw, i: int, volume: dict, nodes: list[dict]) -> dict:
    """A VolumeAttachment of a volume to a node (left from a pod gone, or being made)."""
    attacher = volume["spec"]["csi"]["driver"] if "csi" in volume["spec"] else EBS_DRIVER
    return {"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": f"va-{i}"},
            "spec": {"attacher": attacher, "nodeName": choice(draw, nodes)["metadata"]["name"],
                     "source": {"persistentVolumeName": volume["metadata"]["name"]}}}


def csi_storage(draw: Draw, nodes: list[dict], pods: list[dict], pod: dict) -> dict:
    """CSI claims mounted by the pending pod and by bound pods, CSINodes with limits, attachments."""
    volumes = [csi_volume(draw, i) for i in range(draw(0, 6))]
    claims = [csi_claim(draw, i, volumes) for i in range(draw(1, 5))]
    names = [c["metadata"]["name"] for c in claims]
    wanted = [n for n in names if chance(draw, 50)] or names[:1]
    pod["spec"]["volumes"] = pod["spec"].get("volumes", []) + mount(wanted, prefix="b")
    for other in pods:
        if other["metadata"]["namespace"] == "ns" and chance(draw, 40):
            other["spec"]["volumes"] = other["spec"].get("volumes", []) + mount(
                sorted({choice(draw, names) for _ in range(draw(1, 2))}), prefix="b")
    csinodes = [csi_node(draw, n["metadata"]["name"]) for n in nodes if chance(draw, 85)]
    attachments = [attachment(draw, i, v, nodes) for i, v in enumerate(volumes) if chance(draw, 25)]
    return {"volumes": volumes, "claims": claims, "csiNodes": csinodes, "volumeAttachments": attachments,
            "csiDrivers": CSI_DRIVERS if chance(draw, 70) else []}


def mount(names: list[str], prefix: str = "v") -> list[dict]:
    return [{"name": f"{prefix}{j}", "persistentVolumeClaim": {"claimName": n}} for j, n in enumerate(names)]


def pending_pod(draw: Draw, nodes: list[dict]) -> dict:
    spec: dict = {"containers": [container(draw, "c", ports=True)]}
    if chance(draw, 20):
        spec["initContainers"] = [container(draw, "init", ports=False)]
    if chance(draw, 10):
        spec["overhead"] = {"cpu": "250m"}
    if chance(draw, 20):
        spec["nodeSelector"] = {choice(draw, (ZONE, "gpu")): choice(draw, ("z1", "h100"))}
    affinity: dict = {}
    if chance(draw, 25):
        affinity["nodeAffinity"] = node_affinity(draw, nodes)
    if chance(draw, 30):
        affinity["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution":
                                   [affinity_term(draw) for _ in range(draw(1, 2))]}
    if chance(draw, 35):
        affinity["podAntiAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution":
                                       [affinity_term(draw) for _ in range(draw(1, 2))]}
    for kind in ("podAffinity", "podAntiAffinity"):
        if chance(draw, 20):
            affinity.setdefault(kind, {})["preferredDuringSchedulingIgnoredDuringExecution"] = [
                {"weight": choice(draw, (1, 10, 100)), "podAffinityTerm": affinity_term(draw)}
                for _ in range(draw(1, 2))]
    if affinity:
        spec["affinity"] = affinity
    if chance(draw, 35):
        spec["topologySpreadConstraints"] = [spread_constraint(draw) for _ in range(draw(1, 2))]
    if chance(draw, 20):
        soft = spread_constraint(draw)
        soft["whenUnsatisfiable"] = "ScheduleAnyway"
        soft.pop("minDomains", None)  # only with DoNotSchedule
        spec.setdefault("topologySpreadConstraints", []).append(soft)
    if chance(draw, 30):
        tolerations = []
        for _ in range(draw(1, 2)):
            toleration: dict = {"key": choice(draw, ("dedicated", "maintenance", "soft")),
                                "operator": choice(draw, ("Exists", "Equal"))}
            if toleration["operator"] == "Equal":
                toleration["value"] = choice(draw, ("x", "y"))
            if chance(draw, 50):
                toleration["effect"] = choice(draw, ("NoSchedule", "NoExecute"))
            tolerations.append(toleration)
        spec["tolerations"] = tolerations
    needs_node_features(draw, spec)
    if chance(draw, 4):  # draplane allocate and explain are handed such pods
        spec["nodeName"] = choice(draw, [n["metadata"]["name"] for n in nodes] + ["node-elsewhere"])
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "pending", "namespace": "ns", "uid": "uid-pending", "labels": pod_labels(draw)},
            "spec": spec}


def default_spread_objects(draw: Draw, pod: dict) -> dict:
    """Services and a controller that select the pending pod (which has no constraints of its
    own): kube-scheduler's default profile spreads it among the pods they select."""
    labels = pod["metadata"].setdefault("labels", {})
    app = labels.setdefault("app", choice(draw, APPS))
    found: dict = {}
    services = []
    if chance(draw, 60):
        selector = {"app": app, **({"tier": labels["tier"]} if "tier" in labels and chance(draw, 50) else {})}
        services.append(selector)
    if chance(draw, 30):
        services.append({"app": choice(draw, APPS)})  # selects the pod only if the app is its own
    found["services"] = [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"svc-{i}", "namespace": "ns"},
                          "spec": {"selector": selector, "ports": [{"port": 80, "protocol": "TCP"}]}}
                         for i, selector in enumerate(services)]
    kind = choice(draw, ("ReplicaSet", "StatefulSet", "ReplicationController", "Job", None))
    if kind is None:
        return found
    api_version = {"ReplicationController": "v1", "Job": "batch/v1"}.get(kind, "apps/v1")
    pod["metadata"]["ownerReferences"] = [{"apiVersion": api_version, "kind": kind, "name": "owner",
                                           "uid": "uid-owner", "controller": True}]
    template = {"metadata": {"labels": dict(labels)}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    if kind == "ReplicationController":
        found["replicationControllers"] = [{"apiVersion": "v1", "kind": kind, "metadata": {"name": "owner", "namespace": "ns"},
                                            "spec": {"selector": {"app": app}, "template": template}}]
    elif kind in ("ReplicaSet", "StatefulSet") and chance(draw, 85):  # else: the owner is gone
        selector: dict = {"matchLabels": {"app": app}}
        if "rev" in labels and chance(draw, 50):
            selector["matchExpressions"] = [{"key": "rev", "operator": "In", "values": [labels["rev"], "9"]}]
        plural = "replicaSets" if kind == "ReplicaSet" else "statefulSets"
        found[plural] = [{"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": "owner", "namespace": "ns"},
                          "spec": {"selector": selector, "template": template}}]
    return found


def scoring_case(draw: Draw) -> dict:
    """A case where every node is feasible, so that scores compare: roomy untainted nodes, bound
    pods of the apps, and a pending pod with only preferred terms and ScheduleAnyway spread."""
    nodes = []
    for i in range(draw(2, 6)):
        raw = node(draw, i)
        raw["spec"] = {}
        raw["status"]["allocatable"] = raw["status"]["capacity"] = {"cpu": "64", "memory": "256Gi", "pods": "110"}
        nodes.append(raw)
    pods = []
    for i in range(draw(0, 12)):
        pod = bound_pod(draw, i, nodes)
        pod["spec"]["containers"] = [{"name": "c", "image": "busybox"}]
        pod["spec"].pop("affinity", None)
        pods.append(pod)
    spec: dict = {"containers": [{"name": "c", "image": "busybox"}]}
    affinity: dict = {}
    for kind in ("podAffinity", "podAntiAffinity"):
        if chance(draw, 50):
            affinity[kind] = {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": choice(draw, (1, 10, 100)), "podAffinityTerm": affinity_term(draw)}
                for _ in range(draw(1, 2))]}
    if affinity:
        spec["affinity"] = affinity
    defaults = chance(draw, 35)  # no constraints of its own: spread as its services and owner say
    constraints = []
    for _ in range(0 if defaults else draw(0 if affinity else 1, 2)):
        soft = spread_constraint(draw)
        soft["whenUnsatisfiable"] = "ScheduleAnyway"
        soft.pop("minDomains", None)  # only with DoNotSchedule
        constraints.append(soft)
    if constraints:
        spec["topologySpreadConstraints"] = constraints
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "pending", "namespace": "ns", "uid": "uid-pending", "labels": pod_labels(draw)},
           "spec": spec}
    found = {"nodes": nodes, "pods": pods, "pod": pod}
    if defaults:
        found.update(default_spread_objects(draw, pod))
    return found


def case(draw: Draw) -> dict:
    if chance(draw, 20):
        return scoring_case(draw)
    nodes = [node(draw, i) for i in range(draw(1, 5))]
    pods = [bound_pod(draw, i, nodes) for i in range(draw(0, 10))]
    pod = pending_pod(draw, nodes)
    found = {"nodes": nodes, "pods": pods, "pod": pod}
    if chance(draw, 35):
        volumes = [volume(draw, i, nodes) for i in range(draw(0, 4))]
        claims = [claim(draw, i, volumes) for i in range(draw(1, 3))]
        names = [c["metadata"]["name"] for c in claims]
        wanted = [n for n in names if chance(draw, 70)] or names[:1]
        if chance(draw, 5):
            wanted.append("missing")
        pod["spec"]["volumes"] = mount(wanted)
        for other in pods:
            if other["metadata"]["namespace"] == "ns" and chance(draw, 15):
                other["spec"]["volumes"] = mount([choice(draw, names)])
        found.update(volumes=volumes, claims=claims, storageClasses=STORAGE_CLASSES)
    if chance(draw, 25):
        csi = csi_storage(draw, nodes, pods, pod)
        found["volumes"] = found.get("volumes", []) + csi.pop("volumes")
        found["claims"] = found.get("claims", []) + csi.pop("claims")
        found["storageClasses"] = found.get("storageClasses", STORAGE_CLASSES) + CSI_STORAGE_CLASSES
        found.update(csi)
    return found


def draplane_filter(case: dict) -> dict:
    """The case through draplane's filters (SchedulingState.filter_nodes), in the oracle's shape:
    {"feasible", "reasons" (node -> reasons), "message"}."""
    from draplane.scheduling.framework.interface import PreFilterRejected
    from draplane.scheduling.framework.runtime import named_nodes
    from draplane.scheduling import pod_scores
    from draplane.api.core import Node, Pod
    from draplane.scheduling.placing import SchedulingState

    from draplane.api.storage import (
        CSIDriver, CSINode, PersistentVolume, PersistentVolumeClaim, StorageClass, VolumeAttachment,
    )
    from draplane.scheduling.framework.plugins import node_volume_limits, volume_binding
    from draplane.scheduling.unschedulable import pre_filter_problem

    state = SchedulingState()
    for raw in case["nodes"]:
        state.set_node(msgspec.convert(raw, Node))
    bound = [msgspec.convert(raw, Pod) for raw in case["pods"]]
    for other in bound:
        state.set_pod(other)
    pod = msgspec.convert(case["pod"], Pod)
    volumes = None
    try:
        named_nodes(pod)
        names_conflict = False
    except PreFilterRejected:
        names_conflict = True
    if volume_binding.pod_claim_names(pod) and not names_conflict:
        # the binder's PreFilter (draplane_binder.volumes), over the same objects, where the binder
        # runs it: not for a pod whose node names cancel out (NodeAffinity's and NodeName's
        # PreFilters come first)
        claims = {c["metadata"]["name"]: msgspec.convert(c, PersistentVolumeClaim) for c in case.get("claims", ())}
        pvs = {v["metadata"]["name"]: msgspec.convert(v, PersistentVolume) for v in case.get("volumes", ())}
        classes = {c["metadata"]["name"]: msgspec.convert(c, StorageClass) for c in case.get("storageClasses", ())}

        def used_by_other_pod(name: str) -> bool:
            return any(other.metadata.namespace == pod.metadata.namespace and
                       name in dict(volume_binding.pod_claim_names(other)) for other in bound)

        try:
            volumes = volume_binding.pre_filter(pod, claims, pvs, classes, used_by_other_pod)
        except volume_binding.VolumeUnschedulable as exc:
            return {"feasible": [], "reasons": {n["metadata"]["name"]: [exc.message] for n in case["nodes"]},
                    "message": pre_filter_problem(len(case["nodes"]), exc.message)}
        # NodeVolumeLimits, as the binder evaluates it (draplane_binder.volumes)
        attachments = [msgspec.convert(a, VolumeAttachment) for a in case.get("volumeAttachments", ())]
        objects = node_volume_limits.VolumeObjects(
            claims=lambda namespace: claims if namespace == "ns" else {}, volumes=pvs, classes=classes,
            csinodes={c["metadata"]["name"]: msgspec.convert(c, CSINode) for c in case.get("csiNodes", ())},
            drivers=[msgspec.convert(d, CSIDriver) for d in case.get("csiDrivers", ())],
            pods_on=lambda node: [p for p in bound if p.spec.node_name == node],
            attachments_on=lambda node: [(a.spec.attacher, a.spec.source.persistent_volume_name or "")
                                         for a in attachments if a.spec.node_name == node])
        over_limit = node_volume_limits.nodes_over_limit(pod, [n["metadata"]["name"] for n in case["nodes"]], objects)
        if volumes is not None and over_limit:
            volumes = msgspec.structs.replace(volumes, over_limit=over_limit)
    feasible, account = state.filter_nodes(pod, volumes=volumes)
    reasons = {f.node: list(f.reasons) for f in account.failures if f.node not in feasible}
    found = {"feasible": feasible, "reasons": reasons, "message": account.message}
    if feasible and len(feasible) == len(case["nodes"]):
        # draplane normalizes over every node, kube-scheduler over the feasible ones: comparable here
        found["scores"] = {name: {} for name in feasible}
        for plugin, scores in (("InterPodAffinity", pod_scores.inter_pod_affinity(pod, state.nodes, state.placed,
                                                                                   now=time.time())),
                               ("PodTopologySpread", pod_scores.topology_spread(
                                   pod, state.nodes, state.placed, now=time.time(),
                                   default_spread=default_spread(case, pod)))):
            for name in feasible:
                found["scores"][name][plugin] = int(pod_scores.PLUGIN_WEIGHT * (scores or {}).get(name, 0.0))
    return found


def default_spread(case: dict, pod) -> Any:
    """The pod's default spreading selector, as the binder finds it (draplane_binder.spreading)."""
    from draplane.api.apps import ReplicaSet, ReplicationController, Service, StatefulSet
    from draplane.scheduling.framework.plugins import pod_topology_spread

    if pod.spec.topology_spread_constraints:
        return None
    services = [msgspec.convert(o, Service) for o in case.get("services", ())]
    controllers: dict = {}
    for field, model in (("replicaSets", ReplicaSet), ("statefulSets", StatefulSet),
                         ("replicationControllers", ReplicationController)):
        for raw in case.get(field, ()):
            obj = msgspec.convert(raw, model)
            controllers[(raw["kind"], obj.metadata.name)] = obj.spec.selector
    return pod_topology_spread.default_selector(pod, services, controllers)


def compare(kube: dict, ours: dict) -> str | None:
    """The first disagreement, None if none: feasible nodes, each refused node's reasons, and the
    message where no node is feasible (kube-scheduler writes one only then)."""
    if kube.get("error"):
        return f"kube-scheduler error: {kube['error']}"
    if sorted(kube["feasible"]) != ours["feasible"]:
        return f"feasible: kube-scheduler {sorted(kube['feasible'])}, draplane {ours['feasible']}"
    for name, reasons in sorted(kube["reasons"].items()):
        if sorted(reasons) != sorted(ours["reasons"].get(name, [])):
            return f"reasons on {name}: kube-scheduler {reasons}, draplane {ours['reasons'].get(name)}"
    if not kube["feasible"] and kube["message"] != ours["message"]:
        return f"message: kube-scheduler {kube['message']!r}, draplane {ours['message']!r}"
    if "scores" in ours:
        for name, by_plugin in sorted(ours["scores"].items()):
            theirs = {plugin: kube["scores"].get(name, {}).get(plugin, 0) for plugin in by_plugin}
            if theirs != by_plugin:
                return f"scores on {name}: kube-scheduler {theirs}, draplane {by_plugin}"
    return None

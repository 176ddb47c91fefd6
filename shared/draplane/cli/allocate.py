"""`draplane allocate`: the allocator on YAML/JSON files, offline.

Reads DeviceClass, ResourceSlice, ResourceClaim and Node objects. Claims with `status.allocation`
are in use; the others are pending and are allocated together, all-or-nothing, on --node or on the
best node per the scoring policy. Prints the pending claims with `status.allocation` as
kube-scheduler would write it.

With pending Pods among the files, and a Node object for every node the ResourceSlices name (the
nodes a pod may go to), it places each pod in turn
as the binder and a shard would: its node fit, pod (anti-)affinity and topology spread against the
pods bound in the files, its PersistentVolumeClaims (with PersistentVolumes, StorageClasses,
CSINodes, CSIDrivers and VolumeAttachments), and its claims (named by resourceClaimName). Prints,
as kube-scheduler writes them, each placed pod's claims with status.allocation and reservedFor,
and its Binding to the node.

Exit 0: allocated. Exit 1: cannot be allocated (why, per node, on stderr). Exit 2: invalid input or
an evaluation error (one line on stderr naming the object and the field). Never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import yaml

EXIT_ALLOCATED = 0
EXIT_UNALLOCATABLE = 1
EXIT_INVALID = 2

INPUT_KINDS = ("DeviceClass", "ResourceSlice", "ResourceClaim", "Node", "DeviceTaintRule", "Pod",
               "PersistentVolumeClaim", "PersistentVolume", "StorageClass", "CSINode", "CSIDriver", "VolumeAttachment")
# Read and checked, but not needed to allocate: a directory of manifests usually holds them too.
IGNORED_KINDS = ("ResourceClaimTemplate", "Namespace")


class InputError(Exception):
    """Invalid input: the message is the one line the user sees."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from draplane.allocation.scoring import DEFAULT_POLICY, policy_names

    parser = subparsers.add_parser(
        "allocate",
        help="allocate pending ResourceClaims against ResourceSlices, offline",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML or JSON files (multi-document, List accepted)")
    parser.add_argument("--node", help="allocate on this node only (default: the best node)")
    parser.add_argument(
        "--policy", default=DEFAULT_POLICY, choices=policy_names(),
        help=f"scoring policy among valid placements (default: {DEFAULT_POLICY})",
    )
    parser.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml", help="output format (default: yaml)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except InputError as exc:
        _error(str(exc))
        return EXIT_INVALID
    except Exception as exc:  # a bug must still not print a traceback at the user
        _error(f"internal error: {type(exc).__name__}: {exc}".replace("\n", " "))
        return EXIT_INVALID


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from draplane.allocation import AllocationError, DeviceAllocator, NodeFailure, NodePlacement, get_policy

    objects = load_inputs(args.files)
    pending_pods = [o for o in objects if o.kind == "Pod" and not o.spec.node_name]
    node_objects = {o.metadata.name for o in objects if o.kind == "Node"}
    without_node = sorted({o.spec.node_name for o in objects if o.kind == "ResourceSlice" and o.spec.node_name}
                          - node_objects)
    if pending_pods and node_objects and not without_node:
        return _place_pods(args, objects, pending_pods)
    if pending_pods:
        missing = f" (none for {', '.join(without_node)})" if node_objects else ""
        _error(f"note: the Pods in the files are placed only with a Node object for every node their "
               f"ResourceSlices name{missing}; the pending claims are allocated alone")
    classes = [o for o in objects if o.kind == "DeviceClass"]
    slices = [o for o in objects if o.kind == "ResourceSlice"]
    nodes = [o for o in objects if o.kind == "Node"]
    claims = [o for o in objects if o.kind == "ResourceClaim"]
    taint_rules = [o for o in objects if o.kind == "DeviceTaintRule"]
    pending = [c for c in claims if not (c.status and c.status.allocation)]
    in_use = [c for c in claims if c.status and c.status.allocation]
    if not pending:
        raise InputError("no pending ResourceClaim in the input (every claim already has status.allocation)")

    cluster = DeviceAllocator(slices=slices, classes=classes, nodes=nodes, taint_rules=taint_rules,
                      policy=get_policy(args.policy))
    cluster.ensure_nodes_from_slices()
    for claim in in_use:
        cluster.add_allocated_claim(claim)

    try:
        if args.node:
            if args.node not in cluster.nodes and args.node not in cluster.inventory.node_names():
                known = ", ".join(sorted(cluster.nodes)) or "none"
                raise InputError(f"--node {args.node}: no Node object or ResourceSlice names this node (known: {known})")
            outcome = cluster.allocate_on_node(pending, args.node)
        else:
            outcome = cluster.allocate(pending, explain=True)
    except AllocationError as exc:
        # Kubernetes' Allocate returns an error for these too (an `All` request meeting a pool
        # being updated, or a device that breaks a constraint): kube-scheduler ends the pod's
        # attempt with it rather than call the claims unallocatable, so this is exit 2 as well.
        raise InputError(exc.message) from None

    if not isinstance(outcome, NodePlacement):
        names = ", ".join(_name(c) for c in pending)
        if isinstance(outcome, NodeFailure):
            _error(f"cannot allocate {names} on node {outcome.node}: {outcome.message}")
        else:
            _error(f"cannot allocate {names}: {outcome.message}")
            for failure in outcome.failures:
                print(f"  node {failure.node}: {failure.message}", file=sys.stderr)
        return EXIT_UNALLOCATABLE

    from draplane.api.resource import ResourceClaimStatus

    out = []
    for claim, allocation in zip(pending, outcome.allocations):
        status = claim.status or ResourceClaimStatus()
        status.allocation = allocation
        claim.status = status
        out.append(msgspec.to_builtins(claim))
    document: Any = out[0] if len(out) == 1 else {"apiVersion": "v1", "kind": "List", "items": out}
    if args.output == "json":
        print(json.dumps(document, indent=2))
    else:
        print(yaml.safe_dump(document, sort_keys=False), end="")
    print(f"allocated {len(out)} claim(s) on node {outcome.node} (policy {args.policy})", file=sys.stderr)
    return EXIT_ALLOCATED


def _place_pods(args: argparse.Namespace, objects: list, pending_pods: list) -> int:
    """Each pending pod placed in turn, the ones before it counted as bound (see the module)."""
    from draplane.api.resource import ResourceClaimConsumerReference, ResourceClaimStatus
    from draplane.cli.explain import Snapshot
    from draplane.scheduling.placing import NotPlaced
    from draplane.scheduling.unschedulable import pre_filter_problem
    from draplane.scheduling.framework.plugins.volume_binding import VolumeUnschedulable

    if args.node:
        raise InputError("--node: with Pods and Nodes among the files each pod goes where its own constraints "
                         "allow; pin one with a nodeSelector on kubernetes.io/hostname instead")

    def of(kind: str) -> list:
        return [o for o in objects if o.kind == kind]

    for obj in objects:  # the shard keys pods and claims by uid; files often leave it out
        if obj.kind in ("Pod", "ResourceClaim") and not obj.metadata.uid:
            obj.metadata.uid = f"offline-{obj.kind.lower()}-{obj.metadata.namespace or 'default'}-{obj.metadata.name}"
    claims = {(c.metadata.namespace or "default", c.metadata.name): c for c in of("ResourceClaim")}
    snapshot = Snapshot(slices=of("ResourceSlice"), classes=of("DeviceClass"), nodes=of("Node"), claims=of("ResourceClaim"),
                        pods=[p for p in of("Pod") if p.spec.node_name], taint_rules=of("DeviceTaintRule"),
                        volume_claims=of("PersistentVolumeClaim"), volumes=of("PersistentVolume"),
                        storage_classes=of("StorageClass"), csinodes=of("CSINode"), csidrivers=of("CSIDriver"),
                        volume_attachments=of("VolumeAttachment"))
    state = snapshot.state()
    out, placed_lines, refused = [], [], 0
    for pod in pending_pods:
        namespace = pod.metadata.namespace or "default"
        pod_claims = []
        for i, ref in enumerate(pod.spec.resource_claims or ()):
            where = f"Pod {namespace}/{pod.metadata.name}: field spec.resourceClaims[{i}]"
            if not ref.resource_claim_name:
                raise InputError(f"{where}: resourceClaimTemplateName makes its claim when the pod is created, "
                                 "which does not happen offline; give the ResourceClaim and name it by resourceClaimName")
            claim = claims.get((namespace, ref.resource_claim_name))
            if claim is None:
                raise InputError(f"{where}.resourceClaimName: ResourceClaim {namespace}/{ref.resource_claim_name} "
                                 "is not among the files")
            pod_claims.append(claim)
        try:
            volumes = snapshot.pod_volumes(pod)
        except VolumeUnschedulable as exc:
            _error(f"cannot place Pod {namespace}/{pod.metadata.name}: "
                   f"{pre_filter_problem(len(snapshot.nodes), exc.message)}")
            refused += 1
            continue
        outcome = state.place_pod(pod, pod_claims, volumes=volumes)
        if isinstance(outcome, NotPlaced):
            if outcome.claim_error or outcome.scheduler_error:
                raise InputError(f"Pod {namespace}/{pod.metadata.name}: {outcome.claim_error or outcome.message}")
            _error(f"cannot place Pod {namespace}/{pod.metadata.name}: {outcome.message}")
            refused += 1
            continue
        for claim in pod_claims:
            status = claim.status or ResourceClaimStatus()
            status.allocation = outcome.allocations.get(claim.metadata.uid, status.allocation)
            consumer = ResourceClaimConsumerReference(resource="pods", name=pod.metadata.name, uid=pod.metadata.uid)
            if all(r.uid != consumer.uid for r in status.reserved_for or ()):
                status.reserved_for = [*(status.reserved_for or ()), consumer]
            claim.status = status
            state.set_claim(claim)
        pod.spec.node_name = outcome.node
        state.set_pod(pod)
        snapshot.pods.append(pod)  # its volumes count against the node's attach limits for the next
        written = _volume_prebind(snapshot, pod, volumes, outcome.node)
        out += [*(msgspec.to_builtins(c) for c in pod_claims), *written, {
            "apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": pod.metadata.name, "namespace": namespace},
            "target": {"apiVersion": "v1", "kind": "Node", "name": outcome.node}}]
        placed_lines.append(f"Pod {namespace}/{pod.metadata.name} on node {outcome.node}")
    if out:
        document: Any = out[0] if len(out) == 1 else {"apiVersion": "v1", "kind": "List", "items": out}
        print(json.dumps(document, indent=2) if args.output == "json" else yaml.safe_dump(document, sort_keys=False),
              end="\n" if args.output == "json" else "")
        print(f"placed {len(placed_lines)} pod(s): {'; '.join(placed_lines)}", file=sys.stderr)
    return EXIT_UNALLOCATABLE if refused else EXIT_ALLOCATED


def _volume_prebind(snapshot, pod, volumes, node: str) -> list[dict]:
    """VolumeBinding's PreBind on the files: each volume matched to a claim gets it in its claimRef
    and the claim is taken as bound to it, each claim to provision gets the node in its
    selected-node annotation; so the pods placed after it see them taken. The objects written,
    as kube-scheduler writes them."""
    from draplane.api.storage import ANNOTATION_BIND_COMPLETED, ANNOTATION_SELECTED_NODE, ObjectReference
    from draplane.scheduling.framework.runtime import volume_plan

    if volumes is None:
        return []
    labels = next((n.metadata.labels or {} for n in snapshot.nodes if n.metadata.name == node), {})
    plan = volume_plan(volumes, node, labels)
    if isinstance(plan, list):  # cannot happen: the shard's Filter passed this node with these volumes
        raise InputError(f"Pod {pod.metadata.namespace or 'default'}/{pod.metadata.name}: node {node} no longer fits "
                         f"its volumes: {', '.join(plan)}")
    namespace = pod.metadata.namespace or "default"
    claims = {c.metadata.name: c for c in snapshot.volume_claims if (c.metadata.namespace or "default") == namespace}
    pvs = {v.metadata.name: v for v in snapshot.volumes}
    written = []
    for claim_name, volume_name in plan.bindings:
        claim, volume = claims[claim_name], pvs[volume_name]
        volume.spec.claim_ref = ObjectReference(kind="PersistentVolumeClaim", api_version="v1", namespace=namespace,
                                                name=claim_name, uid=claim.metadata.uid)
        claim.spec.volume_name = volume_name  # as the PV controller completes it
        claim.metadata.annotations = {**(claim.metadata.annotations or {}), ANNOTATION_BIND_COMPLETED: "yes"}
        written.append(msgspec.to_builtins(volume))
    for claim_name in plan.provisions:
        claim = claims[claim_name]
        claim.metadata.annotations = {**(claim.metadata.annotations or {}), ANNOTATION_SELECTED_NODE: node}
        written.append(msgspec.to_builtins(claim))
    return written


def _name(obj) -> str:
    meta = obj.metadata
    return f"{obj.kind} {meta.namespace + '/' if meta.namespace else ''}{meta.name}"


def load_inputs(paths: list[str]) -> list[msgspec.Struct]:
    """Decode, validate like the apiserver, and reject duplicates. Raises InputError (one line)."""
    from draplane.api.codec import DecodeError, decode_object, iter_documents

    from draplane.validation import validate_object

    objects = []
    seen: dict[tuple[str, str, str], str] = {}
    for path in paths:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise InputError(f"{path}: cannot read: {reason}") from None
        try:
            documents = list(iter_documents(text, source=path))
        except DecodeError as exc:
            raise InputError(str(exc)) from None
        if not documents:
            raise InputError(f"{path}: no Kubernetes objects in the file")
        for where, raw in documents:
            if not isinstance(raw, dict) or not raw.get("kind") or not raw.get("apiVersion"):
                raise InputError(
                    f"{where}not a Kubernetes object: a document needs apiVersion and kind "
                    f"(draplane allocate reads {', '.join(INPUT_KINDS)})"
                )
            if raw.get("kind") not in INPUT_KINDS + IGNORED_KINDS:
                raise InputError(
                    f"{where}{raw.get('kind')} {_raw_name(raw)}: kind {raw.get('kind')!r} is not an input of "
                    f"draplane allocate (it reads {', '.join(INPUT_KINDS)})"
                )
            # Admin access is allowed per namespace by a label we cannot see offline; the
            # allocator handles adminAccess requests, so they are not an input error here.
            problems = validate_object(raw, source=path, admin_access=True)
            if problems:
                first = problems[0]
                more = f" (and {len(problems) - 1} more problem(s); run draplane lint {path})" if len(problems) > 1 else ""
                fix = f"; fix: {first.fix.splitlines()[0]}" if first.fix else ""
                raise InputError(f"{where}{first}{fix}{more}".replace("\n", " "))
            try:
                obj = decode_object(raw, where=where)
            except DecodeError as exc:
                raise InputError(str(exc)) from None
            meta = obj.metadata
            if not meta.name:
                raise InputError(f"{where}{raw.get('kind')}: field metadata.name is required")
            key = (obj.kind, meta.namespace or "", meta.name)
            if key in seen:
                raise InputError(
                    f"{where}{_name(obj)}: field metadata.name: duplicate name, already defined at {seen[key].rstrip(': ')}"
                )
            seen[key] = where
            if obj.kind in INPUT_KINDS:
                objects.append(obj)
    return objects


def _raw_name(raw: dict) -> str:
    meta = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    return str(meta.get("name") or "<unnamed>")

"""`draplane demo`: the seed's vLLM example, end to end, on the local environment.

1. `draplane lint` on the seed's files as they are: the two problems and their fixes.
2. The verbatim objects are refused by the real kube-apiserver (a dry run); the corrected ones
   (examples/seed-vllm-fixed/) are applied through the Kubernetes API.
3. The pod is scheduled by draplane's own services (the binder takes `default-scheduler` pods in the
   local environment); the demo waits for it to be bound and shows where it went, why (per node
   class, from the allocator core) and how long it took.

Where it runs: a `draplane up` that is already running is reused (its objects then stay for
`kubectl get`); otherwise the demo starts its own environment and stops it at the end, or leaves it
up until Ctrl-C with `--keep`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

log = logging.getLogger(__name__)

SEED_FILES = ("deviceclass.yaml", "resourceclaim.yaml", "pod.yaml")
DEMO_NODES = 4  # one per shipped profile: 24, 40 and 80 GB GPUs and a mixed node
DEMO_SHARDS = 2


class DemoError(Exception):
    """A step of the demo failed; the text says which and what to look at."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="the seed's vLLM example end to end: lint, apply, bind, and why",
        description="Lint the seed's vLLM example, apply the corrected objects to the local environment, wait for "
        "the pod to be bound by draplane and show the node, the device, why, and how long it took. Reuses a "
        "running `draplane up`, else starts (and stops) its own environment.",
    )
    parser.add_argument("--seed-dir", type=Path, default=None,
                        help="the seed's deviceclass.yaml, resourceclaim.yaml and pod.yaml "
                        "(default: examples/seed-vllm in the repo)")
    parser.add_argument("--kubeconfig", type=Path, default=None,
                        help="use this running draplane environment instead of looking for `draplane up` or starting one")
    parser.add_argument("--fresh", action="store_true", help="always start an environment of the demo's own")
    parser.add_argument("--keep", action="store_true", help="leave the demo's own environment up until Ctrl-C")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="state and logs of the demo's own environment (default ~/.local/state/draplane/demo)")
    parser.add_argument("--namespace", default="default", help="namespace of the claim and the pod (default: default)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the pod to be bound (default 60)")
    parser.set_defaults(handler=run)


def repo_dir() -> Path:
    return Path(__file__).resolve().parents[3]


def default_seed_dir() -> Path:
    """The article's files as it wrote them, shipped in the repo (a user's clone has nothing else)."""
    return repo_dir() / "examples" / "seed-vllm"


def fixed_dir() -> Path:
    return repo_dir() / "examples" / "seed-vllm-fixed"


def load_objects(folder: Path) -> dict[str, dict]:
    """kind -> the raw object, from the three files of the example."""
    objects = {}
    for name in SEED_FILES:
        path = folder / name
        try:
            raw = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise DemoError(f"cannot read {path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise DemoError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("kind"), str) or not isinstance(raw.get("metadata"), dict):
            raise DemoError(f"{path}: expected one Kubernetes object with kind and metadata")
        objects[raw["kind"]] = raw
    missing = {"DeviceClass", "ResourceClaim", "Pod"} - objects.keys()
    if missing:
        raise DemoError(f"{folder}: no {', '.join(sorted(missing))} among {', '.join(SEED_FILES)}")
    return objects


def running_up_kubeconfig(workdir: Path) -> Path | None:
    """The kubeconfig of a `draplane up` running in `workdir`, or None.

    `up` writes up.json (its pid and kubeconfig) once the control plane is up and removes it when it
    stops; a file left by a crash names a dead pid."""
    try:
        info = json.loads((workdir / "up.json").read_text())
        pid, kubeconfig = int(info["pid"]), Path(info["kubeconfig"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, someone else's
    return kubeconfig if kubeconfig.is_file() else None


def run(args: argparse.Namespace) -> int:
    seed_dir = args.seed_dir or default_seed_dir()
    try:
        seed = load_objects(seed_dir)
        fixed = load_objects(fixed_dir())
    except DemoError as exc:
        print(f"draplane demo: {exc}", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print("draplane demo: --timeout must be positive", file=sys.stderr)
        return 2
    return asyncio.run(_main(args, seed_dir, seed, fixed))


async def _main(args, seed_dir: Path, seed: dict[str, dict], fixed: dict[str, dict]) -> int:
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    work = asyncio.create_task(_demo(args, seed_dir, seed, fixed, interrupted))

    def on_signal() -> None:
        interrupted.set()
        work.cancel()  # --keep waits on `interrupted` and shields its clean-up from this

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        return await work
    except asyncio.CancelledError:
        print("\ndraplane demo: interrupted", file=sys.stderr)
        return 130


def _say(text: str = "") -> None:
    print(text, flush=True)


async def _demo(args, seed_dir: Path, seed: dict[str, dict], fixed: dict[str, dict], interrupted: asyncio.Event) -> int:
    from draplane.kube import KubeApiError
    from draplane.localenv import binaries, environment
    from draplane.localenv.processes import StartupError
    from draplane.cli.placement_report import ReportError

    started = time.monotonic()
    if not _lint_step(seed_dir):
        return 1

    env = None
    try:
        kubeconfig, env = await _environment(args)
        await _story(args, kubeconfig, seed, fixed, owned=env is not None)
        if env is not None and args.keep:
            _say(f"\nThe demo's environment stays up: kubeconfig {kubeconfig}, logs {env.logs}. Ctrl-C stops it.")
            await interrupted.wait()
    except (DemoError, ReportError, environment.AlreadyRunning, binaries.BinaryError, StartupError) as exc:
        print(f"draplane demo: {exc}", file=sys.stderr)
        return 1
    except KubeApiError as exc:
        print(f"draplane demo: the Kubernetes API refused {exc}", file=sys.stderr)
        return 1
    except asyncio.CancelledError:
        if not interrupted.is_set():
            raise
    except Exception as exc:  # a bug; the user still gets one line and the logs, not a traceback
        log.debug("demo failed", exc_info=True)
        print(f"draplane demo: unexpected {type(exc).__name__}: {exc} (run `draplane -vv demo` for the traceback)",
              file=sys.stderr)
        return 1
    finally:
        if env is not None:
            _say("\nStopping the demo's environment" + ("" if args.keep else " (--keep leaves it up until Ctrl-C)"))
            # Shielded: a second Ctrl-C must not leave servers behind.
            await asyncio.shield(asyncio.to_thread(env.stop))
    if interrupted.is_set() and not args.keep:
        print("draplane demo: interrupted", file=sys.stderr)
        return 130
    _say(f"\ndraplane demo: done in {time.monotonic() - started:.1f}s")
    return 0


def _lint_step(seed_dir: Path) -> bool:
    from draplane.cli import lint

    _say(f"1. draplane lint {seed_dir}/*.yaml   (the seed's files, verbatim)\n")
    problems, unreadable, checked = lint.lint_files([str(seed_dir / name) for name in SEED_FILES])
    for message in unreadable:
        print(f"draplane demo: {message}", file=sys.stderr)
    if unreadable:
        return False
    text = io.StringIO()
    lint.format_problems(problems, text)
    for line in text.getvalue().splitlines():
        _say(f"   {line}" if line else "")
    objects = len({(p.source, p.kind, p.name) for p in problems})
    _say(f"\n   {len(problems)} problem{'s' * (len(problems) != 1)} in {objects} of {checked} objects")

    fixed_problems, unreadable, _ = lint.lint_files([str(fixed_dir() / name) for name in SEED_FILES])
    if fixed_problems or unreadable:
        print(f"draplane demo: the corrected example in {fixed_dir()} does not pass lint:", file=sys.stderr)
        lint.format_problems(fixed_problems, sys.stderr)
        for message in unreadable:
            print(f"  {message}", file=sys.stderr)
        return False
    _say(f"   The corrected files ({fixed_dir()}) pass lint: no problems.\n")
    return True


async def _environment(args):
    """(kubeconfig, the demo's own Environment or None when it reuses one)."""
    from draplane.localenv import environment

    if args.kubeconfig is not None:
        if not args.kubeconfig.is_file():
            raise DemoError(f"--kubeconfig {args.kubeconfig}: no such file")
        _say(f"Using the draplane environment of {args.kubeconfig}.\n")
        return args.kubeconfig, None
    if not args.fresh:
        kubeconfig = running_up_kubeconfig(environment.state_dir() / "up")
        if kubeconfig is not None:
            _say(f"Using the running `draplane up` (kubeconfig {kubeconfig}).\n")
            return kubeconfig, None
    workdir = args.workdir or environment.state_dir() / "demo"
    _say(f"No `draplane up` is running: starting the demo's own environment ({DEMO_NODES} nodes, "
         f"{DEMO_SHARDS} allocator shards; logs in {workdir / 'logs'})")
    began = time.monotonic()
    env = await environment.start(
        node_count=DEMO_NODES, shards=DEMO_SHARDS, workdir=workdir, progress=lambda m: _say(f"   {m}"),
    )
    nodes = ", ".join(n for names in env.nodes.values() for n in names)
    real = f"; real node {env.real_node.name}" if env.real_node else f"; no real node ({env.real_node_absent})"
    _say(f"   up in {time.monotonic() - began:.1f}s: simulated nodes {nodes}{real}\n")
    return env.kubeconfig, env


async def _story(args, kubeconfig: Path, seed: dict[str, dict], fixed: dict[str, dict], *, owned: bool) -> None:
    from draplane.kube import KubeClient

    namespace = args.namespace
    async with await KubeClient.from_kubeconfig(kubeconfig) as kube:
        _say("2. The objects, through the Kubernetes API")
        await kube.create_namespace(namespace)
        await _show_apiserver_verdict(kube, seed, namespace)
        device_class = fixed["DeviceClass"]
        claim = _in_namespace(fixed["ResourceClaim"], namespace)
        pod = _in_namespace(fixed["Pod"], namespace)
        await _remove_previous_run(kube, claim, pod)
        await _wait_for_settled_inventory(kube)
        await _apply_device_class(kube, device_class)
        _say(f"   corrected DeviceClass {device_class['metadata']['name']}: applied")
        await _create(kube, claim)
        _say(f"   corrected ResourceClaim {namespace}/{claim['metadata']['name']}: created")
        timings = await _create_pod_and_wait(kube, pod, claim["metadata"]["name"], args.timeout)
        _say(f"   Pod {namespace}/{pod['metadata']['name']}: created (schedulerName unset: default-scheduler, "
             "which draplane's binder schedules here)\n")

        _say("3. Where it went, and why\n")
        report = await _report(kube, namespace, pod["metadata"]["name"])
        from draplane.cli.placement_report import format_report

        for line in format_report(report, timings).splitlines():
            _say(f"   {line}" if line else "")
        _say("\n   Try:")
        from draplane.localenv import binaries

        # the kubectl built into the cache: the line works on a machine that has none of its own
        kubectl = f"{binaries.find(binaries.KUBECTL) or 'kubectl'} --kubeconfig {kubeconfig}"
        _say(f"     {kubectl} -n {namespace} get pod {pod['metadata']['name']} -o wide")
        _say(f"     {kubectl} -n {namespace} get resourceclaim {claim['metadata']['name']} -o yaml")
        if owned and not args.keep:
            _say("   These work while an environment is up: pass --keep, or start `draplane up` in another "
                 "terminal and run `draplane demo` again.")

        await _run_on_the_real_node(kube, kubeconfig, claim, pod, args.timeout)


REAL_NODE_SUFFIX = "-on-real-node"
STAND_IN_IMAGE = "busybox"
# What the stand-in container prints: the files and env its devices' CDI spec gave it.
PRINT_DEVICES = ("for f in /var/run/draplane/devices/*; do echo \"== $f\"; cat \"$f\"; done; "
                 "env | grep ^DRAPLANE_ | sort; echo DEVICES-PRINTED; sleep 3600")


def real_node_copies(claim: dict, pod: dict) -> tuple[dict, dict]:
    """The corrected claim and pod for the real node: the same request, busybox standing in for the
    vLLM image (no image registry is reachable from here), the real node's label as its only
    placement constraint; the rest stays draplane's choice."""
    claim, pod = copy.deepcopy(claim), copy.deepcopy(pod)
    claim["metadata"]["name"] += REAL_NODE_SUFFIX
    pod["metadata"]["name"] += REAL_NODE_SUFFIX
    spec = pod["spec"]
    for ref in spec.get("resourceClaims") or []:
        if ref.get("resourceClaimName"):
            ref["resourceClaimName"] += REAL_NODE_SUFFIX
    from draplane.localenv.realnode import REAL_NODE_LABEL

    key, value = REAL_NODE_LABEL
    spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), key: value}
    spec["terminationGracePeriodSeconds"] = 1
    for container in spec["containers"]:
        container["image"] = STAND_IN_IMAGE
        container["command"] = ["sh", "-c", PRINT_DEVICES]
        container.pop("args", None)
    return claim, pod


async def _run_on_the_real_node(kube, kubeconfig: Path, claim: dict, pod: dict, timeout: float) -> None:
    """Step 4: the pod runs. On KWOK's nodes a bound pod is only marked Running; on the real node
    the kubelet asks the node agent (its DRA plugin) to prepare the device, containerd applies the
    CDI spec, and the container's log shows the GPU it was given."""
    from draplane.api import core
    from draplane.localenv import binaries

    from draplane.localenv.realnode import REAL_NODE_LABEL

    nodes, _ = await kube.list(core.Node, label_selector="=".join(REAL_NODE_LABEL))
    _say("\n4. The pod runs, on the real node")
    if not nodes:
        _say("   This environment has no real node (`draplane up` runs one where the machine allows it: root, and "
             "Debian's runc, containernetworking-plugins and busybox-static); skipped.")
        return
    real_claim, real_pod = real_node_copies(claim, pod)
    namespace, name = real_pod["metadata"]["namespace"], real_pod["metadata"]["name"]
    await _remove_previous_run(kube, real_claim, real_pod)
    await _create(kube, real_claim)
    timings = await _create_pod_and_wait(kube, real_pod, real_claim["metadata"]["name"], timeout)
    _say(f"   Pod {namespace}/{name}: the same claim and pod, with {STAND_IN_IMAGE} standing in for "
         f"{pod['spec']['containers'][0].get('image')}, and nodeSelector {'='.join(REAL_NODE_LABEL)}")
    kubectl = [str(binaries.require(binaries.KUBECTL)), "--kubeconfig", str(kubeconfig), "-n", namespace]
    began = time.monotonic()
    logs = ""
    while time.monotonic() - began < timeout:
        found = await kube.get(core.Pod, name, namespace)
        if found.status and found.status.phase in ("Running", "Succeeded", "Failed"):
            result = await asyncio.to_thread(subprocess.run, [*kubectl, "logs", name], capture_output=True, text=True,
                                             timeout=30)
            logs = result.stdout
            if "DEVICES-PRINTED" in logs or found.status.phase != "Running":
                break
        await asyncio.sleep(0.5)
    if "DEVICES-PRINTED" not in logs:
        described = await asyncio.to_thread(subprocess.run, [*kubectl, "describe", "pod", name], capture_output=True,
                                            text=True, timeout=30)
        raise DemoError(f"Pod {namespace}/{name} on the real node did not print its devices within {timeout:.0f}s; "
                        f"kubectl describe says:\n{described.stdout[-2000:]}")
    found = await kube.get(core.Pod, name, namespace)
    _say(f"   bound to {found.spec.node_name} {timings[-1][1] * 1000:.0f} ms after its create; Running, and "
         f"`kubectl logs {name}` shows what its container was given:")
    for line in logs.splitlines():
        if line != "DEVICES-PRINTED":
            _say(f"     {line}")


def _in_namespace(raw: dict, namespace: str) -> dict:
    body = copy.deepcopy(raw)
    body["metadata"]["namespace"] = namespace
    return body


async def _show_apiserver_verdict(kube, seed: dict[str, dict], namespace: str) -> None:
    """The verbatim DeviceClass and ResourceClaim, sent as a dry run: the apiserver's own verdict."""
    from draplane.kube import KubeApiError
    from draplane.kube.client import raw_collection_path

    for kind in ("DeviceClass", "ResourceClaim"):
        body = copy.deepcopy(seed[kind])
        if kind != "DeviceClass":
            body["metadata"]["namespace"] = namespace
        name = body["metadata"].get("name", "")
        try:
            await kube.request("POST", raw_collection_path(body), body=body,
                               query={"dryRun": "All", "fieldValidation": "Strict"})
            verdict = "accepted"
        except KubeApiError as exc:
            if exc.is_already_exists:
                verdict = "valid (an object of that name exists already)"
            else:
                verdict = f"REJECTED ({exc.status} {exc.reason}): {_rejection_summary(exc)}"
        _say(f"   verbatim {kind} {name}, dry run: kube-apiserver says {verdict}")


def _rejection_summary(exc) -> str:
    """The fields the apiserver names (lint above already explained them), else its message, short."""
    fields = [c.get("field") for c in exc.details.get("causes") or () if isinstance(c, dict) and c.get("field")]
    if fields:
        return "invalid " + ", ".join(dict.fromkeys(fields))
    message = " ".join(exc.message.split())
    return message if len(message) <= 240 else message[:239] + "…"


async def _remove_previous_run(kube, claim: dict, pod: dict) -> None:
    """A second demo on the same `draplane up` replaces the first one's pod and claim. The pod has no
    kubelet to confirm its end, so it is deleted at once; the binder then deallocates the claim and
    lifts its finalizer, which lets the claim go."""
    from draplane.api import core, resource
    from draplane.kube import KubeApiError

    namespace = pod["metadata"]["namespace"]
    pod_name, claim_name = pod["metadata"]["name"], claim["metadata"]["name"]
    found = False
    for model, name in ((core.Pod, pod_name), (resource.ResourceClaim, claim_name)):
        try:
            await kube.get(model, name, namespace)
            found = True
        except KubeApiError as exc:
            if not exc.is_not_found:
                raise
    if not found:
        return
    _say(f"   removing the previous demo's Pod and ResourceClaim in {namespace}")
    path = f"/api/v1/namespaces/{namespace}/pods/{pod_name}"
    try:
        await kube.request("DELETE", path, query={"gracePeriodSeconds": 0})
    except KubeApiError as exc:
        if not exc.is_not_found:
            raise
    await kube.delete(resource.ResourceClaim, claim_name, namespace)
    deadline = time.monotonic() + 30
    for model, name in ((core.Pod, pod_name), (resource.ResourceClaim, claim_name)):
        while True:
            try:
                await kube.get(model, name, namespace)
            except KubeApiError as exc:
                if exc.is_not_found:
                    break
                raise
            if time.monotonic() > deadline:
                raise DemoError(f"{model.__name__} {namespace}/{name} from an earlier demo is still there after 30s; "
                                "is the binder running? (see the binder's log)")
            await asyncio.sleep(0.2)


def unsettled_nodes(slices, nodes) -> list[str]:
    """Nodes with no devices published yet, or with a pool whose slices are not all there."""
    from draplane.allocation import Inventory

    inventory = Inventory(slices)
    waiting = []
    for node in nodes:
        pools = inventory.pools_for_node(node)
        if not pools or any(p.incomplete for p in pools):
            waiting.append(node.metadata.name or "")
    return sorted(waiting)


async def _wait_for_settled_inventory(kube, *, quiet: float = 1.0, limit: float = 30.0) -> None:
    """Until every Node's pools are complete and no slice has changed for `quiet` seconds.

    The allocator shards read devices from the inventory's NATS feed, which follows the slices by a
    fraction of a second; a pod created while a node's GPUs are still on their way would be placed
    as if that node had none. In a long-running `draplane up` this returns after `quiet`."""
    from draplane.api import core, resource

    deadline = time.monotonic() + limit
    seen: set | None = None
    stable_since = time.monotonic()
    while True:
        slices, _ = await kube.list(resource.ResourceSlice)
        nodes, _ = await kube.list(core.Node)
        state = {(s.metadata.name, s.metadata.resource_version) for s in slices}
        if state != seen:
            seen, stable_since = state, time.monotonic()
        waiting = unsettled_nodes(slices, nodes)
        if not waiting and time.monotonic() - stable_since >= quiet:
            return
        if time.monotonic() > deadline:
            if waiting:
                _say(f"   note: nodes {', '.join(waiting)} have not published all their devices after {limit:.0f}s; "
                     "going on without them")
            return
        await asyncio.sleep(0.2)


async def _apply_device_class(kube, raw: dict) -> None:
    """Create, or replace the spec of, the class: `draplane up` ships one of the same name."""
    from draplane.kube import KubeApiError
    from draplane.kube.client import raw_collection_path

    path = raw_collection_path(raw)
    try:
        await kube.request("POST", path, body=raw, query={"fieldValidation": "Strict"})
    except KubeApiError as exc:
        if not exc.is_already_exists:
            raise
        await kube.request("PATCH", f"{path}/{raw['metadata']['name']}", body={"spec": raw["spec"]},
                           content_type="application/merge-patch+json", query={"fieldValidation": "Strict"})


async def _create(kube, raw: dict) -> None:
    from draplane.kube.client import raw_collection_path

    await kube.request("POST", raw_collection_path(raw), body=raw, query={"fieldValidation": "Strict"})


async def _first(events, predicate: Callable) -> float:
    """The monotonic time of the first watched object for which predicate holds."""
    async for event in events:
        if event.object is not None and event.type != "DELETED" and predicate(event.object):
            return time.monotonic()
    raise DemoError("the watch ended")


async def _create_pod_and_wait(kube, pod: dict, claim_name: str, timeout: float) -> list[tuple[str, float]]:
    """Create the pod and time it: pod created -> claim allocated -> pod bound, from watches opened
    before the create, so nothing is missed and nothing is polled."""
    from draplane.api import core, resource
    from draplane.kube.watching import watch_objects

    namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    pod_events = watch_objects(kube, core.Pod, namespace, field_selector=f"metadata.name={name}")
    claim_events = watch_objects(kube, resource.ResourceClaim, namespace, field_selector=f"metadata.name={claim_name}")
    # Both lists done before the pod exists: every later change reaches the watch.
    for events in (pod_events, claim_events):
        async for event in events:
            if event.type == "SYNCED":
                break
    bound = asyncio.ensure_future(_first(pod_events, lambda p: bool(p.spec.node_name)))
    allocated = asyncio.ensure_future(_first(claim_events, lambda c: c.status is not None and c.status.allocation is not None))
    try:
        created = time.monotonic()
        await _create(kube, pod)
        try:
            done = await asyncio.wait_for(asyncio.gather(allocated, bound), timeout)
        except asyncio.TimeoutError:
            raise DemoError(await _not_bound_message(kube, namespace, name, claim_name, timeout)) from None
    finally:
        for task in (bound, allocated):
            task.cancel()
        await asyncio.gather(bound, allocated, return_exceptions=True)
        await pod_events.aclose()
        await claim_events.aclose()
    allocated_at, bound_at = done
    return [("create -> allocated", allocated_at - created), ("create -> bound", bound_at - created)]


async def _not_bound_message(kube, namespace: str, name: str, claim_name: str, timeout: float) -> str:
    from draplane.api import core
    from draplane.kube import KubeApiError

    why = ""
    try:
        pod = await kube.get(core.Pod, name, namespace)
        for condition in (pod.status.conditions or []) if pod.status else []:
            if condition.type == "PodScheduled" and condition.status != "True":
                why = f": {condition.reason}: {condition.message}"
    except KubeApiError:
        pass
    return (f"Pod {namespace}/{name} was not bound within {timeout:.0f}s{why}. "
            f"`draplane explain {namespace}/{name}` and the binder's and allocators' logs say more")


async def _report(kube, namespace: str, pod_name: str):
    from draplane.api import core, resource
    from draplane.cli.placement_report import report_placement

    pod = await kube.get(core.Pod, pod_name, namespace)
    names = []
    statuses = {s.name: s.resource_claim_name for s in (pod.status.resource_claim_statuses or [])} if pod.status else {}
    for ref in pod.spec.resource_claims or []:
        names.append(ref.resource_claim_name or statuses.get(ref.name))
    pod_claims = [await kube.get(resource.ResourceClaim, n, namespace) for n in names if n]
    slices, _ = await kube.list(resource.ResourceSlice)
    classes, _ = await kube.list(resource.DeviceClass)
    nodes, _ = await kube.list(core.Node)
    claims, _ = await kube.list(resource.ResourceClaim)
    # The allocator core is pure and CPU-bound: off the event loop.
    return await asyncio.to_thread(
        report_placement, pod, pod_claims, slices=slices, classes=classes, nodes=nodes, all_claims=claims,
    )

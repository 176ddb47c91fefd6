"""`draplane demo`: the seed's vLLM example against a real local kube-apiserver.

1. The verbatim seed objects are sent to the apiserver, which rejects two of them; the demo shows
   its messages and the fix for each.
2. The corrected objects are applied and accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import sys
import time
from pathlib import Path

import yaml

FIXED_EXPRESSION = (
    '"memory" in device.capacity[device.driver] && '
    'device.capacity[device.driver].memory.isGreaterThan(quantity("40Gi"))'
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the seed's vLLM example end to end on a local control plane")
    parser.add_argument(
        "--seed-dir", type=Path, default=None,
        help="folder with the seed's deviceclass.yaml, resourceclaim.yaml and pod.yaml "
        "(default: ../shared/examples/seed-vllm next to the repo)",
    )
    parser.set_defaults(handler=run)


def default_seed_dir() -> Path:
    configured = os.environ.get("DRAPLANE_SHARED_DIR")
    if configured:
        return Path(configured) / "examples" / "seed-vllm"
    repo = Path(__file__).resolve().parents[3]
    return repo.parent / "shared" / "examples" / "seed-vllm"


def corrected(seed: dict[str, dict]) -> dict[str, dict]:
    """The seed's intent in valid resource.k8s.io/v1 (see DESIGN.md)."""
    fixed = copy.deepcopy(seed)
    fixed["deviceclass"]["spec"]["selectors"][0]["cel"]["expression"] = FIXED_EXPRESSION
    request = fixed["resourceclaim"]["spec"]["devices"]["requests"][0]
    request["exactly"] = {"deviceClassName": request.pop("deviceClassName"), "count": request.pop("count")}
    return fixed


def run(args: argparse.Namespace) -> int:
    seed_dir = args.seed_dir or default_seed_dir()
    try:
        seed = {name: yaml.safe_load((seed_dir / f"{name}.yaml").read_text()) for name in ("deviceclass", "resourceclaim", "pod")}
    except OSError as exc:
        print(f"draplane demo: cannot read the seed example in {seed_dir}: {exc.strerror}", file=sys.stderr)
        return 2
    return asyncio.run(_demo(seed))


async def _demo(seed: dict[str, dict]) -> int:
    from draplane.kube import KubeApiError, KubeClient
    from draplane.kube.client import raw_collection_path
    from draplane.localenv import binaries
    from draplane.localenv.controlplane import ControlPlane
    from draplane.localenv.processes import StartupError

    started = time.monotonic()
    try:
        await asyncio.to_thread(binaries.ensure_all, progress=lambda m: print(f"  {m}", flush=True))
        plane = await asyncio.to_thread(ControlPlane.start, with_nats=False)
    except (binaries.BinaryError, StartupError) as exc:
        print(f"draplane demo: {exc}", file=sys.stderr)
        return 1
    print(f"local kube-apiserver {plane.apiserver_url} ready in {time.monotonic() - started:.1f}s")
    try:
        async with await KubeClient.from_kubeconfig(plane.kubeconfig) as kube:
            await kube.create_namespace("demo")

            async def send(raw: dict, namespaced: bool) -> str | None:
                body = copy.deepcopy(raw)
                if namespaced:
                    body["metadata"]["namespace"] = "demo"
                try:
                    await kube.request("POST", raw_collection_path(body), body=body, query={"fieldValidation": "Strict"})
                    return None
                except KubeApiError as exc:
                    return exc.message

            print("\n1. The seed's files, verbatim:")
            for name, namespaced in (("deviceclass", False), ("resourceclaim", True)):
                error = await send(seed[name], namespaced)
                print(f"   {seed[name]['kind']} {seed[name]['metadata']['name']}: "
                      + ("accepted" if error is None else f"REJECTED by kube-apiserver:\n     {error}"))
            print("\n   Why: capacity is keyed by domain first, so device.capacity[\"memory\"] is a map;")
            print("   and v1 puts deviceClassName and count under `exactly:` (the seed uses the v1beta1 shape).")

            fixed = corrected(seed)
            print("\n2. The corrected objects:")
            print(f"   DeviceClass selector: {FIXED_EXPRESSION}")
            print("   ResourceClaim request: {name: gpu, exactly: {deviceClassName: high-memory-gpu, count: 1}}")
            for name, namespaced in (("deviceclass", False), ("resourceclaim", True), ("pod", True)):
                error = await send(fixed[name], namespaced)
                if error is not None:
                    print(f"   {fixed[name]['kind']} was rejected: {error}", file=sys.stderr)
                    return 1
                print(f"   {fixed[name]['kind']} {fixed[name]['metadata']['name']}: accepted")
    finally:
        await asyncio.to_thread(plane.stop)
    print(f"\ndone in {time.monotonic() - started:.1f}s")
    return 0

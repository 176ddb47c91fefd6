"""What the fuzz tests (`test_fuzz_*.py`) share: example counts, the no-hang guard, and mutations of
valid inputs into near-valid ones.

Each fuzz target runs a small, fixed number of examples in CI (derandomized, so a run is repeatable).
A long hunt sets ``DRAPLANE_FUZZ_EXAMPLES`` (every target then runs that many, with fresh random
draws; ``--hypothesis-seed`` fixes them), or runs ``bench/fuzz.py``, which prints one BENCH line per
target. ``COUNTS`` records how many examples each target ran, for that bench.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import os
import signal
import string
import time
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

LONG_RUN_EXAMPLES = int(os.environ["DRAPLANE_FUZZ_EXAMPLES"]) if os.environ.get("DRAPLANE_FUZZ_EXAMPLES") else None

# test function name -> examples it ran (explicit @example cases and shrinking included)
COUNTS: collections.Counter[str] = collections.Counter()


def fuzz(examples: int):
    """Hypothesis settings of a fuzz target: `examples` in CI, DRAPLANE_FUZZ_EXAMPLES in a long run.

    No deadline: on a loaded 2-core machine timings are noise; `bounded` catches real hangs."""

    def apply(test):
        configured = settings(
            max_examples=LONG_RUN_EXAMPLES or examples,
            deadline=None,
            derandomize=LONG_RUN_EXAMPLES is None,
            database=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                   HealthCheck.large_base_example],
        )(test)
        inner = configured.hypothesis.inner_test

        @functools.wraps(inner)
        def counted(*args, **kwargs):
            COUNTS[configured.__name__] += 1
            return inner(*args, **kwargs)

        configured.hypothesis.inner_test = counted
        return configured

    return apply


class Hang(Exception):
    """An input took longer than any input may."""


@contextlib.contextmanager
def bounded(seconds: float = 30.0):
    """Fail with Hang if the block runs longer than `seconds` (SIGALRM; the main thread only).

    Generous on purpose: a legitimate input takes milliseconds to a second, and a machine shared by
    several workers can be slow by a factor of ten and more. What this catches is exponential or
    endless work in Python code; work inside one C call (a backtracking regex did that) sees the
    alarm only when it returns, and is caught by pytest-timeout instead."""
    started = time.monotonic()
    fired = []

    def alarm(signum, frame):
        fired.append(True)
        raise Hang(f"still running after {time.monotonic() - started:.1f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if fired:  # the Hang was raised, and something under test caught it (`except Exception`)
        raise Hang(f"ran for {time.monotonic() - started:.1f} s")


def deep(depth: int, leaf: Any = 0) -> Any:
    """A value nested `depth` levels deep, alternating lists and maps."""
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"a": value}
    return value


# --- values a field should not get -----------------------------------------------------------------

AWKWARD_STRINGS = ["", " ", "\x00", "\u2028", "é", "💥", "-", ".", "a" * 254, "x" * 70_000, "${x}", "%s", "\\",
                   "*", "null", "true", "1e999", "NaN", "-1", "0x1F", "node.a", "a/b/c", "gpu.nvidia.com/",
                   "resource.k8s.io/v1", "ResourceClaim"]
AWKWARD_INTS = [0, 1, -1, 2**31, -(2**31) - 1, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]
AWKWARD_FLOATS = [0.0, -0.0, 0.5, 1e308, float("inf"), float("-inf"), float("nan")]


def awkward_values(*, binary: bool = True) -> st.SearchStrategy[Any]:
    """Wrong types, boundary numbers, odd and oversized strings, deep and long containers."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(AWKWARD_INTS),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.sampled_from(AWKWARD_FLOATS),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from(AWKWARD_STRINGS),
        st.text(max_size=20),
        *([st.binary(max_size=20)] if binary else []),
    )
    small = st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(string.ascii_letters, max_size=8), inner,
                                                                     max_size=3),
        max_leaves=6,
    )
    return st.one_of(
        small,
        st.integers(min_value=50, max_value=400).map(deep),
        st.sampled_from([[0] * 1_000, ["x"] * 500, {f"k{i}": i for i in range(300)}]),
    )


# --- near-valid: a valid tree with a few things wrong ------------------------------------------------


def _slots(tree: Any, path: tuple = ()) -> list[tuple]:
    """Paths of the values in a JSON-like tree (the root is the empty path), down to 30 levels."""
    slots = [path]
    if len(path) >= 30:
        return slots
    if isinstance(tree, dict):
        for key, value in tree.items():
            slots.extend(_slots(value, path + (key,)))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            slots.extend(_slots(value, path + (index,)))
    return slots


def _get(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


MUTATIONS = ("replace", "same-type", "same-type", "delete", "add-field", "duplicate", "nest", "grow")


def same_type_values(value: Any) -> st.SearchStrategy[Any]:
    """Another value of the same JSON type: such a change passes the decoder and tests what is after."""
    if isinstance(value, bool):
        return st.just(not value)
    if isinstance(value, int):
        return st.sampled_from(AWKWARD_INTS) | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    if isinstance(value, float):
        return st.sampled_from(AWKWARD_FLOATS) | st.floats()
    if isinstance(value, str):
        return st.sampled_from(AWKWARD_STRINGS) | st.text(max_size=70) | st.just(value + value)
    if isinstance(value, list):
        return st.just([]) | st.permutations(value) | st.just(value + value)
    if isinstance(value, dict):
        return st.just({})
    return st.just(value)


@st.composite
def mutated(draw, tree: Any, *, values: st.SearchStrategy[Any] | None = None, max_mutations: int = 3,
            protect: tuple[tuple, ...] = ()) -> Any:
    """`tree` with 1..max_mutations changes: a value replaced by an awkward one (of any type, or of
    its own type, so that the decoder takes it and what comes after sees it), a field or element
    removed, an unknown field added, an element duplicated, a value nested deeper, or a list or
    string grown to an oversized one. Paths in `protect` (and below them) are left alone."""
    values = values if values is not None else awkward_values()
    tree = copy.deepcopy(tree)
    for _ in range(draw(st.integers(min_value=1, max_value=max_mutations))):
        slots = [p for p in _slots(tree) if not any(p[: len(q)] == q for q in protect)]
        if not slots:
            break
        path = draw(st.sampled_from(slots))
        mutation = draw(st.sampled_from(MUTATIONS))
        target = _get(tree, path)
        if mutation == "replace" or not path and mutation in ("delete", "duplicate"):
            new = draw(values)
        elif mutation == "same-type":
            new = draw(same_type_values(target))
        elif mutation == "delete":
            parent = _get(tree, path[:-1])
            del parent[path[-1]]
            continue
        elif mutation == "add-field" and isinstance(target, dict):
            key = draw(st.sampled_from(["x", "status", "schemaVersion", "version", "type", "kind", "node"])
                       | st.text(max_size=10))
            target[key] = draw(values)
            continue
        elif mutation == "duplicate" and isinstance(_get(tree, path[:-1]), list):
            _get(tree, path[:-1]).insert(path[-1], copy.deepcopy(target))
            continue
        elif mutation == "nest":
            new = deep(draw(st.integers(min_value=1, max_value=300)), target)
        elif mutation == "grow" and isinstance(target, list) and target:
            new = target * draw(st.sampled_from([2, 10, 50]))
        elif mutation == "grow" and isinstance(target, str):
            new = target * draw(st.sampled_from([2, 64, 4_000]))
        else:
            new = draw(values)
        if not path:
            tree = new
        else:
            _get(tree, path[:-1])[path[-1]] = new
    return tree


# --- valid inputs to start from ----------------------------------------------------------------------

SEED_FIXED = os.path.join(os.path.dirname(__file__), "..", "examples", "seed-vllm-fixed")


@functools.lru_cache(maxsize=None)
def profile_drivers(profile: str = "a100-mig", node: str = "gpu-node-1", devices: int = 4):
    """A shipped node-agent profile's DriverDevices, cut to a few devices per driver (mutating a
    large tree is slow, and a few of each kind exercise the same decoders)."""
    import msgspec

    from draplane.nodes.hardware import driver_devices
    from draplane.nodes.profile import load_profile

    drivers = driver_devices(load_profile(profile).hardware(node))
    return tuple(msgspec.structs.replace(d, devices=d.devices[:devices], counter_sets=d.counter_sets[:2])
                 for d in drivers)


@functools.lru_cache(maxsize=None)
def _manifests() -> tuple[dict, ...]:
    import msgspec
    import yaml

    from draplane.nodes.slices import NodeRef, plan_node

    objects = []
    for name in sorted(os.listdir(SEED_FIXED)):
        with open(os.path.join(SEED_FIXED, name)) as f:
            objects.extend(d for d in yaml.safe_load_all(f) if d)
    for node, profile in (("gpu-node-1", "a100-mig"), ("gpu-node-2", "dgx-h100")):
        for plan in plan_node(NodeRef(node, "uid-" + node), list(profile_drivers(profile, node)), []):
            objects.extend(msgspec.to_builtins(s) for s in plan.creates[:2])
    objects.append({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-node-1", "labels": {"zone": "a"}},
                    "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110"}}})
    claim = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "pair", "namespace": "default"},
        "spec": {"devices": {
            "requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2, "selectors": [
                    {"cel": {"expression": 'device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("40Gi")) >= 0'}}],
                    "tolerations": [{"key": "draplane.io/node-agent-unreachable", "operator": "Exists",
                                     "effect": "NoSchedule"}]}},
                {"name": "mig", "firstAvailable": [
                    {"name": "small", "deviceClassName": "mig.nvidia.com", "count": 1},
                    {"name": "any", "deviceClassName": "gpu.nvidia.com", "count": 1}]},
            ],
            "constraints": [{"requests": ["gpu"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {"a": [1, {"b": 2}]}}}],
        }},
    }
    allocated = copy.deepcopy(claim)
    allocated["metadata"]["name"] = "in-use"
    allocated["spec"]["devices"] = {"requests": [claim["spec"]["devices"]["requests"][0]]}
    allocated["status"] = {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "gpu-node-1", "device": "gpu-0"}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["gpu-node-1"]}]}]}}}
    objects += [claim, allocated]
    objects.append({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "gpu.nvidia.com"},
                    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}]}})
    objects.append({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "mig.nvidia.com"},
                    "spec": {"selectors": [{"cel": {"expression": 'device.driver == "gpu.nvidia.com" && '
                                                                 'device.attributes["gpu.nvidia.com"].type == "mig"'}}]}})
    objects.append({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": "bad-gpu"},
                    "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": "gpu-node-1", "device": "gpu-1"},
                             "taint": {"key": "example.com/broken", "value": "true", "effect": "NoSchedule"}}})
    objects.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                    "metadata": {"name": "one-gpu", "namespace": "default"},
                    "spec": {"spec": {"devices": {"requests": [
                        {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}}})
    return tuple(objects)


def manifests() -> list[dict]:
    """Valid DRA objects and their neighbours, as raw mappings: the seed example (corrected), slices
    of the shipped profiles, a Node, claims with every request shape, one allocated, classes, a
    taint rule and a template. A fresh copy each call."""
    return copy.deepcopy(list(_manifests()))


def render(tree: Any, style: str) -> str:
    """A tree as YAML (block or flow) or JSON, the ways a manifest is written."""
    import json

    import yaml

    if style == "json":
        return json.dumps(tree)
    if style == "flow":
        return yaml.safe_dump(tree, default_flow_style=True, width=1 << 30)
    return yaml.safe_dump(tree, sort_keys=False)


@st.composite
def manifest_files(draw) -> list[bytes]:
    """The contents of one to three manifest files for `draplane allocate` or `lint`: the valid set
    (or a few of its objects) with one object mutated, or its text edited, or random bytes (not
    UTF-8 at all, sometimes)."""
    objects = manifests()
    if draw(st.integers(0, 2)):  # mostly a few objects: reading YAML is what takes the time
        chosen = draw(st.lists(st.integers(0, len(objects) - 1), min_size=1, max_size=5, unique=True))
        objects = [objects[i] for i in sorted(chosen)]
    kind = draw(st.sampled_from(["mutated", "edited", "bytes"]))
    if kind == "bytes":
        return [draw(st.binary(max_size=300))]
    if kind == "mutated":
        index = draw(st.integers(0, len(objects) - 1))
        objects[index] = draw(mutated(objects[index], values=awkward_values(binary=False), max_mutations=2))
    style = draw(st.sampled_from(["yaml", "json", "flow"]))
    split = draw(st.integers(1, 3))
    files = []
    for part in range(split):
        chunk = objects[part::split]
        try:
            if style == "json":
                text = "\n".join(render(o, "json") for o in chunk)  # JSON documents back to back
            else:
                text = "---\n".join(render(o, style) for o in chunk)
        except (ValueError, TypeError, RecursionError):
            text = ""
        files.append(text.encode())
    if kind == "edited":
        which = draw(st.integers(0, len(files) - 1))
        data = files[which]
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, len(data)))
            piece = draw(st.sampled_from([b":", b"-", b"[", b"{", b"&x ", b"*x", b"\n", b"  ", b"\xff", b"'", b"#"]))
            data = data[:at] + piece + data[at + draw(st.integers(0, 10)):]
        files[which] = data
    return files

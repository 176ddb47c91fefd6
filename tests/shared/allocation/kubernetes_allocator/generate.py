"""Random apiserver-valid allocation cases for ONE node, shared by the parity test and the bench.

A case is plain Kubernetes JSON (what the oracle reads):
    {"node": Node, "slices": [...], "classes": [...], "claims": [pending], "allocated": [claims with status.allocation]}
with every field the apiserver would default written out (allocationMode, count, toleration
operator), because the Go allocator reads the objects as stored.

The generator draws from a `Source`: `RandomSource` (random.Random, for the bench) or
`HypothesisSource` (hypothesis' `data.draw`, so the test's failures shrink).
"""

from __future__ import annotations

import random
from typing import Any, Sequence

NODE = "node-1"
OTHER_NODE = "node-2"
D1 = "d1.example.com"
D2 = "d2.example.com"
DRIVERS = (D1, D2)
SHARED_DOMAIN = "example.com"  # attributes qualified with this domain exist on both drivers' devices
API = "resource.k8s.io/v1"


class Source:
    def int(self, lo: int, hi: int) -> int:  # inclusive
        raise NotImplementedError

    def bool(self, p: float = 0.5) -> bool:
        # p is the probability of True; shrinks to False.
        return self.int(0, 999) >= int(1000 * (1 - p))

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.int(0, len(seq) - 1)]

    def subset(self, seq: Sequence[Any], p: float = 0.5) -> list:
        return [x for x in seq if self.bool(p)]


class RandomSource(Source):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


class HypothesisSource(Source):
    def __init__(self, data):
        from hypothesis import strategies as st

        self.data = data
        self.st = st

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))


# --- devices ---------------------------------------------------------------------------------------

STRINGS = ("a", "b", "c")
VERSIONS = ("1.0.0", "1.2.0", "2.0.0")
QUANTITIES = ("1Gi", "2Gi", "4Gi", "8Gi")


def attributes(src: Source) -> dict:
    out: dict[str, dict] = {}
    if src.bool(0.8):
        out["model"] = {"string": src.choice(STRINGS)}
    if src.bool(0.7):
        out["numa"] = {"int": src.int(0, 2)}
    if src.bool(0.5):
        out["fast"] = {"bool": src.bool()}
    if src.bool(0.5):
        out["ver"] = {"version": src.choice(VERSIONS)}
    if src.bool(0.5):
        out[f"{SHARED_DOMAIN}/group"] = {"string": src.choice(STRINGS[:2])}
    return out


TAINT_KEYS = ("example.com/broken", "example.com/maint")
TAINT_EFFECTS = ("NoSchedule", "NoExecute")


def taint(src: Source) -> dict:
    t = {"key": src.choice(TAINT_KEYS), "effect": src.choice(TAINT_EFFECTS), "timeAdded": "2026-01-01T00:00:00Z"}
    if src.bool():
        t["value"] = src.choice(("x", "y"))
    return t


def toleration(src: Source) -> dict:
    t: dict[str, Any] = {}
    if src.bool(0.8):
        t["key"] = src.choice(TAINT_KEYS)
    if "key" in t and src.bool():
        t["operator"] = "Equal"
        t["value"] = src.choice(("x", "y"))
    else:
        t["operator"] = "Exists"
    if src.bool():
        t["effect"] = src.choice(TAINT_EFFECTS)
    return t


def capacity_entry(src: Source, consumable: bool) -> dict:
    value = src.choice(QUANTITIES[1:] if consumable else QUANTITIES)  # a policy's 2Gi must fit
    entry: dict[str, Any] = {"value": value}
    if consumable and src.bool(0.7):
        kind = src.int(0, 2)
        if kind == 0:
            entry["requestPolicy"] = {"default": "1Gi", "validValues": ["1Gi", "2Gi"]}
        elif kind == 1:
            entry["requestPolicy"] = {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}
        else:
            entry["requestPolicy"] = {"default": "1Gi"}
    return entry


def device(src: Source, name: str, counter_sets: list[dict], features: dict) -> dict:
    d: dict[str, Any] = {"name": name}
    attrs = attributes(src)
    if attrs:
        d["attributes"] = attrs
    multi = features["consumable"] and src.bool(0.3)
    if multi:
        d["allowMultipleAllocations"] = True
    if src.bool(0.5 if multi else 0.3):
        d["capacity"] = {"memory": capacity_entry(src, multi)}
    if features["taints"] and src.bool(0.2):
        d["taints"] = [taint(src)]
    if features["binding"] and src.bool(0.15):
        d["bindingConditions"] = ["ready"]
        d["bindingFailureConditions"] = ["failed"]
        if src.bool():
            d["bindsToNode"] = True
    if counter_sets and src.bool(0.8):
        cs = src.choice(counter_sets)
        names = list(cs["counters"])
        d["consumesCounters"] = [{
            "counterSet": cs["name"],
            "counters": {n: {"value": src.choice(("1", "2"))} for n in names if src.bool(0.8)} or {names[0]: {"value": "1"}},
        }]
    return d


def pools(src: Source, features: dict) -> list[dict]:
    slices = []
    serial = 0
    first = src.int(0, 1)
    for p in range(src.int(1, 3)):
        # Mostly both drivers on the node, so that claims for both classes can fit.
        driver = src.choice(DRIVERS) if src.bool(0.3) else DRIVERS[(first + p) % 2]
        pool = f"pool-{p}"
        where = src.int(0, 9)
        placement: dict[str, Any]
        if where <= 6:
            placement = {"nodeName": NODE}
        elif where == 7:
            placement = {"nodeName": OTHER_NODE}
        elif where == 8:
            placement = {"allNodes": True}
        else:
            placement = {"nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "zone", "operator": "In", "values": [src.choice(("z1", "z2"))]}]}]}}
        counter_sets = []
        n_slices = 1
        if features["partitionable"] and src.bool(0.3):
            counter_sets = [{"name": f"cs-{i}", "counters": {"mem": {"value": src.choice(("2", "3", "4"))},
                                                             "cores": {"value": src.choice(("1", "2"))}}}
                            for i in range(src.int(1, 2))]
            n_slices = 2  # the counters in a slice of their own, the devices in another
        device_slices = src.int(1, 2)
        declared = n_slices - 1 + device_slices
        complete = not src.bool(0.08)
        generation = 1
        spec_base = {"driver": driver, "pool": {"name": pool, "generation": generation, "resourceSliceCount": declared}}
        if counter_sets:
            slices.append(_slice(f"slice-{serial}", dict(spec_base, **placement, sharedCounters=counter_sets)))
            serial += 1
        for k in range(device_slices):
            if not complete and k == device_slices - 1:
                break  # the pool says it has one more slice than there is
            devices = [device(src, f"dev-{p}-{k}-{i}", counter_sets, features)
                       for i in range(src.choice((0, 1, 2, 2, 3, 4)))]
            spec = dict(spec_base, **placement)
            if devices and features["partitionable"] and "nodeName" not in placement and src.bool(0.3):
                # Per-device node selection: each device says where it is reachable from.
                del spec["allNodes" if "allNodes" in spec else "nodeSelector"]
                spec["perDeviceNodeSelection"] = True
                for d in devices:
                    d.update(src.choice(({"nodeName": NODE}, {"nodeName": OTHER_NODE}, {"allNodes": True},
                                         {"nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": [
                                             {"key": "zone", "operator": "In", "values": ["z1"]}]}]}})))
            if devices:
                spec["devices"] = devices
            slices.append(_slice(f"slice-{serial}", spec))
            serial += 1
    return slices


def _slice(name: str, spec: dict) -> dict:
    return {"apiVersion": API, "kind": "ResourceSlice", "metadata": {"name": name}, "spec": spec}


# --- classes and claims ----------------------------------------------------------------------------

CLASSES = {
    "class-1": [f'device.driver == "{D1}"'],
    "class-2": [f'device.driver == "{D2}"'],
    "class-any": [],
    # Runtime errors on devices without the attribute (and on the other driver's devices).
    "class-numa": [f'device.attributes["{D1}"].numa >= 0'],
}

# Guarded: no runtime error on any device.
REQUEST_SELECTORS = (
    'device.attributes["{d}"].?model.orValue("") == "a"',
    'device.attributes["{d}"].?model.orValue("c") != "c"',
    '"numa" in device.attributes["{d}"] && device.attributes["{d}"].numa <= 1',
    'device.attributes["{d}"].?fast.orValue(false)',
    '"ver" in device.attributes["{d}"] && device.attributes["{d}"].ver.compareTo(semver("1.1.0")) >= 0',
    '"model" in device.attributes["{d}"]',
    '!("fast" in device.attributes["{d}"]) || device.attributes["{d}"].fast',
    '"memory" in device.capacity["{d}"] && device.capacity["{d}"].memory.compareTo(quantity("4Gi")) >= 0',
    '"memory" in device.capacity["{d}"]',
    'device.attributes["example.com"].?group.orValue("") == "a"',
    'device.allowMultipleAllocations',
)
# Unguarded: a runtime error on devices without the attribute.
ERROR_SELECTORS = (
    'device.attributes["{d}"].model == "a"',
    'device.attributes["{d}"].numa <= 1',
    'device.capacity["{d}"].memory.compareTo(quantity("4Gi")) >= 0',
)

CONSTRAINT_ATTRIBUTES = (f"{D1}/model", f"{D1}/numa", f"{D1}/fast", f"{D1}/ver", f"{D2}/model", f"{D2}/numa",
                         f"{SHARED_DOMAIN}/group")


def _opaque(driver: str, value: str) -> dict:
    return {"opaque": {"driver": driver, "parameters": {"setting": value}}}


def classes() -> list[dict]:
    out = []
    for name, exprs in CLASSES.items():
        spec: dict[str, Any] = {}
        if exprs:
            spec["selectors"] = [{"cel": {"expression": e}} for e in exprs]
        if name in ("class-1", "class-2"):  # config from the class goes into the results too
            spec["config"] = [_opaque(D1 if name == "class-1" else D2, f"from-{name}")]
        out.append({"apiVersion": API, "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec})
    return out


def _class_and_driver(src: Source) -> tuple[str, str]:
    name = src.choice(("class-1", "class-1", "class-2", "class-2", "class-any", "class-numa" if src.bool(0.2) else "class-1"))
    driver = {"class-1": D1, "class-2": D2, "class-numa": D1}.get(name) or src.choice(DRIVERS)
    return name, driver


def _request_body(src: Source, features: dict, *, admin_ok: bool) -> dict:
    cls, driver = _class_and_driver(src)
    body: dict[str, Any] = {"deviceClassName": cls}
    if src.bool(0.15):
        body["allocationMode"] = "All"
    else:
        body["allocationMode"] = "ExactCount"
        body["count"] = src.choice((1, 1, 1, 2, 3))
    if src.bool(0.4):
        exprs = {src.choice(ERROR_SELECTORS if src.bool(0.07) else REQUEST_SELECTORS).format(d=driver)
                 for _ in range(src.int(1, 2))}
        body["selectors"] = [{"cel": {"expression": e}} for e in sorted(exprs)]
    if features["taints"] and src.bool(0.25):
        body["tolerations"] = [toleration(src) for _ in range(src.int(1, 2))]
    if features["consumable"] and src.bool(0.2):
        body["capacity"] = {"requests": {"memory": src.choice(("1Gi", "2Gi", "3Gi"))}}
    if admin_ok and features["admin"] and src.bool(0.1):
        body["adminAccess"] = True
    return body


def claim(src: Source, name: str, features: dict) -> dict:
    requests = []
    names = []
    for r in range(src.choice((1, 1, 2, 3))):
        rname = f"req-{r}"
        names.append(rname)
        if features["prioritized"] and src.bool(0.25):
            subs = []
            for s in range(src.int(1, 3)):
                subs.append({"name": f"sub-{s}", **_request_body(src, features, admin_ok=False)})
            requests.append({"name": rname, "firstAvailable": subs})
        else:
            requests.append({"name": rname, "exactly": _request_body(src, features, admin_ok=True)})
    devices: dict[str, Any] = {"requests": requests}
    constraints = []
    for _ in range(src.int(0, 2) if src.bool(0.4) else 0):
        c: dict[str, Any] = {}
        key = "matchAttribute" if src.bool(0.6) else "distinctAttribute"
        c[key] = src.choice(CONSTRAINT_ATTRIBUTES)
        if len(names) > 1 and src.bool(0.5):
            chosen = src.subset(names)
            if chosen:
                c["requests"] = chosen
        constraints.append(c)
    if constraints:
        devices["constraints"] = constraints
    if src.bool(0.2):
        config = []
        for _ in range(src.int(1, 2)):
            entry = _opaque(src.choice(DRIVERS), src.choice(("x", "y")))
            if src.bool(0.5):
                targets = [r["name"] if "exactly" in r or src.bool(0.5) else f"{r['name']}/{r['firstAvailable'][0]['name']}"
                           for r in requests if src.bool(0.6)]
                if targets:
                    entry["requests"] = targets
            config.append(entry)
        devices["config"] = config
    return {"apiVersion": API, "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": {"devices": devices}}


def allocated_claims(src: Source, slices: list[dict]) -> list[dict]:
    devices = [(s["spec"]["driver"], s["spec"]["pool"]["name"], d)
               for s in slices for d in s["spec"].get("devices", ())]
    out = []
    if not devices:
        return out
    for i in range(src.int(0, 2)):
        results = []
        for k in range(src.int(1, 2)):
            driver, pool, d = src.choice(devices)
            result: dict[str, Any] = {"request": "req-0", "driver": driver, "pool": pool, "device": d["name"]}
            if d.get("allowMultipleAllocations"):
                result["shareID"] = f"00000000-0000-0000-0000-00000000{i:02d}{k:02d}"
                if "capacity" in d and src.bool(0.8):
                    result["consumedCapacity"] = {"memory": src.choice(("1Gi", "2Gi", "4Gi"))}
            elif src.bool(0.1):
                result["adminAccess"] = True
            if any(r["device"] == d["name"] and r["pool"] == pool and r["driver"] == driver for r in results):
                continue
            results.append(result)
        name = f"in-use-{i}"
        spec_request = {"name": "req-0", "exactly": {"deviceClassName": "class-any", "allocationMode": "ExactCount",
                                                      "count": len(results)}}
        if any(r.get("adminAccess") for r in results):
            spec_request["exactly"]["adminAccess"] = True
        out.append({
            "apiVersion": API, "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": {"devices": {"requests": [spec_request]}},
            "status": {"allocation": {"devices": {"results": results},
                                      "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                                          {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}}},
        })
    return out


ALL_FEATURES = {"taints": True, "consumable": True, "partitionable": True, "binding": True, "admin": True,
                "prioritized": True}


def case(src: Source, features: dict | None = None) -> dict:
    features = dict(ALL_FEATURES, **(features or {}))
    slices = pools(src, features)
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE, "zone": src.choice(("z1", "z2"))}}}
    pending = [claim(src, f"claim-{i}", features) for i in range(src.int(1, 2))]
    return {"node": node, "slices": slices, "classes": classes(), "claims": pending,
            "allocated": allocated_claims(src, slices)}


def objects(c: dict) -> list[dict]:
    return [c["node"], *c["slices"], *c["classes"], *c["claims"], *c["allocated"]]


# --- running both ---------------------------------------------------------------------------------

def valid(c: dict) -> bool:
    """Whether the apiserver would have accepted every object of the case."""
    from draplane.validation import validate_object

    return not any(validate_object(o, admin_access=True) for o in objects(c) if o["kind"] != "Node")


def draplane_outcome(c: dict) -> dict:
    """draplane's answer in the oracle's shape. "error": an AllocationError (fatal, or raised for
    the node, where kube-scheduler fails the attempt); "unallocatable": a NodeFailure."""
    import msgspec

    from draplane.allocation import AllocationError, DeviceAllocator, NodePlacement
    from draplane.api.codec import decode_object

    node = decode_object(c["node"])
    cluster = DeviceAllocator(slices=[decode_object(s) for s in c["slices"]], classes=[decode_object(k) for k in c["classes"]],
                      nodes=[node], policy="first-fit")
    for a in c["allocated"]:
        cluster.add_allocated_claim(decode_object(a))
    try:
        outcome = cluster.allocate_on_node([decode_object(k) for k in c["claims"]], NODE)
    except AllocationError as exc:
        return {"outcome": "error", "message": exc.message, "reason": exc.reason.value, "allocations": []}
    if isinstance(outcome, NodePlacement):
        return {"outcome": "allocated", "allocations": [msgspec.to_builtins(a) for a in outcome.allocations]}
    return {"outcome": "unallocatable", "message": outcome.message, "reason": outcome.reason.value, "allocations": []}


def draplane_path_outcomes(c: dict, workdir) -> dict[str, str]:
    """The outcome class on draplane's two other paths for the same input: the shard's
    (`DeviceAllocator.allocate` over every node, as `SchedulingState.place_pod` calls it) and
    `draplane allocate` (its exit code: 0 allocated, 1 unallocatable, 2 error). Both must agree
    with `allocate_on_node`: an error ends kube-scheduler's attempt, it is not "unallocatable"."""
    import contextlib
    import io
    import json
    from pathlib import Path

    from draplane.allocation import AllocationError, DeviceAllocator, NodePlacement
    from draplane.api.codec import decode_object
    from draplane.cli import main

    cluster = DeviceAllocator(slices=[decode_object(s) for s in c["slices"]], classes=[decode_object(k) for k in c["classes"]],
                      nodes=[decode_object(c["node"])], policy="first-fit")
    for a in c["allocated"]:
        cluster.add_allocated_claim(decode_object(a))
    try:
        placed = cluster.allocate([decode_object(k) for k in c["claims"]], explain=True)
        shard = "allocated" if isinstance(placed, NodePlacement) else "unallocatable"
    except AllocationError:
        shard = "error"
    path = Path(workdir) / "case.json"
    items = [c["node"], *c["classes"], *c["slices"], *c["allocated"], *c["claims"]]
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["allocate", "--policy", "first-fit", "--node", NODE, str(path)])
    cli = {0: "allocated", 1: "unallocatable", 2: "error"}.get(code, f"exit {code}")
    return {"shard": shard, "cli": cli}


def chosen_devices(answer: dict) -> list[list[tuple]]:
    """Per claim: (request, driver, pool, device, adminAccess) of each result, in order."""
    return [
        [(r["request"], r["driver"], r["pool"], r["device"], bool(r.get("adminAccess")))
         for r in ((a.get("devices") or {}).get("results") or [])]
        for a in answer.get("allocations") or []
    ]


DETAIL_FIELDS = ("consumedCapacity", "bindingConditions", "bindingFailureConditions", "tolerations")


def _details(answer: dict) -> list:
    out = []
    for a in answer.get("allocations") or []:
        results = (a.get("devices") or {}).get("results") or []
        out.append({
            "nodeSelector": a.get("nodeSelector"),
            "shared": [r.get("shareID") is not None for r in results],
            "config": (a.get("devices") or {}).get("config"),
            **{f: [_normalize(r.get(f)) for r in results] for f in DETAIL_FIELDS},
        })
    return out


def _normalize(value):
    if isinstance(value, dict):  # consumedCapacity: quantities, compared by value
        from draplane.api.quantity import Quantity

        return {k: Quantity.parse(v).value if isinstance(v, str) else v for k, v in value.items()}
    return value or None


def compare(c: dict, kube: dict, ours: dict) -> str | None:
    """None when they agree, else a disagreement category. Beyond the chosen devices, the other
    fields of the results (consumed capacity, binding conditions, tolerations, whether shared,
    the node selector) must match too; share IDs are random on both sides."""
    if kube["outcome"] != ours["outcome"]:
        return f"outcome:draplane={ours['outcome']}/kubernetes={kube['outcome']}"
    if ours["outcome"] != "allocated":
        return None
    if chosen_devices(kube) != chosen_devices(ours):
        return "devices"
    for k, o in zip(_details(kube), _details(ours)):
        for field in k:
            if k[field] != o[field]:
                return f"details:{field}"
    return None

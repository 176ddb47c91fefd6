"""The allocator conformance table as data: every `allocate` call its tests make, with its inputs.

`test_allocator_conformance.py` states each case as a test function that calls the builders'
`allocate` and asserts on the answer. Running those functions once with a recording `allocate`
turns the table into data (classes, slices, claims, node, claims in use) that other tests can feed
through other paths: the live services, for one. The functions' own assertions still run while
recording, so a case is only recorded with an answer its test accepts.

`renamed` gives a case its own drivers, classes, nodes and slice names, so that many cases can
share one apiserver without one case's devices being visible to another's claims. Renaming keeps
the order of drivers (a common prefix), which is the order first-fit walks pools in.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path

import msgspec

import allocation_builders
from draplane.allocation import AllocationError, NodeFailure, NodePlacement
from draplane.api.codec import decode_json, encode_json
from draplane.api.core import Node
from draplane.api.resource import DeviceClass, ResourceClaim, ResourceSlice

CONFORMANCE_MODULE = Path(__file__).with_name("test_allocator_conformance.py")


@dataclasses.dataclass(frozen=True)
class ConformanceCase:
    id: str  # the test function, its parameters, and the call's index within it
    classes: tuple[DeviceClass, ...]
    slices: tuple[ResourceSlice, ...]
    claims: tuple[ResourceClaim, ...]
    node: Node
    in_use: tuple[ResourceClaim, ...]
    policy: str

    def offline(self, policy: str | None = None) -> NodePlacement | NodeFailure | AllocationError:
        """The core's answer, as the conformance test got it (an error is returned, not raised),
        or under another policy."""
        try:
            return allocation_builders.allocate(list(self.classes), list(self.slices), list(self.claims),
                                                on=self.node, in_use=list(self.in_use), policy=policy or self.policy)
        except AllocationError as exc:
            return exc

    def renamed(self, token: str) -> "ConformanceCase":
        """The same case with every cluster-wide name made its own: drivers `<token>.<driver>`,
        classes, nodes, slices and namespaces `<token>-<name>`."""
        drivers = sorted({s.spec.driver for s in self.slices}
                         | {c.opaque.driver for cls in self.classes for c in cls.spec.config or () if c.opaque}
                         | {a.driver for c in self.in_use for a in _results(c)})
        classes = sorted({c.metadata.name for c in self.classes}
                         | {name for c in (*self.claims, *self.in_use) for name in _class_names(c)})
        nodes = sorted({self.node.metadata.name} | {n for s in self.slices for n in _node_names(s)})

        def rename(obj):
            text = encode_json(obj).decode()
            for driver in drivers:
                # drivers also appear inside CEL and qualified attribute names: replace everywhere
                text = text.replace(driver, f"{token}.{driver}")
            for name in classes + nodes:
                if name:
                    text = re.sub(f'"{re.escape(name)}"', f'"{token}-{name}"', text)
            out = decode_json(text, type(obj))
            return out

        def rename_slice(s: ResourceSlice) -> ResourceSlice:
            s = rename(s)
            return msgspec.structs.replace(s, metadata=msgspec.structs.replace(s.metadata, name=f"{token}-{s.metadata.name}"))

        def rename_claim(c: ResourceClaim) -> ResourceClaim:
            c = rename(c)
            namespace = f"{token}-{c.metadata.namespace or 'default'}"
            return msgspec.structs.replace(c, metadata=msgspec.structs.replace(c.metadata, namespace=namespace))

        return ConformanceCase(
            id=self.id,
            classes=tuple(rename(c) for c in self.classes),
            slices=tuple(rename_slice(s) for s in self.slices),
            claims=tuple(rename_claim(c) for c in self.claims),
            node=rename(self.node),
            in_use=tuple(rename_claim(c) for c in self.in_use),
            policy=self.policy,
        )

    @property
    def namespaces(self) -> list[str]:
        return sorted({c.metadata.namespace or "default" for c in (*self.claims, *self.in_use)})


def _results(claim: ResourceClaim):
    allocation = claim.status.allocation if claim.status else None
    return (allocation.devices.results if allocation and allocation.devices else None) or ()


def _class_names(claim: ResourceClaim):
    for request in claim.spec.devices.requests or () if claim.spec.devices else ():
        if request.exactly is not None:
            yield request.exactly.device_class_name
        for sub in request.first_available or ():
            yield sub.device_class_name


def _node_names(s: ResourceSlice):
    if s.spec.node_name:
        yield s.spec.node_name
    for d in s.spec.devices or ():
        if d.node_name:
            yield d.node_name


def _copy(obj):
    return decode_json(encode_json(obj), type(obj))


def _load_module():
    spec = importlib.util.spec_from_file_location("allocator_conformance_table", CONFORMANCE_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _argument_sets(function) -> list[tuple]:
    marks = [m for m in getattr(function, "pytestmark", ()) if m.name == "parametrize"]
    if not marks:
        return [()]
    if len(marks) > 1:
        raise NotImplementedError(f"{function.__name__}: more than one parametrize mark")
    names, values = marks[0].args[0], marks[0].args[1]
    many = "," in names if isinstance(names, str) else len(names) > 1
    return [tuple(v) if many else (v,) for v in values]


def recorded_cases() -> list[ConformanceCase]:
    """Every allocate call of the conformance table, in the table's order."""
    module = _load_module()
    real = module.allocate
    cases: list[ConformanceCase] = []
    current = {"id": "", "n": 0}

    def recording(classes, slices, claims, *, on=None, in_use=(), policy=None):
        cases.append(ConformanceCase(
            id=f"{current['id']}#{current['n']}",
            classes=tuple(_copy(c) for c in classes), slices=tuple(_copy(s) for s in slices),
            claims=tuple(_copy(c) for c in claims), node=_copy(on or allocation_builders.node()),
            in_use=tuple(_copy(c) for c in in_use), policy=policy or "first-fit",
        ))
        current["n"] += 1
        return real(classes, slices, claims, on=on, in_use=in_use, policy=policy)

    module.allocate = recording
    functions = [(n, f) for n, f in inspect.getmembers(module, inspect.isfunction)
                 if n.startswith("test_") and f.__module__ == module.__name__]
    functions.sort(key=lambda nf: nf[1].__code__.co_firstlineno)
    for name, function in functions:
        if inspect.signature(function).parameters and not getattr(function, "pytestmark", None):
            raise NotImplementedError(f"{name} takes fixtures; the table cannot record it")
        for args in _argument_sets(function):
            current["id"] = name + (f"[{'-'.join(map(str, args))}]" if args else "")
            current["n"] = 0
            function(*args)
    return cases

"""CEL selector checks: length, compile and type errors, cost; and fixes for the common mistakes.

Compilation goes through draplane.cel, the same environment the allocator evaluates with, so an
expression lint accepts is one the allocator can run, and one the apiserver rejects is rejected here
with the engine's own type-check message.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Iterable

from draplane.validation import limits
from draplane.validation.problem import INVALID, Findings

# Attribute and capacity names the real drivers publish, so a bare name can be given its domain in a
# suggested fix even when no ResourceSlice is at hand (names from DESIGN.md's node-agent section).
WELL_KNOWN_DOMAINS = {
    "gpu.nvidia.com": (
        "type", "uuid", "productName", "brand", "architecture", "cudaComputeCapability",
        "driverVersion", "memory",
    ),
    "resource.kubernetes.io": ("pcieRoot", "pciBusID", "numaNode"),
}

# device.capacity["memory"] / device.attributes['productName']: a bare name where a domain belongs.
_BARE_LOOKUP = re.compile(r"""device\.(?P<map>capacity|attributes)\[\s*(?P<q>["'])(?P<key>[A-Za-z_][A-Za-z0-9_]*)(?P=q)\s*\]""")


@lru_cache(maxsize=4096)
def compile_error(expression: str) -> tuple[str, str] | None:
    """(reason, message) when the expression does not compile or is too costly, else None."""
    from draplane import cel

    try:
        compiled = cel.compile_selector(expression)
    except cel.CELCompileError as exc:
        return ("compile", getattr(exc, "message", None) or str(exc))
    max_cost = getattr(cel, "MAX_SELECTOR_COST", limits.CEL_SELECTOR_MAX_COST)
    for attribute in ("max_cost", "cost"):
        cost = getattr(compiled, attribute, None)
        if isinstance(cost, (int, float)) and cost > max_cost:
            return ("cost", f"estimated cost {int(cost)} exceeds the limit of {max_cost}")
    return None


def check_expression(expression: str, path: str, findings: Findings,
                     domains_by_name: dict[str, list[str]] | None = None) -> None:
    if not expression:
        findings.required(path, "a CEL selector needs an expression that evaluates to true for wanted devices",
                          fix='expression: device.driver == "gpu.nvidia.com"')
        return
    max_length = limits.CEL_EXPRESSION_MAX_LENGTH
    if len(expression) > max_length:
        # Like the apiserver: too long is not compiled at all.
        findings.too_long(path, len(expression), max_length, "the CEL expression",
                          fix="split it into several selectors (all must match) or simplify it")
        return
    try:
        error = compile_error(expression)
    except ImportError as exc:  # the engine module itself is broken: say so, on this field
        findings.add(path, "Internal error", f"cannot check CEL here: {exc}")
        return
    if error is None:
        return
    reason, message = error
    if reason == "cost":
        findings.forbidden(path, f"too complex: {message}",
                           fix="avoid nested all()/exists() over lists, or split the expression into several selectors")
        return
    bare = list(_bare_lookups(expression))
    if bare:
        # The expression is not repeated in the message: the field names it, and it can be long.
        findings.add(path, INVALID, _bare_lookup_message(bare, message),
                     fix=_bare_lookup_fix(expression, bare, domains_by_name or {}))
    else:
        findings.add(path, INVALID, f"does not compile as a Kubernetes device selector: {message}",
                     fix=_generic_fix(message))


def _bare_lookups(expression: str) -> Iterable[re.Match[str]]:
    return _BARE_LOOKUP.finditer(expression)


def _bare_lookup_message(bare: list[re.Match[str]], engine_message: str) -> str:
    first = bare[0]
    what = first["map"]
    key = first["key"]
    singular = "capacity" if what == "capacity" else "attribute"
    return (
        f"device.{what}[\"{key}\"] looks up the domain \"{key}\", not the {singular} named {key}: "
        f"device.{what} is keyed by domain first (such as \"gpu.nvidia.com\"), then by name, so "
        f"device.{what}[\"{key}\"] is a map of {singular} values and the rest of the expression does "
        f"not type-check.\nCEL: {engine_message}"
    )


def domain_for(name: str, domains_by_name: dict[str, list[str]]) -> str:
    """The domain that publishes `name`: from the slices at hand, else from the well-known drivers."""
    known = domains_by_name.get(name)
    if known:
        return known[0]
    for domain, known_names in WELL_KNOWN_DOMAINS.items():
        if name in known_names:
            return domain
    return "<driver domain>"


def _bare_lookup_fix(expression: str, bare: list[re.Match[str]], domains_by_name: dict[str, list[str]]) -> str:
    qualified = _BARE_LOOKUP.sub(
        lambda m: f'device.{m["map"]}["{domain_for(m["key"], domains_by_name)}"].{m["key"]}', expression
    )
    neutral_body = _BARE_LOOKUP.sub(lambda m: f'device.{m["map"]}[device.driver].{m["key"]}', expression)
    guards = []
    for m in bare:
        guard = f'"{m["key"]}" in device.{m["map"]}[device.driver]'
        if guard not in guards:
            guards.append(guard)
    if "||" in neutral_body or "?" in neutral_body:
        neutral_body = f"({neutral_body})"
    neutral = " && ".join(guards + [neutral_body])
    return f"{qualified}\nor, for any driver that publishes it:\n{neutral}"


def _generic_fix(message: str) -> str | None:
    lowered = message.lower()
    if "undeclared reference" in lowered:
        return "the only variable is `device` (device.driver, device.attributes[domain].name, device.capacity[domain].name)"
    if "no matching overload" in lowered and "quantity" in lowered:
        return 'compare capacities with quantity methods, e.g. device.capacity["gpu.nvidia.com"].memory.isGreaterThan(quantity("40Gi"))'
    if "syntax error" in lowered or "mismatched input" in lowered:
        return "check parentheses, quotes and operators (&&, ||, ==); strings use double or single quotes"
    return None

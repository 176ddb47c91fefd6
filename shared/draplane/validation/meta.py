"""ObjectMeta and NodeSelector rules shared by all kinds (corevalidation in Kubernetes)."""

from __future__ import annotations

from typing import Any, Callable

from draplane.validation import names
from draplane.validation.problem import Findings

ANNOTATIONS_MAX_BYTES = 256 * 1024

NameRule = Callable[[str], list[str]]


def check_object_meta(meta: dict[str, Any] | None, findings: Findings, name_rule: NameRule, name_fix: Callable[[str], str],
                      *, namespaced: bool, path: str = "metadata", check_generate_name: bool = True) -> None:
    meta = meta or {}
    name = meta.get("name")
    generate_name = meta.get("generateName")
    if not name and not generate_name:
        findings.required(f"{path}.name", "every object needs a name (or generateName)",
                          fix=f"add `name: <name>` under {path}")
    if name:
        for message in name_rule(name):
            findings.invalid(f"{path}.name", name, message, fix=f"name: {name_fix(name)}")
    if generate_name and check_generate_name:
        # generateName gets a random suffix appended, so only its prefix is checked here.
        trimmed = generate_name.rstrip("-") or generate_name
        for message in name_rule(trimmed):
            findings.invalid(f"{path}.generateName", generate_name, message)

    namespace = meta.get("namespace")
    # A namespace on a cluster-scoped object is ignored by the apiserver, not rejected.
    if namespace is not None and namespaced:
        if namespace:
            for message in names.dns1123_label(namespace):
                findings.invalid(f"{path}.namespace", namespace, message)
    for key, value in (meta.get("labels") or {}).items():
        for message in names.label_key(key):
            findings.invalid(f"{path}.labels", key, f"not a valid label key: {message}")
        for message in names.label_value(value):
            findings.invalid(f"{path}.labels", value, f"not a valid value for label {key!r}: it {message}")
    generation = meta.get("generation")
    # Cluster-scoped DRA objects get their generation reset on create; claims and templates do not.
    if namespaced and generation is not None and generation < 0:
        findings.invalid(f"{path}.generation", generation, "must be zero or more", fix="remove generation")
    _check_finalizers(meta.get("finalizers") or [], f"{path}.finalizers", findings)
    _check_owner_references(meta.get("ownerReferences") or [], f"{path}.ownerReferences", findings)
    annotations = meta.get("annotations") or {}
    size = 0
    for key, value in annotations.items():
        size += len(key.encode()) + len(value.encode())
        for message in names.label_key(key):
            findings.invalid(f"{path}.annotations", key, f"not a valid annotation key: {message}")
    if size > ANNOTATIONS_MAX_BYTES:
        findings.too_long(f"{path}.annotations", size, ANNOTATIONS_MAX_BYTES, "the annotations together")


STANDARD_FINALIZERS = ("kubernetes", "orphan", "foregroundDeletion")


def _check_finalizers(finalizers: list[Any], path: str, findings: Findings) -> None:
    for index, finalizer in enumerate(finalizers):
        finalizer = finalizer or ""
        errors = names.label_key(finalizer)
        for message in errors:
            findings.invalid(path, finalizer, f"not a valid finalizer name: {message}")
        if "/" not in finalizer and finalizer not in STANDARD_FINALIZERS:
            findings.invalid(f"{path}[{index}]", finalizer, "is neither a standard finalizer name nor qualified with a "
                             "domain", fix=f"example.com/{finalizer}")
    if "orphan" in finalizers and "foregroundDeletion" in finalizers:
        findings.invalid(path, finalizers, "orphan and foregroundDeletion cannot both be set: they are two different "
                         "deletion policies", fix="keep one of them")


def _check_owner_references(references: list[Any], path: str, findings: Findings) -> None:
    controllers = 0
    for index, reference in enumerate(references):
        reference = reference or {}
        for key in ("apiVersion", "kind", "name", "uid"):
            if not reference.get(key):
                findings.required(f"{path}[{index}].{key}", f"an owner reference needs its {key}")
        controllers += reference.get("controller") is True
    if controllers > 1:
        findings.invalid(path, None, "only one owner reference can have controller: true",
                         fix="set controller: true on the one owner that manages this object")


_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
_FIELD_OPERATORS = ("In", "NotIn")


def check_node_selector(selector: dict[str, Any], path: str, findings: Findings) -> None:
    terms = selector.get("nodeSelectorTerms")
    if not terms:
        findings.required(f"{path}.nodeSelectorTerms", "a node selector needs at least one term",
                          fix="add nodeSelectorTerms with one matchExpressions entry, or remove the nodeSelector")
        return
    for t, term in enumerate(terms):
        term = term or {}
        term_path = f"{path}.nodeSelectorTerms[{t}]"
        for r, requirement in enumerate(term.get("matchExpressions") or []):
            _check_requirement(requirement or {}, f"{term_path}.matchExpressions[{r}]", findings, field_selector=False)
        for r, requirement in enumerate(term.get("matchFields") or []):
            _check_requirement(requirement or {}, f"{term_path}.matchFields[{r}]", findings, field_selector=True)


def _check_requirement(requirement: dict[str, Any], path: str, findings: Findings, *, field_selector: bool) -> None:
    key = requirement.get("key") or ""
    operator = requirement.get("operator") or ""
    values = requirement.get("values") or []
    if not key:
        findings.required(f"{path}.key", "a node selector requirement needs a key")
    elif field_selector:
        if key != "metadata.name":
            findings.invalid(f"{path}.key", key, "matchFields can only select on metadata.name",
                             fix="key: metadata.name (or use matchExpressions for labels)")
    else:
        for message in names.label_key(key):
            findings.invalid(f"{path}.key", key, message)
    supported = _FIELD_OPERATORS if field_selector else _SELECTOR_OPERATORS
    if not operator:
        findings.required(f"{path}.operator", "a node selector requirement needs an operator")
        return
    if operator not in supported:
        findings.unsupported(f"{path}.operator", operator, supported)
        return
    if operator in ("In", "NotIn"):
        if not values:
            findings.required(f"{path}.values", f"operator {operator} needs at least one value")
        elif field_selector and len(values) != 1:
            findings.invalid(f"{path}.values", values, "matchFields takes exactly one value")
        if field_selector and key == "metadata.name":
            for v, value in enumerate(values):
                for message in names.dns1123_subdomain(value or ""):
                    findings.invalid(f"{path}.values[{v}]", value, f"not a node name: {message}")
    elif operator in ("Exists", "DoesNotExist"):
        if values:
            findings.forbidden(f"{path}.values", f"operator {operator} takes no values", fix="remove values")
    elif len(values) != 1:  # Gt, Lt; the apiserver does not check that the value is an integer
        findings.required(f"{path}.values", f"operator {operator} takes exactly one (integer) value")
    if not field_selector:
        for v, value in enumerate(values):
            for message in names.label_value(value or ""):
                findings.invalid(f"{path}.values[{v}]", value, message)

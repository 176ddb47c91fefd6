"""The semantic rules of pkg/apis/resource/validation for DeviceClass, ResourceClaim(+Template) and
ResourceSlice, applied after defaulting, to objects that already passed the schema check.

Each check names the field path the apiserver would name. Messages say what is wrong in words a
user can act on, and most carry a concrete fix.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
import uuid
from fractions import Fraction
from typing import Any

import yaml

from draplane.api.quantity import parse_quantity
from draplane.validation import limits, names
from draplane.validation.meta import check_node_selector, check_object_meta
from draplane.validation.problem import UNKNOWN_FIELD, Findings
from draplane.validation.schema import EXACT_FIELDS
from draplane.validation.selectors import check_expression, domain_for

ALLOCATION_MODES = ("All", "ExactCount")
TOLERATION_OPERATORS = ("Equal", "Exists")
TAINT_EFFECTS = ("NoExecute", "NoSchedule", "None")
CONFIG_SOURCES = ("FromClaim", "FromClass")

Domains = dict[str, list[str]]


# --- generic list checks -------------------------------------------------------------------------


def _too_many(items: list[Any] | None, limit: int, path: str, what: str, findings: Findings, fix: str | None = None) -> bool:
    """Like the apiserver, an oversized list is reported once and its entries are not looked at."""
    if items is not None and len(items) > limit:
        findings.too_many(path, len(items), limit, what, fix)
        return True
    return False


def _duplicates(keys: list[Any], path: str, what: str, findings: Findings, fix: str | None = None) -> None:
    seen: dict[Any, int] = {}
    for index, key in enumerate(keys):
        if key is None:
            continue
        if key in seen:
            if key == "":
                findings.duplicate(f"{path}[{index}]", key, f"has no {what}, like {path}[{seen[key]}]; "
                                   f"{what}s must be set and unique", fix=f"give each entry its own {what}")
            else:
                findings.duplicate(f"{path}[{index}]", key, f"{what} {key!r} is already used by {path}[{seen[key]}]; "
                                   f"{what}s must be unique", fix=fix or f"rename one of them, e.g. {key}-{index}")
        else:
            seen[key] = index


# --- DeviceClass ---------------------------------------------------------------------------------


def check_device_class(obj: dict[str, Any], findings: Findings, domains: Domains) -> None:
    # The v1.37 apiserver validates a class's name with its own rule, which leaves generateName alone.
    check_object_meta(obj.get("metadata"), findings, names.dns1123_subdomain, names.to_dns_subdomain, namespaced=False,
                      check_generate_name=False)
    spec = obj.get("spec") or {}
    selectors = spec.get("selectors")
    if not _too_many(selectors, limits.SELECTORS_MAX, "spec.selectors", "selectors", findings,
                     fix="combine selectors with && in fewer expressions"):
        for index, selector in enumerate(selectors or []):
            _check_selector(selector, f"spec.selectors[{index}]", findings, domains)
    config = spec.get("config")
    if not _too_many(config, limits.CONFIG_MAX, "spec.config", "config entries", findings):
        for index, entry in enumerate(config or []):
            _check_device_configuration(entry or {}, f"spec.config[{index}]", findings)
    extended = spec.get("extendedResourceName")
    if extended is not None and not names.is_extended_resource_name(extended):
        findings.invalid("spec.extendedResourceName", extended,
                         "must be an extended resource name: 'domain/name' outside kubernetes.io, such as "
                         "'example.com/gpu'")
    generate_name = (obj.get("metadata") or {}).get("generateName") or ""
    if "/" in generate_name and all(p.reason == UNKNOWN_FIELD for p in findings.problems):
        # A later stage of the apiserver than validation, so only reached by an otherwise valid class.
        findings.invalid("metadata.generateName", generate_name, "may not contain '/'",
                         fix=f"generateName: {generate_name.replace('/', '-')}")


def _check_selector(selector: Any, path: str, findings: Findings, domains: Domains) -> None:
    cel = (selector or {}).get("cel")
    if cel is None:
        findings.required(f"{path}.cel", "a selector must have a cel expression",
                          fix='cel:\n  expression: device.driver == "gpu.nvidia.com"')
        return
    check_expression(cel.get("expression") or "", f"{path}.cel.expression", findings, domains)


def _check_device_configuration(entry: dict[str, Any], path: str, findings: Findings) -> None:
    opaque = entry.get("opaque")
    if opaque is None:
        findings.required(f"{path}.opaque", "a config entry must carry opaque driver parameters",
                          fix="opaque:\n  driver: <driver name>\n  parameters: {...}")
        return
    _check_driver(opaque.get("driver") or "", f"{path}.opaque.driver", findings)
    parameters = opaque.get("parameters")
    param_path = f"{path}.opaque.parameters"
    if parameters is None:
        findings.required(param_path, "opaque config needs parameters (a JSON object for the driver)",
                          fix="parameters: {apiVersion: <driver api>, kind: <kind>}")
    elif not isinstance(parameters, dict):
        findings.invalid(param_path, "<value omitted>", "must be a JSON object (a YAML mapping)")
    else:
        size = len(json.dumps(parameters, separators=(",", ":")).encode())
        if size > limits.OPAQUE_PARAMETERS_MAX_BYTES:
            findings.too_long(param_path, size, limits.OPAQUE_PARAMETERS_MAX_BYTES, "the parameters as JSON")


def _check_driver(driver: str, path: str, findings: Findings) -> None:
    if not driver:
        findings.required(path, "the driver name is required", fix="driver: gpu.nvidia.com")
        return
    for message in names.driver_name(driver):
        findings.invalid(path, driver, message, fix=f"driver: {names.to_dns_subdomain(driver)[:names.DRIVER_NAME_MAX]}")


# --- ResourceClaim / ResourceClaimTemplate -------------------------------------------------------


def check_resource_claim(obj: dict[str, Any], raw: dict[str, Any], findings: Findings, domains: Domains,
                         admin_access: bool = False) -> None:
    check_object_meta(obj.get("metadata"), findings, names.dns1123_subdomain, names.to_dns_subdomain, namespaced=True)
    spec = obj.get("spec") or {}
    raw_spec = raw.get("spec") if isinstance(raw.get("spec"), dict) else {}
    request_names = check_device_claim(spec.get("devices") or {}, _raw_devices(raw_spec), "spec.devices", findings,
                                       domains, admin_access)
    status = obj.get("status")
    if status:
        _check_claim_status(status, request_names, findings, admin_access)


def check_resource_claim_template(obj: dict[str, Any], raw: dict[str, Any], findings: Findings, domains: Domains,
                                  admin_access: bool = False) -> None:
    check_object_meta(obj.get("metadata"), findings, names.dns1123_subdomain, names.to_dns_subdomain, namespaced=True)
    spec = obj.get("spec") or {}
    template_meta = spec.get("metadata") or {}
    for key, value in template_meta.items():
        if key not in ("labels", "annotations") and value not in (0, "", [], {}):
            # The apiserver names the uid field "uID" here; the same path is used so both agree.
            field = "uID" if key == "uid" else key
            findings.forbidden(f"spec.metadata.{field}", "a template's metadata may only carry labels and annotations; "
                               "the claim's name and namespace come from the pod", fix=f"remove spec.metadata.{key}")
    if template_meta.get("labels") or template_meta.get("annotations"):
        sub = {"labels": template_meta.get("labels"), "annotations": template_meta.get("annotations"), "name": "x"}
        check_object_meta(sub, findings, names.dns1123_subdomain, names.to_dns_subdomain, namespaced=True,
                          path="spec.metadata")
    raw_spec = raw.get("spec") if isinstance(raw.get("spec"), dict) else {}
    raw_inner = raw_spec.get("spec") if isinstance(raw_spec.get("spec"), dict) else {}
    check_device_claim(((spec.get("spec") or {}).get("devices")) or {}, _raw_devices(raw_inner), "spec.spec.devices",
                       findings, domains, admin_access)


def _raw_devices(raw_spec: dict[str, Any]) -> dict[str, Any]:
    devices = raw_spec.get("devices")
    return devices if isinstance(devices, dict) else {}


RequestNames = dict[str, set[str] | None]


def check_device_claim(devices: dict[str, Any], raw_devices: dict[str, Any], path: str, findings: Findings,
                       domains: Domains, admin_access: bool = False) -> RequestNames:
    requests = devices.get("requests")
    raw_requests = raw_devices.get("requests") if isinstance(raw_devices.get("requests"), list) else []
    request_names = _gather_request_names(requests or [])
    constraint_attributes = _constraint_attributes(devices.get("constraints") or [])
    # Unknown fields are the decoder's business, so they are reported even in a list that is too long.
    for index, raw_request in enumerate(raw_requests):
        if isinstance(raw_request, dict):
            _report_v1beta1_shape(raw_request, f"{path}.requests[{index}]", findings)
    if not _too_many(requests, limits.REQUESTS_MAX, f"{path}.requests", "requests", findings,
                     fix="split the claim into several ResourceClaims, or ask for more devices per request with count"):
        for index, request in enumerate(requests or []):
            raw_request = raw_requests[index] if index < len(raw_requests) and isinstance(raw_requests[index], dict) else {}
            _check_request(request or {}, raw_request, f"{path}.requests[{index}]", findings, domains,
                           constraint_attributes, admin_access)
        _duplicates([(r or {}).get("name") or "" for r in requests or []], f"{path}.requests", "request name", findings)
    constraints = devices.get("constraints")
    if not _too_many(constraints, limits.CONSTRAINTS_MAX, f"{path}.constraints", "constraints", findings):
        for index, constraint in enumerate(constraints or []):
            _check_constraint(constraint or {}, f"{path}.constraints[{index}]", request_names, findings, domains)
    config = devices.get("config")
    if not _too_many(config, limits.CONFIG_MAX, f"{path}.config", "config entries", findings):
        for index, entry in enumerate(config or []):
            entry = entry or {}
            entry_path = f"{path}.config[{index}]"
            _check_request_refs(entry.get("requests"), f"{entry_path}.requests", request_names, findings)
            _check_device_configuration(entry, entry_path, findings)
    return request_names


def _gather_request_names(requests: list[Any]) -> RequestNames:
    gathered: RequestNames = {}
    for request in requests:
        request = request or {}
        subrequests = request.get("firstAvailable")
        name = request.get("name") or ""
        gathered[name] = {(s or {}).get("name") or "" for s in subrequests} if subrequests else None
    return gathered


def _constraint_attributes(constraints: list[Any]) -> dict[str, set[str]]:
    by_request: dict[str, set[str]] = {}
    for constraint in constraints:
        constraint = constraint or {}
        attribute = constraint.get("matchAttribute") or constraint.get("distinctAttribute")
        if not attribute:
            continue
        for target in constraint.get("requests") or [""]:
            by_request.setdefault(target, set()).add(attribute)
    return by_request


def _v1beta1_fields(raw_request: dict[str, Any]) -> list[str]:
    return [key for key in raw_request if key in EXACT_FIELDS]


def _exactly_snippet(raw_request: dict[str, Any], moved: list[str]) -> str:
    exactly = dict(raw_request.get("exactly") or {}) if isinstance(raw_request.get("exactly"), dict) else {}
    for key in moved:
        exactly[key] = raw_request[key]
    request = {"name": raw_request.get("name", "<name>"), "exactly": exactly}
    text = yaml.safe_dump([request], sort_keys=False, default_flow_style=False).rstrip("\n")
    return "requests:\n" + text


def _report_v1beta1_shape(raw_request: dict[str, Any], path: str, findings: Findings) -> None:
    """ExactDeviceRequest fields directly in the request: one problem for all of them, with the YAML."""
    moved = _v1beta1_fields(raw_request)
    if not moved:
        return
    fields = " and ".join(", ".join(moved).rsplit(", ", 1)) if len(moved) > 1 else moved[0]
    paths = ", ".join(f"{path}.{key}" for key in moved)
    verb = "sit" if len(moved) > 1 else "sits"
    findings.add(
        path, UNKNOWN_FIELD,
        f"{fields} {verb} directly under the request: that is the v1beta1 shape. In resource.k8s.io/v1 "
        f"they belong under `exactly:` (or under each `firstAvailable` entry), so {paths} "
        f"{'are unknown fields' if len(moved) > 1 else 'is an unknown field'}: the apiserver rejects "
        f"{'them' if len(moved) > 1 else 'it'}, or silently drops {'them' if len(moved) > 1 else 'it'}"
        + ("" if "exactly" in raw_request or "firstAvailable" in raw_request
           else " and then finds neither `exactly` nor `firstAvailable`"),
        fix=f"move {'them' if len(moved) > 1 else 'it'} under exactly:\n" + _exactly_snippet(raw_request, moved),
    )


def _check_request(request: dict[str, Any], raw_request: dict[str, Any], path: str, findings: Findings,
                   domains: Domains, constraint_attributes: dict[str, set[str]], admin_access: bool = False) -> None:
    name = request.get("name") or ""
    _check_request_name(name, f"{path}.name", findings)
    moved = _v1beta1_fields(raw_request)  # reported by _report_v1beta1_shape
    has_exactly = request.get("exactly") is not None
    has_first = bool(request.get("firstAvailable"))
    if not has_exactly and not has_first:
        if not moved:  # already explained above, with the fix
            findings.required(path, "a request needs either `exactly` (a fixed set of devices) or `firstAvailable` "
                              "(alternatives in order of preference)",
                              fix="exactly:\n  deviceClassName: <class>\n  count: 1")
        return
    if has_exactly and has_first:
        findings.invalid(path, None, "a request sets both `exactly` and `firstAvailable`; exactly one is allowed",
                         fix="keep one of them; alternatives go into firstAvailable, a single choice into exactly")
        # The handwritten checks stop here, the declarative ones still look at both halves.
        _check_exact_declaratively(request["exactly"], f"{path}.exactly", findings)
        subrequests = request["firstAvailable"]
        if not _too_many(subrequests, limits.FIRST_AVAILABLE_MAX, f"{path}.firstAvailable", "subrequests", findings):
            for index, sub in enumerate(subrequests):
                sub_path = f"{path}.firstAvailable[{index}]"
                _check_device_class_name((sub or {}).get("deviceClassName") or "", f"{sub_path}.deviceClassName", findings)
                _check_exact_declaratively(sub or {}, sub_path, findings)
            _duplicates([(s or {}).get("name") or "" for s in subrequests], f"{path}.firstAvailable",
                        "subrequest name", findings)
        return
    if has_exactly and request["exactly"].get("adminAccess") is True and not admin_access:
        # Checked by the apiserver against the namespace's labels and reported on the request itself,
        # at spec.devices... even in a template (whose requests are under spec.spec.devices).
        findings.forbidden(path.replace("spec.spec.", "spec.", 1) + ".adminAccess", "adminAccess: true is only accepted in a namespace labeled "
                           "resource.kubernetes.io/admin-access: \"true\"",
                           fix="kubectl label namespace <namespace> resource.kubernetes.io/admin-access=true "
                               "(cluster admins only), or remove adminAccess")
    if has_exactly:
        _check_exact(request["exactly"], f"{path}.exactly", findings, domains, name, constraint_attributes)
        return
    subrequests = request["firstAvailable"]
    if _too_many(subrequests, limits.FIRST_AVAILABLE_MAX, f"{path}.firstAvailable", "subrequests", findings,
                 fix="keep the most preferred alternatives"):
        return
    for index, sub in enumerate(subrequests):
        sub = sub or {}
        sub_path = f"{path}.firstAvailable[{index}]"
        _check_request_name(sub.get("name") or "", f"{sub_path}.name", findings)
        _check_exact(sub, sub_path, findings, domains, f"{name}/{sub.get('name') or ''}", constraint_attributes)
    _duplicates([(s or {}).get("name") or "" for s in subrequests], f"{path}.firstAvailable", "subrequest name", findings)


def _check_request_name(name: str, path: str, findings: Findings) -> None:
    if not name:
        findings.required(path, "requests are referenced by name (from containers, constraints and config)",
                          fix="name: gpu")
        return
    for message in names.dns1123_label(name):
        findings.invalid(path, name, message, fix=f"name: {names.to_dns_label(name)}")


def _check_device_class_name(class_name: str, path: str, findings: Findings) -> None:
    if not class_name:
        findings.required(path, "every request names the DeviceClass it draws devices from",
                          fix="deviceClassName: <name of a DeviceClass>")
        return
    for message in names.dns1123_subdomain(class_name):
        findings.invalid(path, class_name, message, fix=f"deviceClassName: {names.to_dns_subdomain(class_name)}")


def _check_exact_declaratively(request: dict[str, Any], path: str, findings: Findings) -> None:
    """What Kubernetes 1.37 checks declaratively in an exact request or subrequest: the mode and the tolerations."""
    mode = request.get("allocationMode") or "ExactCount"
    if mode not in ALLOCATION_MODES:
        findings.unsupported(f"{path}.allocationMode", mode, ALLOCATION_MODES,
                             fix="allocationMode: ExactCount (with count), or All")
    for index, toleration in enumerate(request.get("tolerations") or []):
        check_toleration(toleration or {}, f"{path}.tolerations[{index}]", findings)
    derived = request.get("derivedAttributes")
    if not _too_many(derived, limits.DERIVED_ATTRIBUTES_MAX, f"{path}.derivedAttributes", "derived attributes", findings):
        for index, attribute in enumerate(derived or []):
            attribute = attribute or {}
            a_path = f"{path}.derivedAttributes[{index}]"
            if not attribute.get("name"):
                findings.required(f"{a_path}.name", "a derived attribute needs a fully qualified name",
                                  fix="name: derived/numaNode")
            else:
                for message in names.declared_fully_qualified_name(attribute["name"]):
                    findings.invalid(f"{a_path}.name", attribute["name"], message)
            if not attribute.get("expression"):
                findings.required(f"{a_path}.expression", "a derived attribute needs a CEL expression")


def _check_exact(request: dict[str, Any], path: str, findings: Findings, domains: Domains, request_name: str,
                 constraint_attributes: dict[str, set[str]]) -> None:
    _check_device_class_name(request.get("deviceClassName") or "", f"{path}.deviceClassName", findings)
    selectors = request.get("selectors")
    if not _too_many(selectors, limits.SELECTORS_MAX, f"{path}.selectors", "selectors", findings,
                     fix="combine selectors with && in fewer expressions"):
        for index, selector in enumerate(selectors or []):
            _check_selector(selector, f"{path}.selectors[{index}]", findings, domains)
    # Defaulting, as SetDefaults_ExactDeviceRequest: ExactCount, and a count of 1 when unset (or 0).
    mode = request.get("allocationMode") or "ExactCount"
    count = request.get("count") or 0
    if mode == "ExactCount" and count == 0:
        count = 1
    if mode == "All":
        if count != 0:
            findings.invalid(f"{path}.count", count, "allocationMode All takes every matching device, so count must "
                             "not be set", fix="remove count, or use allocationMode: ExactCount")
    elif mode == "ExactCount":
        if count <= 0:
            findings.invalid(f"{path}.count", count, "must be greater than zero", fix="count: 1")
    else:
        findings.unsupported(f"{path}.allocationMode", mode, ALLOCATION_MODES,
                             fix="allocationMode: ExactCount (with count), or All")
    # The API documents at most 16 tolerations, but the v1.37 apiserver does not enforce it (checked
    # against the real one in test_validation_apiserver.py), so neither do we.
    for index, toleration in enumerate(request.get("tolerations") or []):
        check_toleration(toleration or {}, f"{path}.tolerations[{index}]", findings)
    # capacity.requests keys are not checked by the v1.37 apiserver (a key no device has simply
    # matches nothing), so they are not checked here either.
    derived = request.get("derivedAttributes")
    if not _too_many(derived, limits.DERIVED_ATTRIBUTES_MAX, f"{path}.derivedAttributes", "derived attributes", findings):
        for index, attribute in enumerate(derived or []):
            _check_derived_attribute(attribute or {}, f"{path}.derivedAttributes[{index}]", request_name,
                                     constraint_attributes, findings)
        _duplicates([(a or {}).get("name") or "" for a in derived or []], f"{path}.derivedAttributes", "derived attribute",
                    findings)


def _check_derived_attribute(attribute: dict[str, Any], path: str, request_name: str,
                             constraint_attributes: dict[str, set[str]], findings: Findings) -> None:
    name = attribute.get("name") or ""
    if not name:
        findings.required(f"{path}.name", "a derived attribute needs a fully qualified name",
                          fix="name: derived/numaNode")
    else:
        for message in names.declared_fully_qualified_name(name):
            findings.invalid(f"{path}.name", name, message)
        parent = request_name.split("/", 1)[0]
        used = (name in constraint_attributes.get("", set()) or name in constraint_attributes.get(request_name, set())
                or name in constraint_attributes.get(parent, set()))
        if not used:
            findings.invalid(f"{path}.name", name, "no matchAttribute or distinctAttribute constraint targeting this "
                             "request uses it", fix=f"add a constraint with matchAttribute: {name}, or remove it")
    if not attribute.get("expression"):
        findings.required(f"{path}.expression", "a derived attribute needs a CEL expression")
    elif len(attribute["expression"]) > limits.CEL_EXPRESSION_MAX_LENGTH:
        findings.too_long(f"{path}.expression", len(attribute["expression"]), limits.CEL_EXPRESSION_MAX_LENGTH,
                          "the CEL expression")


def check_toleration(toleration: dict[str, Any], path: str, findings: Findings) -> None:
    key = toleration.get("key") or ""
    if key:
        for message in names.label_key(key):
            findings.invalid(f"{path}.key", key, message)
    operator = toleration.get("operator") or "Equal"  # +default="Equal"
    value = toleration.get("value") or ""
    if operator == "Exists":
        if value:
            findings.invalid(f"{path}.value", value, "must be empty for operator Exists, which matches any value",
                             fix="remove value, or use operator: Equal")
    elif operator == "Equal":
        for message in names.label_value(value):
            findings.invalid(f"{path}.value", value, message)
    else:
        findings.unsupported(f"{path}.operator", operator, TOLERATION_OPERATORS)
    effect = toleration.get("effect") or ""
    if effect and effect not in TAINT_EFFECTS:
        fix = "effect: NoSchedule (PreferNoSchedule exists only for node taints)" if effect == "PreferNoSchedule" else None
        findings.unsupported(f"{path}.effect", effect, TAINT_EFFECTS, fix=fix)


def _check_constraint(constraint: dict[str, Any], path: str, request_names: RequestNames, findings: Findings,
                      domains: Domains) -> None:
    _check_request_refs(constraint.get("requests"), f"{path}.requests", request_names, findings)
    match = constraint.get("matchAttribute")
    distinct = constraint.get("distinctAttribute")
    # Both set is documented as invalid but accepted by the v1.37 apiserver (which then only checks
    # matchAttribute); parity wins, so only "neither" is reported.
    if match is None and distinct is None:
        findings.required(path, 'a constraint needs exactly one of "matchAttribute" or "distinctAttribute"',
                          fix="matchAttribute: resource.kubernetes.io/pcieRoot")
    # Both formats are checked (declaratively), even though only one of them may be set.
    for key, value in (("matchAttribute", match), ("distinctAttribute", distinct)):
        if value is None:
            continue
        for message in names.declared_fully_qualified_name(value):
            fix = None
            if "/" not in value:
                domain = domain_for(value, domains)
                fix = f"{key}: {domain}/{value}" + (" (the domain of the driver that publishes it)"
                                                     if domain.startswith("<") else "")
            findings.invalid(f"{path}.{key}", value, message, fix=fix)


def _check_request_refs(refs: list[Any] | None, path: str, request_names: RequestNames, findings: Findings) -> None:
    if _too_many(refs, limits.REQUESTS_MAX, path, "request references", findings):
        return
    for index, ref in enumerate(refs or []):
        _check_request_ref(ref or "", f"{path}[{index}]", request_names, findings)
    _duplicates(list(refs or []), path, "request reference", findings)


def _check_request_ref(ref: str, path: str, request_names: RequestNames, findings: Findings) -> None:
    segments = ref.split("/")
    if len(segments) > 2:
        findings.invalid(path, ref, "must name a request, or a request and one of its subrequests as "
                         "'request/subrequest'")
        return
    for segment in segments:
        for message in names.dns1123_label(segment):
            findings.invalid(path, ref, message)
    if not _has_request(request_names, ref):
        known = sorted(_reference_names(request_names))
        close = difflib.get_close_matches(ref, known, n=1, cutoff=0.6)
        fix = f"did you mean {close[0]!r}?" if close else (f"use one of: {', '.join(known)}" if known else None)
        findings.invalid(path, ref, "names no request of this claim"
                         + (f" (it has: {', '.join(known)})" if known else ""), fix=fix)


def _reference_names(request_names: RequestNames) -> list[str]:
    refs = []
    for name, subrequests in request_names.items():
        if name:
            refs.append(name)
            refs.extend(f"{name}/{sub}" for sub in sorted(subrequests or ()) if sub)
    return refs


def _has_request(request_names: RequestNames, ref: str) -> bool:
    segments = ref.split("/")
    if segments[0] not in request_names:
        return False
    if len(segments) == 1:
        return True
    subrequests = request_names[segments[0]]
    return subrequests is not None and segments[1] in subrequests


def _check_claim_status(status: dict[str, Any], request_names: RequestNames, findings: Findings,
                        admin_access: bool = False) -> None:
    reserved = status.get("reservedFor")
    if not _too_many(reserved, limits.RESERVED_FOR_MAX, "status.reservedFor", "consumers", findings):
        for index, ref in enumerate(reserved or []):
            ref = ref or {}
            for key in ("resource", "name", "uid"):
                if not ref.get(key):
                    findings.required(f"status.reservedFor[{index}].{key}", f"a consumer reference needs its {key}")
        _duplicates([(r or {}).get("uid") or "" for r in reserved or []], "status.reservedFor", "consumer uid", findings)
        if reserved and status.get("allocation") is None:
            findings.forbidden("status.reservedFor", "a claim can only be reserved once it is allocated",
                               fix="remove reservedFor, or add the allocation")
    allocation = status.get("allocation")
    _check_device_statuses(status.get("devices") or [], allocation, findings)
    if allocation is None:
        return
    devices = allocation.get("devices") or {}
    results = devices.get("results")
    if not _too_many(results, limits.RESULTS_MAX, "status.allocation.devices.results", "allocated devices", findings):
        for index, result in enumerate(results or []):
            _check_result(result or {}, f"status.allocation.devices.results[{index}]", request_names, findings,
                          admin_access)
    config = devices.get("config")
    if not _too_many(config, limits.ALLOCATION_CONFIG_MAX, "status.allocation.devices.config", "config entries", findings):
        for index, entry in enumerate(config or []):
            entry = entry or {}
            entry_path = f"status.allocation.devices.config[{index}]"
            source = entry.get("source") or ""
            if not source:
                findings.required(f"{entry_path}.source", "allocated config records where it came from",
                                  fix="source: FromClaim")
            elif source not in CONFIG_SOURCES:
                findings.unsupported(f"{entry_path}.source", source, CONFIG_SOURCES)
            _check_request_refs(entry.get("requests"), f"{entry_path}.requests", request_names, findings)
            _check_device_configuration(entry, entry_path, findings)
    if allocation.get("nodeSelector") is not None:
        check_node_selector(allocation["nodeSelector"], "status.allocation.nodeSelector", findings)


CONDITION_STATUSES = ("True", "False", "Unknown")
_CONDITION_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")


def _check_device_statuses(entries: list[Any], allocation: dict[str, Any] | None, findings: Findings) -> None:
    """status.devices, written by drivers: each entry must describe a device allocated to this claim."""
    results = ((allocation or {}).get("devices") or {}).get("results") or []
    allocated = {(r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID") or None) for r in results if r}
    keys = []
    for index, entry in enumerate(entries):
        entry = entry or {}
        path = f"status.devices[{index}]"
        _check_driver(entry.get("driver") or "", f"{path}.driver", findings)
        check_pool_name(entry.get("pool") or "", f"{path}.pool", findings)
        device = entry.get("device") or ""
        for message in names.dns1123_label(device) if device else ["a device status names its device"]:
            findings.invalid(f"{path}.device", device, message)
        if entry.get("shareID") is not None:
            check_uid(entry["shareID"], f"{path}.shareID", findings)
        key = (entry.get("driver"), entry.get("pool"), device, entry.get("shareID") or None)  # "" means none
        keys.append("/".join(str(k or "") for k in key))
        if key not in allocated:
            findings.invalid(path, "/".join(str(k) for k in key[:3] if k), "must be a device allocated in this claim's "
                             "status.allocation.devices.results", fix="remove the entry, or fix driver/pool/device")
        conditions = entry.get("conditions") or []
        if len(conditions) > limits.DEVICE_STATUS_CONDITIONS_MAX:
            findings.too_many(f"{path}.conditions", len(conditions), limits.DEVICE_STATUS_CONDITIONS_MAX, "conditions")
        for c_index, condition in enumerate(conditions):
            _check_condition(condition or {}, f"{path}.conditions[{c_index}]", findings)
        _duplicates([(c or {}).get("type") or "" for c in conditions], f"{path}.conditions", "condition type",
                    findings, fix="one condition per type")
        data = entry.get("data")
        if data is not None:
            if not isinstance(data, dict):
                findings.invalid(f"{path}.data", "<value omitted>", "must be a JSON object (a YAML mapping)")
            elif len(json.dumps(data, separators=(",", ":")).encode()) > limits.DEVICE_STATUS_DATA_MAX_BYTES:
                findings.too_long(f"{path}.data", len(json.dumps(data, separators=(",", ":")).encode()),
                                  limits.DEVICE_STATUS_DATA_MAX_BYTES, "the data as JSON")
        network = entry.get("networkData")
        if network:
            _check_network_data(network, f"{path}.networkData", findings)
    _duplicates(keys, "status.devices", "device", findings, fix="one entry per allocated device")


def _check_condition(condition: dict[str, Any], path: str, findings: Findings) -> None:
    kind = condition.get("type") or ""
    if not kind:
        findings.required(f"{path}.type", "a condition needs a type", fix="type: Ready")
    else:
        for message in names.label_key(kind):
            findings.invalid(f"{path}.type", kind, message)
    status = condition.get("status") or ""
    if not status:
        findings.required(f"{path}.status", "a condition needs a status", fix="status: \"True\"")
    elif status not in CONDITION_STATUSES:
        findings.unsupported(f"{path}.status", status, CONDITION_STATUSES)
    if (condition.get("observedGeneration") or 0) < 0:
        findings.invalid(f"{path}.observedGeneration", condition["observedGeneration"], "must be zero or more")
    if not condition.get("lastTransitionTime"):
        findings.required(f"{path}.lastTransitionTime", "must be set", fix="lastTransitionTime: <RFC 3339 time>")
    reason = condition.get("reason") or ""
    if not reason:
        findings.required(f"{path}.reason", "a condition needs a CamelCase reason", fix="reason: Prepared")
    else:
        if len(reason) > 1024:
            findings.too_long(f"{path}.reason", len(reason), 1024, "the reason")
        if not _CONDITION_REASON.match(reason):
            findings.invalid(f"{path}.reason", reason, "must start with a letter and contain only letters, digits, "
                             "'_', ',' and ':' (a CamelCase word such as DevicePrepared)")
    if len(condition.get("message") or "") > 32768:
        findings.too_long(f"{path}.message", len(condition["message"]), 32768, "the message")


def _check_network_data(network: dict[str, Any], path: str, findings: Findings) -> None:
    interface = network.get("interfaceName") or ""
    if len(interface.encode()) > limits.NETWORK_DATA_INTERFACE_NAME_MAX:
        findings.too_long(f"{path}.interfaceName", len(interface.encode()), limits.NETWORK_DATA_INTERFACE_NAME_MAX,
                          "the interface name")
    address = network.get("hardwareAddress") or ""
    if len(address.encode()) > limits.NETWORK_DATA_HARDWARE_ADDRESS_MAX:
        findings.too_long(f"{path}.hardwareAddress", len(address.encode()), limits.NETWORK_DATA_HARDWARE_ADDRESS_MAX,
                          "the hardware address")
    ips = network.get("ips")
    if _too_many(ips, limits.NETWORK_DATA_IPS_MAX, f"{path}.ips", "addresses", findings):
        return
    for index, ip in enumerate(ips or []):
        try:
            ipaddress.ip_interface(ip or "")
            ok = "/" in (ip or "")
        except ValueError:
            ok = False
        if not ok:
            findings.invalid(f"{path}.ips[{index}]", ip, "must be an IP address with its prefix length, such as "
                             "192.0.2.5/24 or 2001:db8::5/64")
    _duplicates(list(ips or []), f"{path}.ips", "address", findings)


def _check_result(result: dict[str, Any], path: str, request_names: RequestNames, findings: Findings,
                  admin_access: bool = False) -> None:
    request = result.get("request") or ""
    if not request:
        findings.required(f"{path}.request", "a result names the request it satisfies")
    else:
        _check_request_ref(request, f"{path}.request", request_names, findings)
    _check_driver(result.get("driver") or "", f"{path}.driver", findings)
    check_pool_name(result.get("pool") or "", f"{path}.pool", findings)
    device = result.get("device") or ""
    if not device:
        findings.required(f"{path}.device", "a result names the allocated device")
    else:
        for message in names.dns1123_label(device):
            findings.invalid(f"{path}.device", device, message)
    check_binding_conditions(result, path, findings)
    for index, toleration in enumerate(result.get("tolerations") or []):
        check_toleration(toleration or {}, f"{path}.tolerations[{index}]", findings)
    share_id = result.get("shareID")
    if share_id is not None:
        check_uid(share_id, f"{path}.shareID", findings)
    _check_skip_node_operations(result.get("skipNodeOperations"), f"{path}.skipNodeOperations", findings)
    if result.get("adminAccess") is True and not admin_access:
        findings.forbidden(f"{path}.adminAccess", "an admin-access allocation is only accepted in a namespace labeled "
                           "resource.kubernetes.io/admin-access: \"true\"",
                           fix="kubectl label namespace <namespace> resource.kubernetes.io/admin-access=true "
                               "(cluster admins only)")


def check_uid(value: str, path: str, findings: Findings) -> None:
    try:
        parsed = uuid.UUID(value)
    except ValueError:
        findings.invalid(path, value, "must be a UUID such as 123e4567-e89b-12d3-a456-426614174000")
        return
    if len(value) != 36 or value != value.lower() or str(parsed) != value:
        findings.invalid(path, value, "must be a UUID in normalized form: lower-case hex, xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
                         fix=f"{path.rsplit('.', 1)[-1]}: {parsed}")


def check_pool_name(pool: str, path: str, findings: Findings) -> None:
    if not pool:
        findings.required(path, "the pool name is required (often the node name)",
                          fix="pool:\n  name: <node name>\n  generation: 1\n  resourceSliceCount: 1")
        return
    if len(pool) > limits.POOL_NAME_MAX_LENGTH:
        findings.too_long(path, len(pool), limits.POOL_NAME_MAX_LENGTH, "the pool name")
    for part in pool.split("/"):
        for message in names.dns1123_subdomain(part):
            fixed = "/".join(names.to_dns_subdomain(p) for p in pool.split("/"))
            findings.invalid(path, pool, f"each '/'-separated part {message}", fix=f"name: {fixed}")


def check_binding_conditions(owner: dict[str, Any], path: str, findings: Findings) -> None:
    conditions = owner.get("bindingConditions") or []
    failures = owner.get("bindingFailureConditions") or []
    for key, items, limit in (("bindingConditions", conditions, limits.BINDING_CONDITIONS_MAX),
                              ("bindingFailureConditions", failures, limits.BINDING_FAILURE_CONDITIONS_MAX)):
        if not _too_many(items, limit, f"{path}.{key}", "conditions", findings):
            for index, condition in enumerate(items):
                for message in names.label_key(condition or ""):
                    findings.invalid(f"{path}.{key}[{index}]", condition, message)
    # Unlike most lists, the apiserver checks these for duplicates and overlap even when too long.
    _duplicates(list(conditions), f"{path}.bindingConditions", "condition", findings)
    _duplicates(list(failures), f"{path}.bindingFailureConditions", "condition", findings)
    for index, condition in enumerate(failures):
        if condition in conditions:
            findings.invalid(f"{path}.bindingFailureConditions[{index}]", condition,
                             "must not also be listed in bindingConditions")
    if failures and not conditions:
        findings.invalid(f"{path}.bindingConditions", [], "bindingFailureConditions need bindingConditions too")
    if conditions and not failures:
        findings.invalid(f"{path}.bindingFailureConditions", [], "bindingConditions need bindingFailureConditions too")


# --- ResourceSlice -------------------------------------------------------------------------------


def check_resource_slice(obj: dict[str, Any], raw: dict[str, Any], findings: Findings) -> None:
    check_object_meta(obj.get("metadata"), findings, names.dns1123_subdomain, names.to_dns_subdomain, namespaced=False)
    spec = obj.get("spec") or {}
    _check_driver(spec.get("driver") or "", "spec.driver", findings)
    # A missing pool is an empty one to the apiserver, which then reports its name and count.
    pool = spec.get("pool") or {}
    check_pool_name(pool.get("name") or "", "spec.pool.name", findings)
    count = pool.get("resourceSliceCount") or 0
    if count <= 0:
        findings.invalid("spec.pool.resourceSliceCount", count, "must be greater than zero: it is the number "
                         "of slices in the pool at this generation", fix="resourceSliceCount: 1")
    generation = pool.get("generation") or 0
    if generation < 0:
        findings.invalid("spec.pool.generation", generation, "must be zero or more", fix="generation: 0")
    _check_slice_node_selection(spec, findings)
    if spec.get("sharedCounters") is not None and spec.get("devices") is not None:
        findings.invalid("spec", "", "only one of `sharedCounters` or `devices` is allowed in one slice",
                         fix="publish the counter sets in a slice of their own in the same pool")
    devices = spec.get("devices")
    raw_devices = ((raw.get("spec") or {}) if isinstance(raw.get("spec"), dict) else {}).get("devices")
    raw_devices = raw_devices if isinstance(raw_devices, list) else []
    for index, raw_device in enumerate(raw_devices):
        # Unknown fields are the decoder's business, so even in a list that is too long.
        if isinstance(raw_device, dict) and "basic" in raw_device:
            findings.add(f"spec.devices[{index}].basic", UNKNOWN_FIELD,
                         "`basic` is the v1beta1 device shape; in resource.k8s.io/v1 its fields (attributes, "
                         "capacity, ...) sit directly in the device",
                         fix="move the contents of basic: up one level into the device and remove basic:")
    advanced = any(_uses_advanced_features(d or {}) for d in devices or [])
    limit = limits.DEVICES_MAX_WITH_ADVANCED_FEATURES if advanced else limits.DEVICES_MAX
    why = " (64 because some device uses taints, consumesCounters or list attributes)" if advanced else ""
    if _too_many(devices, limit, "spec.devices", f"devices{why}", findings,
                 fix=f"split the pool into several slices of at most {limit} devices and set "
                     "pool.resourceSliceCount to the number of slices"):
        for index, device in enumerate(devices or []):
            _check_device_declaratively(device or {}, f"spec.devices[{index}]", findings)
    else:
        per_device = spec.get("perDeviceNodeSelection") is True
        for index, device in enumerate(devices or []):
            _check_device(device or {}, f"spec.devices[{index}]", per_device, findings)
        _duplicates([(d or {}).get("name") or "" for d in devices or []], "spec.devices", "device name", findings)
    counter_sets = spec.get("sharedCounters")
    if not _too_many(counter_sets, limits.COUNTER_SETS_MAX, "spec.sharedCounters", "counter sets", findings,
                     fix="spread the counter sets over several slices of the same pool"):
        for index, counter_set in enumerate(counter_sets or []):
            counter_set = counter_set or {}
            set_path = f"spec.sharedCounters[{index}]"
            _check_counter_set_name(counter_set.get("name") or "", f"{set_path}.name", findings)
            _check_counters(counter_set.get("counters"), f"{set_path}.counters", limits.COUNTERS_PER_COUNTER_SET_MAX,
                            findings)
        _duplicates([(c or {}).get("name") or "" for c in counter_sets or []], "spec.sharedCounters", "counter set name",
                    findings)
    partition_attribute = spec.get("partitionTypeAttribute")
    if partition_attribute is not None:
        _check_partition_type_attribute(partition_attribute, spec.get("driver") or "", devices or [], findings)
    _check_skip_node_operations(spec.get("skipNodeOperations"), "spec.skipNodeOperations", findings)


def _check_partition_type_attribute(name: str, driver: str, devices: list[Any], findings: Findings) -> None:
    path = "spec.partitionTypeAttribute"
    format_errors = names.declared_fully_qualified_name(name)
    for message in format_errors:
        findings.invalid(path, name, message)
    if not any((d or {}).get("consumesCounters") for d in devices):
        findings.invalid(path, name, "may only be set on a slice whose devices consume counters",
                         fix="remove partitionTypeAttribute")
        return
    if format_errors:
        return  # no device can carry a malformed name; one error is enough
    # An attribute in the driver's own domain may also be written without it.
    bare = name[len(driver) + 1:] if name.startswith(driver + "/") else ""
    for index, device in enumerate(devices):
        device = device or {}
        if not device.get("consumesCounters"):
            continue
        attributes = device.get("attributes") or {}
        attribute = attributes.get(name) if name in attributes else attributes.get(bare) if bare else None
        attribute_path = f"spec.devices[{index}].attributes[{name}]"
        if attribute is None:
            findings.required(attribute_path, "the device consumes counters and partitionTypeAttribute names this "
                              "attribute, so the device must have it", fix=f"{name}: {{string: <partition type>}}")
        elif attribute.get("string") is None:
            findings.invalid(attribute_path, attribute, "must be a string because partitionTypeAttribute names it")


def _check_slice_node_selection(spec: dict[str, Any], findings: Findings) -> None:
    chosen = []
    node_name = spec.get("nodeName")
    if node_name is not None:
        if node_name:
            chosen.append("nodeName")
            for message in names.dns1123_subdomain(node_name):
                findings.invalid("spec.nodeName", node_name, message)
        else:
            findings.invalid("spec.nodeName", node_name, "must be unset or a node name, not empty")
    selector = spec.get("nodeSelector")
    if selector is not None:
        chosen.append("nodeSelector")
        check_node_selector(selector, "spec.nodeSelector", findings)
        terms = selector.get("nodeSelectorTerms") or []
        if len(terms) != 1:
            findings.invalid("spec.nodeSelector.nodeSelectorTerms", f"{len(terms)} terms",
                             "a slice's node selector must have exactly one term (so selectors of different "
                             "slices can be merged)", fix="put all requirements into one term")
    for key in ("allNodes", "perDeviceNodeSelection"):
        value = spec.get(key)
        if value is True:
            chosen.append(key)
        elif value is False:
            findings.invalid(f"spec.{key}", False, "must be unset or true", fix=f"remove {key}: false")
    if not chosen:
        findings.required("spec", "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` "
                          "is required: it says which nodes can use the devices", fix="nodeName: <node name>")
    elif len(chosen) > 1:
        findings.invalid("spec", "{" + ", ".join(f"`{c}`" for c in chosen) + "}",
                         "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is "
                         "allowed, but several are set", fix=f"keep only {chosen[0]}")


def _uses_advanced_features(device: dict[str, Any]) -> bool:
    if device.get("taints") or device.get("consumesCounters"):
        return True
    return any(
        any(attribute.get(k) is not None for k in ("ints", "bools", "strings", "versions"))
        for attribute in (device.get("attributes") or {}).values()
    )


def _check_device(device: dict[str, Any], path: str, per_device_node_selection: bool, findings: Findings) -> None:
    name = device.get("name") or ""
    if not name:
        findings.required(f"{path}.name", "every device needs a name, unique in its pool", fix="name: gpu-0")
    else:
        for message in names.dns1123_label(name):
            findings.invalid(f"{path}.name", name, message, fix=f"name: {names.to_dns_label(name)}")
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    total = len(attributes) + len(capacity)
    if total > limits.ATTRIBUTES_AND_CAPACITIES_PER_DEVICE_MAX:
        findings.invalid(path, total, f"a device may have at most {limits.ATTRIBUTES_AND_CAPACITIES_PER_DEVICE_MAX} "
                         "attributes and capacities together", fix="drop attributes no selector uses")
    values = sum(_attribute_value_count(a) for a in attributes.values())
    if values > limits.ATTRIBUTE_VALUES_PER_DEVICE_MAX:
        findings.invalid(path, values, f"a device may have at most {limits.ATTRIBUTE_VALUES_PER_DEVICE_MAX} attribute "
                         "values (list entries counted one by one)")
    for key, attribute in attributes.items():
        for message in names.qualified_device_name(key):
            findings.invalid(f"{path}.attributes", key, f"attribute name {message}",
                             fix=f"use {names.to_c_identifier(key)!r} or 'domain/{names.to_c_identifier(key)}'")
        _check_attribute(attribute, f"{path}.attributes[{key}]", findings)
    multiple = device.get("allowMultipleAllocations") is True
    for key, entry in capacity.items():
        for message in names.qualified_device_name(key):
            findings.invalid(f"{path}.capacity", key, f"capacity name {message}")
        policy = entry.get("requestPolicy")
        if policy is None:
            continue
        if not multiple:
            findings.forbidden(f"{path}.capacity[{key}].requestPolicy", "requestPolicy needs allowMultipleAllocations: true "
                               "on the device", fix="set allowMultipleAllocations: true, or remove requestPolicy")
        else:
            # A missing value is a zero quantity to the apiserver, not an error.
            _check_request_policy(entry.get("value") or "0", policy, f"{path}.capacity[{key}].requestPolicy", findings)
    taints = device.get("taints")
    too_many_taints = _too_many(taints, limits.TAINTS_PER_DEVICE_MAX, f"{path}.taints", "taints", findings)
    for index, taint in enumerate(taints or []):
        # The effect is checked declaratively, so even in a list that is too long.
        check = _check_taint_effect if too_many_taints else check_taint
        check(taint or {}, f"{path}.taints[{index}]", findings)
    _check_consumptions(device.get("consumesCounters"), f"{path}.consumesCounters", findings)
    _check_device_node_selection(device, path, per_device_node_selection, findings)
    check_binding_conditions(device, path, findings)
    _check_node_allocatable_resources(device.get("nodeAllocatableResources") or {}, capacity,
                                      f"{path}.nodeAllocatableResources", findings)


def _check_consumptions(consumptions: list[Any] | None, path: str, findings: Findings) -> None:
    if _too_many(consumptions, limits.COUNTER_CONSUMPTIONS_PER_DEVICE_MAX, path, "counter consumptions", findings):
        return
    for index, consumption in enumerate(consumptions or []):
        consumption = consumption or {}
        c_path = f"{path}[{index}]"
        _check_counter_set_name(consumption.get("counterSet") or "", f"{c_path}.counterSet", findings)
        _check_counters(consumption.get("counters"), f"{c_path}.counters",
                        limits.COUNTERS_PER_COUNTER_CONSUMPTION_MAX, findings)
        groups = consumption.get("compatibilityGroups")
        if not _too_many(groups, limits.COMPATIBILITY_GROUPS_MAX, f"{c_path}.compatibilityGroups", "groups", findings):
            for g_index, group in enumerate(groups or []):
                for message in names.dns1123_label(group or ""):
                    findings.invalid(f"{c_path}.compatibilityGroups[{g_index}]", group, message,
                                     fix=f"{names.to_dns_label(group or '')}")
            _duplicates(list(groups or []), f"{c_path}.compatibilityGroups", "group", findings)
    _duplicates([(c or {}).get("counterSet") or "" for c in consumptions or []], path, "counter set", findings,
                fix="list all counters this device takes from one counter set in a single entry")


def _check_device_declaratively(device: dict[str, Any], path: str, findings: Findings) -> None:
    """The checks Kubernetes 1.37 makes declaratively (+k8s tags on the v1 types), which still run on
    every device of a slice that has too many devices, unlike the handwritten ones."""
    for key, attribute in (device.get("attributes") or {}).items():
        _check_attribute_union(attribute, f"{path}.attributes[{key}]", findings)
    for index, taint in enumerate(device.get("taints") or []):
        _check_taint_effect(taint or {}, f"{path}.taints[{index}]", findings)
    _check_consumptions(device.get("consumesCounters"), f"{path}.consumesCounters", findings)
    for key, limit in (("bindingConditions", limits.BINDING_CONDITIONS_MAX),
                       ("bindingFailureConditions", limits.BINDING_FAILURE_CONDITIONS_MAX)):
        _too_many(device.get(key), limit, f"{path}.{key}", "conditions", findings)


# Node-allocatable resources a DRA driver may take over (corehelper.IsNodeAllocatableResourceName).
_NODE_ALLOCATABLE = ("cpu", "memory", "ephemeral-storage")


def _is_node_allocatable(name: str) -> bool:
    return name in _NODE_ALLOCATABLE or name.startswith("hugepages-")


def _check_node_allocatable_resources(resources: dict[str, Any], capacity: dict[str, Any], path: str,
                                      findings: Findings) -> None:
    for name, resource in resources.items():
        key_path = f"{path}[{name}]"
        if not _is_node_allocatable(name):
            findings.invalid(key_path, name, "must be a node allocatable resource name: cpu, memory, ephemeral-storage "
                             "or hugepages-<size> (extended resources are not allowed here)")
        mapping, overhead = resource.get("mapping"), resource.get("overhead")
        if mapping is None and overhead is None:
            findings.required(key_path, "at least one of mapping or overhead must be set",
                              fix="mapping:\n  deviceMultiplier: \"1\"")
        if mapping is not None:
            _check_allocatable_mapping(mapping, capacity, f"{key_path}.mapping", findings)
        if overhead is not None:
            _check_allocatable_overhead(overhead, f"{key_path}.overhead", findings)


def _check_allocatable_mapping(mapping: dict[str, Any], capacity: dict[str, Any], path: str, findings: Findings) -> None:
    key = mapping.get("capacityKey")
    multiplier = mapping.get("capacityMultiplier")
    if key is not None:
        if key == "":
            findings.invalid(f"{path}.capacityKey", "", "capacityKey must not be an empty string")
        elif key not in capacity:
            findings.add(f"{path}.capacityKey", "Not found", f"{key!r} is not a capacity of this device",
                         fix=f"use one of: {', '.join(sorted(capacity))}" if capacity else None)
        if multiplier is None:
            findings.required(f"{path}.capacityMultiplier", "capacityMultiplier is required when capacityKey is set")
        elif _q(multiplier) <= 0:
            findings.invalid(f"{path}.capacityMultiplier", multiplier, "must be positive")
    device_multiplier = mapping.get("deviceMultiplier")
    if device_multiplier is not None and _q(device_multiplier) <= 0:
        findings.invalid(f"{path}.deviceMultiplier", device_multiplier, "must be positive")
    if multiplier is not None and key is None:
        findings.required(f"{path}.capacityKey", "capacityKey is required when capacityMultiplier is set")


def _check_allocatable_overhead(overhead: dict[str, Any], path: str, findings: Findings) -> None:
    per_pod, per_container = overhead.get("perPod"), overhead.get("perContainer")
    if per_pod is None and per_container is None:
        findings.invalid(path, "", "at least one of perPod or perContainer must be set")
        return
    for key, value in (("perPod", per_pod), ("perContainer", per_container)):
        if value is not None and _q(value) < 0:
            findings.invalid(f"{path}.{key}", value, "must be non-negative")


def _attribute_value_count(attribute: dict[str, Any]) -> int:
    lists = [attribute.get(k) for k in ("ints", "bools", "strings", "versions") if attribute.get(k)]
    return sum(len(x) for x in lists) if lists else 1


def _check_attribute_union(attribute: dict[str, Any], path: str, findings: Findings) -> None:
    # An empty list counts as unset for the union (as the apiserver's declarative check counts it),
    # and is reported on its own as well.
    set_keys = [k for k in ("int", "bool", "string", "version") if attribute.get(k) is not None]
    set_keys += [k for k in ("ints", "bools", "strings", "versions") if attribute.get(k)]
    if len(set_keys) != 1:
        findings.invalid(path, attribute, "exactly one of int, bool, string or version (or a list form) must be set"
                         + (f"; found {', '.join(set_keys)}" if set_keys else ""),
                         fix="for example string: \"H100\" or version: \"12.4.0\"")


def _check_attribute(attribute: dict[str, Any], path: str, findings: Findings) -> None:
    _check_attribute_union(attribute, path, findings)
    string = attribute.get("string")
    if string is not None and len(string) > limits.ATTRIBUTE_VALUE_MAX_LENGTH:
        findings.too_long(f"{path}.string", len(string), limits.ATTRIBUTE_VALUE_MAX_LENGTH, "the string")
    version = attribute.get("version")
    if version is not None:
        _check_version(version, f"{path}.version", findings)
    for key in ("ints", "bools", "strings", "versions"):
        items = attribute.get(key)
        if items is None:
            continue
        if not items:
            findings.invalid(f"{path}.{key}", items, "must not be empty if set")
        for index, item in enumerate(items):
            if key == "strings" and item is not None and len(item) > limits.ATTRIBUTE_VALUE_MAX_LENGTH:
                findings.too_long(f"{path}.strings[{index}]", len(item), limits.ATTRIBUTE_VALUE_MAX_LENGTH, "the string")
            if key == "versions" and item is not None:
                _check_version(item, f"{path}.versions[{index}]", findings)


def _check_version(version: str, path: str, findings: Findings) -> None:
    if not names.SEMVER.match(version):
        fix = None
        parts = version.lstrip("v").split(".")
        if all(p.isdigit() for p in parts) and 1 <= len(parts) <= 3:
            fix = "version: " + ".".join(str(int(p)) for p in (parts + ["0", "0"])[:3])
        elif version.startswith("v"):
            fix = f"version: {version[1:]}"
        findings.invalid(path, version, "must be a semantic version (semver.org 2.0.0) such as 12.4.0", fix=fix)
    if len(version) > limits.ATTRIBUTE_VALUE_MAX_LENGTH:
        findings.too_long(path, len(version), limits.ATTRIBUTE_VALUE_MAX_LENGTH, "the version")


def _q(text: str) -> Fraction:
    return parse_quantity(text).value


def _check_request_policy(capacity_value: str, policy: dict[str, Any], path: str, findings: Findings) -> None:
    maximum = _q(capacity_value)
    valid_values = policy.get("validValues")
    valid_range = policy.get("validRange")
    default = policy.get("default")
    if valid_values and valid_range is not None:
        findings.forbidden(path, 'exactly one policy can be specified: not both "validValues" and "validRange"')
        return
    if valid_values:
        if default is None:
            findings.required(f"{path}.default", "required when validValues is set")
            return
        values = [_q(v) for v in valid_values]
        for index in range(len(values) - 1):
            if values[index] > values[index + 1]:
                findings.invalid(f"{path}.validValues[{index + 1}]", valid_values[index + 1],
                                 "validValues must be sorted in ascending order")
        if _too_many(valid_values, limits.REQUEST_POLICY_VALID_VALUES_MAX, f"{path}.validValues", "valid values", findings):
            return
        for index, value in enumerate(values):
            if value > maximum:
                findings.invalid(f"{path}.validValues[{index}]", valid_values[index],
                                 f"is larger than the capacity value {capacity_value}")
        _duplicates(values, f"{path}.validValues", "valid value", findings)
        if _q(default) not in values:
            findings.invalid(f"{path}.validValues", default, "the default must be one of validValues")
    elif valid_range is not None:
        if default is None:
            findings.required(f"{path}.default", "required when validRange is set")
            return
        if valid_range.get("min") is None:
            findings.required(f"{path}.validRange.min", "required when validRange is set")
            return
        low, dflt = _q(valid_range["min"]), _q(default)
        rpath = f"{path}.validRange"
        if low > maximum:
            findings.invalid(f"{rpath}.min", valid_range["min"], f"min is larger than the capacity value {capacity_value}")
        if dflt < low:
            findings.invalid(f"{rpath}.default", default, f"default is less than min {valid_range['min']}")
        high = None
        if valid_range.get("max") is not None:
            high = _q(valid_range["max"])
            if low > high:
                findings.invalid(f"{rpath}.max", valid_range["min"], f"min is larger than max {valid_range['max']}")
            if high > maximum:
                findings.invalid(f"{rpath}.max", valid_range["max"], f"max is larger than the capacity value {capacity_value}")
            if dflt > high:
                findings.invalid(f"{rpath}.default", default, f"default is more than max {valid_range['max']}")
        _check_range_step(valid_range, default, maximum, rpath, findings)


_MAX_INT64 = 2**63 - 1


def _check_range_step(valid_range: dict[str, Any], default: str, maximum: Fraction, path: str,
                      findings: Findings) -> None:
    """The step checks of a validRange, in the apiserver's order (DRAFractionalCapacityRange on).

    Values with a fraction are compared in milli-units and must be representable as such; whole
    values must fit an int64 and not be negative. Either kind of unsafe value stops the step checks.
    """
    named = {"default": default, "min": valid_range.get("min"), "max": valid_range.get("max"),
             "step": valid_range.get("step")}
    values = {key: _q(text) for key, text in named.items() if text is not None}
    use_milli = any(v.denominator != 1 for v in values.values())
    if use_milli:
        unsafe = False
        for key, value in values.items():
            if (value * 1000).denominator != 1:
                findings.invalid(f"{path}.{key}", named[key], "cannot be represented in milli-units (at most 3 decimals)")
                unsafe = True
        if unsafe:
            return
    if "step" not in values:
        return
    step, low = values["step"], values["min"]
    if step <= 0:
        findings.invalid(f"{path}.step", named["step"], "must be greater than zero")
        return
    if low + step > maximum:
        findings.invalid(f"{path}.step", named["step"], "one step above min is larger than the capacity value")
    if not use_milli:
        unsafe = False
        for key, value in values.items():
            if value < 0:
                findings.invalid(f"{path}.{key}", named[key], "must be greater than or equal to 0")
                unsafe = True
            elif value > _MAX_INT64:
                findings.invalid(f"{path}.{key}", named[key], f"must not be larger than {_MAX_INT64}")
                unsafe = True
        if unsafe:
            return
    for key in ("default", "max"):
        if key in values and (values[key] - low) % step != 0:
            # The next valid value up for a default; the last one below for a max.
            steps = -(-(values[key] - low) // step) if key == "default" else (values[key] - low) // step
            suggestion = parse_quantity(named[key])
            suggestion = type(suggestion)(low + steps * step, suggestion.format)
            findings.invalid(f"{path}.step", named[key], f"is not min ({named['min']}) plus a multiple of step "
                             f"({named['step']})", fix=f"{key}: {suggestion}")


# --- DeviceTaintRule -----------------------------------------------------------------------------


def check_device_taint_rule(obj: dict[str, Any], findings: Findings) -> None:
    check_object_meta(obj.get("metadata"), findings, names.dns1123_subdomain, names.to_dns_subdomain, namespaced=False)
    spec = obj.get("spec") or {}
    selector = spec.get("deviceSelector")
    if selector is not None:
        # Only what is set is checked; an empty selector is valid and matches every device.
        if selector.get("driver") is not None:
            _check_driver(selector["driver"], "spec.deviceSelector.driver", findings)
        if selector.get("pool") is not None:
            check_pool_name(selector["pool"], "spec.deviceSelector.pool", findings)
        if selector.get("device") is not None:
            device = selector["device"]
            if not device:
                findings.required("spec.deviceSelector.device", "the device name, when set, must not be empty",
                                  fix="device: gpu-0")
            for message in names.dns1123_label(device) if device else ():
                findings.invalid("spec.deviceSelector.device", device, message, fix=f"device: {names.to_dns_label(device)}")
    check_taint(spec.get("taint") or {}, "spec.taint", findings)


def check_taint(taint: dict[str, Any], path: str, findings: Findings) -> None:
    key = taint.get("key") or ""
    if not key:
        findings.required(f"{path}.key", "a taint needs a key", fix="key: example.com/unhealthy")
    else:
        for message in names.label_key(key):
            findings.invalid(f"{path}.key", key, message)
    value = taint.get("value") or ""
    if value:
        for message in names.label_value(value):
            findings.invalid(f"{path}.value", value, message)
    _check_taint_effect(taint, path, findings)


def _check_taint_effect(taint: dict[str, Any], path: str, findings: Findings) -> None:
    effect = taint.get("effect") or ""
    if not effect:
        findings.required(f"{path}.effect", "a taint needs an effect", fix="effect: NoSchedule")
    elif effect not in TAINT_EFFECTS:
        fix = "effect: NoSchedule (PreferNoSchedule exists only for node taints)" if effect == "PreferNoSchedule" else None
        findings.unsupported(f"{path}.effect", effect, TAINT_EFFECTS, fix=fix)


def _check_counter_set_name(name: str, path: str, findings: Findings) -> None:
    if not name:
        findings.required(path, "a counter set is referenced by name", fix="name: gpu-0-counters")
        return
    for message in names.dns1123_label(name):
        findings.invalid(path, name, message, fix=f"{path.rsplit('.', 1)[-1]}: {names.to_dns_label(name)}")


def _check_counters(counters: dict[str, Any] | None, path: str, limit: int, findings: Findings) -> None:
    if not counters:
        findings.required(path, "at least one counter is required", fix="counters:\n  memory:\n    value: 80Gi")
        return
    if len(counters) > limit:
        findings.too_many(path, len(counters), limit, "counters")
        return
    for key in counters:  # a counter without a value is a zero quantity, which the apiserver accepts
        for message in names.dns1123_label(key):
            findings.invalid(path, key, f"counter name {message}")


def _check_device_node_selection(device: dict[str, Any], path: str, per_device: bool, findings: Findings) -> None:
    node_name = device.get("nodeName")
    selector = device.get("nodeSelector")
    all_nodes = device.get("allNodes")
    if not per_device:
        if node_name is not None or selector is not None or all_nodes is not None:
            findings.invalid(path, None, "`nodeName`, `nodeSelector` and `allNodes` can only be set on a device when "
                             "the slice sets perDeviceNodeSelection: true",
                             fix="set perDeviceNodeSelection: true in the slice spec (instead of nodeName/nodeSelector/"
                                 "allNodes there), or remove them from the device")
        return
    chosen = []
    if node_name is not None:
        if node_name:
            chosen.append("nodeName")
            for message in names.dns1123_subdomain(node_name):
                findings.invalid(f"{path}.nodeName", node_name, message)
        else:
            findings.invalid(f"{path}.nodeName", node_name, "must not be empty")
    if selector is not None:
        chosen.append("nodeSelector")
        check_node_selector(selector, f"{path}.nodeSelector", findings)
    if all_nodes is True:
        chosen.append("allNodes")
    elif all_nodes is False:
        findings.invalid(f"{path}.allNodes", False, "must be unset or true")
    if len(chosen) != 1:
        findings.required(path, "with perDeviceNodeSelection: true every device sets exactly one of `nodeName`, "
                          "`nodeSelector` or `allNodes`" + (f" (this one sets {', '.join(chosen)})" if chosen else ""),
                          fix="nodeName: <node name>")


SKIP_NODE_OPERATIONS = ("*", "NodePrepareResources", "NodeUnprepareResources")


def _check_skip_node_operations(operations: list[Any] | None, path: str, findings: Findings) -> None:
    if not operations:
        return
    for index, operation in enumerate(operations):
        if operation not in SKIP_NODE_OPERATIONS:
            findings.unsupported(f"{path}[{index}]", operation, SKIP_NODE_OPERATIONS)
    _duplicates(list(operations), path, "operation", findings, fix="list each operation once")
    chosen = set(operations)
    if "NodePrepareResources" in chosen and not ({"NodeUnprepareResources", "*"} & chosen):
        findings.invalid(path, operations, "NodePrepareResources cannot be skipped unless NodeUnprepareResources is "
                         "skipped too", fix="add NodeUnprepareResources")

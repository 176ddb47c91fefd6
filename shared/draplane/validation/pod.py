"""The DRA parts of a core/v1 Pod: its resourceClaims and the containers' references to them.

Only these parts are checked (and the name): the rest of a Pod is not draplane's to judge.
"""

from __future__ import annotations

from typing import Any

from draplane.validation import names
from draplane.validation.meta import check_object_meta
from draplane.validation.problem import NOT_FOUND, Findings


def check_pod(raw: dict[str, Any], findings: Findings) -> None:
    meta = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    check_object_meta(
        {k: v for k, v in meta.items() if k in ("name", "generateName", "namespace") and isinstance(v, str)},
        findings, names.dns1123_subdomain, names.to_dns_subdomain, namespaced=True,
    )
    spec = raw.get("spec")
    if not isinstance(spec, dict):
        findings.required("spec", "a Pod needs a spec with containers")
        return
    claims = spec.get("resourceClaims")
    claim_names: list[str] = []
    if claims is not None and not isinstance(claims, list):
        findings.add("spec.resourceClaims", "Invalid type", "must be a list")
        claims = []
    for index, claim in enumerate(claims or []):
        path = f"spec.resourceClaims[{index}]"
        if not isinstance(claim, dict):
            findings.add(path, "Invalid type", "must be a mapping with name and resourceClaimName or "
                         "resourceClaimTemplateName")
            continue
        name = claim.get("name")
        if not name or not isinstance(name, str):
            findings.required(f"{path}.name", "containers refer to the claim by this name", fix="name: gpu-claim")
        else:
            claim_names.append(name)
            for message in names.dns1123_label(name):
                findings.invalid(f"{path}.name", name, message, fix=f"name: {names.to_dns_label(name)}")
        sources = [k for k in ("resourceClaimName", "resourceClaimTemplateName") if claim.get(k)]
        if len(sources) != 1:
            findings.invalid(path, None, "exactly one of resourceClaimName (an existing claim) or "
                             "resourceClaimTemplateName (a claim per pod) must be set"
                             + (f"; both are" if len(sources) == 2 else ""),
                             fix="resourceClaimName: <ResourceClaim name>")
        for key in sources:
            value = claim[key]
            if isinstance(value, str):
                for message in names.dns1123_subdomain(value):
                    findings.invalid(f"{path}.{key}", value, message)
    seen: dict[str, int] = {}
    for index, name in enumerate(claim_names):
        if name in seen:
            findings.duplicate(f"spec.resourceClaims[{index}].name", name, "pod claim names must be unique")
        seen.setdefault(name, index)
    for list_name in ("initContainers", "containers"):
        containers = spec.get(list_name)
        if not isinstance(containers, list):
            continue
        for c_index, container in enumerate(containers):
            resources = container.get("resources") if isinstance(container, dict) else None
            refs = resources.get("claims") if isinstance(resources, dict) else None
            if not isinstance(refs, list):
                continue
            seen: set[tuple[str, str]] = set()
            for r_index, ref in enumerate(refs):
                ref = ref if isinstance(ref, dict) else {}
                ref_name, request = ref.get("name") or "", ref.get("request") or ""
                path = f"spec.{list_name}[{c_index}].resources.claims[{r_index}]"
                wrong = [key for key, value in (("name", ref_name), ("request", request)) if not isinstance(value, str)]
                if wrong:
                    findings.add(f"{path}.{wrong[0]}", "Invalid type", "must be a string")
                    continue
                if not ref_name:
                    findings.required(path, "a container's claim reference names one of the pod's spec.resourceClaims",
                                      fix=f"name: {claim_names[0]}" if claim_names else None)
                elif ref_name not in claim_names:
                    known = ", ".join(claim_names) or "none"
                    findings.add(path, NOT_FOUND, f"{ref_name!r} must be the name of one of the pod's "
                                 f"spec.resourceClaims (it has: {known})",
                                 fix=f"name: {claim_names[0]}" if claim_names else
                                 f"add {{name: {ref_name}, resourceClaimName: <claim>}} to spec.resourceClaims")
                elif (ref_name, request) in seen:
                    findings.duplicate(path, ref_name, "the container already refers to this claim"
                                       + (f" and request {request!r}" if request else ""), fix="remove the repeat")
                seen.add((ref_name, request))

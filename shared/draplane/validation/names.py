"""Name formats the apiserver enforces, each returning the list of what is wrong (empty when valid).

Same rules and limits as k8s.io/apimachinery/pkg/util/validation; the messages are ours, written
to say what a valid name looks like rather than only which regular expression failed.
"""

from __future__ import annotations

import functools
import re
from typing import Callable

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
LABEL_VALUE_MAX = 63
QUALIFIED_NAME_MAX = 63
DRIVER_NAME_MAX = 63
DEVICE_MAX_DOMAIN_LENGTH = 63
DEVICE_MAX_ID_LENGTH = 32

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_LABEL = re.compile(rf"^{_LABEL}$")
_DNS1123_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_QUALIFIED_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

# semver.org 2.0.0, as the apiserver checks version attributes.
_NUMERIC = r"(0|[1-9]\d*)"
_PRERELEASE = r"(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
_BUILD = r"[0-9a-zA-Z-]+"
SEMVER = re.compile(
    rf"^{_NUMERIC}\.{_NUMERIC}\.{_NUMERIC}(-{_PRERELEASE}(\.{_PRERELEASE})*)?(\+{_BUILD}(\.{_BUILD})*)?$"
)


def _cached(check: Callable[[str], list[str]]) -> Callable[[str], list[str]]:
    """Names repeat across thousands of devices (the same attribute names, driver, pool): check each once."""
    cached = functools.lru_cache(maxsize=16384)(lambda value: tuple(check(value)))

    @functools.wraps(check)
    def wrapper(value: str) -> list[str]:
        return list(cached(value))

    return wrapper


@_cached
def dns1123_label(value: str) -> list[str]:
    errors = []
    if len(value) > DNS1123_LABEL_MAX:
        errors.append(f"is {len(value)} characters long; a DNS label has at most {DNS1123_LABEL_MAX}")
    if not _DNS1123_LABEL.match(value):
        errors.append(
            "must be a DNS label: lower-case letters, digits and '-', starting and ending with a letter "
            "or digit (for example 'gpu-0')"
        )
    return errors


@_cached
def dns1123_subdomain(value: str) -> list[str]:
    errors = []
    if len(value) > DNS1123_SUBDOMAIN_MAX:
        errors.append(f"is {len(value)} characters long; a DNS subdomain has at most {DNS1123_SUBDOMAIN_MAX}")
    if not _DNS1123_SUBDOMAIN.match(value):
        errors.append(
            "must be a DNS subdomain: lower-case letters, digits, '-' and '.', each dot-separated part "
            "starting and ending with a letter or digit (for example 'high-memory-gpu' or 'gpu.example.com')"
        )
    return errors


@_cached
def driver_name(value: str) -> list[str]:
    """A CSI-style driver name: a DNS subdomain of at most 63 characters, compared case-insensitively."""
    errors = []
    if len(value) > DRIVER_NAME_MAX:
        errors.append(f"is {len(value)} characters long; a driver name has at most {DRIVER_NAME_MAX}")
    if not _DNS1123_SUBDOMAIN.match(value.lower()):
        errors.append(
            "must be a DNS subdomain such as 'gpu.example.com' (letters, digits, '-' and '.', "
            "each part starting and ending with a letter or digit)"
        )
    return errors


@_cached
def c_identifier(value: str) -> list[str]:
    errors = []
    if len(value) > DEVICE_MAX_ID_LENGTH:
        errors.append(f"is {len(value)} characters long; an identifier has at most {DEVICE_MAX_ID_LENGTH}")
    if not _C_IDENTIFIER.match(value):
        errors.append(
            "must be a C identifier: letters, digits and '_', not starting with a digit (for example 'memory' "
            "or 'pcieRoot')"
        )
    return errors


@_cached
def qualified_device_name(value: str) -> list[str]:
    """An attribute or capacity name: `identifier` or `domain/identifier` (resource.QualifiedName)."""
    parts = value.split("/")
    if len(parts) == 1:
        return c_identifier(value)
    if len(parts) > 2:
        return ["must not contain more than one '/': it is either 'name' or 'domain/name'"]
    domain, ident = parts
    errors = []
    if not domain:
        errors.append("the domain before '/' must not be empty")
    else:
        errors.extend(f"domain {domain!r} {e}" for e in driver_name(domain))
    if not ident:
        errors.append("the name after '/' must not be empty")
    else:
        errors.extend(f"name {ident!r} {e}" for e in c_identifier(ident))
    return errors


def fully_qualified_device_name(value: str) -> list[str]:
    errors = qualified_device_name(value)
    if "/" not in value:
        errors.append(
            "must include the domain: 'domain/name', for example 'resource.kubernetes.io/pcieRoot' or "
            "'gpu.nvidia.com/productName'"
        )
    return errors


def declared_fully_qualified_name(value: str) -> list[str]:
    """A fully qualified name as Kubernetes 1.37 checks it declaratively (constraints, derived
    attributes): a name with more than one '/' is not checked at all there, so it passes."""
    if value.count("/") > 1:
        return []
    errors = fully_qualified_device_name(value)
    domain = value.split("/", 1)[0] if "/" in value else ""
    if domain and domain != domain.lower() and not driver_name(domain):
        # Unlike a driver name, the domain here is case-sensitive: it must be lower-case.
        errors.append(f"domain {domain!r} must be lower-case")
    return errors


@_cached
def label_key(value: str) -> list[str]:
    """A label or annotation key (metav1 qualified name): optional DNS-subdomain prefix and '/'."""
    if not value:
        return ["must not be empty"]
    parts = value.split("/")
    if len(parts) > 2:
        return ["may contain at most one '/', between an optional DNS-subdomain prefix and the name"]
    name = parts[-1]
    errors = []
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            errors.append("the prefix before '/' must not be empty")
        else:
            errors.extend(f"prefix {prefix!r} {e}" for e in dns1123_subdomain(prefix))
    if not name:
        errors.append("the name part must not be empty")
    elif len(name) > QUALIFIED_NAME_MAX:
        errors.append(f"the name part is {len(name)} characters long; at most {QUALIFIED_NAME_MAX} are allowed")
    if name and not _QUALIFIED_NAME_PART.match(name):
        errors.append(
            "the name part must consist of letters, digits, '-', '_' or '.', starting and ending with a "
            "letter or digit"
        )
    return errors


@_cached
def label_value(value: str) -> list[str]:
    errors = []
    if len(value) > LABEL_VALUE_MAX:
        errors.append(f"is {len(value)} characters long; a label value has at most {LABEL_VALUE_MAX}")
    if not _LABEL_VALUE.match(value):
        errors.append(
            "must be empty or consist of letters, digits, '-', '_' or '.', starting and ending with a "
            "letter or digit"
        )
    return errors


def is_extended_resource_name(value: str) -> bool:
    """Same test as v1helper.IsExtendedResourceName: domain-qualified, not in kubernetes.io, quota-able."""
    if "/" not in value or "kubernetes.io/" in value or value.startswith("requests."):
        return False
    return not label_key("requests." + value)


def to_dns_label(value: str) -> str:
    """A best-effort valid DNS label close to `value`, for suggesting a fix."""
    label = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")[:DNS1123_LABEL_MAX].strip("-")
    return label or "name"


def to_dns_subdomain(value: str) -> str:
    text = re.sub(r"[^a-z0-9.-]+", "-", value.lower())
    parts = [p.strip("-") for p in text.split(".")]
    subdomain = ".".join(p for p in parts if p)[:DNS1123_SUBDOMAIN_MAX].strip("-.")
    return subdomain or "name"


def to_c_identifier(value: str) -> str:
    ident = re.sub(r"[^A-Za-z0-9_]+", "_", value)
    if not ident or ident[0].isdigit():
        ident = "_" + ident
    return ident[:DEVICE_MAX_ID_LENGTH]

"""How Kubernetes' opaque CEL types travel through the C++ runtime.

cel-expr-python cannot carry Python objects as CEL values, so Quantity and Semver values are encoded
as tagged bytes while an expression runs. A version's encoding is canonical — "1.0.0" and
"1.0.0+build" encode to equal bytes, as Semver.Equal ignores build metadata. A quantity's encoding
keeps Kubernetes' representation, which some quantity functions depend on (kube_quantity.py). The
type checker still sees the declared types kubernetes.Quantity and kubernetes.Semver, so a
statically typed expression cannot mix them with real bytes.
"""

from __future__ import annotations

import datetime
from functools import lru_cache

from draplane.api.quantity import Quantity

from .kube_quantity import KubeQuantity, kube_quantity_of

from .semver import Semver, parse_semver

# 0xFF never occurs in UTF-8, so no string converted to bytes can look like a tagged value.
QUANTITY_TAG = b"\xffkubernetes.Quantity:"
SEMVER_TAG = b"\xffkubernetes.Semver:"
IP_TAG = b"\xffnet.IP:"
CIDR_TAG = b"\xffnet.CIDR:"


def encode_quantity(quantity: Quantity | KubeQuantity) -> bytes:
    """Tag and Kubernetes representation (kube_quantity.py). Two encodings of equal values can
    differ ("1" and "1.0"), so quantity equality is decided in Python (rewrite.py), not on bytes."""
    if isinstance(quantity, Quantity):
        quantity = kube_quantity_of(quantity)
    return QUANTITY_TAG + quantity.encode().encode()


@lru_cache(maxsize=16384)
def decode_quantity(encoded: bytes) -> KubeQuantity | None:
    if not encoded.startswith(QUANTITY_TAG):
        return None
    return KubeQuantity.decode(encoded[len(QUANTITY_TAG):].decode())


def encode_semver(version: Semver) -> bytes:
    # Build metadata is dropped: Kubernetes' Semver.Equal ignores it, and so do all comparisons.
    pre = ".".join(str(p) for p in version.pre)
    text = f"{version.major}.{version.minor}.{version.patch}" + (f"-{pre}" if pre else "")
    return SEMVER_TAG + text.encode()


@lru_cache(maxsize=16384)
def decode_semver(encoded: bytes) -> Semver | None:
    if not encoded.startswith(SEMVER_TAG):
        return None
    return parse_semver(encoded[len(SEMVER_TAG):].decode())


def cel_type_name(value: object) -> str:
    """The CEL type name Kubernetes would print for a runtime value."""
    if isinstance(value, (bytes, bytearray)):
        if value.startswith(QUANTITY_TAG):
            return "kubernetes.Quantity"
        if value.startswith(SEMVER_TAG):
            return "kubernetes.Semver"
        if value.startswith(IP_TAG):
            return "net.IP"
        if value.startswith(CIDR_TAG):
            return "net.CIDR"
        return "bytes"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "map"
    if value is None:
        return "null_type"
    if isinstance(value, datetime.timedelta):
        return "google.protobuf.Duration"
    if isinstance(value, datetime.datetime):
        return "google.protobuf.Timestamp"
    return type(value).__name__

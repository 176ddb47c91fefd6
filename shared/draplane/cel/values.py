"""How Kubernetes' opaque CEL types travel through the C++ runtime.

cel-expr-python cannot carry Python objects as CEL values, so Quantity and Semver values are encoded
as tagged bytes while an expression runs. The encoding is canonical — equal quantities ("1Gi",
"1024Mi") and equal versions ("1.0.0", "1.0.0+build") encode to equal bytes — so CEL's own `==` on
them agrees with Kubernetes' Quantity.Equal and Semver.Equal. The type checker still sees the
declared types kubernetes.Quantity and kubernetes.Semver, so a statically typed expression cannot
mix them with real bytes.
"""

from __future__ import annotations

import datetime
from fractions import Fraction
from functools import lru_cache

from draplane.api.quantity import Quantity

from .semver import Semver, parse_semver

# 0xFF never occurs in UTF-8, so no string converted to bytes can look like a tagged value.
QUANTITY_TAG = b"\xffkubernetes.Quantity:"
SEMVER_TAG = b"\xffkubernetes.Semver:"


def encode_quantity(quantity: Quantity) -> bytes:
    # Only the value: a quantity's format (DecimalSI, BinarySI) is invisible inside CEL, which can
    # neither print a Quantity nor convert it to a string.
    value = quantity.value
    return QUANTITY_TAG + f"{value.numerator}/{value.denominator}".encode()


@lru_cache(maxsize=16384)
def decode_quantity(encoded: bytes) -> Quantity | None:
    if not encoded.startswith(QUANTITY_TAG):
        return None
    numerator, denominator = encoded[len(QUANTITY_TAG):].split(b"/")
    value = Fraction(int(numerator), int(denominator))
    return Quantity(value)


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

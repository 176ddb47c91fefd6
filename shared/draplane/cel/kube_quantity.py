"""Quantities as Kubernetes' CEL quantity library sees them, representation included.

draplane.api.quantity.Quantity is the exact value. Kubernetes' CEL answers some questions from the
*representation* of a resource.Quantity (k8s.io/apimachinery/pkg/api/resource), not its value:

- isInteger() / asInteger() succeed only for the int64 form with a non-negative scale, so
  quantity("1.0").isInteger() and quantity("1000m").isInteger() are false, quantity("1k") is true,
  and a value parsed into the arbitrary-precision form (19 digits and more, fractions of binary
  suffixes) is never an integer;
- add() and sub() keep the smaller scale (1.5 + 1.5 is 30 tenths: not an integer);
- asApproximateFloat() multiplies the unscaled integer by a power of ten in float64;
- add() and sub() return a *pointer* to a Quantity, and cel-go's Quantity.Equal fails with
  "no such overload" when the right-hand side is such a pointer.

KubeQuantity reproduces the two forms — int64Amount (value × 10^scale) and inf.Dec
(unscaled × 10^-scale) — with ParseQuantity's choice between them and Add/Sub's arithmetic.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache

from draplane.api.quantity import Quantity, QuantityError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_MAX_INT64_FACTORS = 18
_NANO_SCALE = -9
_BINARY_MAX = Fraction(INT64_MAX)  # resource.maxAllowed, the clamp for BinarySI

_DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}

FORMAT_ERROR = "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"


def _fits(value: int) -> bool:
    return INT64_MIN <= value <= INT64_MAX


class KubeQuantity:
    """One resource.Quantity: its form ("int": value × 10^scale, "dec": unscaled × 10^-scale)."""

    __slots__ = ("form", "unscaled", "scale", "pointer", "_value")

    def __init__(self, form: str, unscaled: int, scale: int, pointer: bool = False):
        self.form = form
        self.unscaled = unscaled
        self.scale = scale
        self.pointer = pointer
        self._value: Fraction | None = None

    @property
    def value(self) -> Fraction:
        # Decoded quantities are cached (values.py), so the exact value is worth keeping.
        if self._value is None:
            exponent = self.scale if self.form == "int" else -self.scale
            self._value = Fraction(self.unscaled) * Fraction(10) ** exponent
        return self._value

    def sign(self) -> int:
        return (self.unscaled > 0) - (self.unscaled < 0)

    def compare(self, other: "KubeQuantity") -> int:
        a, b = self.value, other.value
        return (a > b) - (a < b)

    def as_int64(self) -> int | None:
        """Quantity.AsInt64: only the int64 form, only without a fractional scale."""
        if self.form != "int" or self.scale < 0:
            return None
        result = self.unscaled * 10**self.scale
        return result if _fits(result) else None

    def as_approximate_float(self) -> float:
        if self.form == "int":
            base, exponent = float(self.unscaled), self.scale
        else:
            base, exponent = _to_float(self.unscaled), -self.scale
        if exponent == 0:
            return base
        return base * _pow10(exponent)

    def _as_dec(self) -> tuple[int, int]:
        return (self.unscaled, -self.scale) if self.form == "int" else (self.unscaled, self.scale)

    def add(self, other: "KubeQuantity") -> "KubeQuantity":
        if self.form == "int" and other.form == "int":
            summed = _int64_add(self.unscaled, self.scale, other.unscaled, other.scale)
            if summed is not None:
                return KubeQuantity("int", summed[0], summed[1], pointer=True)
        return _dec_add(self._as_dec(), other._as_dec())

    def sub(self, other: "KubeQuantity") -> "KubeQuantity":
        if self.form == "int" and other.form == "int":
            summed = _int64_add(self.unscaled, self.scale, -other.unscaled, other.scale)
            if summed is not None:
                return KubeQuantity("int", summed[0], summed[1], pointer=True)
        unscaled, scale = other._as_dec()
        return _dec_add(self._as_dec(), (-unscaled, scale))

    def encode(self) -> str:
        return f"{self.form}:{self.unscaled}:{self.scale}{':*' if self.pointer else ''}"

    @classmethod
    def decode(cls, text: str) -> "KubeQuantity":
        parts = text.split(":")
        return cls(parts[0], int(parts[1]), int(parts[2]), len(parts) > 3)

    def __repr__(self) -> str:
        return f"KubeQuantity({self.encode()!r})"


def _int64_add(a_value: int, a_scale: int, b_value: int, b_scale: int) -> tuple[int, int] | None:
    """int64Amount.Add: align to the smaller scale; None on int64 overflow."""
    if b_value == 0:
        return a_value, a_scale
    if a_value == 0:
        return b_value, b_scale
    scale = min(a_scale, b_scale)
    a_aligned = a_value * 10 ** (a_scale - scale)
    b_aligned = b_value * 10 ** (b_scale - scale)
    if not (_fits(a_aligned) and _fits(b_aligned) and _fits(a_aligned + b_aligned)):
        return None
    return a_aligned + b_aligned, scale


def _dec_add(a: tuple[int, int], b: tuple[int, int]) -> KubeQuantity:
    """inf.Dec.Add: the larger scale wins."""
    scale = max(a[1], b[1])
    unscaled = a[0] * 10 ** (scale - a[1]) + b[0] * 10 ** (scale - b[1])
    return KubeQuantity("dec", unscaled, scale, pointer=True)


# Go's math.Pow10 tables, so that asApproximateFloat() rounds as Kubernetes does.
_POW10 = [float(10**i) for i in range(32)]
_POW10_POS32 = [float(10 ** (32 * i)) for i in range(10)]
_POW10_NEG32 = [1.0, 1e-32, 1e-64, 1e-96, 1e-128, 1e-160, 1e-192, 1e-224, 1e-256, 1e-288, 1e-320]


def _pow10(n: int) -> float:
    if 0 <= n <= 308:
        return _POW10_POS32[n // 32] * _POW10[n % 32]
    if -323 <= n <= 0:
        return _POW10_NEG32[-n // 32] / _POW10[-n % 32]
    return math.inf if n > 0 else 0.0


def _to_float(value: int) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.copysign(math.inf, value)


NUMERIC_ERROR = "unable to parse numeric part of quantity"
_MAX_EXPONENT = 10_000
SUFFIX_ERROR = "unable to parse quantity's suffix"


@lru_cache(maxsize=16384)
def parse_kube_quantity(text: str) -> KubeQuantity:
    """resource.ParseQuantity: what it accepts (more than its documented regular expression: "k"
    alone is zero) and which form it chooses. Raises QuantityError with Kubernetes' messages."""
    if not text:
        raise QuantityError(FORMAT_ERROR)
    if text == "0":
        return KubeQuantity("int", 0, 0)
    positive, value, whole, fraction, suffix = _split(text)
    if suffix in _DECIMAL_SUFFIXES:
        base, exponent, binary = 10, _DECIMAL_SUFFIXES[suffix], False
    elif suffix in _BINARY_SUFFIXES:
        base, exponent, binary = 2, _BINARY_SUFFIXES[suffix], True
    elif len(suffix) > 1 and suffix[0] in "eE":
        try:
            exponent = int(suffix[1:])
        except ValueError:
            raise QuantityError(SUFFIX_ERROR) from None
        if not -(2**63) <= exponent < 2**63:
            raise QuantityError(SUFFIX_ERROR)
        exponent = (exponent + 2**31) % 2**32 - 2**31  # int32(parsed), as Go truncates it
        if abs(exponent) > _MAX_EXPONENT:
            # Kubernetes accepts these; exact arithmetic on them would not finish. A known limit.
            raise QuantityError(NUMERIC_ERROR)
        base, binary = 10, False
    else:
        raise QuantityError(SUFFIX_ERROR)

    mantissa = 1
    if binary:
        scale = 0
        if exponent >= 0 and not fraction:
            mantissa = 1 << exponent
            precision = 15 - len(whole) - int(exponent * 3 / 10) - 1
        else:
            precision = -1
    else:
        scale = exponent
        precision = _MAX_INT64_FACTORS - (len(whole) + len(fraction))
    if precision >= 0:
        scale -= len(fraction)
        if scale >= _NANO_SCALE:
            digits = int(whole + fraction)
            if not _fits(digits):
                raise QuantityError(NUMERIC_ERROR)
            result = digits * mantissa
            if _fits(result):
                return KubeQuantity("int", result if positive else -result, scale)

    # inf.Dec: the written number (sign included), the suffix applied, rounded up to nano precision.
    unsigned = value[1:] if value[:1] in "+-" else value
    integer_part, _, decimals = unsigned.partition(".")
    if not (integer_part + decimals) or not (integer_part + decimals).isdigit():
        raise QuantityError(NUMERIC_ERROR)
    unscaled, dec_scale = int(integer_part + decimals), len(decimals)
    if base == 10:
        dec_scale -= exponent
    else:
        unscaled *= 1 << exponent
    if unscaled != 0:
        # Round(x, 9, RoundUp): the scale becomes exactly 9, rounding away from zero.
        if dec_scale <= 9:
            unscaled *= 10 ** (9 - dec_scale)
        else:
            divisor = 10 ** (dec_scale - 9)
            unscaled = -((-unscaled) // divisor)
        dec_scale = 9
    if binary and Fraction(unscaled, 10**dec_scale) > _BINARY_MAX:
        unscaled, dec_scale = INT64_MAX, 0
    negative = value.startswith("-")
    return KubeQuantity("dec", -unscaled if negative else unscaled, dec_scale)


def _split(text: str) -> tuple[bool, str, str, str, str]:
    """parseQuantityString, step by step: (positive, value, whole digits, fraction digits, suffix)."""
    pos, end, positive = 0, len(text), True
    if text[0] == "-":
        positive, pos = False, 1
    elif text[0] == "+":
        pos = 1
    while True:  # leading zeros
        if pos >= end:
            return positive, "0", "0", "", ""
        if text[pos] != "0":
            break
        pos += 1
    start = pos
    while True:
        if pos >= end:
            return positive, text, text[start:], "", ""
        if not text[pos].isdigit() or not text[pos].isascii():
            break
        pos += 1
    whole = text[start:pos] or "0"
    fraction = ""
    if text[pos] == ".":
        pos += 1
        fraction_start = pos
        while True:
            if pos >= end:
                return positive, text, whole, text[fraction_start:], ""
            if not text[pos].isdigit() or not text[pos].isascii():
                break
            pos += 1
        fraction = text[fraction_start:pos]
    value = text[:pos]
    suffix_start = pos
    while pos < end and text[pos] in "eEinumkKMGTP":
        pos += 1
    if pos >= end:
        return positive, value, whole, fraction, text[suffix_start:]
    if text[pos] in "+-":
        pos += 1
    while pos < end and text[pos].isdigit() and text[pos].isascii():
        pos += 1
    if pos < end:
        raise QuantityError(FORMAT_ERROR)
    return positive, value, whole, fraction, text[suffix_start:]


def kube_quantity_of(quantity: Quantity) -> KubeQuantity:
    """A capacity value as the scheduler sees it: parsed from the canonical string the apiserver
    stores, so "1000m" in a file is 1 here, as it is after a round trip through the API."""
    value = quantity.value
    return _of_canonical(value.numerator, value.denominator, quantity.format)


@lru_cache(maxsize=16384)
def _of_canonical(numerator: int, denominator: int, quantity_format) -> KubeQuantity:
    return parse_kube_quantity(str(Quantity(Fraction(numerator, denominator), quantity_format)))

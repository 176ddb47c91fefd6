"""Kubernetes resource.Quantity: exact parsing, comparison and canonical formatting.

Capacity, counters and consumed capacity are compared exactly (Fractions, never floats) and written
back in the canonical form the apiserver itself produces, so a result we write round-trips unchanged.
"""

from __future__ import annotations

import enum
import re
from fractions import Fraction
from functools import lru_cache, total_ordering


class QuantityError(ValueError):
    pass


class QuantityFormat(enum.Enum):
    DECIMAL_SI = "DecimalSI"
    BINARY_SI = "BinarySI"
    DECIMAL_EXPONENT = "DecimalExponent"


_BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_BY_EXPONENT = {v: k for k, v in _DECIMAL_SUFFIXES.items()}
_BINARY_BY_SHIFT = {v: k for k, v in _BINARY_SUFFIXES.items()}

_QUANTITY_RE = re.compile(
    r"^(?P<sign>[+-])?(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
_NANO = Fraction(1, 10**9)
# Values are exact, so their cost grows with their size: "1e9999999" took 12 s to parse and
# "1e99999" 7 s to format, and 5,000 digits overflow int()'s conversion limit (ValueError). Within
# these bounds every value, and every integer made from one, has fewer digits than that limit. No
# device has a capacity anywhere near them.
_MAX_DIGITS = 1_000
_MAX_EXPONENT = 1_000


@total_ordering
class Quantity:
    """An exact quantity. Equal values compare equal whatever their suffix, as in Kubernetes."""

    __slots__ = ("value", "format")

    def __init__(self, value: Fraction | int, format: QuantityFormat = QuantityFormat.DECIMAL_SI):
        value = Fraction(value)
        # Kubernetes keeps at most nano precision and rounds away from zero beyond it.
        if (value / _NANO).denominator != 1:
            scaled = value / _NANO
            rounded = -((-scaled.numerator) // scaled.denominator) if value > 0 else scaled.numerator // scaled.denominator
            value = Fraction(rounded) * _NANO
        self.value = value
        self.format = format

    @classmethod
    def parse(cls, text: str) -> "Quantity":
        return _parse_cached(text)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Quantity):
            return self.value == other.value
        return NotImplemented

    def __lt__(self, other: "Quantity") -> bool:
        return self.value < other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __add__(self, other: "Quantity") -> "Quantity":
        return Quantity(self.value + other.value, self.format)

    def __sub__(self, other: "Quantity") -> "Quantity":
        return Quantity(self.value - other.value, self.format)

    def __repr__(self) -> str:
        return f"Quantity({str(self)!r})"

    def __str__(self) -> str:
        return format_quantity(self.value, self.format)

    def sign(self) -> int:
        return (self.value > 0) - (self.value < 0)

    def is_integer(self) -> bool:
        return self.value.denominator == 1


@lru_cache(maxsize=4096)
def _parse_cached(text: str) -> Quantity:
    if not isinstance(text, str):
        raise QuantityError(f"quantity must be a string, got {type(text).__name__}")
    match = _QUANTITY_RE.match(text.strip() if text != text.strip() else text)
    if not match or text != text.strip():
        raise QuantityError(
            f"quantities must match the regular expression "
            f"'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {text!r}"
        )
    suffix = match["suffix"] or ""
    if len(match["number"]) > _MAX_DIGITS:
        raise QuantityError(f"quantity {text[:20]!r}... has {len(match['number'])} digits; at most {_MAX_DIGITS} are read")
    if suffix[:1] in ("e", "E") and len(suffix) > 1 and (len(suffix) > 8 or abs(int(suffix[1:])) > _MAX_EXPONENT):
        raise QuantityError(f"quantity {text[:20]!r}: the exponent is beyond ±{_MAX_EXPONENT}")
    number = Fraction(match["number"] if not match["number"].endswith(".") else match["number"][:-1])
    if match["sign"] == "-":
        number = -number
    if suffix in _BINARY_SUFFIXES:
        return Quantity(number * (2 ** _BINARY_SUFFIXES[suffix]), QuantityFormat.BINARY_SI)
    if suffix[:1] in ("e", "E") and len(suffix) > 1:  # a lone "E" is the exa suffix
        return Quantity(number * Fraction(10) ** int(suffix[1:]), QuantityFormat.DECIMAL_EXPONENT)
    return Quantity(number * Fraction(10) ** _DECIMAL_SUFFIXES[suffix], QuantityFormat.DECIMAL_SI)


def parse_quantity(text: str) -> Quantity:
    return _parse_cached(text)


def _decimal_mantissa_exponent(value: Fraction) -> tuple[int, int]:
    """value == mantissa * 10**exponent with the exponent as large as possible (value at nano precision)."""
    scaled = value / _NANO
    mantissa, exponent = int(scaled), -9
    if mantissa == 0:
        return 0, 0
    while mantissa % 10 == 0:
        mantissa //= 10
        exponent += 1
    return mantissa, exponent


def format_quantity(value: Fraction, fmt: QuantityFormat = QuantityFormat.DECIMAL_SI) -> str:
    """The canonical string, as resource.Quantity.String() writes it."""
    if value == 0:
        return "0"
    if fmt is QuantityFormat.BINARY_SI and -1024 < value < 1024:
        # Kubernetes writes small binary quantities in decimal form.
        fmt = QuantityFormat.DECIMAL_SI
    if fmt is QuantityFormat.BINARY_SI:
        if value.denominator == 1:
            integer, shift = abs(value.numerator), 0
            while integer % 1024 == 0 and shift < 60:
                integer //= 1024
                shift += 10
            sign = "-" if value < 0 else ""
            return f"{sign}{integer}{_BINARY_BY_SHIFT.get(shift, '') if shift else ''}"
        fmt = QuantityFormat.DECIMAL_SI
    mantissa, exponent = _decimal_mantissa_exponent(value)
    if fmt is QuantityFormat.DECIMAL_EXPONENT:
        # Exponents are multiples of three, as in Kubernetes' canonical form.
        while exponent % 3:
            mantissa *= 10
            exponent -= 1
        return f"{mantissa}" if exponent == 0 else f"{mantissa}e{exponent}"
    while exponent % 3 or exponent > 18:
        mantissa *= 10
        exponent -= 1
    return f"{mantissa}{_DECIMAL_BY_EXPONENT[exponent]}"

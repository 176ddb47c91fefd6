"""One device as a CEL selector sees it.

Attribute and capacity names are qualified the way Kubernetes does it: "model" belongs to the
driver's domain, "resource.kubernetes.io/pcieRoot" to the domain before the slash. The snapshot is
immutable and hashable so that the allocator can cache selector results per (expression, device).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from draplane.api.quantity import Quantity, QuantityError, parse_quantity
from draplane.api.resource import Device

from .semver import Semver, SemverError, parse_semver
from .values import encode_quantity, encode_semver

AttributeValue = int | bool | str | Semver

_EMPTY: Mapping = MappingProxyType({})


def split_qualified_name(name: str, default_domain: str) -> tuple[str, str]:
    domain, sep, ident = name.partition("/")
    if not sep:
        return default_domain, name
    return domain, ident


class CELDevice:
    """driver, attributes[domain][id], capacity[domain][id] and allowMultipleAllocations.

    `invalid` is set when a value cannot be represented (a version that is not semver): Kubernetes
    fails every selector on such a device at evaluation time, and so does draplane.
    """

    __slots__ = (
        "driver", "attributes", "capacity", "allow_multiple_allocations", "invalid",
        "_key", "_hash", "_activation", "_runtime",
    )

    def __init__(
        self,
        driver: str,
        attributes: Mapping[str, Mapping[str, AttributeValue]] | None = None,
        capacity: Mapping[str, Mapping[str, Quantity]] | None = None,
        allow_multiple_allocations: bool = False,
        invalid: str | None = None,
    ):
        frozen_attributes = {d: MappingProxyType(dict(ids)) for d, ids in (attributes or {}).items()}
        frozen_capacity = {d: MappingProxyType(dict(ids)) for d, ids in (capacity or {}).items()}
        for domain, ids in frozen_attributes.items():
            for ident, value in ids.items():
                if not isinstance(value, (bool, int, str, Semver)):
                    raise TypeError(
                        f"attribute {domain}/{ident}: expected int, bool, str or Semver, got {type(value).__name__}"
                    )
        for domain, ids in frozen_capacity.items():
            for ident, value in ids.items():
                if not isinstance(value, Quantity):
                    raise TypeError(f"capacity {domain}/{ident}: expected a Quantity, got {type(value).__name__}")
        _init(self, driver, frozen_attributes, frozen_capacity, bool(allow_multiple_allocations), invalid)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"CELDevice is immutable (tried to set {name})")

    def _identity(self) -> tuple:
        key = self._key
        if key is None:
            # bool is an int to Python: the type tag keeps True apart from 1, as CEL keeps them apart.
            key = (
                self.driver,
                frozenset((d, i, type(v), v) for d, ids in self.attributes.items() for i, v in ids.items()),
                # Numerator and denominator: hashing a Fraction costs a modular inverse.
                frozenset(
                    (d, i, v.value.numerator, v.value.denominator) for d, ids in self.capacity.items() for i, v in ids.items()
                ),
                # Empty domains are invisible to lookups but not to size() and `in`.
                frozenset(self.attributes),
                frozenset(self.capacity),
                self.allow_multiple_allocations,
                self.invalid,
            )
            object.__setattr__(self, "_key", key)
        return key

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, CELDevice):
            return hash(self) == hash(other) and self._identity() == other._identity()
        return NotImplemented

    def __hash__(self) -> int:
        value = self._hash
        if value is None:
            value = hash(self._identity())
            object.__setattr__(self, "_hash", value)
        return value

    def __repr__(self) -> str:
        attributes = {d: dict(ids) for d, ids in self.attributes.items()}
        capacity = {d: dict(ids) for d, ids in self.capacity.items()}
        return f"CELDevice(driver={self.driver!r}, attributes={attributes!r}, capacity={capacity!r})"

    def cel_value(self) -> dict:
        """The `device` variable in the runtime representation, built once per snapshot."""
        value = self._activation
        if value is None:
            value = {
                "driver": self.driver,
                "allowMultipleAllocations": self.allow_multiple_allocations,
                "attributes": {
                    d: {i: encode_semver(v) if isinstance(v, Semver) else v for i, v in ids.items()}
                    for d, ids in self.attributes.items()
                },
                "capacity": {d: {i: encode_quantity(v) for i, v in ids.items()} for d, ids in self.capacity.items()},
            }
            object.__setattr__(self, "_activation", value)
        return value


def _init(device: CELDevice, driver, attributes, capacity, allow_multiple_allocations, invalid) -> None:
    setter = object.__setattr__
    setter(device, "driver", driver)
    setter(device, "attributes", MappingProxyType(attributes))
    setter(device, "capacity", MappingProxyType(capacity))
    setter(device, "allow_multiple_allocations", allow_multiple_allocations)
    setter(device, "invalid", invalid)
    setter(device, "_key", None)
    setter(device, "_hash", None)
    setter(device, "_activation", None)
    # The engine's own activation for this device, built on first evaluation (selector.py) and
    # shared by every selector evaluated against the device.
    setter(device, "_runtime", None)


def device_for_cel(driver: str, device: Device) -> CELDevice:
    """The CEL view of one ResourceSlice device of `driver`."""
    attributes: dict[str, dict[str, AttributeValue]] = {}
    invalid: str | None = None
    for name, attribute in (device.attributes or {}).items():
        domain, ident = split_qualified_name(name, driver)
        if attribute.int_value is not None:
            value: AttributeValue = attribute.int_value
        elif attribute.bool_value is not None:
            value = attribute.bool_value
        elif attribute.string_value is not None:
            value = attribute.string_value
        elif attribute.version_value is not None:
            try:
                value = parse_semver(attribute.version_value)
            except SemverError as err:
                invalid = invalid or f"attribute {name}: parse semantic version: {err}"
                continue
        else:
            invalid = invalid or f"attribute {name}: unsupported attribute value"
            continue
        attributes.setdefault(domain, {})[ident] = value
    capacity: dict[str, dict[str, Quantity]] = {}
    for name, entry in (device.capacity or {}).items():
        domain, ident = split_qualified_name(name, driver)
        try:
            capacity.setdefault(domain, {})[ident] = parse_quantity(entry.value)
        except QuantityError as err:
            invalid = invalid or f"capacity {name}: {err}"
    # The values were built here from typed fields, so the public constructor's checks and copies
    # are skipped; this runs once per device of every slice.
    snapshot = CELDevice.__new__(CELDevice)
    _init(
        snapshot,
        driver,
        {d: MappingProxyType(ids) for d, ids in attributes.items()},
        {d: MappingProxyType(ids) for d, ids in capacity.items()},
        bool(device.allow_multiple_allocations),
        invalid,
    )
    return snapshot

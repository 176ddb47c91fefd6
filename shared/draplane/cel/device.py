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

    __slots__ = ("driver", "attributes", "capacity", "allow_multiple_allocations", "invalid", "_key", "_hash", "_activation")

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
        for domain, ids in frozen_capacity.items():
            for ident, value in ids.items():
                if not isinstance(value, Quantity):
                    raise TypeError(f"capacity {domain}/{ident}: expected a Quantity, got {type(value).__name__}")
        object.__setattr__(self, "driver", driver)
        object.__setattr__(self, "attributes", MappingProxyType(frozen_attributes))
        object.__setattr__(self, "capacity", MappingProxyType(frozen_capacity))
        object.__setattr__(self, "allow_multiple_allocations", bool(allow_multiple_allocations))
        object.__setattr__(self, "invalid", invalid)
        # bool is an int in Python: keep True apart from 1 in the key, as CEL keeps them apart.
        key = (
            driver,
            tuple(sorted((d, tuple(sorted((i, type(v).__name__, v) for i, v in ids.items()))) for d, ids in frozen_attributes.items())),
            tuple(sorted((d, tuple(sorted(ids.items()))) for d, ids in frozen_capacity.items())),
            bool(allow_multiple_allocations),
            invalid,
        )
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_hash", hash(key))
        object.__setattr__(self, "_activation", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"CELDevice is immutable (tried to set {name})")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CELDevice):
            return self._hash == other._hash and self._key == other._key
        return NotImplemented

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"CELDevice(driver={self.driver!r}, attributes={dict(self.attributes)!r}, capacity={dict(self.capacity)!r})"

    def cel_value(self) -> dict:
        """The `device` variable in the runtime representation, built once per snapshot."""
        if self._activation is None:
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
        return self._activation


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
    return CELDevice(driver, attributes, capacity, bool(device.allow_multiple_allocations), invalid)

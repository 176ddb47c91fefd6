"""What of a device a selector can see: the attribute and capacity entries it names.

A selector's answer depends on the device only through what it reads. Most selectors read a few
named entries (`device.attributes["gpu.nvidia.com"].productName`, `device.capacity[...].memory`)
and `device.driver`; every GPU of one model then gets the same answer, though each has its own
UUID. `referenced_entries` finds those entries by reading the text, and gives up (None) at any
use of `device` it does not recognise: a whole map passed on (`device.attributes["d"]` alone, in
a comprehension or `in`), a macro or method on a map (`.exists(`, `.size()`), index or optional
syntax, odd spacing, raw or triple-quoted strings. Giving up only costs the cache its sharing, never an answer:
a string literal that looks like a reference adds an entry, which only makes the key finer.

`projection` is the part of a device such a selector sees, as a hashable key. `slice_projection`
is a key that decides it, read straight from the ResourceSlice device: a cache can then tell that
a fresh device looks like one already evaluated without building its CELDevice first.
"""

from __future__ import annotations

import re
from functools import lru_cache

from draplane.api.resource import Device

from .device import CELDevice

_DEVICE = re.compile(r"\bdevice\b")
_FIELD = re.compile(r"device\.(?:driver|allowMultipleAllocations)\b(?!\s*\()")
# Either quote: CEL's '...' and "..." are the same string, and the classes NVIDIA's DRA driver
# installs write `device.attributes['gpu.nvidia.com'].type` (without sharing, each of 40,000 GPUs
# got its own CEL view and evaluation: 588 MB and 6.7 s for a shard's first pod at 5,000 nodes).
_ENTRY = re.compile(r"""device\.(attributes|capacity)\[(["'])([A-Za-z0-9._/-]+)\2\]\.([A-Za-z_][A-Za-z0-9_]*)\b(?!\s*\()""")

Entry = tuple[str, str, str]  # ("attributes" | "capacity", domain, name)


@lru_cache(maxsize=4096)
def referenced_entries(expression: str) -> tuple[Entry, ...] | None:
    """The entries `expression` reads, sorted; None where it may read more than named entries."""
    entries = set()
    for found in _DEVICE.finditer(expression):
        at = found.start()
        entry = _ENTRY.match(expression, at)
        if entry is not None:
            entries.add((entry.group(1), entry.group(3), entry.group(4)))
        elif _FIELD.match(expression, at) is None:
            return None
    return tuple(sorted(entries))


_ABSENT = ("absent",)


def projection(device: CELDevice, entries: tuple[Entry, ...]) -> tuple:
    """What a selector reading only `entries` (and the device's fields) sees of `device`."""
    key: list = [device.driver, device.allow_multiple_allocations, device.invalid]
    for kind, domain, name in entries:
        table = device.attributes if kind == "attributes" else device.capacity
        ids = table.get(domain)
        if ids is None:
            key.append(_ABSENT)  # the domain itself is missing: a different error than the name
            continue
        value = ids.get(name, _ABSENT)
        if value is _ABSENT:
            key.append(("no such name",))
        elif kind == "capacity":
            key.append((value.value.numerator, value.value.denominator))
        else:
            # bool is an int to Python: the type keeps True apart from 1, as CEL keeps them apart
            key.append((type(value), value))
    return tuple(key)


@lru_cache(maxsize=4096)
def _attribute_names(entries: tuple[Entry, ...]) -> tuple[frozenset[str], frozenset[tuple[str, str]]]:
    """The attribute domains, and the (domain, name) pairs, that `entries` read."""
    named = [(domain, name) for kind, domain, name in entries if kind == "attributes"]
    return frozenset(domain for domain, _ in named), frozenset(named)


def slice_projection(driver: str, device: Device, entries: tuple[Entry, ...]) -> tuple:
    """A key for what a selector reading only `entries` sees of `device` (of `driver`): devices with
    equal keys have equal `projection(device_for_cel(driver, device), entries)`. It keeps, in
    order, everything `device_for_cel` could turn into a named entry, a named domain's presence or
    the device's `invalid`: attributes of the named domains (the value of a named one), versions
    and attributes without a value wherever they are (they may not parse, and the first one that
    does not names the device's error), and every capacity (each is parsed)."""
    domains, names = _attribute_names(entries)
    key: list = [driver, bool(device.allow_multiple_allocations)]
    for raw_name, attribute in (device.attributes or {}).items():
        # device_for_cel's order of precedence among the value fields
        value = attribute.int_value
        if value is None:
            value = attribute.bool_value
            if value is None:
                value = attribute.string_value
                if value is None:
                    key.append((raw_name, attribute.version_value))
                    continue
        domain, slash, ident = raw_name.partition("/")  # split_qualified_name, inline: this is hot
        if not slash:
            domain, ident = driver, raw_name
        if domain in domains:
            # the type keeps True apart from 1 (see `projection`)
            key.append((domain, ident, type(value), value) if (domain, ident) in names else (domain,))
    key.append(tuple((name, entry.value) for name, entry in (device.capacity or {}).items()))
    return tuple(key)

"""DeviceTaintRules: a taint put on every device a rule's selector matches, as if the driver had
published it in the ResourceSlice (Kubernetes' ResourceSlice tracker does the same for the
scheduler, so the allocator only ever sees device taints).

Pure: a slice in, the slice as the allocator must see it out. A slice that no rule touches comes
back as the same object, so holding both costs nothing where no rule applies.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from draplane.api.resource import DeviceTaint, DeviceTaintRule, ResourceSlice


def rule_selects(rule: DeviceTaintRule, driver: str, pool: str, device: str) -> bool:
    """Every field the selector sets must match; an empty selector matches every device, and a
    rule without one matches none."""
    selector = rule.spec.device_selector
    if selector is None:
        return False
    return (
        (selector.driver is None or selector.driver == driver)
        and (selector.pool is None or selector.pool == pool)
        and (selector.device is None or selector.device == device)
    )


def _rule_taint(rule: DeviceTaintRule) -> DeviceTaint:
    taint = rule.spec.taint
    if taint.time_added is None and rule.metadata.creation_timestamp:
        # The apiserver sets timeAdded; a rule read from a file may lack it.
        taint = msgspec.structs.replace(taint, time_added=rule.metadata.creation_timestamp)
    return taint


def taint_slice(slice_: ResourceSlice, rules: Iterable[DeviceTaintRule]) -> ResourceSlice:
    """The slice with the taints of the rules that select its devices appended, rules in name
    order; the same object when no rule selects any of them."""
    rules = sorted(rules, key=lambda r: r.metadata.name or "")
    if not rules or not slice_.spec.devices:
        return slice_
    driver, pool = slice_.spec.driver, slice_.spec.pool.name
    devices = []
    changed = False
    for device in slice_.spec.devices:
        added = [_rule_taint(rule) for rule in rules if rule_selects(rule, driver, pool, device.name)]
        if added:
            device = msgspec.structs.replace(device, taints=[*(device.taints or ()), *added])
            changed = True
        devices.append(device)
    if not changed:
        return slice_
    return msgspec.structs.replace(slice_, spec=msgspec.structs.replace(slice_.spec, devices=devices))

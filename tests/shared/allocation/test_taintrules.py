"""DeviceTaintRules: their taints act like the devices' own, as Kubernetes' slice tracker applies them."""

from __future__ import annotations

from allocation_builders import (
    CLASS_A,
    DRIVER_A,
    DRIVER_B,
    NODE_1,
    claim,
    device,
    device_class,
    node,
    request,
    results,
    slice_,
)

from draplane.allocation import DeviceAllocator, NodePlacement
from draplane.allocation.taintrules import rule_selects, taint_slice
from draplane.api.meta import ObjectMeta
from draplane.api.resource import DeviceTaint, DeviceTaintRule, DeviceTaintRuleSpec, DeviceTaintSelector, DeviceToleration


def rule(name: str, effect: str = "NoSchedule", *, selector: DeviceTaintSelector | None = DeviceTaintSelector(),
         key: str = "example.com/maintenance") -> DeviceTaintRule:
    return DeviceTaintRule(metadata=ObjectMeta(name=name),
                           spec=DeviceTaintRuleSpec(device_selector=selector, taint=DeviceTaint(key=key, effect=effect)))


def two_gpus():
    return slice_("s1", NODE_1, NODE_1, DRIVER_A, device("gpu-0"), device("gpu-1"))


def test_selector_fields_must_all_match_and_no_selector_matches_nothing():
    assert rule_selects(rule("all"), DRIVER_A, "p", "d")
    assert not rule_selects(rule("none", selector=None), DRIVER_A, "p", "d")
    only = rule("one", selector=DeviceTaintSelector(driver=DRIVER_A, pool="p", device="gpu-1"))
    assert rule_selects(only, DRIVER_A, "p", "gpu-1")
    assert not rule_selects(only, DRIVER_B, "p", "gpu-1")
    assert not rule_selects(only, DRIVER_A, "q", "gpu-1")
    assert not rule_selects(only, DRIVER_A, "p", "gpu-0")


def test_a_slice_no_rule_touches_is_the_same_object():
    s = two_gpus()
    assert taint_slice(s, [rule("other", selector=DeviceTaintSelector(driver=DRIVER_B))]) is s
    tainted = taint_slice(s, [rule("gpu-1", selector=DeviceTaintSelector(device="gpu-1"))])
    assert [d.taints for d in tainted.spec.devices][0] is None
    assert [t.key for t in tainted.spec.devices[1].taints] == ["example.com/maintenance"]
    assert s.spec.devices[1].taints is None  # the published slice is left as it was


def cluster_with(*rules):
    return DeviceAllocator(slices=[two_gpus()], classes=[device_class(CLASS_A, DRIVER_A)], nodes=[node()], taint_rules=rules,
                   policy="first-fit")


def test_no_schedule_and_no_execute_rules_keep_claims_without_a_toleration_off_the_devices():
    for effect in ("NoSchedule", "NoExecute"):
        c = cluster_with(rule("gpu-0", effect, selector=DeviceTaintSelector(device="gpu-0")))
        placed = c.allocate([claim("c", request("r", CLASS_A))])
        assert isinstance(placed, NodePlacement)
        assert results(placed) == [[("r", DRIVER_A, NODE_1, "gpu-1")]]
        assert not isinstance(c.allocate([claim("c", request("r", CLASS_A, 2))]), NodePlacement)


def test_a_tolerated_rule_and_an_effect_none_rule_do_not_block():
    tolerate = [DeviceToleration(key="example.com/maintenance", operator="Exists")]
    c = cluster_with(rule("all"))
    assert isinstance(c.allocate([claim("c", request("r", CLASS_A, 2, tolerations=tolerate))]), NodePlacement)
    assert isinstance(cluster_with(rule("info", "None")).allocate([claim("c", request("r", CLASS_A, 2))]), NodePlacement)


def test_rules_changed_later_take_effect_and_deleting_them_frees_the_devices():
    c = cluster_with()
    two = [claim("c", request("r", CLASS_A, 2))]
    assert isinstance(c.allocate(two), NodePlacement)
    c.set_taint_rules([rule("all")])
    assert not isinstance(c.allocate(two), NodePlacement)
    assert all(d.taints for s in c.inventory.slices() for d in s.spec.devices)
    c.set_taint_rules([])
    assert isinstance(c.allocate(two), NodePlacement)

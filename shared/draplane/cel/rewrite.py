"""Kubernetes' device maps, reproduced on the C++ runtime by rewriting the expression.

kube-scheduler hands CEL `device.attributes` and `device.capacity` as maps whose lookup of an
absent domain yields an empty map (dynamic-resource-allocation/cel: newStringInterfaceMapWithDefault)
while `in`, size() and iteration see only the real domains. So, in Kubernetes:

    device.attributes["other.example.com"].model      -> error "no such key: model"
    has(device.attributes["other.example.com"].model) -> false
    has(device.attributes.anything)                   -> true
    device.attributes[?"anything"].hasValue()         -> true
    "anything" in device.attributes                   -> false unless the domain exists

cel-cpp's maps cannot have a default, so lookups on those two maps are rewritten before evaluation
into optional lookups with an empty-map default, which gives exactly those results. The rewrite
follows the maps through `cel.bind` (`cel.bind(a, device.attributes, a["x"].y)`,
`cel.bind(d, device, d.capacity["x"])`); a map passed through anything else (a list, a
comprehension's range, a conditional) keeps plain CEL map semantics.
"""

from __future__ import annotations

from .ast import Call, Comprehension, Constant, CreateList, CreateStruct, Expr, Ident, Select

DEVICE_MAPS = ("attributes", "capacity")

# What a name in scope stands for.
DEVICE = "device"
DEVICE_MAP = "map"
OTHER = "other"


def is_bind(kind: Comprehension) -> bool:
    """cel.bind(v, init, body) expands to a comprehension over an empty list whose accumulator is v."""
    return (
        isinstance(kind.iter_range.kind, CreateList)
        and not kind.iter_range.kind.elements
        and isinstance(kind.loop_condition.kind, Constant)
        and kind.loop_condition.kind.value is False
    )


def classify(node: Expr | None, scope: dict[str, str]) -> str | None:
    """DEVICE for the `device` variable (or a name bound to it), DEVICE_MAP for its two maps."""
    if node is None:
        return None
    kind = node.kind
    if isinstance(kind, Ident):
        role = scope.get(kind.name)
        return role if role in (DEVICE, DEVICE_MAP) else None
    if isinstance(kind, Select) and not kind.test_only and kind.field in DEVICE_MAPS:
        if classify(kind.operand, scope) == DEVICE:
            return DEVICE_MAP
    return None


def comprehension_scopes(kind: Comprehension, scope: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Scopes for (loop condition and step, result) of a comprehension."""
    loop = dict(scope)
    for name in (kind.iter_var, kind.iter_var2):
        if name:
            loop[name] = OTHER
    accumulator = OTHER
    if is_bind(kind):
        accumulator = classify(kind.accu_init, scope) or OTHER
    loop[kind.accu_var] = accumulator
    result = dict(scope)
    result[kind.accu_var] = accumulator
    return loop, result


ROOT_SCOPE = {"device": DEVICE}


class _Ids:
    def __init__(self, start: int):
        self.last = start

    def new(self, kind) -> Expr:
        self.last += 1
        return Expr(self.last, kind)


def _lookup_with_default(ids: _Ids, device_map: Expr, key: Expr) -> Expr:
    """device_map[?key].orValue({})"""
    optional = ids.new(Call("_[?_]", [device_map, key]))
    return ids.new(Call("orValue", [ids.new(CreateStruct("", []))], target=optional))


def _optional_of(ids: _Ids, value: Expr) -> Expr:
    return ids.new(Call("of", [value], target=ids.new(Ident("optional"))))


def rewrite_device_maps(expr: Expr, first_free_id: int) -> Expr:
    return _rewrite(expr, ROOT_SCOPE, _Ids(first_free_id - 1))


def _rewrite(node: Expr, scope: dict[str, str], ids: _Ids) -> Expr:
    kind = node.kind
    if isinstance(kind, Select):
        if classify(kind.operand, scope) == DEVICE_MAP:
            if kind.test_only:
                return Expr(node.id, Constant("bool", True))
            return _lookup_with_default(ids, kind.operand, ids.new(Constant("string", kind.field)))
        kind.operand = _rewrite(kind.operand, scope, ids)
        return node
    if isinstance(kind, Call):
        if kind.target is None and len(kind.args) == 2 and classify(kind.args[0], scope) == DEVICE_MAP:
            key = _rewrite(kind.args[1], scope, ids)
            if kind.function == "_[_]":
                return _lookup_with_default(ids, kind.args[0], key)
            if kind.function in ("_[?_]", "_?._"):
                return _optional_of(ids, _lookup_with_default(ids, kind.args[0], key))
        if kind.target is not None:
            kind.target = _rewrite(kind.target, scope, ids)
        kind.args = [_rewrite(arg, scope, ids) for arg in kind.args]
        return node
    if isinstance(kind, CreateList):
        kind.elements = [_rewrite(e, scope, ids) for e in kind.elements]
        return node
    if isinstance(kind, CreateStruct):
        for entry in kind.entries:
            if entry.map_key is not None:
                entry.map_key = _rewrite(entry.map_key, scope, ids)
            entry.value = _rewrite(entry.value, scope, ids)
        return node
    if isinstance(kind, Comprehension):
        loop_scope, result_scope = comprehension_scopes(kind, scope)
        # The range and the accumulator's start are evaluated outside the loop.
        kind.iter_range = _rewrite(kind.iter_range, scope, ids)
        kind.accu_init = _rewrite(kind.accu_init, scope, ids)
        kind.loop_condition = _rewrite(kind.loop_condition, loop_scope, ids)
        kind.loop_step = _rewrite(kind.loop_step, loop_scope, ids)
        kind.result = _rewrite(kind.result, result_scope, ids)
        return node
    return node

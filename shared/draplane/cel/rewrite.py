"""Kubernetes' device maps and opaque-type equality, reproduced on the C++ runtime by rewriting.

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

Equality: cel-go compares a Semver or Quantity with its own Equal, which fails with "no such
overload" when the other side is not of the same type (`version_attribute == "1.0.0"`) or is the
*pointer* that add() and sub() return, while `!=` is true whenever Equal is not. Quantities are
compared by value although their encodings keep the representation. So where the left side may be
a Quantity or Semver (typed so, or dyn), `L == R` becomes
`cel.bind(@l, L, type(@l) == bytes ? EQUALS(@l, R) : @l == R)`, and `!=` likewise: only byte
values reach the Python comparison, everything else keeps the C++ one.
"""

from __future__ import annotations

from .ast import DYN as DYN_TYPE
from .ast import Call, CelType, Comprehension, Constant, CreateList, CreateStruct, Expr, Ident, Select

DEVICE_MAPS = ("attributes", "capacity")

# Runtime functions (library.py) that treat a byte-encoded operand as Kubernetes treats the
# Semver or Quantity it stands for.
OPAQUE_EQUALS = "@draplane.opaque_equals"
OPAQUE_NOT_EQUALS = "@draplane.opaque_not_equals"
OPAQUE_SIZE = "@draplane.opaque_size"
OPAQUE_STRING = "@draplane.opaque_string"

# cel-cpp's two-variable comprehensions expand transformMap() and transformMapEntry() into calls
# of cel.@mapInsert but register no implementation for it; they call this one (library.py).
MAP_INSERT = "@draplane.map_insert"

# Strings-extension overloads whose cel-cpp behaviour differs from cel-go's (substring to the end
# of the string fails in cel-cpp; indexOf past the end, split on "" differ), and the global
# function with cel-go's behaviour (library.py) each member call is rewritten to.
CEL_GO_STRINGS = {
    "string_substring_int": "@draplane.substring",
    "string_substring_int_int": "@draplane.substring",
    "string_index_of_string": "@draplane.index_of",
    "string_index_of_string_int": "@draplane.index_of",
    "string_last_index_of_string": "@draplane.last_index_of",
    "string_last_index_of_string_int": "@draplane.last_index_of",
    "string_split_string": "@draplane.split",
    "string_split_string_int": "@draplane.split",
    # Kubernetes' lists library: cel-cpp has no list overloads of these names at all.
    "list_a_index_of_int": "@draplane.list_index_of",
    "list_a_last_index_of_int": "@draplane.list_last_index_of",
}
# cel-go fails an ordering that involves NaN ("NaN values cannot be ordered"); cel-cpp answers
# false. Comparisons with a double operand call these instead (library.py).
ORDERED = {"_<_": "@draplane.less", "_<=_": "@draplane.less_equals", "_>_": "@draplane.greater", "_>=_": "@draplane.greater_equals"}

# Kubernetes' ip and cidr libraries add string(ip) and string(cidr) to the standard string().
CEL_GO_STRINGS["ip_to_string"] = CEL_GO_STRINGS["cidr_to_string"] = "@draplane.net_to_string"
NET_TO_STRING = "@draplane.net_to_string"
LIST_INDEX_OF = CEL_GO_STRINGS["list_a_index_of_int"]
LIST_LAST_INDEX_OF = CEL_GO_STRINGS["list_a_last_index_of_int"]
_LEFT = "@draplane_left"

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

# cel-cpp initializes a cel.bind variable lazily, in a slot that an earlier comprehension which
# stopped early (all() meeting a false) leaves looking initialized: `[1, 2].all(k, k > 5) ||
# cel.bind(l, 5, l == 5)` gives false there. It recognizes a bind by the iteration variable name the
# macro uses ("#unused"); any other name makes the accumulator eager, as in cel-go.
EAGER_BIND = "#bind"


class _Ids:
    def __init__(self, start: int, types: dict[int, CelType] | None = None, overloads: dict[int, tuple[str, ...]] | None = None):
        self.last = start
        self.types = types or {}
        self.overloads = overloads or {}

    def new(self, kind) -> Expr:
        self.last += 1
        return Expr(self.last, kind)


def _lookup_with_default(ids: _Ids, device_map: Expr, key: Expr) -> Expr:
    """device_map[?key].orValue({})"""
    optional = ids.new(Call("_[?_]", [device_map, key]))
    return ids.new(Call("orValue", [ids.new(CreateStruct("", []))], target=optional))


def _optional_of(ids: _Ids, value: Expr) -> Expr:
    return ids.new(Call("of", [value], target=ids.new(Ident("optional"))))


def rewrite_for_runtime(
    expr: Expr, first_free_id: int, types: dict[int, CelType], overloads: dict[int, tuple[str, ...]]
) -> Expr:
    """The expression, parsed from the same text the checker saw, with the checked types and
    overload ids by node id."""
    return _rewrite(expr, ROOT_SCOPE, _Ids(first_free_id - 1, types, overloads))


def _may_compare_opaque(ids: _Ids, function: str, left: Expr, right: Expr) -> bool:
    """Whether the left operand may be a Quantity or Semver whose comparison differs from bytes'."""
    left_type, right_type = ids.types.get(left.id), ids.types.get(right.id)
    if left_type is None:
        return False
    if left_type.name in ("dyn", "kubernetes.Quantity"):
        # Quantities: equal values may have different encodings ("1" and "1.0").
        return True
    # A Semver's encoding is canonical: only == against another type must fail.
    return function == "_==_" and left_type.name == "kubernetes.Semver" and right_type is not None and right_type.name == "dyn"


def _guarded(ids: _Ids, left: Expr, opaque_call, plain_call) -> Expr:
    """cel.bind(@l, left, type(@l) == bytes ? opaque_call(@l) : plain_call(@l))"""
    held = lambda: ids.new(Ident(_LEFT))  # noqa: E731 - a fresh node per use
    is_bytes = ids.new(Call("_==_", [ids.new(Call("type", [held()])), ids.new(Ident("bytes"))]))
    body = ids.new(Call("_?_:_", [is_bytes, opaque_call(held()), plain_call(held())]))
    return ids.new(
        Comprehension(
            iter_var=EAGER_BIND,
            iter_range=ids.new(CreateList([])),
            accu_var=_LEFT,
            accu_init=left,
            loop_condition=ids.new(Constant("bool", False)),
            loop_step=held(),
            result=body,
        )
    )


def _guarded_equality(ids: _Ids, function: str, left: Expr, right: Expr) -> Expr:
    opaque = OPAQUE_EQUALS if function == "_==_" else OPAQUE_NOT_EQUALS
    return _guarded(
        ids, left,
        lambda held: ids.new(Call(opaque, [held, right])),
        lambda held: ids.new(Call(function, [held, _copy(ids, right)])),
    )


def _cel_go_string_function(ids: _Ids, node: Expr) -> str | None:
    overload_ids = ids.overloads.get(node.id, ())
    names = {CEL_GO_STRINGS.get(overload_id) for overload_id in overload_ids}
    if len(names) == 1 and None not in names:
        return names.pop()
    return None


def _is_dyn(ids: _Ids, node: Expr) -> bool:
    node_type = ids.types.get(node.id)
    return node_type is not None and node_type.name == "dyn"


def _copy(ids: _Ids, node: Expr) -> Expr:
    """A deep copy with fresh ids: one subtree must not appear twice in the AST."""
    kind = node.kind
    if isinstance(kind, Constant):
        new_kind = Constant(kind.kind, kind.value)
    elif isinstance(kind, Ident):
        new_kind = Ident(kind.name)
    elif isinstance(kind, Select):
        new_kind = Select(_copy(ids, kind.operand), kind.field, kind.test_only)
    elif isinstance(kind, Call):
        new_kind = Call(kind.function, [_copy(ids, a) for a in kind.args], _copy(ids, kind.target) if kind.target else None)
    elif isinstance(kind, CreateList):
        new_kind = CreateList([_copy(ids, e) for e in kind.elements], list(kind.optional_indices))
    elif isinstance(kind, CreateStruct):
        from .ast import Entry

        entries = []
        for entry in kind.entries:
            ids.last += 1
            entries.append(
                Entry(ids.last, _copy(ids, entry.value), entry.field_key,
                      _copy(ids, entry.map_key) if entry.map_key else None, entry.optional)
            )
        new_kind = CreateStruct(kind.message_name, entries)
    else:
        new_kind = Comprehension(
            kind.iter_var, _copy(ids, kind.iter_range), kind.accu_var, _copy(ids, kind.accu_init),
            _copy(ids, kind.loop_condition), _copy(ids, kind.loop_step), _copy(ids, kind.result), kind.iter_var2,
        )
    return ids.new(new_kind)


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
        if kind.function == "cel.@mapInsert":
            kind.function = MAP_INSERT
        if kind.function in ORDERED and kind.target is None and len(kind.args) == 2 and any(
            (ids.types.get(arg.id) or DYN_TYPE).name == "double" and not isinstance(arg.kind, Constant) for arg in kind.args
        ):
            kind.function = ORDERED[kind.function]
        if kind.function == "@in" and len(kind.args) == 2 and isinstance(kind.args[1].kind, CreateList) and not kind.args[1].kind.elements:
            # cel-go turns `x in []` into false while building the program: x is never evaluated.
            return Expr(node.id, Constant("bool", False))
        if (
            kind.function in ("_==_", "_!=_") and kind.target is None and len(kind.args) == 2
            and _may_compare_opaque(ids, kind.function, kind.args[0], kind.args[1])
        ):
            left, right = (_rewrite(arg, scope, ids) for arg in kind.args)
            return _guarded_equality(ids, kind.function, left, right)
        replacement = _cel_go_string_function(ids, node)
        if replacement is not None:
            receiver = [_rewrite(kind.target, scope, ids)] if kind.target is not None else []
            args = [_rewrite(arg, scope, ids) for arg in kind.args]
            return Expr(node.id, Call(replacement, [*receiver, *args]))
        # size() and string() of a dyn value: a Semver has neither in Kubernetes.
        if kind.function in ("size", "string"):
            operand = kind.target if kind.target is not None and not kind.args else (
                kind.args[0] if kind.target is None and len(kind.args) == 1 else None
            )
            if operand is not None and _is_dyn(ids, operand):
                operand = _rewrite(operand, scope, ids)
                member = kind.target is not None
                opaque = OPAQUE_SIZE if kind.function == "size" else OPAQUE_STRING
                return _guarded(
                    ids, operand,
                    lambda held: ids.new(Call(opaque, [held])),
                    lambda held: ids.new(Call(kind.function, [], held) if member else Call(kind.function, [held])),
                )
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
        if is_bind(kind):
            kind.iter_var = EAGER_BIND
        # The range and the accumulator's start are evaluated outside the loop.
        kind.iter_range = _rewrite(kind.iter_range, scope, ids)
        kind.accu_init = _rewrite(kind.accu_init, scope, ids)
        kind.loop_condition = _rewrite(kind.loop_condition, loop_scope, ids)
        kind.loop_step = _rewrite(kind.loop_step, loop_scope, ids)
        kind.result = _rewrite(kind.result, result_scope, ids)
        return node
    return node

"""Worst-case CEL cost of a device selector, estimated at compile time as the apiserver does it.

The apiserver rejects a selector whose estimated maximum cost exceeds 1,000,000
(CELSelectorExpressionMaxCost) with "too complex, exceeds cost limit". The estimate is cel-go's
static cost model (checker/cost.go), extended by the Kubernetes CEL libraries' call estimates
(apiserver/pkg/cel/library/cost.go), the cel-go extension libraries' estimates (ext: strings,
lists, sets) and the DRA compiler's size estimator, which knows the declared maximum sizes of
everything reachable from `device`. This module reimplements that model over the AST that
cel-cpp's checker produced (ast.py); costs and sizes are (min, max) pairs of saturating uint64.

It is an estimate of the worst case, so it is sound: the cost of any evaluation is at most the
maximum. It is not a runtime limit; the C++ runtime does not meter cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .ast import Call, CelType, Comprehension, Constant, CreateList, CreateStruct, Expr, Ident, ParsedAst, Select

MAX = 2**64 - 1
_TWO_TO_64 = float(2**64)

STRING_TRAVERSAL = 0.1
REGEX_LENGTH = 0.25
SELECT_AND_IDENT = 1
LIST_CREATE = 10
MAP_CREATE = 30
STRUCT_CREATE = 40
CALL = 1

Estimate = tuple[int, int]  # (min, max) — a cost or a size
UNKNOWN: Estimate = (0, MAX)


def _add(a: int, b: int) -> int:
    return min(a + b, MAX)


def _mul(a: int, b: int) -> int:
    return min(a * b, MAX)


def _scale(x: int, factor: float) -> int:
    """multiplyByCostFactor: ceil(x * factor) in float64, saturating."""
    fx = float(x)
    if fx > 0 and factor > 0 and fx > float(MAX) / factor:
        return MAX
    value = math.ceil(fx * factor)
    return MAX if value >= _TWO_TO_64 else int(value)


def add(a: Estimate, b: Estimate) -> Estimate:
    return _add(a[0], b[0]), _add(a[1], b[1])


def mul(a: Estimate, b: Estimate) -> Estimate:
    return _mul(a[0], b[0]), _mul(a[1], b[1])


def scale(a: Estimate, factor: float) -> Estimate:
    return _scale(a[0], factor), _scale(a[1], factor)


def union(a: Estimate, b: Estimate) -> Estimate:
    return min(a[0], b[0]), max(a[1], b[1])


def fixed(n: int) -> Estimate:
    return n, n


# --- what the DRA compiler declares about `device` (dynamic-resource-allocation/cel) -------------


@dataclass
class _Decl:
    max_elements: int
    fields: dict[str, "_Decl"] = field(default_factory=dict)
    key: "_Decl | None" = None
    elem: "_Decl | None" = None


# k8s.io/api/resource/v1 limits.
_ATTRIBUTE = _Decl(64)  # DeviceAttributeMaxValueLength
_DOMAIN = _Decl(63)  # DeviceMaxDomainLength
_ID = _Decl(32)  # DeviceMaxIDLength
_QUANTITY = _Decl(0)  # a simple type without a declared maximum
_INNER_ATTRIBUTES = _Decl(32, key=_ID, elem=_ATTRIBUTE)  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
_INNER_CAPACITY = _Decl(32, key=_ID, elem=_QUANTITY)
_DEVICE = _Decl(
    0,
    fields={
        "driver": _Decl(63),  # DriverNameMaxLength
        "attributes": _Decl(32, key=_DOMAIN, elem=_INNER_ATTRIBUTES),
        "capacity": _Decl(32, key=_DOMAIN, elem=_INNER_CAPACITY),
        "allowMultipleAllocations": _Decl(1),
    },
)


def device_size(path: list[str]) -> Estimate | None:
    """The DRA size estimator: the declared maximum size of what a path from `device` reaches."""
    if not path or path[0] != "device":
        return None
    node = _DEVICE
    for name in path[1:]:
        if name in ("@items", "@values"):
            if node.elem is None:
                return None
            node = node.elem
        elif name == "@keys":
            if node.key is None:
                return None
            node = node.key
        elif name in node.fields:
            node = node.fields[name]
        elif node.elem is _ATTRIBUTE:
            # Any attribute name: all attribute values share one maximum size.
            node = _ATTRIBUTE
        else:
            return None
    return 0, node.max_elements


# --- the estimator --------------------------------------------------------------------------------

_SCALARS = {"bool", "double", "google.protobuf.Duration", "int", "google.protobuf.Timestamp", "uint"}
_STRUCT_TYPES = {"kubernetes.Quantity", "kubernetes.Semver"}


def _is_scalar(t: CelType | None) -> bool:
    if t is None:
        return False
    if t.name in _SCALARS:
        return True
    return t.name == "optional_type" and bool(t.params) and _is_scalar(t.params[0])


def _kind(t: CelType | None) -> str:
    if t is None:
        return "dyn"
    if t.name in ("map", "list"):
        return t.name
    if t.name in _STRUCT_TYPES:
        return "struct"
    if t.name.startswith("type_param:"):
        return "type_param"
    return t.name


@dataclass
class _EntrySize:
    container: str
    key: Estimate
    value: Estimate

    def union(self, other: "_EntrySize | None") -> "_EntrySize | None":
        if other is None:
            return None
        return _EntrySize(self.container, union(self.key, other.key), union(self.value, other.value))


@dataclass
class _LocalVar:
    path: list[str]
    size: Estimate | None
    entry_size: _EntrySize | None


class _Node:
    """What a call estimate may ask about an argument: its path, type, expression and size."""

    __slots__ = ("path", "type", "expr", "size")

    def __init__(self, path, cel_type, expr, size):
        self.path = path
        self.type = cel_type
        self.expr = expr
        self.size = size


class CostEstimator:
    def __init__(self, ast: ParsedAst):
        self.ast = ast
        self.paths: dict[int, list[str]] = {}
        self.locals: dict[str, list[_LocalVar]] = {}
        self.sizes: dict[int, Estimate] = {}
        self.entry_sizes: dict[int, _EntrySize] = {}

    # -- bookkeeping, as cel-go's coster keeps it
    def _type(self, e: Expr) -> CelType | None:
        return self.ast.types.get(e.id)

    def _local(self, name: str) -> _LocalVar | None:
        stack = self.locals.get(name)
        return stack[-1] if stack else None

    def _push(self, name: str, var: _LocalVar) -> None:
        self.locals.setdefault(name, []).append(var)

    def _pop(self, name: str) -> None:
        self.locals[name].pop()

    def _path(self, e: Expr) -> list[str]:
        if isinstance(e.kind, Ident):
            var = self._local(e.kind.name)
            if var is not None:
                return list(var.path)
        return list(self.paths.get(e.id, []))

    def _estimate_size(self, path: list[str]) -> Estimate | None:
        return device_size(path)

    def _size(self, e: Expr) -> Estimate | None:
        if e.id in self.sizes:
            return self.sizes[e.id]
        literal = _literal_size(e)
        if literal is not None:
            return literal
        estimated = self._estimate_size(self._path(e))
        if estimated is not None:
            self.sizes[e.id] = estimated
            return estimated
        if _is_scalar(self._type(e)):
            return fixed(1)
        if isinstance(e.kind, Ident):
            var = self._local(e.kind.name)
            if var is not None and var.size is not None:
                return var.size
        return None

    def _size_or_unknown(self, e: Expr) -> Estimate:
        size = self._size(e)
        return UNKNOWN if size is None else size

    def _entry_size(self, e: Expr) -> _EntrySize | None:
        if e.id in self.entry_sizes:
            return self.entry_sizes[e.id]
        if isinstance(e.kind, Ident):
            var = self._local(e.kind.name)
            if var is not None:
                return var.entry_size
        return None

    def _node(self, e: Expr) -> _Node:
        path = self._path(e)
        if path and path[0] in ("@result", "@__result__"):
            path = []
        return _Node(path, self._type(e), e, self._size(e))

    def _node_size(self, node: _Node) -> Estimate:
        if node.size is not None:
            return node.size
        estimated = self._estimate_size(node.path) if node.path else None
        return UNKNOWN if estimated is None else estimated

    # -- the walk
    def cost(self, e: Expr | None) -> Estimate:
        if e is None:
            return fixed(0)
        kind = e.kind
        if isinstance(kind, Constant):
            return fixed(0)
        if isinstance(kind, Ident):
            return self._ident(e, kind)
        if isinstance(kind, Select):
            return self._select(e, kind)
        if isinstance(kind, Call):
            return self._call(e, kind)
        if isinstance(kind, CreateList):
            return self._list(e, kind)
        if isinstance(kind, CreateStruct):
            return self._map(e, kind) if not kind.message_name else self._struct(kind)
        if isinstance(kind, Comprehension):
            return self._bind(e, kind) if _is_bind(kind) else self._comprehension(e, kind)
        return fixed(0)

    def _ident(self, e: Expr, kind: Ident) -> Estimate:
        var = self._local(kind.name)
        if var is not None:
            self.paths[e.id] = list(var.path)
            return fixed(SELECT_AND_IDENT)
        if kind.name.startswith("device."):
            # cel-cpp resolved `device.field` to one qualified name; cel-go costs the identifier
            # and the select on the object.
            self.paths[e.id] = kind.name.split(".", 1)[0:1] + [kind.name.split(".", 1)[1]]
            return fixed(2 * SELECT_AND_IDENT)
        self.paths[e.id] = [kind.name]
        return fixed(SELECT_AND_IDENT)

    def _select(self, e: Expr, kind: Select) -> Estimate:
        if kind.test_only:
            # Kubernetes sets PresenceTestHasCost(false).
            return self.cost(kind.operand)
        total = self.cost(kind.operand)
        if _kind(self._type(kind.operand)) in ("map", "struct", "type_param"):
            total = add(total, fixed(SELECT_AND_IDENT))
        self.paths[e.id] = self._path(kind.operand) + [kind.field]
        return total

    def _call(self, e: Expr, kind: Call) -> Estimate:
        if kind.function == "dyn" and kind.target is None and len(kind.args) == 1:
            arg_cost = self.cost(kind.args[0])
            self._copy_sizes(e, kind.args[0])
            return add(fixed(1), arg_cost)
        arg_costs = [self.cost(a) for a in kind.args]
        arg_nodes = [self._node(a) for a in kind.args]
        reference = self.ast.references.get(e.id)
        overload_ids = reference.overload_ids if reference else ()
        if not overload_ids:
            return fixed(0)
        total = fixed(0)
        target = None
        if kind.target is not None:
            total = add(total, self.cost(kind.target))
            target = self._node(kind.target)
        function_cost: Estimate = (MAX, 0)
        result_size: Estimate | None = None
        for overload_id in overload_ids:
            call_cost, call_size = self._function_cost(e, kind.function, overload_id, target, arg_nodes, arg_costs)
            function_cost = union(function_cost, call_cost)
            if call_size is not None:
                result_size = call_size if result_size is None else union(result_size, call_size)
            if overload_id in ("index_list", "index_map") and kind.args:
                entry = self._entry_size(kind.args[0])
                result_size = entry.value if entry is not None else None
                self.paths[e.id] = self._path(kind.args[0]) + ["@items" if overload_id == "index_list" else "@values"]
            if result_size is None:
                result_size = self._size(e)
        if result_size is not None:
            self.sizes[e.id] = result_size
        return add(total, function_cost)

    def _list(self, e: Expr, kind: CreateList) -> Estimate:
        total = fixed(0)
        item: Estimate = (0 if not kind.elements else MAX, 0)
        for element in kind.elements:
            total = add(total, self.cost(element))
            item = union(item, self._size_or_unknown(element))
        self.entry_sizes[e.id] = _EntrySize("list", fixed(1), item)
        return add(total, fixed(LIST_CREATE))

    def _map(self, e: Expr, kind: CreateStruct) -> Estimate:
        total = fixed(0)
        empty = not kind.entries
        key: Estimate = (0 if empty else MAX, 0)
        value: Estimate = (0 if empty else MAX, 0)
        for entry in kind.entries:
            total = add(total, self.cost(entry.map_key))
            total = add(total, self.cost(entry.value))
            key = union(key, self._size_or_unknown(entry.map_key))
            value = union(value, self._size_or_unknown(entry.value))
        self.entry_sizes[e.id] = _EntrySize("map", key, value)
        return add(total, fixed(MAP_CREATE))

    def _struct(self, kind: CreateStruct) -> Estimate:
        total = fixed(0)
        for entry in kind.entries:
            total = add(total, self.cost(entry.value))
        return add(total, fixed(STRUCT_CREATE))

    def _push_local(self, name: str, e: Expr) -> None:
        self._push(name, _LocalVar(self._path(e), self._size(e), self._entry_size(e)))

    def _container(self, range_expr: Expr, entry: _EntrySize | None) -> str:
        if entry is not None:
            return entry.container
        return _kind(self._type(range_expr))

    def _comprehension(self, e: Expr, kind: Comprehension) -> Estimate:
        total = add(self.cost(kind.iter_range), self.cost(kind.accu_init))
        self._push_local(kind.accu_var, kind.accu_init)
        entry = self._entry_size(kind.iter_range)
        container = self._container(kind.iter_range, entry)
        range_path = self._path(kind.iter_range)
        if kind.iter_var2:
            key_sub = "@indices" if container == "list" else "@keys"
            value_sub = "@items" if container == "list" else "@values"
            self._push(kind.iter_var, _LocalVar(range_path + [key_sub], entry.key if entry else None, None))
            self._push(kind.iter_var2, _LocalVar(range_path + [value_sub], entry.value if entry else None, None))
        else:
            if container == "list":
                size, sub = (entry.value if entry else None), "@items"
            else:
                size, sub = (entry.key if entry else None), "@keys"
            self._push(kind.iter_var, _LocalVar(range_path + [sub], size, None))
        loop_cost = self.cost(kind.loop_condition)
        step_cost = self.cost(kind.loop_step)
        self._pop(kind.iter_var)
        if kind.iter_var2:
            self._pop(kind.iter_var2)
        total = add(total, self.cost(kind.result))
        self._pop(kind.accu_var)
        range_count = self._size_or_unknown(kind.iter_range)
        total = add(total, mul(range_count, add(step_cost, loop_cost)))
        init = kind.accu_init.kind
        if isinstance(init, Constant):
            size = self._size(kind.accu_init)
            if size is not None:
                self.sizes[e.id] = size
        elif isinstance(init, (CreateList, CreateStruct)):
            self.sizes[e.id] = range_count
            step_entry = self._entry_size(kind.loop_step)
            if step_entry is not None:
                self.entry_sizes[e.id] = step_entry
        return total

    def _bind(self, e: Expr, kind: Comprehension) -> Estimate:
        total = add(self.cost(kind.iter_range), self.cost(kind.accu_init))
        self._push_local(kind.accu_var, kind.accu_init)
        total = add(total, self.cost(kind.result))
        self._pop(kind.accu_var)
        self._copy_sizes(e, kind.result)
        return total

    def _copy_sizes(self, dst: Expr, src: Expr) -> None:
        size = self._size(src)
        if size is not None:
            self.sizes[dst.id] = size
        entry = self._entry_size(src)
        if entry is not None:
            self.entry_sizes[dst.id] = entry

    # -- calls: extension estimates first, then Kubernetes', then cel-go's defaults
    def _function_cost(self, e, function, overload_id, target, args, arg_costs) -> tuple[Estimate, Estimate | None]:
        arg_sum = fixed(0)
        for c in arg_costs:
            arg_sum = add(arg_sum, c)
        for estimate in (_extension_estimate, _kubernetes_estimate):
            found = estimate(self, function, overload_id, target, args)
            if found is not None:
                call_cost, size = found
                return add(call_cost, arg_sum), size
        return self._builtin_cost(e, overload_id, target, args, arg_costs, arg_sum)

    def _builtin_cost(self, e, overload_id, target, args, arg_costs, arg_sum) -> tuple[Estimate, Estimate | None]:
        size_of = self._node_size
        if overload_id == "string_format" and target is not None:
            return add(scale(size_of(target), STRING_TRAVERSAL), arg_sum), None
        if overload_id == "string_to_bytes" and len(args) == 1:
            sz = size_of(args[0])
            return add(scale(sz, STRING_TRAVERSAL), arg_sum), (sz[0], _mul(sz[1], 4))
        if overload_id == "bytes_to_string" and len(args) == 1:
            sz = size_of(args[0])
            return add(scale(sz, STRING_TRAVERSAL), arg_sum), (sz[0] // 4, sz[1])
        if overload_id == "strings_quote" and len(args) == 1:
            sz = size_of(args[0])
            return add(scale(sz, STRING_TRAVERSAL), arg_sum), (_add(sz[0], 2), _add(_mul(sz[1], 2), 2))
        if overload_id in ("starts_with_string", "ends_with_string") and len(args) == 1:
            return add(scale(size_of(args[0]), STRING_TRAVERSAL), arg_sum), None
        if overload_id == "in_list" and len(args) == 2:
            return add(scale(size_of(args[1]), 1), arg_sum), None
        if overload_id in ("matches", "matches_string"):
            if overload_id == "matches_string" and target is not None and len(args) == 1:
                text, regex = target, args[0]
            elif overload_id == "matches" and target is None and len(args) == 2:
                text, regex = args
            else:
                text = regex = None
            if text is not None:
                text_cost = scale(add(size_of(text), fixed(1)), STRING_TRAVERSAL)
                regex_cost = scale(size_of(regex), REGEX_LENGTH)
                return add(mul(text_cost, regex_cost), arg_sum), None
        if overload_id == "contains_string" and target is not None and len(args) == 1:
            text_cost = scale(size_of(target), STRING_TRAVERSAL)
            sub_cost = scale(size_of(args[0]), STRING_TRAVERSAL)
            return add(mul(text_cost, sub_cost), arg_sum), None
        if overload_id in ("logical_or", "logical_and"):
            lhs, rhs = arg_costs
            return (lhs[0], add(lhs, rhs)[1]), None
        if overload_id == "conditional":
            size = union(size_of(args[1]), size_of(args[2]))
            left, right = self._entry_size(args[1].expr), self._entry_size(args[2].expr)
            merged = left.union(right) if left is not None else None
            if merged is not None:
                self.entry_sizes[e.id] = merged
            return add(arg_costs[0], union(arg_costs[1], arg_costs[2])), size
        if overload_id in ("add_string", "add_bytes", "add_list") and len(args) == 2:
            result = add(size_of(args[0]), size_of(args[1]))
            left, right = self._entry_size(args[0].expr), self._entry_size(args[1].expr)
            merged = left.union(right) if left is not None else None
            if merged is not None:
                self.entry_sizes[e.id] = merged
            if overload_id == "add_list":
                return add(fixed(1), arg_sum), result
            return add(scale(result, STRING_TRAVERSAL), arg_sum), result
        if overload_id in _SIZED_COMPARISONS:
            lhs, rhs = size_of(args[0]), size_of(args[1])
            smallest = min(lhs[1], rhs[1])
            low = 1 if smallest > 0 else 0
            return add(scale((low, smallest), STRING_TRAVERSAL), arg_sum), None
        return add(fixed(CALL), arg_sum), None

    def estimate(self) -> Estimate:
        return self.cost(self.ast.expr)


_SIZED_COMPARISONS = {
    "less_string", "greater_string", "less_equals_string", "greater_equals_string",
    "less_bytes", "greater_bytes", "less_equals_bytes", "greater_equals_bytes",
    "equals", "not_equals",
}


def _literal_size(e: Expr) -> Estimate | None:
    kind = e.kind
    if isinstance(kind, Constant):
        if kind.kind == "string":
            return fixed(len(kind.value))
        if kind.kind == "bytes":
            return fixed(len(kind.value))
        return fixed(1)
    if isinstance(kind, CreateList):
        return fixed(len(kind.elements))
    if isinstance(kind, CreateStruct) and not kind.message_name:
        return fixed(len(kind.entries))
    return None


def _is_bind(kind: Comprehension) -> bool:
    return (
        isinstance(kind.iter_range.kind, CreateList)
        and not kind.iter_range.kind.elements
        and isinstance(kind.loop_condition.kind, Constant)
        and kind.loop_condition.kind.value is False
        and kind.accu_var != "@result"
    )


def _literal_uint(node: _Node, default: int) -> int:
    kind = node.expr.kind if node.expr is not None else None
    if not isinstance(kind, Constant) or kind.kind != "int":
        return default
    return max(kind.value, 0)



def _list_call(factor: float, list_size: Estimate, allocates: bool = True) -> tuple[Estimate, Estimate]:
    cost = add(scale(list_size, factor), fixed(CALL))
    if allocates:
        cost = add(cost, fixed(LIST_CREATE))
    return cost, list_size


def _extension_estimate(c: CostEstimator, function, overload_id, target, args):
    """cel-go ext: lists (v3) and sets register estimates per overload (strings only from v5)."""
    size_of = c._node_size
    if overload_id == "list_slice" and target is not None and len(args) == 2:
        sz = size_of(target)
        start, end = _literal_uint(args[0], 0), _literal_uint(args[1], sz[1])
        return _list_call(1, fixed((end - start) % 2**64))
    if overload_id in ("list_range", "lists_range") and target is None and len(args) == 1:
        return _list_call(1, fixed(_literal_uint(args[0], MAX)))
    if overload_id == "list_reverse" and target is not None and not args:
        return _list_call(1, size_of(target))
    if overload_id in ("list_flatten", "list_flatten_int") and target is not None and len(args) <= 1:
        depth = 1 if not args else _literal_uint(args[0], MAX)
        return _list_call(float(depth), size_of(target))
    if overload_id == "list_distinct" and target is not None and not args:
        sz = size_of(target)
        return _list_call(2.0, mul(sz, sz))
    if overload_id.endswith("_sort") and overload_id.startswith("list_") and target is not None and not args:
        return _sort_cost(size_of(target), overload_id)
    if overload_id.endswith("_sortByAssociatedKeys") and len(args) == 1:
        return _sort_cost(size_of(args[0]), overload_id)
    if overload_id in ("list_sets_contains_list", "list_sets_intersects_list", "list_sets_equivalent_list") and len(args) == 2:
        factor = 2 if overload_id == "list_sets_equivalent_list" else 1
        return add(scale(mul(size_of(args[0]), size_of(args[1])), factor), fixed(CALL)), None
    return None


def _sort_cost(sz: Estimate, overload_id: str):
    factor = 2.0 + (STRING_TRAVERSAL if ("_string_" in overload_id or "_bytes_" in overload_id) else 0)
    return _list_call(factor, mul(sz, sz))



def _kubernetes_estimate(c: CostEstimator, function, overload_id, target, args):
    """apiserver/pkg/cel/library/cost.go, for the functions of the libraries enabled here."""
    size_of = c._node_size
    if function in ("isSorted", "sum", "max", "min", "indexOf", "lastIndexOf") and target is not None:
        element = _list_element(target)
        if element is not None:
            element_cost = fixed(1)
            if element.type is not None and element.type.name in ("string", "bytes"):
                element_cost = add(element_cost, scale(size_of(element), STRING_TRAVERSAL))
            return mul(size_of(target), element_cost), None
        return scale(size_of(target), STRING_TRAVERSAL), None
    if function in ("lowerAscii", "upperAscii", "substring", "trim") and target is not None:
        sz = size_of(target)
        return scale(sz, STRING_TRAVERSAL), sz
    if function == "replace" and target is not None and len(args) >= 2:
        return _replace_estimate(size_of(target), size_of(args[0]), size_of(args[1]))
    if function == "join" and target is not None:
        list_size = size_of(target)
        result = fixed(0)
        element = _list_element(target)
        if element is not None:
            result = mul(list_size, size_of(element))
        if args:
            separators = (max(list_size[0] - 1, 0), max(list_size[1] - 1, 0))
            result = add(result, mul(size_of(args[0]), separators))
        return scale(result, STRING_TRAVERSAL), result
    if function == "split" and target is not None:
        sz = size_of(target)
        maximum = sz[1]
        if len(args) > 1 and isinstance(args[1].expr.kind, Constant) and args[1].expr.kind.kind == "int":
            maximum = args[1].expr.kind.value % 2**64
        return scale(sz, 2 * STRING_TRAVERSAL), (0, maximum)
    if function in ("find", "findAll") and target is not None and args:
        sz = size_of(target)
        text_cost = scale(add(sz, fixed(1)), STRING_TRAVERSAL)
        regex_cost = scale(size_of(args[0]), REGEX_LENGTH)
        return mul(text_cost, regex_cost), (0, sz[1])
    if function in ("quantity", "isQuantity", "semver", "isSemver") and args:
        return scale(size_of(args[0]), STRING_TRAVERSAL), None
    if function in (
        "sign", "asInteger", "isInteger", "asApproximateFloat", "isGreaterThan", "isLessThan",
        "compareTo", "add", "sub", "major", "minor", "patch",
    ):
        return fixed(1), None
    if function in ("cidr", "isIP", "isCIDR") and args:
        return scale(size_of(args[0]), STRING_TRAVERSAL), None
    if function == "ip":
        if overload_id == "cidr_ip":
            return fixed(1), None
        if args:
            return scale(size_of(args[0]), STRING_TRAVERSAL), None
    if function == "ip.isCanonical" and args:
        return scale(size_of(args[0]), 2 * STRING_TRAVERSAL), None
    if function in (
        "masked", "prefixLength", "family", "isUnspecified", "isLoopback", "isLinkLocalMulticast",
        "isLinkLocalUnicast", "isGlobalUnicast",
    ):
        return fixed(1), None
    if function in ("containsIP", "containsCIDR") and args:
        address_size = (4, 16)  # an IP's size in bytes
        compare = scale(add(address_size, address_size), STRING_TRAVERSAL)
        if function == "containsCIDR":
            compare = add(add(compare, scale(address_size, STRING_TRAVERSAL)), fixed(1))
        if overload_id in ("cidr_contains_ip_string", "cidr_contains_cidr_string"):
            compare = add(compare, scale(size_of(args[0]), STRING_TRAVERSAL))
        return compare, None
    if function == "_==_" and len(args) == 2:
        left, right = args[0].type, args[1].type
        if left is not None and left == right and left.name in (*_STRUCT_TYPES, "net.IP", "net.CIDR"):
            return fixed(1), None
    return None


def _replace_estimate(sz: Estimate, to_replace: Estimate, replace_with: Estimate):
    """How many replacements fit, and what is left, bound the result's size."""
    count_max = retained_max = count_min = retained_min = 0
    if to_replace[0] == 0:
        count_max = _add(sz[1], 1) if sz[1] < MAX else sz[1]
        retained_max = sz[1]
    elif replace_with[1] <= to_replace[0]:
        count_max, retained_max = 0, sz[1]
    else:
        count_max = min(int(math.ceil(float(sz[1]) / float(to_replace[0]))), MAX)
    if to_replace[1] == 0:
        count_min = _add(sz[0], 1) if sz[0] < MAX else sz[0]
        retained_min = sz[0]
    elif to_replace[1] <= replace_with[0]:
        count_min, retained_min = 0, sz[0]
    else:
        count_min = min(int(math.ceil(float(sz[0]) / float(to_replace[1]))), MAX)
    result = add(mul((count_min, count_max), replace_with), (retained_min, retained_max))
    return scale(sz, 2 * STRING_TRAVERSAL), result


def _list_element(target: _Node) -> _Node | None:
    if target.type is None or not target.type.params:
        return None
    path = target.path + ["@items"] if target.path else []
    return _Node(path, target.type.params[0], None, None)


def estimate_cost(ast: ParsedAst) -> Estimate:
    """(min, max) cost of the checked expression."""
    return CostEstimator(ast).estimate()

"""Compile-time checks the apiserver makes that cel-cpp's checker does not.

- `device` is an object with four fields (kubernetes.DRADevice): other fields and indexing fail.
- cel.HomogeneousAggregateLiterals: list and map literals hold one type (`[1, "a"]` is an error),
  except a list passed to string.format.

Both run on the checked AST (ast.py) and answer in cel-go's error layout.
"""

from __future__ import annotations

from .ast import Call, Comprehension, CreateList, CreateStruct, Expr, ParsedAst, Select, error_at, source_positions
from .rewrite import DEVICE, ROOT_SCOPE, classify, comprehension_scopes

DEVICE_FIELD_NAMES = ("driver", "attributes", "capacity", "allowMultipleAllocations")


def first_static_error(ast: ParsedAst, expression: str) -> str | None:
    positions = source_positions(ast.source_info)
    message = _device_field_error(ast, ast.expr, ROOT_SCOPE)
    if message is None:
        message = _aggregate_literal_error(ast)
    if message is None:
        return None
    node_id, text = message
    return error_at(expression, positions.get(node_id, 0), text)


def _device_field_error(ast: ParsedAst, node: Expr, scope: dict[str, str]) -> tuple[int, str] | None:
    kind = node.kind
    if isinstance(kind, Select) and classify(kind.operand, scope) == DEVICE and kind.field not in DEVICE_FIELD_NAMES:
        return node.id, f"undefined field '{kind.field}'"
    if isinstance(kind, Call) and kind.function in ("_[_]", "_[?_]") and kind.args and classify(kind.args[0], scope) == DEVICE:
        key_type = ast.types.get(kind.args[1].id, "dyn")
        return node.id, f"found no matching overload for '{kind.function}' applied to '(kubernetes.DRADevice, {key_type})'"
    if isinstance(kind, Comprehension):
        loop_scope, result_scope = comprehension_scopes(kind, scope)
        parts = (
            (kind.iter_range, scope), (kind.accu_init, scope), (kind.loop_condition, loop_scope),
            (kind.loop_step, loop_scope), (kind.result, result_scope),
        )
    else:
        parts = tuple((child, scope) for child in node.children())
    for child, child_scope in parts:
        found = _device_field_error(ast, child, child_scope)
        if found:
            return found
    return None


def _exempt_lists(root: Expr) -> set[int]:
    """Literals anywhere inside a string.format call, which cel-go exempts from the rule."""
    exempt: set[int] = set()
    for node in root.walk():
        kind = node.kind
        if isinstance(kind, Call) and kind.function == "format":
            for arg in kind.args:
                exempt.update(inner.id for inner in arg.walk())
    return exempt


def _equivalent(a, b) -> bool:
    """cel-go's IsEquivalentType: the same type, type parameter names aside."""
    if a is None or b is None:
        return a is b
    if a.name.startswith("type_param:") and b.name.startswith("type_param:"):
        return True
    return a.name == b.name and len(a.params) == len(b.params) and all(_equivalent(x, y) for x, y in zip(a.params, b.params))


# Functions whose result cel-cpp types less precisely than cel-go (flatten() is list(dyn) to
# cel-cpp, list(T) to cel-go): their results are left out of the homogeneity comparison.
_IMPRECISE = {"flatten"}


def _imprecise(node: Expr) -> bool:
    return isinstance(node.kind, Call) and node.kind.function in _IMPRECISE


def _element_type(ast: ParsedAst, node: Expr, optional: bool):
    cel_type = ast.types.get(node.id)
    if optional and cel_type is not None and cel_type.params:
        return cel_type.params[0]
    return cel_type


def _aggregate_literal_error(ast: ParsedAst) -> tuple[int, str] | None:
    exempt = _exempt_lists(ast.expr)
    for node in ast.expr.walk():
        kind = node.kind
        if isinstance(kind, CreateList) and node.id not in exempt:
            first = None
            for index, element in enumerate(kind.elements):
                if _imprecise(element):
                    continue
                element_type = _element_type(ast, element, index in kind.optional_indices)
                if first is None:
                    first = element_type
                elif not _equivalent(element_type, first):
                    return element.id, f"expected type '{first}' but found '{element_type}'"
        elif isinstance(kind, CreateStruct) and not kind.message_name:
            key_type = value_type = None
            for entry in kind.entries:
                if _imprecise(entry.map_key) or _imprecise(entry.value):
                    continue
                entry_key = _element_type(ast, entry.map_key, False)
                entry_value = _element_type(ast, entry.value, entry.optional)
                if key_type is None and value_type is None:
                    key_type, value_type = entry_key, entry_value
                    continue
                if not _equivalent(entry_key, key_type):
                    return entry.map_key.id, f"expected type '{key_type}' but found '{entry_key}'"
                if not _equivalent(entry_value, value_type):
                    return entry.value.id, f"expected type '{value_type}' but found '{entry_value}'"
    return None

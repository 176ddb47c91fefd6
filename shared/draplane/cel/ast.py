"""The CEL abstract syntax tree, read from and written back to cel-expr-python.

cel-expr-python exposes no AST, but `Expression.serialize()` returns a google.protobuf.Any holding
a cel.expr.ParsedExpr or cel.expr.CheckedExpr, and `Env.deserialize()` accepts one back. This
module reads that protobuf wire format (no protobuf package needed: the schema is small and
stable, github.com/google/cel-spec proto/cel/expr/{syntax,checked}.proto) so that draplane can
inspect checked types for its cost estimate, reject unknown device fields, and rewrite the
runtime expression where the C++ runtime's maps differ from Kubernetes' (see selector.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Iterator

# --- wire format ------------------------------------------------------------------------------------


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value): ints for varints and fixed, bytes for length-delimited."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value = data[pos:pos + 8]
            pos += 8
        elif wire == 2:
            length, pos = _varint(data, pos)
            value = data[pos:pos + length]
            pos += length
        elif wire == 5:
            value = data[pos:pos + 4]
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _put_varint(out: bytearray, value: int) -> None:
    if value < 0:
        value += 1 << 64
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def _put_tag(out: bytearray, number: int, wire: int) -> None:
    _put_varint(out, number << 3 | wire)


def _put_bytes(out: bytearray, number: int, value: bytes) -> None:
    _put_tag(out, number, 2)
    _put_varint(out, len(value))
    out += value


def _put_int(out: bytearray, number: int, value: int) -> None:
    _put_tag(out, number, 0)
    _put_varint(out, value)


# --- expressions -------------------------------------------------------------------------------------


@dataclass(eq=False)
class Constant:
    kind: str  # null, bool, int, uint, double, string, bytes
    value: object = None


@dataclass(eq=False)
class Ident:
    name: str


@dataclass(eq=False)
class Select:
    operand: "Expr"
    field: str
    test_only: bool = False


@dataclass(eq=False)
class Call:
    function: str
    args: list["Expr"]
    target: "Expr | None" = None


@dataclass(eq=False)
class CreateList:
    elements: list["Expr"]
    optional_indices: list[int] = field(default_factory=list)


@dataclass(eq=False)
class Entry:
    id: int
    value: "Expr"
    field_key: str | None = None
    map_key: "Expr | None" = None
    optional: bool = False


@dataclass(eq=False)
class CreateStruct:
    message_name: str
    entries: list[Entry]


@dataclass(eq=False)
class Comprehension:
    iter_var: str
    iter_range: "Expr"
    accu_var: str
    accu_init: "Expr"
    loop_condition: "Expr"
    loop_step: "Expr"
    result: "Expr"
    iter_var2: str = ""


@dataclass(eq=False)
class Expr:
    id: int
    kind: Constant | Ident | Select | Call | CreateList | CreateStruct | Comprehension

    def children(self) -> list["Expr"]:
        k = self.kind
        if isinstance(k, Select):
            return [k.operand]
        if isinstance(k, Call):
            return ([k.target] if k.target is not None else []) + list(k.args)
        if isinstance(k, CreateList):
            return list(k.elements)
        if isinstance(k, CreateStruct):
            return [e for entry in k.entries for e in ((entry.map_key,) if entry.map_key else ()) + (entry.value,)]
        if isinstance(k, Comprehension):
            return [k.iter_range, k.accu_init, k.loop_condition, k.loop_step, k.result]
        return []

    def walk(self) -> Iterator["Expr"]:
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children()))


def _decode_constant(data: bytes) -> Constant:
    for number, _wire, value in fields(data):
        if number == 1:
            return Constant("null")
        if number == 2:
            return Constant("bool", bool(value))
        if number == 3:
            return Constant("int", _signed64(value))
        if number == 4:
            return Constant("uint", value)
        if number == 5:
            return Constant("double", struct.unpack("<d", value)[0])
        if number == 6:
            return Constant("string", value.decode())
        if number == 7:
            return Constant("bytes", bytes(value))
        raise ValueError(f"unsupported constant kind {number}")
    return Constant("null")  # an empty Constant message is the default null


def decode_expr(data: bytes) -> Expr:
    expr_id, kind = 0, None
    for number, _wire, value in fields(data):
        if number == 2:
            expr_id = value
        elif number == 3:
            kind = _decode_constant(value)
        elif number == 4:
            kind = Ident(next((v.decode() for n, _w, v in fields(value) if n == 1), ""))
        elif number == 5:
            operand, name, test_only = None, "", False
            for n, _w, v in fields(value):
                if n == 1:
                    operand = decode_expr(v)
                elif n == 2:
                    name = v.decode()
                elif n == 3:
                    test_only = bool(v)
            kind = Select(operand, name, test_only)
        elif number == 6:
            target, function, args = None, "", []
            for n, _w, v in fields(value):
                if n == 1:
                    target = decode_expr(v)
                elif n == 2:
                    function = v.decode()
                elif n == 3:
                    args.append(decode_expr(v))
            kind = Call(function, args, target)
        elif number == 7:
            elements, optional = [], []
            for n, w, v in fields(value):
                if n == 1:
                    elements.append(decode_expr(v))
                elif n == 2:
                    optional.extend(_packed_ints(v) if w == 2 else [v])
            kind = CreateList(elements, optional)
        elif number == 8:
            message_name, entries = "", []
            for n, _w, v in fields(value):
                if n == 1:
                    message_name = v.decode()
                elif n == 2:
                    entries.append(_decode_entry(v))
            kind = CreateStruct(message_name, entries)
        elif number == 9:
            parts: dict[int, object] = {}
            for n, _w, v in fields(value):
                parts[n] = v.decode() if n in (1, 3, 8) else decode_expr(v)
            kind = Comprehension(
                parts.get(1, ""), parts.get(2), parts.get(3, ""), parts.get(4), parts.get(5), parts.get(6), parts.get(7),
                parts.get(8, ""),
            )
    if kind is None:
        raise ValueError(f"expression {expr_id} has no kind")
    return Expr(expr_id, kind)


def _packed_ints(data: bytes) -> list[int]:
    out, pos = [], 0
    while pos < len(data):
        value, pos = _varint(data, pos)
        out.append(value)
    return out


def _decode_entry(data: bytes) -> Entry:
    entry = Entry(0, None)
    for n, _w, v in fields(data):
        if n == 1:
            entry.id = v
        elif n == 2:
            entry.field_key = v.decode()
        elif n == 3:
            entry.map_key = decode_expr(v)
        elif n == 4:
            entry.value = decode_expr(v)
        elif n == 5:
            entry.optional = bool(v)
    return entry


def encode_expr(expr: Expr) -> bytes:
    out = bytearray()
    _put_int(out, 2, expr.id)
    k = expr.kind
    body = bytearray()
    if isinstance(k, Constant):
        if k.kind == "null":
            _put_int(body, 1, 0)
        elif k.kind == "bool":
            _put_int(body, 2, int(bool(k.value)))
        elif k.kind == "int":
            _put_int(body, 3, k.value)
        elif k.kind == "uint":
            _put_int(body, 4, k.value)
        elif k.kind == "double":
            _put_tag(body, 5, 1)
            body += struct.pack("<d", k.value)
        elif k.kind == "string":
            _put_bytes(body, 6, k.value.encode())
        elif k.kind == "bytes":
            _put_bytes(body, 7, k.value)
        _put_bytes(out, 3, bytes(body))
    elif isinstance(k, Ident):
        _put_bytes(body, 1, k.name.encode())
        _put_bytes(out, 4, bytes(body))
    elif isinstance(k, Select):
        _put_bytes(body, 1, encode_expr(k.operand))
        _put_bytes(body, 2, k.field.encode())
        if k.test_only:
            _put_int(body, 3, 1)
        _put_bytes(out, 5, bytes(body))
    elif isinstance(k, Call):
        if k.target is not None:
            _put_bytes(body, 1, encode_expr(k.target))
        _put_bytes(body, 2, k.function.encode())
        for arg in k.args:
            _put_bytes(body, 3, encode_expr(arg))
        _put_bytes(out, 6, bytes(body))
    elif isinstance(k, CreateList):
        for element in k.elements:
            _put_bytes(body, 1, encode_expr(element))
        for index in k.optional_indices:
            _put_int(body, 2, index)
        _put_bytes(out, 7, bytes(body))
    elif isinstance(k, CreateStruct):
        if k.message_name:
            _put_bytes(body, 1, k.message_name.encode())
        for entry in k.entries:
            e = bytearray()
            _put_int(e, 1, entry.id)
            if entry.field_key is not None:
                _put_bytes(e, 2, entry.field_key.encode())
            if entry.map_key is not None:
                _put_bytes(e, 3, encode_expr(entry.map_key))
            _put_bytes(e, 4, encode_expr(entry.value))
            if entry.optional:
                _put_int(e, 5, 1)
            _put_bytes(body, 2, bytes(e))
        _put_bytes(out, 8, bytes(body))
    elif isinstance(k, Comprehension):
        _put_bytes(body, 1, k.iter_var.encode())
        _put_bytes(body, 2, encode_expr(k.iter_range))
        _put_bytes(body, 3, k.accu_var.encode())
        _put_bytes(body, 4, encode_expr(k.accu_init))
        _put_bytes(body, 5, encode_expr(k.loop_condition))
        _put_bytes(body, 6, encode_expr(k.loop_step))
        _put_bytes(body, 7, encode_expr(k.result))
        if k.iter_var2:
            _put_bytes(body, 8, k.iter_var2.encode())
        _put_bytes(out, 9, bytes(body))
    return bytes(out)


# --- types (cel.expr.Type, for the checked type map) --------------------------------------------------

_PRIMITIVES = {1: "bool", 2: "int", 3: "uint", 4: "double", 5: "string", 6: "bytes"}
_WELL_KNOWN = {1: "any", 2: "google.protobuf.Timestamp", 3: "google.protobuf.Duration"}


@dataclass(frozen=True)
class CelType:
    """A checked type: name ("int", "list", "map", "dyn", "kubernetes.Quantity", ...) and parameters."""

    name: str
    params: tuple["CelType", ...] = ()

    def __str__(self) -> str:
        if self.params:
            return f"{self.name}({', '.join(str(p) for p in self.params)})"
        return self.name


DYN = CelType("dyn")


def decode_type(data: bytes) -> CelType:
    for number, _wire, value in fields(data):
        if number == 1:
            return DYN
        if number == 2:
            return CelType("null_type")
        if number == 3:
            return CelType(_PRIMITIVES.get(value, "dyn"))
        if number == 4:
            return CelType("wrapper", (CelType(_PRIMITIVES.get(value, "dyn")),))
        if number == 5:
            return CelType(_WELL_KNOWN.get(value, "dyn"))
        if number == 6:
            elem = next((decode_type(v) for n, _w, v in fields(value) if n == 1), DYN)
            return CelType("list", (elem,))
        if number == 7:
            key, val = DYN, DYN
            for n, _w, v in fields(value):
                if n == 1:
                    key = decode_type(v)
                elif n == 2:
                    val = decode_type(v)
            return CelType("map", (key, val))
        if number == 8:
            return CelType("function")
        if number == 9:
            return CelType(value.decode())
        if number == 10:
            return CelType("type_param:" + value.decode())
        if number == 11:
            return CelType("type", (decode_type(value),))
        if number == 12:
            return CelType("error")
        if number == 14:
            name, params = "", []
            for n, _w, v in fields(value):
                if n == 1:
                    name = v.decode()
                elif n == 2:
                    params.append(decode_type(v))
            return CelType(name, tuple(params))
    return DYN


# --- parsed and checked expressions ---------------------------------------------------------------------

_ANY_PARSED = "type.googleapis.com/cel.expr.ParsedExpr"
_ANY_CHECKED = "type.googleapis.com/cel.expr.CheckedExpr"


@dataclass
class Reference:
    name: str = ""
    overload_ids: tuple[str, ...] = ()


@dataclass
class ParsedAst:
    expr: Expr
    source_info: bytes
    types: dict[int, CelType] = field(default_factory=dict)
    references: dict[int, Reference] = field(default_factory=dict)
    checked: bool = False

    def max_id(self) -> int:
        return max(node.id for node in self.expr.walk())


def _unwrap_any(serialized: bytes) -> tuple[str, bytes]:
    type_url, payload = "", b""
    for number, _wire, value in fields(serialized):
        if number == 1:
            type_url = value.decode()
        elif number == 2:
            payload = bytes(value)
    return type_url, payload


def _decode_map_entry(data: bytes) -> tuple[int, bytes]:
    key, value = 0, b""
    for n, _w, v in fields(data):
        if n == 1:
            key = v
        elif n == 2:
            value = v
    return key, value


def decode_serialized(serialized: bytes) -> ParsedAst:
    """Read what cel-expr-python's Expression.serialize() returns."""
    type_url, payload = _unwrap_any(serialized)
    if type_url not in (_ANY_PARSED, _ANY_CHECKED):
        raise ValueError(f"unexpected serialized expression type {type_url!r}")
    checked = type_url == _ANY_CHECKED
    expr, source_info = None, b""
    types: dict[int, CelType] = {}
    references: dict[int, Reference] = {}
    for number, _wire, value in fields(payload):
        if checked:
            if number == 4:
                expr = decode_expr(value)
            elif number == 5:
                source_info = bytes(value)
            elif number == 3:
                key, type_bytes = _decode_map_entry(value)
                types[key] = decode_type(type_bytes)
            elif number == 2:
                key, ref_bytes = _decode_map_entry(value)
                ref = Reference()
                overloads = []
                for n, _w, v in fields(ref_bytes):
                    if n == 1:
                        ref.name = v.decode()
                    elif n == 3:
                        overloads.append(v.decode())
                ref.overload_ids = tuple(overloads)
                references[key] = ref
        else:
            if number == 2:
                expr = decode_expr(value)
            elif number == 3:
                source_info = bytes(value)
    if expr is None:
        raise ValueError("serialized expression holds no expression")
    return ParsedAst(expr, source_info, types, references, checked)


def encode_parsed(ast: ParsedAst) -> bytes:
    """A google.protobuf.Any holding cel.expr.ParsedExpr, for Env.deserialize()."""
    payload = bytearray()
    _put_bytes(payload, 2, encode_expr(ast.expr))
    if ast.source_info:
        _put_bytes(payload, 3, ast.source_info)
    out = bytearray()
    _put_bytes(out, 1, _ANY_PARSED.encode())
    _put_bytes(out, 2, bytes(payload))
    return bytes(out)


def source_positions(source_info: bytes) -> dict[int, int]:
    """Expression id -> offset (in code points) of the node in the expression text."""
    positions: dict[int, int] = {}
    for number, _wire, value in fields(source_info):
        if number == 4:
            key, offset = _decode_map_entry(value)
            positions[key] = _signed64(offset) if isinstance(offset, int) else 0
    return positions


def error_at(expression: str, offset: int, message: str) -> str:
    """cel-go's error layout: `ERROR: <input>:line:column: message` and the line with a caret."""
    line_start = expression.rfind("\n", 0, offset) + 1
    line_number = expression.count("\n", 0, offset) + 1
    column = offset - line_start
    line_end = expression.find("\n", offset)
    line_text = expression[line_start:] if line_end == -1 else expression[line_start:line_end]
    return f"ERROR: <input>:{line_number}:{column + 1}: {message}\n | {line_text}\n | {'.' * column}^"

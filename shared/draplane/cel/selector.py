"""Compiling and evaluating device selectors, with Kubernetes' checks and messages.

compile_selector() does what the apiserver's DRA CEL compiler does: length limit, parse, type check
against the device declaration and the Kubernetes libraries, result type bool (or the attribute's
unknown type), cost limit. A compiled program is cached per expression string.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache

from cel_expr_python import cel

from .ast import decode_serialized, encode_parsed
from .cost import estimate_cost
from .device import CELDevice
from .errors import CELCompileError, CELRuntimeError
from .library import DEVICE_FIELDS, new_checking_env, new_runtime_env
from .rewrite import rewrite_for_runtime
from . import library
from .program_checks import ProgramError, conversion_message, fold_constants, regex_error, validate_literals
from .static_checks import first_static_error
from .values import cel_type_name

# k8s.io/api/resource/v1: CELSelectorExpressionMaxLength and CELSelectorExpressionMaxCost.
MAX_EXPRESSION_LENGTH = 10 * 1024
MAX_SELECTOR_COST = 1_000_000

_envs_lock = threading.Lock()
_envs: tuple[cel.Env, cel.Env] | None = None


def _environments() -> tuple[cel.Env, cel.Env]:
    global _envs
    with _envs_lock:
        if _envs is None:
            _envs = (new_checking_env(), new_runtime_env())
            runtime_env = _envs[1]
            library.regex_check = lambda pattern: regex_error(pattern, runtime_env)
        return _envs


# `has(device.driver)` is always true in Kubernetes (the fields are required). The checker sees the
# fields as qualified identifiers, and cel-cpp types has() of a qualified identifier as the field's
# type instead of bool; the checking pass therefore reads it as `true`, padded to the same length so
# that columns in error messages stay those of the user's text.
_HAS_DEVICE_FIELD = re.compile(r"\bhas\s*\(\s*device\s*\.\s*(" + "|".join(DEVICE_FIELDS) + r")\s*\)")


def _for_checking(expression: str) -> tuple[str, int]:
    """The text the checker sees, and how many presence tests on device fields it replaced."""
    return _HAS_DEVICE_FIELD.subn(lambda m: "true".ljust(len(m.group(0))), expression)


class DeviceSelectorProgram:
    """A compiled selector. matches() evaluates it for one device."""

    __slots__ = ("expression", "max_cost", "_program", "_env")

    def __init__(self, expression: str, program: cel.Expression, env: cel.Env, max_cost: int):
        self.expression = expression
        # The estimated worst-case cost, as the apiserver computes it; at most MAX_SELECTOR_COST.
        self.max_cost = max_cost
        self._program = program
        self._env = env

    def __repr__(self) -> str:
        return f"DeviceSelectorProgram({self.expression!r})"

    def matches(self, device: CELDevice) -> bool:
        if device.invalid:
            raise CELRuntimeError(self.expression, device.invalid)
        activation = device._runtime
        if activation is None:
            activation = self._env.Activation({"device": device.cel_value()})
            object.__setattr__(device, "_runtime", activation)
        result = self._program.eval(activation)
        value = result.value()
        if value is True or value is False:
            return value
        if result.type() == cel.Type.ERROR:
            raise CELRuntimeError(self.expression, runtime_message(str(value)))
        # An attribute lookup type-checks as the unknown type; Kubernetes fails at evaluation when
        # the value turns out not to be a bool.
        type_name = "uint" if result.type() == cel.Type.UINT else cel_type_name(value)
        raise CELRuntimeError(
            self.expression,
            f"CEL result of type {type_name} could not be converted to bool: {_NOT_BOOL.get(type_name, '')}",
        )


# cel-go's ConvertToNative(bool) errors, type by type.
_NOT_BOOL = {
    "string": "unsupported native conversion from string to 'bool'",
    "int": "unsupported type conversion from 'int' to bool",
    "uint": "unsupported type conversion from 'uint' to bool",
    "double": "type conversion error from Double to 'bool'",
    "bytes": "type conversion error from Bytes to 'bool'",
    "list": "type conversion error from list to 'bool'",
    "map": "type conversion error from map to 'bool'",
    "null_type": "type conversion error from 'null_type' to 'bool'",
    "kubernetes.Quantity": "type conversion error from 'Quantity' to 'bool'",
    "kubernetes.Semver": "type conversion error from 'Semver' to 'bool'",
}


def compile_selector(expression: str) -> DeviceSelectorProgram:
    """Compile once per expression string; raise CELCompileError with the apiserver's reason."""
    if not isinstance(expression, str):
        raise CELCompileError(str(expression), f"expression must be a string, got {type(expression).__name__}", "syntax")
    return _compile_cached(expression)


# Cached per expression string; failures are not cached and raise again each time.
compile_selector.cache_clear = lambda: _compile_cached.cache_clear()  # type: ignore[attr-defined]


@lru_cache(maxsize=4096)
def _compile_cached(expression: str) -> DeviceSelectorProgram:
    size = len(expression.encode())
    if size > MAX_EXPRESSION_LENGTH:
        # field.TooLong's wording; Go's len() counts bytes.
        raise CELCompileError(
            expression, f"may not be more than {MAX_EXPRESSION_LENGTH} bytes (the expression has {size})", "length"
        )
    checking_env, runtime_env = _environments()
    try:
        checking_text, replaced_presence_tests = _for_checking(expression)
        checked = checking_env.compile(checking_text)
    except RuntimeError as err:
        message = compile_message(str(err), expression)
        reason = "syntax" if "Syntax error" in message else "type"
        raise CELCompileError(expression, "compilation failed: " + message, reason) from None
    checked_ast = decode_serialized(checked.serialize())
    # In the apiserver's order: the checker's own validators, the result type, building the
    # program, and the cost estimate.
    static_error = first_static_error(checked_ast, expression)
    if static_error:
        raise CELCompileError(expression, "compilation failed: " + static_error)
    try:
        validate_literals(checked_ast, expression, runtime_env)
    except ProgramError as err:
        raise CELCompileError(expression, err.message) from None
    result_type = checked_ast.types.get(checked_ast.expr.id)
    if result_type is not None and result_type.name not in ("bool", "dyn"):
        raise CELCompileError(expression, f"must evaluate to bool or the unknown type, not {result_type}", "result")
    try:
        fold_constants(checked_ast, runtime_env)
    except ProgramError as err:
        raise CELCompileError(expression, err.message) from None
    # Each replaced has(device.f) costs what cel-go charges for it: the identifier `device`.
    min_cost, max_cost = estimate_cost(checked_ast)
    max_cost = min(max_cost + replaced_presence_tests, 2**64 - 1)
    if max_cost > MAX_SELECTOR_COST:
        raise CELCompileError(
            expression,
            f"too complex, exceeds cost limit (estimated worst-case cost {max_cost}, limit {MAX_SELECTOR_COST})",
            "cost",
        )
    try:
        # Parsed from the checker's text, so that node ids match the checked types; the replaced
        # has(device.f) are `true`, which they always are.
        parsed = decode_serialized(runtime_env.compile(checking_text, disable_check=True).serialize())
        overloads = {node_id: ref.overload_ids for node_id, ref in checked_ast.references.items()}
        parsed.expr = rewrite_for_runtime(parsed.expr, parsed.max_id() + 1, checked_ast.types, overloads)
        program = runtime_env.deserialize(encode_parsed(parsed))
    except (RuntimeError, ValueError) as err:  # the checker accepted it, so this is draplane's fault
        raise CELCompileError(expression, "internal error preparing the expression: " + str(err), "internal") from None
    return DeviceSelectorProgram(expression, program, runtime_env, max_cost)


# --- messages -------------------------------------------------------------------------------------

_STATUS_PREFIX = re.compile(r"^[A-Z_]+: ")
_STATUS_SUFFIX = re.compile(r"\s*\[[A-Z_]+\]$")
_OVERLOAD = re.compile(r"found no matching overload for '([^']+)' applied to '\((.*)\)'")
_LOCATION = re.compile(r"<input>:(\d+):(\d+): ")
_UNDECLARED_DEVICE_FIELD = re.compile(r"undeclared reference to 'device\.([A-Za-z0-9_]+)' \(in container ''\)")


def compile_message(raw: str, expression: str) -> str:
    """cel-cpp's checker text in cel-go's wording, which is what the apiserver prints."""
    text = _STATUS_SUFFIX.sub("", _STATUS_PREFIX.sub("", raw.strip()))
    if not expression:
        # cel-go reports the end of an empty input at column 0.
        text = text.replace("<input>:1:1: ", "<input>:1:0: ", 1)
    lines = text.split("\n")
    out: list[str] = []
    for line in lines:
        location = _LOCATION.search(line)
        overload = _OVERLOAD.search(line)
        if location and overload:
            source_line = expression.split("\n")[int(location.group(1)) - 1] if expression else ""
            column = int(location.group(2)) - 1
            line = line[: overload.start()] + _overload_text(
                overload.group(1), overload.group(2), _is_member_call(source_line, column, overload.group(1))
            ) + line[overload.end():]
        line = _UNDECLARED_DEVICE_FIELD.sub(lambda m: f"undefined field '{m.group(1)}'", line)
        if line.startswith("ERROR"):
            line = line.replace("*error*", "!error!")  # cel-go's name for the error type
            line = _TYPE_PARAM.sub("dyn", line)  # cel-go prints an unresolved type parameter as dyn
        out.append(line)
    return "\n".join(out)


def _split_types(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "(<":
            depth += 1
        elif ch in ")>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def _overload_text(function: str, args: str, member: bool) -> str:
    types = _split_types(args)
    if member and types:
        signature = f"{types[0]}.({', '.join(types[1:])})"
    else:
        signature = f"({', '.join(types)})"
    return f"found no matching overload for '{function}' applied to '{signature}'"


def _is_member_call(text: str, column: int, function: str) -> bool:
    """The checker points at the call's '(' in this line; a member call has `.function` before it."""
    if function.startswith("_"):  # operators are never member calls
        return False
    end = min(column, len(text))
    while end > 0 and text[end - 1].isspace():
        end -= 1
    start = end
    while start > 0 and (text[start - 1].isalnum() or text[start - 1] == "_"):
        start -= 1
    if text[start:end] != function.rsplit(".", 1)[-1]:
        return False
    while start > 0 and text[start - 1].isspace():
        start -= 1
    return start > 0 and text[start - 1] == "."


_TYPE_PARAM = re.compile(r"\bT%\d+\b")
_KEY_NOT_FOUND = re.compile(r'Key not found in map\s*:\s*"?(.*?)"?$')
_NO_OVERLOAD = re.compile(r"No matching overloads found")


def runtime_message(raw: str) -> str:
    """cel-cpp's evaluation errors in cel-go's words, with Kubernetes' hint for missing keys."""
    text = _STATUS_PREFIX.sub("", raw.strip())
    key = _KEY_NOT_FOUND.search(text)
    if key:
        return (
            f"no such key: {key.group(1)}. consider using CEL optional chaining (.? followed by orValue()) "
            "or guarding the check with has() for optional fields"
        )
    if _NO_OVERLOAD.search(text):
        return "no such overload"
    if text == "divide by zero":
        return "division by zero"
    index = _INDEX_ERROR.search(text)
    if index:
        return f"index out of bounds: {index.group(1)}"
    return conversion_message(text)


_INDEX_ERROR = re.compile(r"^Index error: index=(-?\d+)")

"""What cel-go does to a checked expression before it can run, and cel-cpp does not.

The apiserver's environment validates literals (cel.ValidateRegexLiterals, ValidateDurationLiterals,
ValidateTimestampLiterals): `"a".matches("(")` fails to compile with "invalid matches argument".
Its programs are built with cel.OptOptimize, which evaluates type conversions of constants while
building the program and compiles constant regular expressions of matches(), find() and findAll():
`int("x")` or `"a".find("(")` fail with "program instantiation failed: ...", before any device is
looked at. draplane answers the same at compile time, evaluating the constant parts with the C++
runtime (whose regular expressions are RE2, as Go's are).
"""

from __future__ import annotations

import re

from cel_expr_python import cel

from .ast import Call, Constant, CreateList, CreateStruct, Expr, ParsedAst, encode_parsed, error_at, source_positions

# overloads.IsTypeConversionFunction
CONVERSIONS = {"bool", "bytes", "double", "duration", "dyn", "int", "string", "timestamp", "type", "uint"}


class ProgramError(Exception):
    """`message` is the apiserver's whole text ("compilation failed: ..." or "program instantiation failed: ...")."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def validate_literals(ast: ParsedAst, expression: str, runtime_env: cel.Env) -> None:
    """The checker's literal validators: ProgramError with "compilation failed: ..."."""
    _validate_literals(ast, expression, source_positions(ast.source_info), runtime_env)


def fold_constants(ast: ParsedAst, runtime_env: cel.Env) -> None:
    """Building the program: ProgramError with "program instantiation failed: ..."."""
    _fold(ast.expr, set(), ast, runtime_env)


def _string_literal(node: Expr | None) -> str | None:
    if node is not None and isinstance(node.kind, Constant) and node.kind.kind == "string":
        return node.kind.value
    return None


def _evaluate(node: Expr, ast: ParsedAst, runtime_env: cel.Env):
    """The value of a constant subexpression, or the error text the C++ runtime gives."""
    sub = ParsedAst(node, ast.source_info)
    result = runtime_env.deserialize(encode_parsed(sub)).eval(data={})
    if result.type() == cel.Type.ERROR:
        return None, re.sub(r"^[A-Z_]+: ", "", str(result.value()))
    return result, None


_MATCHES_PROGRAMS: dict[int, cel.Expression] = {}


def regex_error(pattern: str, runtime_env: cel.Env) -> str | None:
    """RE2's message for an invalid pattern, else None."""
    program = _MATCHES_PROGRAMS.get(id(runtime_env))
    if program is None:
        program = _MATCHES_PROGRAMS[id(runtime_env)] = runtime_env.compile('"".matches(p)', disable_check=True)
    result = program.eval(data={"p": pattern})
    if result.type() == cel.Type.ERROR:
        return re.sub(r"^[A-Z_]+: ", "", str(result.value()))
    return None


def _validate_literals(ast: ParsedAst, expression: str, positions: dict[int, int], runtime_env: cel.Env) -> None:
    for node in ast.expr.walk():
        kind = node.kind
        if not isinstance(kind, Call):
            continue
        if kind.function == "matches" and kind.target is not None and len(kind.args) == 1:
            pattern = _string_literal(kind.args[0])
            if pattern is not None and regex_error(pattern, runtime_env):
                raise ProgramError(
                    "compilation failed: " + error_at(expression, positions.get(kind.args[0].id, 0), "invalid matches argument")
                )
        if kind.function in ("duration", "timestamp") and kind.target is None and len(kind.args) == 1:
            if _string_literal(kind.args[0]) is not None and _evaluate(node, ast, runtime_env)[1] is not None:
                raise ProgramError(
                    "compilation failed: "
                    + error_at(expression, positions.get(kind.args[0].id, 0), f"invalid {kind.function} argument")
                )


def _fold(node: Expr, constant: set[int], ast: ParsedAst, runtime_env: cel.Env) -> None:
    """Post-order, as the planner decorates: a conversion of a constant is evaluated now."""
    for child in node.children():
        _fold(child, constant, ast, runtime_env)
    kind = node.kind
    if isinstance(kind, Constant):
        constant.add(node.id)
    elif isinstance(kind, CreateList):
        if all(e.id in constant for e in kind.elements):
            constant.add(node.id)
    elif isinstance(kind, CreateStruct) and not kind.message_name:
        if all(e.map_key.id in constant and e.value.id in constant for e in kind.entries):
            constant.add(node.id)
    elif isinstance(kind, Call):
        if kind.function in CONVERSIONS and kind.target is None and len(kind.args) == 1 and kind.args[0].id in constant:
            _, error = _evaluate(node, ast, runtime_env)
            if error is not None:
                raise ProgramError("program instantiation failed: " + conversion_message(error))
            constant.add(node.id)
            return
        pattern = None
        if kind.function in ("find", "findAll") and kind.target is not None and kind.args:
            pattern = _string_literal(kind.args[0])
        elif kind.function == "matches" and kind.target is None and len(kind.args) == 2:
            pattern = _string_literal(kind.args[1])
        if pattern is not None:
            error = regex_error(pattern, runtime_env)
            if error is not None:
                raise ProgramError("program instantiation failed: " + go_regexp_message(error, pattern))


_CONVERSION_MESSAGES = [
    (re.compile(r"^cannot convert string to (int|uint|double)$"), r"type conversion error from 'string' to '\1'"),
    (re.compile(r"^(int64|double) out of uint64 range$"), "unsigned integer overflow"),
    (re.compile(r"^(uint64|double) out of int64 range$"), "integer overflow"),
    (re.compile(r"^Type conversion error from '(\w+)' to '(\w+)'$"), r"type conversion error from '\1' to '\2'"),
    (re.compile(r"^malformed UTF-8 bytes$"), "invalid UTF-8 in bytes, cannot convert to string"),
]


def conversion_message(text: str) -> str:
    """cel-cpp's conversion errors in cel-go's words."""
    for pattern, replacement in _CONVERSION_MESSAGES:
        if pattern.match(text):
            return pattern.sub(replacement, text)
    return text


# RE2's texts (C++) and Go regexp/syntax's texts for the same errors.
_REGEXP_MESSAGES = {
    "missing )": "missing closing )",
    "missing ]": "missing closing ]",
    "unexpected )": "unexpected )",
    "trailing \\": "trailing backslash at end of expression",
    "invalid escape sequence": "invalid escape sequence",
    "invalid character class range": "invalid character class range",
    "invalid character class": "invalid character class",
    "missing argument to repetition operator": "missing argument to repetition operator",
    "bad repetition operator": "invalid nested repetition operator",
    "invalid repetition size": "invalid repeat count",
    "invalid perl operator": "invalid or unsupported Perl syntax",
    "invalid named capture group": "invalid named capture",
    "invalid UTF-8": "invalid UTF-8",
}


def go_regexp_message(re2_text: str, pattern: str) -> str:
    """`error parsing regexp: <code>: `<fragment>`` as Go writes it, from RE2's message."""
    text = re.sub(r"^invalid regular expression: ", "", re2_text)
    code, _, fragment = text.partition(": ")
    go_code = _REGEXP_MESSAGES.get(code, code)
    return f"error parsing regexp: {go_code}: `{fragment or pattern}`"

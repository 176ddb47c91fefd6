"""Kubernetes' CEL extension functions for device selectors, declared twice over.

The apiserver type-checks selectors against declared types (kubernetes.Quantity, kubernetes.Semver)
and evaluates them with Go implementations. cel-expr-python can type-check against abstract types
but cannot carry Python objects at run time, so draplane builds two environments from one table:

- the *checking* environment declares every overload with Kubernetes' types and no implementation;
  it gives compile-time errors the apiserver would give;
- the *runtime* environment declares the same names over the runtime representation (values.py:
  Quantity and Semver as tagged bytes) with Python implementations, and evaluates the expression
  that the checking environment accepted.

Functions whose Quantity and Semver overloads share a name (isGreaterThan, isLessThan, compareTo)
get one runtime overload that dispatches on the tag, as the Go runtime dispatches on the value.
"""

from __future__ import annotations

import math
import re2
from functools import lru_cache

from cel_expr_python import cel

from draplane.api.quantity import QuantityError

from .errors import CELFunctionError
from .kube_quantity import KubeQuantity, parse_kube_quantity
from .program_checks import go_regexp_message
from .semver import SemverError, parse_semver, parse_semver_normalized
from . import network
from .rewrite import LIST_INDEX_OF, LIST_LAST_INDEX_OF, MAP_INSERT, NET_TO_STRING, ORDERED, OPAQUE_EQUALS, OPAQUE_NOT_EQUALS, OPAQUE_SIZE, OPAQUE_STRING
from .values import (
    QUANTITY_TAG,
    SEMVER_TAG,
    cel_type_name,
    decode_quantity,
    decode_semver,
    encode_quantity,
    encode_semver,
)

T = cel.Type
QUANTITY = T.AbstractType("kubernetes.Quantity")
SEMVER = T.AbstractType("kubernetes.Semver")
IP = T.AbstractType("net.IP")
CIDR = T.AbstractType("net.CIDR")


# Kubernetes' base environment for stored expressions (k8s.io/apiserver/pkg/cel/environment,
# v1.37): strings v2, sets, lists v3, two-variable comprehensions, optional types; the DRA
# compiler adds cel.bind. cel-cpp names these extensions in its environment configuration.
_EXTENSIONS_YAML = """
extensions:
  - name: "sets"
  - name: "lists"
  - name: "two-var-comprehensions"
  - name: "optional"
  - name: "bindings"
"""
_STRINGS_EXTENSION_YAML = """
  - name: "strings"
    version: 2
"""


def _type_yaml(name: str) -> str:
    if name == "A":
        return '{type_name: "A", is_type_param: true}'
    if name == "list(A)":
        return '{type_name: "list", params: [{type_name: "A", is_type_param: true}]}'
    if name.startswith("list("):
        return f'{{type_name: "list", params: [{{type_name: "{name[5:-1]}"}}]}}'
    return f'{{type_name: "{name}"}}'


# The checking environment declares the strings extension (version 2) itself, with cel-go's
# overload ids, because cel-cpp's extension owns indexOf and lastIndexOf and Kubernetes' lists
# library adds list overloads to both names. (name, overload id, target or None, args, result)
_STRINGS_AND_LIST_SEARCH = [
    ("charAt", "string_char_at_int", "string", ["int"], "string"),
    ("indexOf", "string_index_of_string", "string", ["string"], "int"),
    ("indexOf", "string_index_of_string_int", "string", ["string", "int"], "int"),
    ("indexOf", "list_a_index_of_int", "list(A)", ["A"], "int"),
    ("lastIndexOf", "string_last_index_of_string", "string", ["string"], "int"),
    ("lastIndexOf", "string_last_index_of_string_int", "string", ["string", "int"], "int"),
    ("lastIndexOf", "list_a_last_index_of_int", "list(A)", ["A"], "int"),
    ("lowerAscii", "string_lower_ascii", "string", [], "string"),
    ("upperAscii", "string_upper_ascii", "string", [], "string"),
    ("replace", "string_replace_string_string", "string", ["string", "string"], "string"),
    ("replace", "string_replace_string_string_int", "string", ["string", "string", "int"], "string"),
    ("split", "string_split_string", "string", ["string"], "list(string)"),
    ("split", "string_split_string_int", "string", ["string", "int"], "list(string)"),
    ("substring", "string_substring_int", "string", ["int"], "string"),
    ("substring", "string_substring_int_int", "string", ["int", "int"], "string"),
    ("trim", "string_trim", "string", [], "string"),
    ("join", "list_join", "list(string)", [], "string"),
    ("join", "list_join_string", "list(string)", ["string"], "string"),
    ("format", "string_format", "string", ["list(dyn)"], "string"),
    ("strings.quote", "strings_quote", None, ["string"], "string"),
]


def _strings_functions_yaml() -> str:
    lines = ["functions:"]
    names: dict[str, list[str]] = {}
    for name, overload_id, target, args, result in _STRINGS_AND_LIST_SEARCH:
        entry = [f'      - id: "{overload_id}"']
        if target is not None:
            entry.append(f"        target: {_type_yaml(target)}")
        if args:
            entry.append(f"        args: [{', '.join(_type_yaml(a) for a in args)}]")
        entry.append(f"        return: {_type_yaml(result)}")
        names.setdefault(name, []).extend(entry)
    for name, entries in names.items():
        lines.append(f'  - name: "{name}"')
        lines.append("    overloads:")
        lines.extend(entries)
    return "\n".join(lines) + "\n"


def _no_such_overload(function: str, *args: object) -> CELFunctionError:
    return CELFunctionError(f"no such overload: {function}(" + ", ".join(cel_type_name(a) for a in args) + ")")


def _as_bytes(value: object) -> bytes | None:
    # The C++ runtime hands bytes to Python as bytearray.
    if isinstance(value, bytearray):
        return bytes(value)
    return value if isinstance(value, bytes) else None


def _quantity(value: object, function: str = "quantity", *others: object) -> KubeQuantity:
    encoded = _as_bytes(value)
    quantity = decode_quantity(encoded) if encoded is not None else None
    if quantity is None:
        raise _no_such_overload(function, value, *others)
    return quantity


# --- quantity library (k8s.io/apiserver/pkg/cel/library/quantity.go) ----------------------------


def _string_to_quantity(text: str) -> bytes:
    try:
        return encode_quantity(parse_kube_quantity(text))
    except QuantityError as err:
        raise CELFunctionError(str(err)) from None


def _is_quantity(text: str) -> bool:
    try:
        parse_kube_quantity(text)
    except QuantityError:
        return False
    return True


def _quantity_sign(value: bytes) -> int:
    return _quantity(value, "sign").sign()


def _quantity_is_integer(value: bytes) -> bool:
    return _quantity(value, "isInteger").as_int64() is not None


def _quantity_as_integer(value: bytes) -> int:
    result = _quantity(value, "asInteger").as_int64()
    if result is None:
        raise CELFunctionError("cannot convert value to integer")
    return result


def _quantity_as_float(value: bytes) -> float:
    return _quantity(value, "asApproximateFloat").as_approximate_float()


def _operand(right: object, function: str, left: object) -> KubeQuantity:
    if isinstance(right, int) and not isinstance(right, bool):
        # resource.NewQuantity(n, DecimalExponent): the int64 form at scale 0.
        return KubeQuantity("int", right, 0)
    return _quantity(right, function, left)


def _quantity_add(left: bytes, right: bytes | int) -> bytes:
    return encode_quantity(_quantity(left, "add", right).add(_operand(right, "add", left)))


def _quantity_sub(left: bytes, right: bytes | int) -> bytes:
    return encode_quantity(_quantity(left, "sub", right).sub(_operand(right, "sub", left)))


# --- semver library (k8s.io/apiserver/pkg/cel/library/semverlib.go) -----------------------------


def _string_to_semver(text: str, normalize: bool = False) -> bytes:
    try:
        version = parse_semver_normalized(text) if normalize else parse_semver(text)
    except SemverError as err:
        raise CELFunctionError(str(err)) from None
    return encode_semver(version)


def _is_semver(text: str, normalize: bool = False) -> bool:
    try:
        parse_semver_normalized(text) if normalize else parse_semver(text)
    except SemverError:
        return False
    return True


def _int64(value: int) -> int:
    """types.Int(uint64): Go wraps a version number above 2^63-1 around to a negative int."""
    return (value + 2**63) % 2**64 - 2**63


def _semver(value: object, function: str):
    encoded = _as_bytes(value)
    version = decode_semver(encoded) if encoded is not None else None
    if version is None:
        raise _no_such_overload(function, value)
    return version


# --- shared by both: ordering ---------------------------------------------------------------------


def _compare(left: object, right: object, function: str = "compareTo") -> int:
    left_bytes, right_bytes = _as_bytes(left), _as_bytes(right)
    if left_bytes is not None and right_bytes is not None:
        lq, rq = decode_quantity(left_bytes), decode_quantity(right_bytes)
        if lq is not None and rq is not None:
            return lq.compare(rq)
        ls, rs = decode_semver(left_bytes), decode_semver(right_bytes)
        if ls is not None and rs is not None:
            return ls.compare(rs)
    raise _no_such_overload(function, left, right)


def _is_greater_than(left: object, right: object) -> bool:
    return _compare(left, right, "isGreaterThan") == 1


def _is_less_than(left: object, right: object) -> bool:
    return _compare(left, right, "isLessThan") == -1


# --- Kubernetes' lists and regex libraries (library/lists.go, library/regex.go) ---------------------



def _list_is_sorted(values: list) -> bool:
    return all(not (values[i] > values[i + 1]) for i in range(len(values) - 1))


def _list_sum(values: list):
    total = 0.0 if values and isinstance(values[0], float) else 0
    for value in values:
        total += value
    return total


def _list_extreme(name: str, prefer):
    def pick(values: list):
        if not values:
            raise CELFunctionError(f"{name} called on empty list")
        result = values[0]
        for value in values[1:]:
            if prefer(value, result):
                result = value
        return result

    return pick


# Set by selector.py once the runtime environment exists: RE2's verdict on a pattern (None if valid).
regex_check = None


@lru_cache(maxsize=1024)
def _compile_regex(pattern: str):
    """Go's regexp is RE2: the pattern must be valid RE2, and \\d, \\w, \\s, \\b are ASCII-only.

    Matched with RE2 itself, in linear time: Python's backtracking `re` took seconds on
    `"aaaaaaaaaaaaaaaaaaaaaaaa!".find("(a+)+$")` and doubled with every `a`, and a selector's cost
    estimate counts a regex match as linear in the string, as RE2 is."""
    problem = regex_check(pattern) if regex_check is not None else None
    if problem is not None:
        raise CELFunctionError(f"Illegal regex: {go_regexp_message(problem, pattern)}")
    try:
        return re2.compile(pattern)
    except re2.error as err:
        raise CELFunctionError(f"Illegal regex: {err}") from None


def _string_find(text: str, pattern: str) -> str:
    match = _compile_regex(pattern).search(text)
    return match.group(0) if match else ""


def _string_find_all(text: str, pattern: str, limit: int = -1) -> list[str]:
    # Go's FindAllString drops an empty match that abuts the match before it, which Python's
    # finditer keeps: "baaab" and a* give ["", "aaa", ""] there, not ["", "aaa", "", ""].
    found: list[str] = []
    previous_end = None
    for match in _compile_regex(pattern).finditer(text):
        if match.start() == match.end() == previous_end:
            continue
        previous_end = match.end()
        found.append(match.group(0))
    return found if limit < 0 else found[:limit]


# --- equality of a byte-encoded left operand, as cel-go's Semver.Equal / Quantity.Equal -----------


def _opaque_equals(left: object, right: object) -> bool:
    left_bytes, right_bytes = _as_bytes(left), _as_bytes(right)
    if left_bytes.startswith(QUANTITY_TAG):
        right_quantity = decode_quantity(right_bytes) if right_bytes is not None else None
        # add() and sub() return *Quantity in Kubernetes, and Quantity.Equal rejects a pointer.
        if right_quantity is None or right_quantity.pointer:
            raise CELFunctionError("no such overload")
        return decode_quantity(left_bytes).compare(right_quantity) == 0
    if left_bytes.startswith(SEMVER_TAG):
        if right_bytes is None or not right_bytes.startswith(SEMVER_TAG):
            raise CELFunctionError("no such overload")
        return left_bytes == right_bytes
    return right_bytes is not None and left_bytes == right_bytes  # real bytes


def _opaque_not_equals(left: object, right: object) -> bool:
    """cel-go's != is true whenever Equal is not true, an error included."""
    try:
        return not _opaque_equals(left, right)
    except CELFunctionError:
        return True


def _opaque_size(value: object) -> int:
    encoded = _as_bytes(value)
    if encoded.startswith(QUANTITY_TAG) or encoded.startswith(SEMVER_TAG):
        raise CELFunctionError("no such overload: size")
    return len(encoded)


def _opaque_string(value: object) -> str:
    encoded = _as_bytes(value)
    if encoded.startswith(QUANTITY_TAG) or encoded.startswith(SEMVER_TAG):
        raise CELFunctionError(f"no such overload: string({cel_type_name(encoded)})")
    try:
        return encoded.decode()
    except UnicodeDecodeError:
        raise CELFunctionError("invalid UTF-8 in bytes, cannot convert to string") from None


# --- strings extension functions where cel-cpp and cel-go disagree (rewrite.py CEL_GO_STRINGS) ----
# cel-go's ext/strings.go (version 2, as Kubernetes configures it), in runes.


def _out_of_range(index: int) -> CELFunctionError:
    return CELFunctionError(f"index out of range: {index}")


def _substring(text: str, start: int, end: int | None = None) -> str:
    size = len(text)
    if end is None:
        if start < 0 or start > size:
            raise _out_of_range(start)
        return text[start:]
    if start > end:
        raise CELFunctionError(f"invalid substring range. start: {start}, end: {end}")
    if start < 0 or start > size:
        raise _out_of_range(start)
    if end < 0 or end > size:
        raise _out_of_range(end)
    return text[start:end]


def _index_of(text: str, sub: str, offset: int = 0) -> int:
    if offset < 0:
        raise _out_of_range(offset)
    if sub == "":
        return min(offset, len(text))
    if offset >= len(text):
        return -1
    return text.find(sub, offset)


def _last_index_of(text: str, sub: str, offset: int | None = None) -> int:
    if offset is None:
        if sub == "":
            return len(text)
        # cel-go compares byte lengths here.
        if len(text.encode()) < len(sub.encode()):
            return -1
        offset = len(text) - 1
    if offset < 0:
        raise _out_of_range(offset)
    if sub == "":
        return min(offset, len(text))
    if offset >= len(text):
        return -1
    return text.rfind(sub, 0, min(offset, len(text) - len(sub)) + len(sub))


def _split(text: str, separator: str, limit: int = -1) -> list[str]:
    """Go's strings.SplitN: n == 0 gives no parts, n < 0 all of them, "" splits into runes."""
    if limit == 0:
        return []
    if separator == "":
        runes = list(text)
        if limit < 0 or limit >= len(runes):
            return runes
        return runes[: limit - 1] + ["".join(runes[limit - 1:])]
    return text.split(separator) if limit < 0 else text.split(separator, limit - 1)


# --- orderings with a double, as cel-go compares (common/types: compareDouble*, NaN fails) -------------


def _order(left: object, right: object) -> int:
    if isinstance(left, float) and math.isnan(left) or isinstance(right, float) and math.isnan(right):
        raise CELFunctionError("NaN values cannot be ordered")
    if isinstance(left, float) and not isinstance(right, float):
        return -_order_number_double(right, left)
    if isinstance(right, float) and not isinstance(left, float):
        return _order_number_double(left, right)
    return (left > right) - (left < right)


def _order_number_double(number: int, value: float) -> int:
    """An int or uint against a double: outside int64 range by value, else as doubles."""
    if value < -(2**63):
        return 1
    if value > 2**63 - 1:
        return -1
    as_double = float(number)
    return (as_double > value) - (as_double < value)


def _ordering(accept) -> object:
    return lambda left, right: accept(_order(left, right))


# --- Kubernetes' list indexOf / lastIndexOf (library/lists.go), reached through rewrite.py ----------


def _cel_equal(left: object, right: object) -> bool:
    """CEL's equality on runtime values: bool is not a number; quantities compare by value."""
    if isinstance(left, (bytes, bytearray)) and isinstance(right, (bytes, bytearray)):
        lq, rq = decode_quantity(bytes(left)), decode_quantity(bytes(right))
        if lq is not None and rq is not None:
            return lq.compare(rq) == 0
        return bytes(left) == bytes(right)
    if isinstance(left, bool) or isinstance(right, bool):
        return type(left) is type(right) and left == right
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(_cel_equal(a, b) for a, b in zip(left, right))
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(_cel_equal(left[k], right[k]) for k in left)
    return left == right


def _list_index_of(values: list, item: object) -> int:
    return next((i for i, value in enumerate(values) if _cel_equal(value, item)), -1)


def _list_last_index_of(values: list, item: object) -> int:
    return next((i for i in range(len(values) - 1, -1, -1) if _cel_equal(values[i], item)), -1)


# --- cel.@mapInsert, behind transformMap() and transformMapEntry() (cel-go ext/comprehensions.go) ---


def _map_insert_entry(target: dict, key: object, value: object) -> dict:
    if key in target:
        raise CELFunctionError(f"insert failed: key {_go_value(key)} already exists")
    result = dict(target)
    result[key] = value
    return result


def _map_insert_map(target: dict, entries: dict) -> dict:
    result = dict(target)
    for key, value in entries.items():
        if key in result:
            raise CELFunctionError(f"insert failed: key {_go_value(key)} already exists")
        result[key] = value
    return result


def _go_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# --- the declarations -------------------------------------------------------------------------------


def _checking_functions() -> list[cel.FunctionDecl]:
    """Kubernetes' overloads with Kubernetes' types; no implementations (never evaluated)."""

    def overload(overload_id: str, result: cel.Type, params: list[cel.Type], member: bool = False) -> cel.Overload:
        return cel.Overload(overload_id, return_type=result, parameters=params, is_member=member)

    S, B, I, D = T.STRING, T.BOOL, T.INT, T.DOUBLE
    Q, V = QUANTITY, SEMVER
    return [
        cel.FunctionDecl("quantity", [overload("string_to_quantity", Q, [S])]),
        cel.FunctionDecl("isQuantity", [overload("is_quantity_string", B, [S])]),
        cel.FunctionDecl("sign", [overload("quantity_sign", I, [Q])]),
        cel.FunctionDecl("asApproximateFloat", [overload("quantity_get_float", D, [Q], True)]),
        cel.FunctionDecl("asInteger", [overload("quantity_get_int", I, [Q], True)]),
        cel.FunctionDecl("isInteger", [overload("quantity_is_integer", B, [Q], True)]),
        cel.FunctionDecl(
            "add",
            [overload("quantity_add", Q, [Q, Q], True), overload("quantity_add_int", Q, [Q, I], True)],
        ),
        cel.FunctionDecl(
            "sub",
            [overload("quantity_sub", Q, [Q, Q], True), overload("quantity_sub_int", Q, [Q, I], True)],
        ),
        cel.FunctionDecl(
            "isGreaterThan",
            [overload("quantity_is_greater_than", B, [Q, Q], True), overload("semver_is_greater_than", B, [V, V], True)],
        ),
        cel.FunctionDecl(
            "isLessThan",
            [overload("quantity_is_less_than", B, [Q, Q], True), overload("semver_is_less_than", B, [V, V], True)],
        ),
        cel.FunctionDecl(
            "compareTo",
            [overload("quantity_compare_to", I, [Q, Q], True), overload("semver_compare_to", I, [V, V], True)],
        ),
        cel.FunctionDecl(
            "semver",
            [overload("string_to_semver", V, [S]), overload("string_bool_to_semver", V, [S, B])],
        ),
        cel.FunctionDecl(
            "isSemver",
            [overload("is_semver_string", B, [S]), overload("is_semver_string_bool", B, [S, B])],
        ),
        cel.FunctionDecl("major", [overload("semver_major", I, [V], True)]),
        cel.FunctionDecl("minor", [overload("semver_minor", I, [V], True)]),
        cel.FunctionDecl("patch", [overload("semver_patch", I, [V], True)]),
        *_ordering_with_cross_type_numerics(),
        *_lists_library_checking(),
        *_network_checking(),
        cel.FunctionDecl("find", [overload("string_find_string", S, [S, S], True)]),
        cel.FunctionDecl(
            "findAll",
            [
                overload("string_find_all_string", T.List(S), [S, S], True),
                overload("string_find_all_string_int", T.List(S), [S, S, I], True),
            ],
        ),
    ]


def _network_checking() -> list[cel.FunctionDecl]:
    """The ip and cidr libraries, and string() with their two overloads added."""

    def overload(overload_id: str, result: cel.Type, params: list[cel.Type], member: bool = False) -> cel.Overload:
        return cel.Overload(overload_id, return_type=result, parameters=params, is_member=member)

    S, B, I = T.STRING, T.BOOL, T.INT
    predicates = {
        "isUnspecified": "ip_is_unspecified", "isLoopback": "ip_is_loopback",
        "isLinkLocalMulticast": "ip_is_link_local_multicast", "isLinkLocalUnicast": "ip_is_link_local_unicast",
        "isGlobalUnicast": "ip_is_global_unicast",
    }
    conversions = {
        "string_to_string": S, "int64_to_string": I, "uint64_to_string": T.UINT, "double_to_string": T.DOUBLE,
        "bytes_to_string": T.BYTES, "bool_to_string": B, "timestamp_to_string": T.TIMESTAMP,
        "duration_to_string": T.DURATION, "ip_to_string": IP, "cidr_to_string": CIDR,
    }
    return [
        cel.FunctionDecl("ip", [overload("string_to_ip", IP, [S]), overload("cidr_ip", IP, [CIDR], True)]),
        cel.FunctionDecl("family", [overload("ip_family", I, [IP], True)]),
        cel.FunctionDecl("ip.isCanonical", [overload("ip_is_canonical", B, [S])]),
        *[cel.FunctionDecl(name, [overload(oid, B, [IP], True)]) for name, oid in predicates.items()],
        cel.FunctionDecl("isIP", [overload("is_ip", B, [S])]),
        cel.FunctionDecl("cidr", [overload("string_to_cidr", CIDR, [S])]),
        cel.FunctionDecl(
            "containsIP",
            [overload("cidr_contains_ip_string", B, [CIDR, S], True), overload("cidr_contains_ip_ip", B, [CIDR, IP], True)],
        ),
        cel.FunctionDecl(
            "containsCIDR",
            [overload("cidr_contains_cidr_string", B, [CIDR, S], True), overload("cidr_contains_cidr", B, [CIDR, CIDR], True)],
        ),
        cel.FunctionDecl("prefixLength", [overload("cidr_prefix_length", I, [CIDR], True)]),
        cel.FunctionDecl("masked", [overload("cidr_masked", CIDR, [CIDR], True)]),
        cel.FunctionDecl("isCIDR", [overload("is_cidr", B, [S])]),
        cel.FunctionDecl("string", [overload(oid, S, [param]) for oid, param in conversions.items()]),
    ]


_COMPARABLE = {
    "int": T.INT, "uint": T.UINT, "double": T.DOUBLE, "bool": T.BOOL, "duration": T.DURATION,
    "timestamp": T.TIMESTAMP, "string": T.STRING, "bytes": T.BYTES,
}
_SUMMABLE = {"int": T.INT, "uint": T.UINT, "double": T.DOUBLE, "duration": T.DURATION}


def _lists_library_checking() -> list[cel.FunctionDecl]:
    """isSorted, sum, min, max over the element types Kubernetes lists. indexOf and lastIndexOf on
    lists are missing: cel-cpp's strings extension owns the name indexOf and cannot be extended."""

    def member(overload_id: str, result: cel.Type, params: list[cel.Type]) -> cel.Overload:
        return cel.Overload(overload_id, return_type=result, parameters=params, is_member=True)

    return [
        cel.FunctionDecl(
            "isSorted", [member(f"list_{n}_is_sorted_bool", T.BOOL, [T.List(t)]) for n, t in _COMPARABLE.items()]
        ),
        cel.FunctionDecl("sum", [member(f"list_{n}_sum_{n}", t, [T.List(t)]) for n, t in _SUMMABLE.items()]),
        cel.FunctionDecl("max", [member(f"list_{n}_max_{n}", t, [T.List(t)]) for n, t in _COMPARABLE.items()]),
        cel.FunctionDecl("min", [member(f"list_{n}_min_{n}", t, [T.List(t)]) for n, t in _COMPARABLE.items()]),
    ]


def _ordering_with_cross_type_numerics() -> list[cel.FunctionDecl]:
    """<, <=, >, >= as the apiserver declares them, with cel.CrossTypeNumericComparisons(true).

    cel-cpp's checker has no switch for cross-type numeric comparisons, so the checking
    environment drops the standard ordering operators (see _CHECKING_STDLIB_YAML) and declares
    them again with the mixed int/uint/double overloads added. The C++ runtime already compares
    mixed numerics, so the runtime environment keeps its standard operators.
    """
    same_type = {
        "bool": T.BOOL, "int64": T.INT, "uint64": T.UINT, "double": T.DOUBLE, "string": T.STRING,
        "bytes": T.BYTES, "timestamp": T.TIMESTAMP, "duration": T.DURATION,
    }
    numeric = {"int64": T.INT, "uint64": T.UINT, "double": T.DOUBLE}
    decls = []
    for operator, name in _ORDERING_OPERATORS.items():
        overloads = [
            cel.Overload(f"{name}_{suffix}", return_type=T.BOOL, parameters=[cel_type, cel_type])
            for suffix, cel_type in same_type.items()
        ]
        overloads += [
            cel.Overload(f"{name}_{left}_{right}", return_type=T.BOOL, parameters=[lt, rt])
            for left, lt in numeric.items()
            for right, rt in numeric.items()
            if left != right
        ]
        decls.append(cel.FunctionDecl(operator, overloads))
    return decls


_ORDERING_OPERATORS = {"_<_": "less", "_<=_": "less_equals", "_>_": "greater", "_>=_": "greater_equals"}
# Standard functions the checking environment declares again with more overloads.
_CHECKING_STDLIB_YAML = "stdlib:\n  exclude_functions:\n" + "".join(
    f'    - name: "{name}"\n' for name in [*_ORDERING_OPERATORS, "string"]
)


_OTHER_KINDS = {
    "string": T.STRING, "int64": T.INT, "uint64": T.UINT, "double": T.DOUBLE, "bool": T.BOOL,
    "list": T.LIST, "map": T.MAP, "null": T.NULL, "timestamp": T.TIMESTAMP, "duration": T.DURATION,
}


def _mismatches(function: str, result: cel.Type, impl) -> list[cel.Overload]:
    """Overloads for a Quantity/Semver method reached through dyn with a value of another kind.

    Without them the C++ runtime answers "No matching overloads" without naming the types; with
    them the implementation raises Kubernetes' "no such overload: f(string, kubernetes.Semver)".
    """
    overloads = []
    for name, kind in _OTHER_KINDS.items():
        overloads.append(cel.Overload(f"{function}_{name}_bytes", return_type=result, parameters=[kind, T.BYTES], is_member=True, impl=impl))
        overloads.append(cel.Overload(f"{function}_bytes_{name}", return_type=result, parameters=[T.BYTES, kind], is_member=True, impl=impl))
    return overloads


def _runtime_functions() -> list[cel.FunctionDecl]:
    """The same names over the runtime representation, with implementations."""

    def overload(overload_id: str, result: cel.Type, params: list[cel.Type], impl, member: bool = False) -> cel.Overload:
        return cel.Overload(overload_id, return_type=result, parameters=params, is_member=member, impl=impl)

    S, B, I, D, X = T.STRING, T.BOOL, T.INT, T.DOUBLE, T.BYTES
    return [
        cel.FunctionDecl("quantity", [overload("string_to_quantity", X, [S], _string_to_quantity)]),
        cel.FunctionDecl("isQuantity", [overload("is_quantity_string", B, [S], _is_quantity)]),
        cel.FunctionDecl("sign", [overload("quantity_sign", I, [X], _quantity_sign)]),
        cel.FunctionDecl("asApproximateFloat", [overload("quantity_get_float", D, [X], _quantity_as_float, True)]),
        cel.FunctionDecl("asInteger", [overload("quantity_get_int", I, [X], _quantity_as_integer, True)]),
        cel.FunctionDecl("isInteger", [overload("quantity_is_integer", B, [X], _quantity_is_integer, True)]),
        cel.FunctionDecl(
            "add",
            [
                overload("quantity_add", X, [X, X], _quantity_add, True),
                overload("quantity_add_int", X, [X, I], _quantity_add, True),
            ],
        ),
        cel.FunctionDecl(
            "sub",
            [
                overload("quantity_sub", X, [X, X], _quantity_sub, True),
                overload("quantity_sub_int", X, [X, I], _quantity_sub, True),
            ],
        ),
        cel.FunctionDecl(
            "isGreaterThan",
            [overload("bytes_is_greater_than", B, [X, X], _is_greater_than, True), *_mismatches("isGreaterThan", B, _is_greater_than)],
        ),
        cel.FunctionDecl(
            "isLessThan",
            [overload("bytes_is_less_than", B, [X, X], _is_less_than, True), *_mismatches("isLessThan", B, _is_less_than)],
        ),
        cel.FunctionDecl(
            "compareTo",
            [overload("bytes_compare_to", I, [X, X], _compare, True), *_mismatches("compareTo", I, _compare)],
        ),
        cel.FunctionDecl(
            "semver",
            [
                overload("string_to_semver", X, [S], _string_to_semver),
                overload("string_bool_to_semver", X, [S, B], _string_to_semver),
            ],
        ),
        cel.FunctionDecl(
            "isSemver",
            [
                overload("is_semver_string", B, [S], _is_semver),
                overload("is_semver_string_bool", B, [S, B], _is_semver),
            ],
        ),
        cel.FunctionDecl("major", [overload("semver_major", I, [X], lambda v: _int64(_semver(v, "major").major), True)]),
        cel.FunctionDecl("minor", [overload("semver_minor", I, [X], lambda v: _int64(_semver(v, "minor").minor), True)]),
        cel.FunctionDecl("patch", [overload("semver_patch", I, [X], lambda v: _int64(_semver(v, "patch").patch), True)]),
        cel.FunctionDecl(
            OPAQUE_EQUALS,
            [
                overload(f"opaque_equals_bytes_{name}", B, [X, kind], _opaque_equals)
                for name, kind in {**_OTHER_KINDS, "bytes": X}.items()
            ],
        ),
        cel.FunctionDecl(
            OPAQUE_NOT_EQUALS,
            [
                overload(f"opaque_not_equals_bytes_{name}", B, [X, kind], _opaque_not_equals)
                for name, kind in {**_OTHER_KINDS, "bytes": X}.items()
            ],
        ),
        cel.FunctionDecl(
            "@draplane.substring",
            [
                overload("draplane_substring_int", S, [S, I], _substring),
                overload("draplane_substring_int_int", S, [S, I, I], _substring),
            ],
        ),
        cel.FunctionDecl(
            "@draplane.index_of",
            [
                overload("draplane_index_of", I, [S, S], _index_of),
                overload("draplane_index_of_int", I, [S, S, I], _index_of),
            ],
        ),
        cel.FunctionDecl(
            "@draplane.last_index_of",
            [
                overload("draplane_last_index_of", I, [S, S], _last_index_of),
                overload("draplane_last_index_of_int", I, [S, S, I], _last_index_of),
            ],
        ),
        cel.FunctionDecl(
            "@draplane.split",
            [
                overload("draplane_split", T.List(S), [S, S], _split),
                overload("draplane_split_int", T.List(S), [S, S, I], _split),
            ],
        ),
        cel.FunctionDecl(
            "ip",
            [overload("string_to_ip", X, [S], network.string_to_ip), overload("cidr_ip", X, [X], network.cidr_ip, True)],
        ),
        cel.FunctionDecl("family", [overload("ip_family", I, [X], network.ip_family, True)]),
        cel.FunctionDecl("ip.isCanonical", [overload("ip_is_canonical", B, [S], network.ip_is_canonical)]),
        cel.FunctionDecl("isUnspecified", [overload("ip_is_unspecified", B, [X], network.ip_is_unspecified, True)]),
        cel.FunctionDecl("isLoopback", [overload("ip_is_loopback", B, [X], network.ip_is_loopback, True)]),
        cel.FunctionDecl(
            "isLinkLocalMulticast",
            [overload("ip_is_link_local_multicast", B, [X], network.ip_is_link_local_multicast, True)],
        ),
        cel.FunctionDecl(
            "isLinkLocalUnicast", [overload("ip_is_link_local_unicast", B, [X], network.ip_is_link_local_unicast, True)]
        ),
        cel.FunctionDecl("isGlobalUnicast", [overload("ip_is_global_unicast", B, [X], network.ip_is_global_unicast, True)]),
        cel.FunctionDecl("isIP", [overload("is_ip", B, [S], network.is_ip)]),
        cel.FunctionDecl("cidr", [overload("string_to_cidr", X, [S], network.string_to_cidr)]),
        cel.FunctionDecl(
            "containsIP",
            [
                overload("cidr_contains_ip_string", B, [X, S], network.cidr_contains_ip, True),
                overload("cidr_contains_ip_ip", B, [X, X], network.cidr_contains_ip, True),
            ],
        ),
        cel.FunctionDecl(
            "containsCIDR",
            [
                overload("cidr_contains_cidr_string", B, [X, S], network.cidr_contains_cidr, True),
                overload("cidr_contains_cidr", B, [X, X], network.cidr_contains_cidr, True),
            ],
        ),
        cel.FunctionDecl("prefixLength", [overload("cidr_prefix_length", I, [X], network.cidr_prefix_length, True)]),
        cel.FunctionDecl("masked", [overload("cidr_masked", X, [X], network.cidr_masked, True)]),
        cel.FunctionDecl("isCIDR", [overload("is_cidr", B, [S], network.is_cidr)]),
        cel.FunctionDecl(NET_TO_STRING, [overload("draplane_net_to_string", S, [X], network.net_to_string)]),
        *[
            cel.FunctionDecl(
                name,
                [
                    overload(f"{name}_{left_name}_{right_name}", B, [left, right], _ordering(accept))
                    for left_name, left in (("double", T.DOUBLE), ("int64", I), ("uint64", T.UINT))
                    for right_name, right in (("double", T.DOUBLE), ("int64", I), ("uint64", T.UINT))
                    if "double" in (left_name, right_name)
                ],
            )
            for name, accept in (
                (ORDERED["_<_"], lambda c: c < 0), (ORDERED["_<=_"], lambda c: c <= 0),
                (ORDERED["_>_"], lambda c: c > 0), (ORDERED["_>=_"], lambda c: c >= 0),
            )
        ],
        cel.FunctionDecl(
            LIST_INDEX_OF,
            [
                overload(f"draplane_list_index_of_{name}", I, [T.LIST, kind], _list_index_of)
                for name, kind in {**_OTHER_KINDS, "bytes": X}.items()
            ],
        ),
        cel.FunctionDecl(
            LIST_LAST_INDEX_OF,
            [
                overload(f"draplane_list_last_index_of_{name}", I, [T.LIST, kind], _list_last_index_of)
                for name, kind in {**_OTHER_KINDS, "bytes": X}.items()
            ],
        ),
        cel.FunctionDecl(
            MAP_INSERT,
            [
                overload(f"draplane_map_insert_{key_name}_{value_name}", T.MAP, [T.MAP, key_kind, value_kind], _map_insert_entry)
                for key_name, key_kind in {"int64": I, "uint64": T.UINT, "string": S, "bool": B}.items()
                for value_name, value_kind in {**_OTHER_KINDS, "bytes": X}.items()
            ]
            + [overload("draplane_map_insert_map", T.MAP, [T.MAP, T.MAP], _map_insert_map)],
        ),
        cel.FunctionDecl(OPAQUE_SIZE, [overload("opaque_size_bytes", I, [X], _opaque_size)]),
        cel.FunctionDecl(OPAQUE_STRING, [overload("opaque_string_bytes", S, [X], _opaque_string)]),
        # The C++ runtime dispatches on the list kind; the elements' type was checked at compile time.
        cel.FunctionDecl("isSorted", [overload("list_is_sorted", B, [T.LIST], _list_is_sorted, True)]),
        cel.FunctionDecl("sum", [overload("list_sum", T.DYN, [T.LIST], _list_sum, True)]),
        cel.FunctionDecl("max", [overload("list_max", T.DYN, [T.LIST], _list_extreme("max", lambda a, b: a > b), True)]),
        cel.FunctionDecl("min", [overload("list_min", T.DYN, [T.LIST], _list_extreme("min", lambda a, b: a < b), True)]),
        cel.FunctionDecl("find", [overload("string_find_string", S, [S, S], _string_find, True)]),
        cel.FunctionDecl(
            "findAll",
            [
                overload("string_find_all_string", T.List(S), [S, S], _string_find_all, True),
                overload("string_find_all_string_int", T.List(S), [S, S, I], _string_find_all, True),
            ],
        ),
    ]


# The device variable, as the checker sees it. cel-expr-python has no object types without
# protobuf descriptors, so the four fields are declared as qualified identifiers; the checker
# resolves `device.capacity` to the declared map type exactly as it would resolve a field.
DEVICE_FIELDS = {
    "driver": T.STRING,
    "attributes": T.Map(T.STRING, T.Map(T.STRING, T.DYN)),
    "capacity": T.Map(T.STRING, T.Map(T.STRING, QUANTITY)),
    "allowMultipleAllocations": T.BOOL,
}


def new_checking_env() -> cel.Env:
    config = cel.NewEnvConfigFromYaml(_EXTENSIONS_YAML + _CHECKING_STDLIB_YAML + _strings_functions_yaml())
    variables = {f"device.{name}": cel_type for name, cel_type in DEVICE_FIELDS.items()}
    # `device` on its own (cel.bind(d, device, ...)) is a map to the checker; selector.py rejects
    # fields other than the four, as the object type would.
    variables["device"] = T.Map(T.STRING, T.DYN)
    return cel.NewEnv(config=config, variables=variables, functions=_checking_functions())


def new_runtime_env() -> cel.Env:
    config = cel.NewEnvConfigFromYaml(_EXTENSIONS_YAML + _STRINGS_EXTENSION_YAML)
    return cel.NewEnv(config=config, variables={"device": T.DYN}, functions=_runtime_functions())

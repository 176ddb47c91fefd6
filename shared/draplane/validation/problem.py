"""A problem found in a Kubernetes object, and the collector the rules write problems into."""

from __future__ import annotations

import json
from typing import Any, Iterable

import msgspec

# The apiserver's field.ErrorType strings; kept so a problem reads like the apiserver's own line.
REQUIRED = "Required value"
INVALID = "Invalid value"
UNSUPPORTED = "Unsupported value"
DUPLICATE = "Duplicate value"
TOO_MANY = "Too many"
TOO_LONG = "Too long"
FORBIDDEN = "Forbidden"
NOT_FOUND = "Not found"
UNKNOWN_FIELD = "Unknown field"
WRONG_TYPE = "Invalid type"
NOT_AN_OBJECT = "Not a Kubernetes object"


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """One reason the v1 apiserver would reject an object (or would silently drop part of it).

    `field` is a Kubernetes field path such as `spec.devices.requests[0].exactly`; `fix` is a
    concrete change that resolves it, when one can be named; `source` says which file and document
    the object came from.
    """

    kind: str
    name: str
    field: str
    message: str
    reason: str = INVALID
    fix: str | None = None
    source: str | None = None

    def __str__(self) -> str:
        # The apiserver's one-line form: <Kind> "<name>" is invalid: <field>: <type>: <detail>
        field = f"{self.field}: " if self.field else ""
        return f'{self.kind} "{self.name}" is invalid: {field}{self.reason}: {self.message}'


def show_value(value: Any) -> str:
    """A value as the apiserver quotes it in a message: JSON, truncated when long."""
    try:
        text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Findings:
    """Collects the problems of one object; every helper takes the field path first."""

    __slots__ = ("kind", "name", "source", "problems")

    def __init__(self, kind: str, name: str, source: str | None = None):
        self.kind = kind
        self.name = name
        self.source = source
        self.problems: list[Problem] = []

    def add(self, field: str, reason: str, message: str, fix: str | None = None) -> None:
        self.problems.append(
            Problem(kind=self.kind, name=self.name, field=field, reason=reason, message=message, fix=fix,
                    source=self.source)
        )

    def required(self, field: str, message: str, fix: str | None = None) -> None:
        self.add(field, REQUIRED, message, fix)

    def invalid(self, field: str, value: Any, message: str, fix: str | None = None) -> None:
        # None: the problem is the combination of fields, not one value worth quoting.
        self.add(field, INVALID, message if value is None else f"{show_value(value)}: {message}", fix)

    def invalid_each(self, field: str, value: Any, messages: Iterable[str], fix: str | None = None) -> None:
        for message in messages:
            self.invalid(field, value, message, fix)

    def unsupported(self, field: str, value: Any, supported: Iterable[str], fix: str | None = None) -> None:
        supported = list(supported)
        options = ", ".join(f'"{s}"' for s in supported)
        same_letters = [s for s in supported if isinstance(value, str) and s.lower() == value.lower()]
        if same_letters:  # the commonest slip: the right word in the wrong case
            fix = f"{field.rsplit('.', 1)[-1]}: {same_letters[0]} (values are case-sensitive)"
        self.add(field, UNSUPPORTED, f"{show_value(value)} is not one of the supported values {options}", fix)

    def duplicate(self, field: str, value: Any, message: str, fix: str | None = None) -> None:
        self.add(field, DUPLICATE, f"{show_value(value)}: {message}", fix)

    def too_many(self, field: str, count: int, limit: int, what: str, fix: str | None = None) -> None:
        self.add(field, TOO_MANY, f"{count} {what}; the v1 API allows at most {limit}", fix)

    def too_long(self, field: str, length: int, limit: int, what: str, fix: str | None = None) -> None:
        self.add(field, TOO_LONG, f"{what} is {length} bytes long; the v1 API allows at most {limit}", fix)

    def forbidden(self, field: str, message: str, fix: str | None = None) -> None:
        self.add(field, FORBIDDEN, message, fix)

"""The errors of draplane's CEL module. Every one carries the expression and a human message."""

from __future__ import annotations


class CELError(Exception):
    def __init__(self, expression: str, message: str):
        super().__init__(message)
        self.expression = expression
        self.message = message

    def __str__(self) -> str:
        return self.message


class CELCompileError(CELError):
    """Syntax error, type-check error, a result that is not bool, too long or too costly.

    `reason` says which, for callers that answer differently (draplane lint):
    "length", "syntax", "type" (type check and the apiserver's other compile-time checks),
    "result" (not bool), "cost", and "internal" when draplane itself fails to prepare an accepted one.
    """

    def __init__(self, expression: str, message: str, reason: str = "type"):
        super().__init__(expression, message)
        self.reason = reason


class CELRuntimeError(CELError):
    """An evaluation failed for one device: a missing key, no such overload, a bad quantity."""


class CELFunctionError(Exception):
    """Raised by an extension function implementation; its text becomes the CEL error message."""

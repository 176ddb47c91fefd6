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
    """Syntax error, type-check error, a result that is not bool, too long or too costly."""


class CELRuntimeError(CELError):
    """An evaluation failed for one device: a missing key, no such overload, a bad quantity."""


class CELFunctionError(Exception):
    """Raised by an extension function implementation; its text becomes the CEL error message."""

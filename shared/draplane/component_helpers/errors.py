"""The one error the helpers raise."""

from __future__ import annotations


class SpecError(ValueError):
    """A pod's or a node's field that cannot be read: a bad quantity, a malformed selector. The
    message names the object and the field."""

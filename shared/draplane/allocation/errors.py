"""Why claims could not be allocated: structured, so the binder and the CLI can word it per node."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Reason(str, enum.Enum):
    # Input that can never be allocated as written (the CLI's exit 2).
    INVALID_CLAIM = "InvalidClaim"
    UNKNOWN_CLASS = "UnknownDeviceClass"
    CEL_COMPILE = "CELCompileError"
    CEL_RUNTIME = "CELRuntimeError"
    TOO_MANY_RESULTS = "TooManyResults"
    # This node cannot take the claims now (the CLI's exit 1).
    NO_DEVICES = "NoDevices"
    CLASS_SELECTOR = "NoDeviceMatchesClass"
    REQUEST_SELECTOR = "NoDeviceMatchesSelector"
    IN_USE = "DevicesInUse"
    TAINTED = "DevicesTainted"
    CAPACITY = "CapacityExhausted"
    COUNTERS = "CountersExhausted"
    CONSTRAINT = "ConstraintUnsatisfiable"
    NOT_ENOUGH_DEVICES = "NotEnoughDevices"
    POOL_INCOMPLETE = "PoolIncomplete"
    POOL_INVALID = "PoolInvalid"
    NODE_FILTERED = "NodeFiltered"
    SEARCH_LIMIT = "SearchLimit"
    NOT_DIAGNOSED = "DoesNotFit"


FATAL_REASONS = frozenset(
    {Reason.INVALID_CLAIM, Reason.UNKNOWN_CLASS, Reason.CEL_COMPILE, Reason.CEL_RUNTIME, Reason.TOO_MANY_RESULTS}
)


class AllocationError(Exception):
    """The claims cannot be evaluated: bad input or an evaluation error. One line, object and field."""

    def __init__(self, reason: Reason, message: str, *, node: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.node = node

    @property
    def fatal(self) -> bool:
        """Fatal errors hold on every node; the others (an incomplete pool for `All`) are per node."""
        return self.reason in FATAL_REASONS


@dataclass(frozen=True, slots=True)
class NodeFailure:
    """The claims do not fit on this node, and why (the first reason found, most specific first)."""

    node: str
    reason: Reason
    message: str
    # The claim ("namespace/name") and request the failure is about, where it is about one.
    claim: str = ""
    request: str = ""
    # An AllocationError that holds on this node only (an incomplete pool for `All`, say): its
    # message is the explanation, where kube-scheduler would abort the attempt with it.
    from_error: bool = False

    def __str__(self) -> str:
        return f"node {self.node}: {self.message}"

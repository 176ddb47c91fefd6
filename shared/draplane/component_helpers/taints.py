"""Does a toleration cover a taint: one rule for a pod's tolerations of node taints
(core/v1 Toleration, Taint) and a request's tolerations of device taints (resource/v1
DeviceToleration, DeviceTaint), which Kubernetes matches alike. Pure."""

from __future__ import annotations

from typing import Protocol, Sequence, TypeVar


class _Taint(Protocol):
    key: str
    value: str | None
    effect: str | None


class _Toleration(Protocol):
    key: str | None
    operator: str | None
    value: str | None
    effect: str | None


def tolerates(toleration: _Toleration, taint: _Taint) -> bool:
    if toleration.effect and toleration.effect != taint.effect:
        return False
    # An empty key matches every key (validation only allows that together with Exists).
    if toleration.key and toleration.key != taint.key:
        return False
    operator = toleration.operator or "Equal"
    if operator == "Exists":
        return True
    if operator == "Equal":
        return (toleration.value or "") == (taint.value or "")
    return False


_T = TypeVar("_T", bound=_Taint)


def untolerated_taint(tolerations: Sequence[_Toleration], taints: Sequence[_T]) -> _T | None:
    """The first NoSchedule/NoExecute taint no toleration covers (PreferNoSchedule never blocks)."""
    for taint in taints:
        if taint.effect not in ("NoSchedule", "NoExecute"):
            continue
        if not any(tolerates(t, taint) for t in tolerations):
            return taint
    return None

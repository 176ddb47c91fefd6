"""policy/v1 PodDisruptionBudget, and the label selector it (and much of Kubernetes) uses."""

from __future__ import annotations

from typing import Mapping

import msgspec

from draplane.api.meta import Base, ListMeta, ObjectMeta


class LabelSelectorRequirement(Base, kw_only=True):
    key: str
    operator: str
    values: list[str] | None = None


class LabelSelector(Base, kw_only=True):
    match_labels: dict[str, str] | None = None
    match_expressions: list[LabelSelectorRequirement] | None = None


class LabelSelectorError(ValueError):
    """A selector the apiserver would not have accepted (an unknown operator, values where none belong)."""


def label_selector_matches(selector: LabelSelector, labels: Mapping[str, str], where: str = "selector") -> bool:
    """metav1.LabelSelectorAsSelector's meaning: every matchLabels pair and every expression holds.
    The caller decides what an empty selector means: a PodDisruptionBudget's matches no pod in
    preemption, a Deployment's would match every pod."""
    for key, value in (selector.match_labels or {}).items():
        if labels.get(key) != value:
            return False
    for i, requirement in enumerate(selector.match_expressions or ()):
        operator, values = requirement.operator, requirement.values or []
        present = requirement.key in labels
        at = f"{where}.matchExpressions[{i}]"
        if operator in ("In", "NotIn"):
            if not values:
                raise LabelSelectorError(f"{at}: operator {operator} needs at least one value")
            inside = present and labels[requirement.key] in values
            if inside != (operator == "In"):
                return False
        elif operator in ("Exists", "DoesNotExist"):
            if values:
                raise LabelSelectorError(f"{at}: operator {operator} takes no values")
            if present != (operator == "Exists"):
                return False
        else:
            raise LabelSelectorError(f"{at}: unknown operator {operator!r} (In, NotIn, Exists, DoesNotExist)")
    return True


def selector_is_empty(selector: LabelSelector | None) -> bool:
    return selector is None or not (selector.match_labels or selector.match_expressions)


class PodDisruptionBudgetSpec(Base, kw_only=True):
    min_available: int | str | None = None
    max_unavailable: int | str | None = None
    selector: LabelSelector | None = None
    unhealthy_pod_eviction_policy: str | None = None


class PodDisruptionBudgetStatus(Base, kw_only=True):
    observed_generation: int | None = None
    # pod name -> when the eviction was granted: the disruption controller has not seen it go yet
    disrupted_pods: dict[str, str] | None = None
    disruptions_allowed: int = 0
    current_healthy: int = 0
    desired_healthy: int = 0
    expected_pods: int = 0


class PodDisruptionBudget(Base, kw_only=True):
    api_version: str = msgspec.field(default_factory=lambda: "policy/v1")
    kind: str = msgspec.field(default_factory=lambda: "PodDisruptionBudget")
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PodDisruptionBudgetSpec = msgspec.field(default_factory=PodDisruptionBudgetSpec)
    status: PodDisruptionBudgetStatus | None = None


class PodDisruptionBudgetList(Base, kw_only=True):
    metadata: ListMeta | None = None
    items: list[PodDisruptionBudget] = msgspec.field(default_factory=list)

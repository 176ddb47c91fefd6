"""The conformance table as data: every test function recorded, and renaming keeps each answer."""

from __future__ import annotations

import inspect

import pytest

from conformance_cases import _load_module, recorded_cases
from draplane.allocation import AllocationError, NodeFailure, NodePlacement

CASES = recorded_cases()


def test_every_conformance_function_is_recorded():
    functions = {n for n, _ in inspect.getmembers(_load_module(), inspect.isfunction) if n.startswith("test_")}
    recorded = {c.id.split("[")[0].split("#")[0] for c in CASES}
    assert recorded == functions
    assert len(CASES) >= len(functions)


def _answer(outcome, token: str = "") -> tuple:
    """The outcome with the case's own names taken out again."""
    def plain(text: str) -> str:
        return text.replace(f"{token}.", "").replace(f"{token}-", "") if token else text

    if isinstance(outcome, AllocationError):
        return ("error", outcome.reason, plain(str(outcome)))
    if isinstance(outcome, NodeFailure):
        return ("unallocatable", outcome.reason, plain(outcome.message))
    assert isinstance(outcome, NodePlacement)
    return ("allocated", [[(r.request, plain(r.driver), r.pool, r.device, r.admin_access, r.consumed_capacity)
                           for r in a.devices.results or ()] for a in outcome.allocations])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_renamed_case_gets_the_same_answer(case):
    assert _answer(case.renamed("lc7").offline(), "lc7") == _answer(case.offline())

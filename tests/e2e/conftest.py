"""e2e fixtures: a scratch folder for prompts and logits, and the oracle."""

from __future__ import annotations

import pytest

from support.e2e_harness import Oracle
from support.fault_table import FaultRows


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    return Oracle()


@pytest.fixture
def fault_table(request: pytest.FixtureRequest) -> FaultRows:
    """Where a fault test files its (case, route, reason, outcome) row for the table in the terminal summary."""
    return FaultRows(request.node)

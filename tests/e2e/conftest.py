"""e2e fixtures: a scratch folder for prompts and logits, and the oracle."""

from __future__ import annotations

import pytest

from .harness import Oracle


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    return Oracle()


_FAULT_ROWS: list[tuple[str, str, str, str]] = []


@pytest.fixture(scope="session")
def fault_table() -> list[tuple[str, str, str, str]]:
    """Rows (case, route, reason, outcome) of the fault matrix; printed in the terminal summary, -s or not."""
    return _FAULT_ROWS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _FAULT_ROWS:
        return
    widths = [max(len(r[i]) for r in [("case", "route", "reason", "outcome"), *_FAULT_ROWS]) for i in range(4)]
    terminalreporter.section("kvtier fault matrix")
    for row in [("case", "route", "reason", "outcome"), tuple("-" * w for w in widths), *sorted(_FAULT_ROWS)]:
        terminalreporter.write_line("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())

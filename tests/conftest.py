"""Root of the test tree: pytest puts `tests/` on sys.path from here, so `support` (shared helpers) imports
everywhere. Report hooks live here because only this conftest is loaded by a pytest-xdist controller."""

from __future__ import annotations

import pytest
from support.fault_table import rows_of, write_table

_FAULT_ROWS: list[tuple[str, ...]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _FAULT_ROWS.extend(rows_of(report))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    write_table(terminalreporter, _FAULT_ROWS)

"""Root of the test tree. One convention for helpers: everything a test shares lives in the `support` package
(`tests/support/`), imported as `support.<module>`; pyproject's `pythonpath = ["tests"]` makes it importable, and
test files are imported with `--import-mode=importlib`, so test folders are not packages and need no __init__.py.
Report hooks live here because only this conftest is loaded by a pytest-xdist controller."""

from __future__ import annotations

import pytest

from support.fault_table import rows_of, write_table

pytest_plugins = ("support.daemon_fixtures", "support.read_paths", "support.alone")

_FAULT_ROWS: list[tuple[str, ...]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _FAULT_ROWS.extend(rows_of(report))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    write_table(terminalreporter, _FAULT_ROWS)

"""The fault matrix's table: each fault test files its row on its own report (so rows from pytest-xdist
workers reach the controller), and the terminal summary prints them all, -s or not."""

from __future__ import annotations

import pytest

ROW_KEY = "kvtier_fault_row"
HEADER = ("case", "route", "reason", "outcome")


class FaultRows:
    """What a fault test appends its (case, route, reason, outcome) row to."""

    def __init__(self, node: pytest.Item) -> None:
        self._node = node

    def append(self, row: tuple[str, str, str, str]) -> None:
        self._node.user_properties.append((ROW_KEY, row))


def rows_of(report: pytest.TestReport) -> list[tuple[str, ...]]:
    return [tuple(value) for key, value in report.user_properties if key == ROW_KEY] if report.when == "call" else []


def write_table(terminalreporter: pytest.TerminalReporter, rows: list[tuple[str, ...]]) -> None:
    if not rows:
        return
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    terminalreporter.section("kvtier fault matrix")
    for row in [HEADER, tuple("-" * w for w in widths), *sorted(rows)]:
        terminalreporter.write_line("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())

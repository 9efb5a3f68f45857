"""A pytest plugin for the suites CI requires: a skipped test, or a module skipped at collection, is a failure.

The engine and service suites (tests/vllm, tests/sglang, tests/cluster, tests/systemd) skip where their engine
or service is missing, which is right on a developer's machine and wrong in CI: there a missing engine is an
install that failed. Their run.sh loads this plugin when CI=true (`-p support.noskip`, tests/ on PYTHONPATH).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

WHY = "skipped in a suite CI requires (CI=true)"


def _reason(longrepr: Any) -> str:
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"{WHY}: {_reason(report.longrepr)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        report.outcome = "failed"
        report.longrepr = f"{WHY}: {_reason(report.longrepr)}"

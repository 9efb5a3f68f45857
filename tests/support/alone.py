"""Tests marked `alone` run with no other test in flight, across pytest-xdist workers.

Such a test bounds a latency (a probe under a storm, a p99 ratio), and a test on another worker sharing the
machine's cores moves that bound more than the code under test does: on 2 cores the hostile-load probe went
from 1.0 s alone to 5.5 s beside another worker. The workers share a readers-writer lock made of two flock(2)
files named by the run's xdist id: every test holds the run file shared for its whole protocol (setup, call,
teardown); an `alone` test holds it exclusive. The gate file keeps a waiting `alone` test from being starved:
it takes the gate exclusive before waiting on the run file, and other tests pass the gate (shared, for an
instant) before they take the run file, so no new test starts once an `alone` test is waiting. Without xdist
every test is alone already and no lock is taken. Closing a descriptor releases its lock, so a worker that
dies frees what it held. The controller removes the two files once the run is over (they are per run)."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator

import pytest

_runs: set[str] = set()  # (the xdist controller) the lock files' base path of each run it started workers for


def _base(run_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"kvtier-tests-{run_id}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: runs with no other test in flight on any xdist worker (latency bounds)")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: object) -> None:
    _runs.add(_base(node.workerinput["testrunuid"]))  # type: ignore[attr-defined]


def pytest_unconfigure() -> None:
    """The controller, once every worker is done: the run's lock files go (a worker never removes them: one that
    opened them after would lock another file)."""
    for base in _runs:
        for path in (base + ".gate", base + ".run"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    _runs.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        yield
        return
    base = _base(run_id)
    gate = os.open(base + ".gate", os.O_RDWR | os.O_CREAT, 0o600)
    run = os.open(base + ".run", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if item.get_closest_marker("alone") is not None:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(run, fcntl.LOCK_EX)
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(run, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        os.close(run)
        os.close(gate)

"""pytest fixtures over a real `kvtier serve` subprocess (registered for the whole tree in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.daemon import DaemonProc


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path)
    yield d
    d.close()


@pytest.fixture
def small_daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    """Pools of a few dozen blocks, so eviction is easy to force."""
    d = DaemonProc(tmp_path, pools='compressed = "64KiB"\nindexer = "16KiB"\ntail = "64KiB"\nswa = "128KiB"\n')
    yield d
    d.close()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path_factory.mktemp("daemon"))
    yield d
    d.close()

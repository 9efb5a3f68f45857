"""pytest fixtures over a real `kvtier serve` subprocess (registered for the whole tree in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.daemon import SMALL_POOLS, DaemonProc


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path)
    yield d
    d.close()


@pytest.fixture
def small_daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    """Pools of a few dozen blocks, so eviction is easy to force."""
    d = DaemonProc(tmp_path, pools=SMALL_POOLS)
    yield d
    d.close()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path_factory.mktemp("daemon"))
    yield d
    d.close()


@pytest.fixture(scope="module")
def shared_small_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """`small_daemon` for a whole module: its tests must not depend on one another's pool contents."""
    d = DaemonProc(tmp_path_factory.mktemp("small"), pools=SMALL_POOLS)
    yield d
    d.close()

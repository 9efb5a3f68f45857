"""A write-back whose namespace a rollout retired in the meantime: skipped quietly, nothing stored, no error.

The daemon's persister takes a batch of sealed objects under the manager's lock and stores it outside;
a version reload may retire the namespace in between (the rollout test's flake: a traceback in the log).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.core.errors import VersionError
from kvtier.core.forms import Reason
from kvtier.core.tier import ObjectKey
from kvtier.gpu import CacheManager
from kvtier.store import DiskStore, NamespaceRetired, StoreConfig
from support.gpuworld import PROFILE, budgets, hashes_of, prompt, write


def test_writeback_into_a_retired_namespace_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with DiskStore(str(tmp_path), StoreConfig(io_backend="buffered"), writer=True) as store:
        store.register_namespace(PROFILE.version)
        m = CacheManager(PROFILE, budgets_bytes=budgets(PROFILE, 8), lower=store)
        try:
            written = write(m, hashes_of(m, prompt(1, 2)), range(2), state_at={1})
            assert written > 0
            assert issubclass(NamespaceRetired, VersionError)  # how the write-back knows a rollout from a fault
            store.retire_namespace(m.namespace)  # as a reload does, between the seal and the write-back
            with caplog.at_level(logging.INFO, logger="kvtier.gpu.writeback"):
                outcome = m.persist_batch()
            assert outcome.stored == 0 and not outcome.failed  # a rollout, not a failing tier
            assert caplog.records and {r.levelno for r in caplog.records} == {logging.INFO}  # one line per form
            assert all("skipped" in r.getMessage() and not r.exc_info for r in caplog.records)
            store.register_namespace(PROFILE.version)  # live again (a rollback): nothing of the batch was stored
            hashes = hashes_of(m, prompt(1, 2))
            g = PROFILE.groups[0]
            key = ObjectKey(m.namespace, hashes[0], g.name, g.form)
            assert store.has([key], [m.layout_digest(g.name)]) == [Reason.MISSING]
        finally:
            m.close()

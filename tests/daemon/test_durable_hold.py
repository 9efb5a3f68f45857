"""While an engine waits for a durable offload (`make_durable`), the verifier's decisions wait too: the daemon's
applier holds back its next write transaction until the offload's objects were tried (at most its bound), so
the offload's write-back neither waits for a decision's commit nor shares the process with its work."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from kvtier.daemon.durability import make_durable
from kvtier.store import DiskStore, StoreConfig
from kvtier.store.decisions import Drop, DropIf
from kvtier.store.gil import applying
from kvtier.store.index import encode_key
from support.store_helpers import DIGEST, VK, make_key, make_payload

DEADLINE_S = 30.0


class _Manager:
    def layout_digest(self, group: str) -> bytes:
        return DIGEST

    def residence(self, keys: list[Any]) -> list[None]:
        return [None] * len(keys)


class _Runtime:
    name = "ref-tiny"
    manager = _Manager()


class _Persister:
    """Stores nothing (the offload's objects are in the store already); while it is asked, a decision is applied on
    the applier's thread, and what that thread did meanwhile is recorded."""

    def __init__(self, store: DiskStore, victim: Any) -> None:
        self.store, self.victim = store, victim
        self.applied = threading.Event()
        self.seen: list[tuple[int, bool]] = []  # (the applier's waits so far, whether the victim was still there)

    def _apply(self) -> None:
        with applying():
            self.store.apply_decision(Drop([DropIf(encode_key(self.victim))]))
        self.applied.set()

    def persist_first(self, rt: Any, keys: list[Any], timeout_s: float) -> dict:
        applier = threading.Thread(target=self._apply, daemon=True)
        applier.start()
        writers = self.store.index.writers
        deadline = time.monotonic() + DEADLINE_S
        while writers.held_back == 0 and not self.applied.is_set():  # it reached its write transaction, or went on
            assert time.monotonic() < deadline
            time.sleep(0.001)
        self.seen.append((writers.held_back, self.store.records([self.victim])[0] is not None))
        return {}


def test_the_applier_waits_while_a_durable_offload_is_made_durable(tmp_path: Path) -> None:
    with DiskStore(str(tmp_path), StoreConfig(io_backend="buffered"), writer=True) as store:
        ns = store.register_namespace(VK)
        offloaded, victim = make_key(ns, "offloaded"), make_key(ns, "victim")
        store.store_many([(k, make_payload(k.block_hash.hex(), 5000), DIGEST) for k in (offloaded, victim)])
        persister = _Persister(store, victim)
        d = make_durable(store, persister, _Runtime(), [offloaded], frozenset(), 5.0)  # type: ignore[arg-type]
        assert d.durable == 1 and d.not_durable == 0
        assert persister.seen == [(1, True)]  # the decision waited, and had not dropped the victim
        assert persister.applied.wait(DEADLINE_S)  # once the offload was answered, it went on
        assert store.records([victim]) == [None]

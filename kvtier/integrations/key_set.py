"""An engine tier's namespace in memory: which (group, block hash) the store holds live, so a lookup is a set test.

Loaded at start by one pass over the namespace's index keys (`DiskStore.live_keys`, or `tier_keys` through the
daemon), then kept close to the store: this tier adds what it commits and drops what failed to load; a thread
re-reads the namespace, page by page, whenever the index changed (another engine stored, the verifier or
cleaner removed), at most every `refresh_s`. Between passes an answer can be stale, and that is safe: a key
the set holds but the store no longer does fails its load's verification and vLLM recomputes it; a key the
store holds but the set does not yet is a miss until the next pass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from kvtier.core.errors import KvtierError
from kvtier.core.tier import KeyPage

log = logging.getLogger("vllm.kvtier")

ReadPage = Callable[[bytes, int], KeyPage]  # (after, limit) -> a page of the namespace's live keys
_PAGE = 2048  # keys per index read: a short read txn, and the scheduler thread never waits long for the GIL


class KeySet:
    """Live block hashes per group id; `groups` maps the store's group names to the engine's group ids."""

    def __init__(
        self,
        read: ReadPage,
        groups: Mapping[str, int],
        refresh_s: float,
        on_gone: Callable[[list[tuple[int, bytes]]], None] | None = None,
    ) -> None:
        self._read = read
        # told (from the refresh thread) of the keys a complete pass no longer found: evicted, dropped, quarantined
        self._on_gone = on_gone
        self._gids = dict(groups)
        self._lock = threading.Lock()  # between a pass's swap and this tier's own adds
        self._present: dict[int, set[bytes]] = {g: set() for g in self._gids.values()}
        self._added: list[tuple[int, bytes]] | None = None  # this tier's adds while a pass runs
        self._txn = -1  # the index snapshot the last complete pass began at
        self._stop = threading.Event()
        started = time.monotonic()
        self._pass()
        self.load_s = time.monotonic() - started  # the first pass, at start-up
        log.info("kvtier tier: %d live records of this namespace in memory (%.0f ms)", len(self), self.load_s * 1e3)
        self._refresh_s = refresh_s
        self._thread = threading.Thread(target=self._refresh, name="kvtier-vllm-keys", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return sum(map(len, self._present.values()))

    def has(self, gid: int, block_hash: bytes) -> bool:
        return block_hash in self._present[gid]

    def add(self, items: Iterable[tuple[int, bytes]]) -> None:
        """Keys this tier committed (call before reporting the store done, so a lookup after it hits)."""
        with self._lock:
            for gid, block_hash in items:
                self._present[gid].add(block_hash)
                if self._added is not None:
                    self._added.append((gid, block_hash))

    def discard(self, gid: int, block_hash: bytes) -> None:
        """A key whose load failed: not servable until stored again (or a pass finds it live again)."""
        self._present[gid].discard(block_hash)

    def _pass(self) -> None:
        """Read the namespace page by page: new keys count at once, removed ones once the pass is complete."""
        fresh: dict[int, set[bytes]] = {g: set() for g in self._gids.values()}
        with self._lock:
            self._added = []
        after, txn, complete = b"", None, False
        try:
            while True:
                page = self._read(after, _PAGE)
                txn = page.txn if txn is None else txn
                found = [(self._gids[g], h) for h, g in page.keys if g in self._gids]
                with self._lock:
                    for gid, block_hash in found:
                        fresh[gid].add(block_hash)
                        self._present[gid].add(block_hash)
                if not (after := page.cursor):
                    complete = True
                    break
                time.sleep(0)  # let the scheduler thread in between pages
        finally:
            gone: list[tuple[int, bytes]] = []
            with self._lock:
                added, self._added = self._added or [], None
                if complete:  # the pass's view (plus what this tier stored meanwhile) replaces the set
                    for gid, block_hash in added:
                        fresh[gid].add(block_hash)
                    if self._on_gone is not None:
                        gone = [(gid, h) for gid, old in self._present.items() for h in old - fresh[gid]]
                    self._present = fresh
                    self._txn = txn if txn is not None else -1
            if gone and self._on_gone is not None:
                self._on_gone(gone)

    def _refresh(self) -> None:
        while not self._stop.wait(self._refresh_s):
            try:
                if self._read(b"", 0).txn != self._txn:
                    self._pass()
            except KvtierError as exc:  # the store cannot answer now (daemon gone): keep the set, try again later
                log.debug("kvtier tier: key set not refreshed: %s", exc)
            except Exception:  # anything else: say so, keep the set (stale answers stay safe), try again later
                log.warning("kvtier tier: key set not refreshed", exc_info=True)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

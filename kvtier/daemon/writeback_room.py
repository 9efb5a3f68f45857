"""Ask the cleaner for room for writes that wait: while the store refuses a form's write-back (its quota, the
budget, a full disk), the daemon publishes in the store's `meta` how many bytes each blocked form's waiting
objects need (document `write_back`); the verifier's cleaner counts them as used, so it evicts below its
usual watermark for that form (or the budget) until they fit. The daemon retries blocked write-back now and
then on its own, so a form unblocks through the verifier without anyone flushing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvtier.core.forms import CacheForm
from kvtier.daemon.persister import Persister
from kvtier.store import DiskStore

log = logging.getLogger(__name__)
DOC = "write_back"
HEADER_BYTES = 160  # a v2 record's inline header, counted in the store's usage with the payload (FORMAT.md)
RETRY_S = 5.0  # how often a blocked write-back is tried again without a seal or flush asking for a pass


class RoomRequests:
    """Publishes the blocked forms' needs (only when they change) and retries blocked write-back.

    `tick` runs on the daemon's main loop, which must never wait for the index's write lock: `publish` hands the
    document to the thread that applies index changes (`kvtier.store.DecisionServer.post`) and returns at once.
    Without one (a test, a tool), the document is written here."""

    def __init__(
        self, store: DiskStore, persister: Persister, publish: Callable[[str, dict[str, Any]], None] | None = None
    ) -> None:
        self._store = store
        self._persister = persister
        self._publish = publish or store.put_meta_doc
        self._published: dict[str, int] | None = None
        self._retry_at = 0.0

    def tick(self) -> None:
        need = self.need_bytes()
        if need != self._published:
            self._publish(DOC, {"room_bytes": need, "at": time.time()})
            if need:
                log.info("write-back blocked: asking the cleaner for room: %s", need)
            self._published = need
        now = time.monotonic()
        if need and now >= self._retry_at:
            self._retry_at = now + RETRY_S
            self._persister.request()

    def need_bytes(self) -> dict[str, int]:
        """Per blocked form, the bytes its waiting objects take in the store (uncompressed: an upper bound)."""
        stuck = self._persister.stuck()
        need: dict[str, int] = {}
        for rt in self._persister.runtimes:  # every profile's pools, a canary's too
            for form, n in stuck.get(rt.name, {}).items():
                if form == "*" or not n:  # "*": the write-back itself failed (a bug), not a refusal
                    continue
                h = rt.profile.hash_block_tokens
                per = HEADER_BYTES + max(g.object_bytes(h) for g in rt.profile.groups_of(CacheForm(form)))
                need[form] = need.get(form, 0) + n * per
        return need

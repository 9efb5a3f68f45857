"""A background writer with a byte budget: SGLang's backup thread hands pages over and never waits on a disk.

SGLang's cache controller calls `batch_set_v2` on its backup thread and waits for the answer. The pages
are copied out of the host pool (SGLang may reuse the slots as soon as the call returns) and queued; a
writer thread stores them. When the queue holds `max_pending_bytes`, a caller waits at most `timeout_s`
for room, then the pages are refused (reported not stored): a slow or full disk costs SGLang a bounded
wait and a later recompute, never a stall.

Read your writes: a page is reported stored as soon as it is queued, so until its batch is on disk the
queue is where it lives. `queued` answers for those pages with the bytes the set call handed over (the
copy the writer will store); a batch the store refuses or fails leaves the queue and stops being answered,
so a page is never reported present that neither the queue nor the disk holds.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from kvtier.core.tier import ObjectKey
from kvtier.store import StoreFull

log = logging.getLogger(__name__)

Item = tuple[ObjectKey, torch.Tensor, bytes]
_WARN_EVERY_S = 30.0


class BoundedWriter:
    """Queue (key, bytes, layout digest) batches for `store_many` on one thread, within a byte budget."""

    def __init__(self, store_many: Callable[[Sequence[Item]], None], max_pending_bytes: int, timeout_s: float) -> None:
        self._store_many = store_many
        self._max = max_pending_bytes
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[int, list[Item]]] = collections.deque()
        self._pending_bytes = 0
        # every queued or in-flight page by key: its bytes, layout digest, and the batch that carries it (a later
        # set of the same key replaces the entry; only the batch that put an entry there takes it out)
        self._queued: dict[ObjectKey, tuple[torch.Tensor, bytes, int]] = {}
        self._batch_ids = itertools.count()
        self._writing = False
        self._closed = False
        self.stored = 0
        self.refused = 0
        self.failed = 0
        self._last_warning = 0.0
        self._thread = threading.Thread(target=self._run, name="kvtier-sglang-store", daemon=True)
        self._thread.start()

    def submit(self, items: list[Item]) -> bool:
        """Copy and queue the batch; False (nothing queued) when no room came within the timeout or after close."""
        nbytes = _nbytes(items)
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            # A batch larger than the whole budget still goes through alone, so it is never refused forever.
            while not self._closed and self._pending_bytes and self._pending_bytes + nbytes > self._max:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    break
            if self._closed or (self._pending_bytes and self._pending_bytes + nbytes > self._max):
                self.refused += len(items)
                self._warn(f"store queue full ({self._pending_bytes} bytes pending): {len(items)} pages not stored")
                return False
            batch = [(k, p.detach().clone(), d) for k, p, d in items]
            ident = next(self._batch_ids)
            for k, p, d in batch:
                self._queued[k] = (p, d, ident)
            self._queue.append((ident, batch))
            self._pending_bytes += nbytes
            self._cond.notify_all()
        return True

    def queued(self, keys: Sequence[ObjectKey], layout_digests: Sequence[bytes]) -> list[torch.Tensor | None]:
        """Per key, the bytes queued for it under that layout digest (not yet on disk, or being written), else None.

        The tensors are the writer's own copies and are never changed: a caller may read one after its batch
        has gone to disk."""
        with self._cond:
            found = [self._queued.get(k) for k in keys]
        return [q[0] if q is not None and q[1] == d else None for q, d in zip(found, layout_digests)]

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued batch is written (or failed); False when `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._writing, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                ident, batch = self._queue.popleft()
                self._writing = True
            try:
                self._store_many(batch)
                ok = True
            except StoreFull as exc:
                ok = False
                self._warn(f"{len(batch)} pages not stored: {exc}")
            except Exception:  # the writer outlives any one batch: a lost batch is only a later miss
                ok = False
                log.exception("kvtier sglang: storing %d pages failed", len(batch))
            with self._cond:
                # stored: the disk answers for these keys from now on; failed: nothing does (a miss, never bytes)
                for k, _, _ in batch:
                    if (q := self._queued.get(k)) is not None and q[2] == ident:
                        del self._queued[k]
                self._pending_bytes -= _nbytes(batch)
                self._writing = False
                if ok:
                    self.stored += len(batch)
                else:
                    self.failed += len(batch)
                self._cond.notify_all()

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning("kvtier sglang: %s", message)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (up to `timeout_s`), then stop the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)


def _nbytes(items: Sequence[Item]) -> int:
    return sum(p.numel() * p.element_size() for _, p, _ in items)

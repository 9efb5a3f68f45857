"""What the store's reader, writer and maintenance share: its knobs (`StoreConfig`, from core), the index, the I/O
backend, buffers, pools."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvtier.core.forms import CacheForm
from kvtier.core.store_config import StoreConfig
from kvtier.core.tier import ObjectKey
from kvtier.store.errors import CorruptRecord, StoreForkError, StoreRequestError
from kvtier.store.index import Index, IndexEntry, unpack_time
from kvtier.store.io import BufferPool, PosixBackend

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch

log = logging.getLogger(__name__)


class StoreContext:
    """One per DiskStore (and per process: LMDB handles and flocks do not survive fork)."""

    def __init__(
        self, root: str, seg_dir: str, config: StoreConfig, index: Index, backend: PosixBackend, *, readonly: bool
    ) -> None:
        self.root = root
        self.seg_dir = seg_dir
        self.readonly = readonly
        self.config = config  # replaced whole by a reload of the limits (`Writer.set_limits`)
        self.index = index
        self.backend = backend
        self.buffers = BufferPool(config.buffer_retain_bytes)
        self.write_lock = threading.Lock()  # one batch (a store or a relocation) appends at a time
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._pid = os.getpid()
        # Where the index changes that maintenance decides go (a `kvtier.store.decisions.Decision`): applied here,
        # or sent to the daemon that serves the store (DiskStore sets it).
        self.decide: Callable[[Any], Any] = _no_decisions
        # Told, in commit order, of every committed change to which keys the index serves (`observing`):
        # the daemon publishes them as KV events. None: nobody listens, and nothing is serialised for it.
        self.observer: StoreObserver | None = None
        self._observe_lock = threading.Lock()

    @property
    def quotas(self) -> dict[CacheForm, int]:
        return dict(self.config.form_quotas)

    @property
    def device_checksums(self) -> bool:
        """Whether records get the device checksum beside xxh3, so GDS readers check them on the device."""
        choice = self.config.device_checksums
        if choice not in ("auto", "on", "off"):
            raise StoreRequestError(f"device_checksums {choice!r}: use auto, on or off")
        return choice == "on" or (choice == "auto" and self.backend.gpu_direct)

    def executor(self, role: str) -> ThreadPoolExecutor:
        """Separate read and write pools, so loads never queue behind a write that is growing the map."""
        pool = self._pools.get(role)
        if pool is None:
            threads = self.config.read_threads if role == "read" else self.config.io_threads
            pool = self._pools[role] = ThreadPoolExecutor(max(1, threads), thread_name_prefix=f"kvtier-store-{role}")
            _start_workers(pool, max(1, threads))
        return pool

    def close_pools(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()

    @contextlib.contextmanager
    def observing(self) -> Iterator[StoreObserver]:
        """Around one index commit and the report of what it changed: the commits of writes, drops and
        quarantines that report run one at a time, so the observer hears them in the order they committed. A
        thread that waits for another's turn says so as it would waiting for LMDB's write lock (`wanting`): a
        piece of the applier's that holds the turn then ends at its next item (`gil.Piece`)."""
        observer = self.observer
        if observer is None:
            yield _unobserved
            return
        if not self._observe_lock.acquire(blocking=False):
            with self.index.writers.wanting():
                self._observe_lock.acquire()
        try:
            yield _guarded(observer)
        finally:
            self._observe_lock.release()

    @property
    def forked(self) -> bool:
        return os.getpid() != self._pid

    def check_pid(self) -> None:
        if self.forked:
            raise StoreForkError("this DiskStore was opened before fork(): open the store again in the child process")


# ("stored" | "removed", keys): the keys a commit made servable, or took out of service (dropped, evicted or
# quarantined). Called with the store's observe lock held: it must only hand the keys on, never block.
StoreObserver = Callable[[str, list[ObjectKey]], None]


def _unobserved(change: str, keys: list[ObjectKey]) -> None:
    return None


def _guarded(observer: StoreObserver) -> StoreObserver:
    def tell(change: str, keys: list[ObjectKey]) -> None:
        if not keys:
            return
        try:
            observer(change, keys)
        except Exception:  # a listener's fault must never fail a commit that already happened
            log.exception("the store observer failed on %d %s keys", len(keys), change)

    return tell


def _no_decisions(decision: Any) -> Any:
    raise RuntimeError(f"no one applies {type(decision).__name__}: DiskStore sets StoreContext.decide")


def _start_workers(pool: ThreadPoolExecutor, n: int) -> None:
    """Start all `n` workers now: the executor starts one per submit that finds none idle, and a thread start
    (several ms on a busy host) would otherwise land inside the first large load. The barrier keeps each
    task on its own thread until all are up."""
    barrier = threading.Barrier(n)
    for _ in range(n):
        pool.submit(barrier.wait, 10.0)


def flat_uint8(t: torch.Tensor) -> torch.Tensor:
    import torch  # loaded by whoever made `t`: a dictionary lookup here

    if not isinstance(t, torch.Tensor) or t.dtype is not torch.uint8 or not t.is_contiguous() or t.numel() == 0:
        raise StoreRequestError(
            "payloads and load targets must be non-empty contiguous uint8 tensors (a view of the slot)"
        )
    return t if t.dim() == 1 else t.view(-1)


def entry_or_none(raw: bytes | memoryview) -> IndexEntry | None:
    try:
        return IndexEntry.unpack(raw)
    except CorruptRecord:
        return None


def atime_or_zero(raw: bytes | memoryview | None) -> float:
    try:
        return unpack_time(raw) if raw is not None else 0.0
    except CorruptRecord:
        return 0.0


def key_str(key: ObjectKey) -> str:
    return f"{key.namespace.hex()}/{key.block_hash.hex()}/{key.group}/{key.form.value}"

"""The write side (the daemon's role): admission, batched appends, the commit, and the budget and quotas."""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import lmdb

from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.store.accounting import Ledger
from kvtier.store.context import StoreContext, entry_or_none, flat_uint8
from kvtier.store.devsum import device_checksum
from kvtier.store.errors import NamespaceError, NamespaceRetired, StoreFull
from kvtier.store.extent import MAX_EXTENT_BYTES, ExtentPlan, write_extent
from kvtier.store.index import IndexEntry, NamespaceEntry, RecordState, Usage, encode_key, pack_time, u64_key
from kvtier.store.record import (
    Codec,
    Flags,
    RecordHeader,
    namespace_record,
    payload_checksum,
    record_length,
    zstd_compress,
)
from kvtier.store.segments import Appender

if TYPE_CHECKING:  # annotations only: torch is imported where used, so a daemon can listen before it loads
    import torch

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

Item = tuple[ObjectKey, "torch.Tensor", bytes]  # (key, payload, layout digest)


@dataclasses.dataclass(frozen=True, slots=True)
class _Written:
    """A record written (not yet committed): its key, header, layout digest and place."""

    key: ObjectKey
    header: RecordHeader
    layout_digest: bytes
    seg_id: int
    offset: int


class Writer:
    """Appends records to segments it alone owns and commits them to the index; one batch at a time."""

    def __init__(self, ctx: StoreContext) -> None:
        self._ctx = ctx
        self.appender = Appender(ctx.root, ctx.index, ctx.backend, ctx.config.segment_bytes)

    def store_many(self, items: Sequence[Item]) -> None:
        """Persist objects with one fdatasync per segment and one commit: all visible, or none (StoreFull)."""
        with self._ctx.write_lock:
            todo, namespaces = self._admit(items)
            if todo:
                self._write_batch(todo, namespaces)

    def _admit(self, items: Sequence[Item]) -> tuple[list[Item], dict[bytes, NamespaceEntry]]:
        """Drop items already live (records are immutable, keys content-addressed); check namespaces; refuse a
        batch whose new records would bring the store over its budget or a quota (StoreFull, `_check_budget`).
        The refusal comes as soon as the new records found so far do not fit, the keys after them not looked up
        (counted as new, so the refusal's `needed` is at most what it says): on a store at its budget the
        write-back offers every round's batch, and each refusal used to look every key of it up."""
        index = self._ctx.index
        todo: list[Item] = []
        namespaces: dict[bytes, NamespaceEntry] = {}
        seen: set[bytes] = set()
        added: collections.Counter[CacheForm] = collections.Counter()
        plain: dict[tuple[bytes, CacheForm], bool] = {}

        def as_is(key: ObjectKey) -> bool:  # its namespace stores its form uncompressed: its size is exact now
            kind = (key.namespace, key.form)  # (a compressed record's size is checked at commit)
            stored_as_is = plain.get(kind)
            if stored_as_is is None:
                stored_as_is = plain[kind] = namespaces[key.namespace].codec_for(key.form) is Codec.NONE
            return stored_as_is

        estimated = False  # whether keys were left unread, counted as new
        with index.read() as txn:
            usage = index.usage(txn)
            room = _Room(self._ctx.config.budget_bytes, self._ctx.quotas, usage)
            for i, (key, payload, digest) in enumerate(items):
                if key.namespace not in namespaces:
                    namespaces[key.namespace] = self._live_namespace(txn, key.namespace)
                raw_key = encode_key(key)
                raw = txn.get(raw_key, db=index.obj)
                if raw_key in seen or (raw is not None and _is_live(raw)):
                    continue
                seen.add(raw_key)
                todo.append((key, payload, digest))
                if not as_is(key):
                    continue
                n = record_length(payload.numel())
                added[key.form] += n
                if room.take(key.form, n):
                    rest = items[i + 1 :]
                    for ns in {k.namespace for k, _, _ in rest} - namespaces.keys():  # (an unknown one says so)
                        namespaces[ns] = self._live_namespace(txn, ns)
                    for k, p, _ in rest:
                        if as_is(k):
                            added[k.form] += record_length(p.numel())
                    estimated = bool(rest)
                    break
        for form, n in added.items():
            usage[form].record_bytes += n
        self._check_budget(usage, added, at_most=estimated)
        return todo, namespaces

    def _live_namespace(self, txn: lmdb.Transaction, namespace: bytes) -> NamespaceEntry:
        ns = self._ctx.index.namespace(txn, namespace)
        if ns is None:
            raise NamespaceError(f"namespace {namespace.hex()} is not registered: register its version key first")
        if not ns.live:
            raise NamespaceRetired(f"namespace {namespace.hex()} is retired: register its version key (live) first")
        return ns

    def _write_batch(self, items: list[Item], namespaces: dict[bytes, NamespaceEntry]) -> None:
        """Cut the batch into extents (in order), build and write them on the pool, sync once, commit once. The
        applier's thread holds back its decisions' commits meanwhile (`DurableFirst`)."""
        with self._ctx.index.writers.durable():
            self._write_batch_durably(items, namespaces)

    def _write_batch_durably(self, items: list[Item], namespaces: dict[bytes, NamespaceEntry]) -> None:
        appender = self.appender
        now = time.time()
        extents = _cut_extents(items, self._ctx.config.segment_bytes)
        pending: collections.deque[Future[list[_Written]]] = collections.deque()
        written: list[_Written] = []
        appender.begin_batch()
        sync_failed = False
        try:
            if len(extents) == 1:  # one extent: no hop through the pool
                written += self._write_extent(extents[0], namespaces, now)
            else:
                pool = self._ctx.executor("write")
                pending.extend(pool.submit(self._write_extent, part, namespaces, now) for part in extents)
            while pending:
                written += pending.popleft().result()
            try:
                appender.sync_batch()
            except OSError:
                sync_failed = True
                raise
            with self._ctx.observing() as tell:
                self._ctx.index.update(lambda txn: self._commit(txn, written))
                tell("stored", [w.key for w in written])
        except OSError as exc:
            _drain(pending)
            appender.rewind(abandon=sync_failed)
            if exc.errno in _DISK_FULL:
                raise StoreFull(
                    f"{self._ctx.root}: filesystem full ({exc.strerror}): let the cleaner evict, or grow the disk",
                    limit="disk",
                ) from None
            raise
        except lmdb.DiskError as exc:
            appender.rewind(abandon=False)
            raise StoreFull(f"{self._ctx.root}: index could not grow ({exc}): free disk space", limit="disk") from None
        except BaseException:
            _drain(pending)
            appender.rewind(abandon=False)
            raise
        finally:
            appender.end_batch()

    def _write_extent(self, items: list[Item], namespaces: dict[bytes, NamespaceEntry], now: float) -> list[_Written]:
        """Checksum and lay out one extent (its namespaces' records first) and write it: from the host in
        `write_piece_bytes` pieces one after another (0: one call).

        Staged in an aligned host buffer; or, where the backend writes device memory directly (GDS) and every
        payload lives there uncompressed, in a device tensor written with one KvikIO call and checksummed on the
        device: no payload byte visits the host."""
        codecs = [namespaces[k.namespace].codec_for(k.form) for k, _, _ in items]
        flats = [flat_uint8(p) for _, p, _ in items]
        device = all(self._ctx.backend.device_io(f) for f in flats) and all(c is Codec.NONE for c in codecs)
        ns_records = [
            namespace_record(namespaces[ns].version_key, now) for ns in dict.fromkeys(k.namespace for k, _, _ in items)
        ]
        import torch

        records = [(h, torch.frombuffer(bytearray(body), dtype=torch.uint8)) for h, body in ns_records]
        for (key, _, digest), codec, flat in zip(items, codecs, flats):
            data = flat if codec is Codec.NONE else _compressed(flat)
            xxh = None if device else payload_checksum(_host_bytes(data))
            dsum = device_checksum(data) if device or (codec is Codec.NONE and self._ctx.device_checksums) else None
            flags = (Flags.XXH3 if xxh is not None else Flags(0)) | (Flags.DEVSUM if dsum is not None else Flags(0))
            header = RecordHeader(
                key.namespace,
                key.block_hash,
                key.group,
                key.form,
                digest,
                codec,
                flat.numel(),
                data.numel(),
                now,
                flags,
                xxh or bytes(16),
                dsum or 0,
            )
            records.append((header, data))
        self._check_free_space(items[0][0].form, sum(record_length(h.stored_len) for h, _ in records))
        seg_id, offsets = write_extent(
            self.appender,
            self._ctx.backend,
            self._ctx.buffers,
            records,
            flats[0].device if device else None,
            piece_bytes=self._ctx.config.write_piece_bytes,
        )
        return [
            _Written(key, h, digest, seg_id, at)
            for (key, _, digest), (h, _), at in zip(items, records[len(ns_records) :], offsets[len(ns_records) :])
        ]

    def _check_free_space(self, form: CacheForm, record_len: int) -> None:
        """Cheap pre-write check of the filesystem's free space (the budget is checked in the commit)."""
        cfg = self._ctx.config
        if cfg.min_free_bytes is None:
            return
        st = os.statvfs(self._ctx.seg_dir)
        if st.f_blocks and st.f_bavail * st.f_frsize < record_len + cfg.min_free_bytes:  # ramfs reports 0
            raise StoreFull(
                f"{self._ctx.root}: {st.f_bavail * st.f_frsize} bytes free, a {form.value} record needs {record_len} "
                f"plus {cfg.min_free_bytes} reserved: let the cleaner evict, or grow the disk",
                limit="disk",
            )

    def _commit(self, txn: lmdb.Transaction, written: list[_Written]) -> None:
        index = self._ctx.index
        ledger = Ledger(index, txn)
        seq = index.get_meta_u64(txn, b"seq", 1)
        added: collections.Counter[CacheForm] = collections.Counter()
        live: set[bytes] = set()  # namespaces found live in this transaction: a lookup decodes the entry's JSON
        for w in written:
            h, seg_id, offset = w.header, w.seg_id, w.offset
            if h.namespace not in live:
                ns = index.namespace(txn, h.namespace)
                if ns is None or not ns.live:
                    raise NamespaceRetired(
                        f"namespace {h.namespace.hex()} was retired during the write: nothing stored"
                    )
                live.add(h.namespace)
            assert h.form is not None  # a written object's header names its form (only namespace records do not)
            entry = IndexEntry(
                RecordState.LIVE,
                h.form,
                h.codec,
                seg_id,
                offset,
                h.record_len,
                h.payload_len,
                h.stored_len,
                h.payload_checksum,
                w.layout_digest,
                seq,
                h.created,
                flags=int(h.flags),
                device_checksum=h.device_checksum,
            )
            raw_key = encode_key(w.key)
            old = txn.get(raw_key, db=index.obj)
            if old is not None:  # a quarantined record is replaced
                ledger.forget(raw_key, old)
            ledger.count(raw_key, h.form, (h.record_len, h.payload_len, h.stored_len), +1)
            added[h.form] += h.record_len
            ledger.add(seg_id, offset, h.record_len)
            txn.put(raw_key, entry.pack(), db=index.obj)
            txn.delete(raw_key, db=index.gone)  # stored again after an eviction
            txn.put(u64_key(seq), raw_key, db=index.dirty)
            txn.put(raw_key, pack_time(h.created), db=index.atime)
            seq += 1
        self._check_budget(ledger.usage, added)
        index.put_meta_u64(txn, b"seq", seq)
        ledger.save()

    def _check_budget(self, usage: Usage, added: Mapping[CacheForm, int], *, at_most: bool = False) -> None:
        """Refuse a batch that brings `usage` (with the batch's records, `added` bytes of them per form) over the
        budget or a quota, saying the room that was left and what the batch needed: the write-back sizes its next
        try by them instead of asking again and again while nothing fits. `at_most`: `added` counts keys not looked
        up as new, so the figures are upper bounds."""
        cfg = self._ctx.config
        up_to = "up to " if at_most else ""
        total = sum(u.record_bytes for u in usage.values())
        if cfg.budget_bytes and total > cfg.budget_bytes:
            needed = sum(added.values())
            raise StoreFull(
                f"{self._ctx.root}: write would bring the store to {up_to}{total} bytes, over its budget of "
                f"{cfg.budget_bytes}: let the cleaner evict, or raise the budget",
                limit="budget",
                room=cfg.budget_bytes - (total - needed),
                needed=needed,
            )
        for form, quota in self._ctx.quotas.items():
            if usage[form].record_bytes > quota:
                raise StoreFull(
                    f"{self._ctx.root}: {form.value} records would use {up_to}{usage[form].record_bytes} bytes, "
                    f"over the {form.value} quota of {quota}: let the cleaner evict, or raise the quota",
                    limit=f"quota:{form.value}",
                    room=quota - (usage[form].record_bytes - added.get(form, 0)),
                    needed=added.get(form, 0),
                )

    def close(self) -> None:
        self.appender.close()


def _is_live(raw: bytes | memoryview) -> bool:
    entry = entry_or_none(raw)
    return entry is not None and entry.state is RecordState.LIVE


def _drain(pending: collections.deque[Future[list[_Written]]]) -> None:
    """Wait for extents still being written after a failure (their bytes are rewound with the batch)."""
    for fut in pending:
        try:
            fut.result()
        except BaseException:  # the first error is the one reported
            pass
    pending.clear()


def _cut_extents(items: list[Item], segment_bytes: int) -> list[list[Item]]:
    """Consecutive items in extents of about MAX_EXTENT_BYTES, never more than a segment holds (by payload size;
    a larger item stands alone)."""
    extents: list[list[Item]] = []
    plan = ExtentPlan()
    for item in items:
        n = item[1].numel()
        if not extents or not plan.fits(n, min(MAX_EXTENT_BYTES, segment_bytes)):
            extents.append([])
            plan = ExtentPlan()
        plan.add(n)
        extents[-1].append(item)
    return extents


def _compressed(flat: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(zstd_compress(_host_bytes(flat))), dtype=torch.uint8)


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as host memory, without a copy when it already lives there."""
    return (t.numpy() if t.device.type == "cpu" else t.cpu().numpy()).data  # ndarray.data: a memoryview


class _Room:
    """The bytes a batch may still add under the budget and each quota (None: no limit) while admission counts
    its new records in, from the store's usage before the batch."""

    __slots__ = ("_forms", "_total")

    def __init__(self, budget_bytes: int, quotas: Mapping[CacheForm, int], usage: Usage) -> None:
        self._total = budget_bytes - sum(u.record_bytes for u in usage.values()) if budget_bytes else None
        self._forms = {form: quota - usage[form].record_bytes for form, quota in quotas.items()}

    def take(self, form: CacheForm, n: int) -> bool:
        """Take a new record of `n` bytes out of the room; True once the batch so far does not fit."""
        over = False
        if self._total is not None:
            self._total -= n
            over = self._total < 0
        left = self._forms.get(form)
        if left is not None:
            self._forms[form] = left - n
            over = over or left < n
        return over

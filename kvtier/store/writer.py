"""The write side (the daemon's role): admission, batched appends, the commit, and the budget and quotas."""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future

import lmdb
import torch

from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.store.accounting import Ledger
from kvtier.store.context import StoreContext, entry_or_none, flat_uint8
from kvtier.store.errors import NamespaceError, StoreFull
from kvtier.store.index import IndexEntry, NamespaceEntry, RecordState, Usage, encode_key, pack_time, u64_key
from kvtier.store.io import AlignedBuffer
from kvtier.store.record import HEADER_BYTES, Codec, RecordHeader, payload_checksum, record_length, zstd_compress
from kvtier.store.segments import Appender

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

Item = tuple[ObjectKey, torch.Tensor, bytes]  # (key, payload, layout digest)


@dataclasses.dataclass(slots=True)
class _Prepared:
    key: ObjectKey
    header: RecordHeader
    layout_digest: bytes
    buf: AlignedBuffer


_Written = tuple[_Prepared, int, int]  # (record, segment id, offset)


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
        """Drop items already live (records are immutable, keys content-addressed); check namespaces."""
        index = self._ctx.index
        todo: list[Item] = []
        namespaces: dict[bytes, NamespaceEntry] = {}
        seen: set[bytes] = set()
        with index.read() as txn:
            for key, payload, digest in items:
                if key.namespace not in namespaces:
                    ns = index.namespace(txn, key.namespace)
                    if ns is None or not ns.live:
                        state = "not registered" if ns is None else "retired"
                        raise NamespaceError(
                            f"namespace {key.namespace.hex()} is {state}: register its version key first"
                        )
                    namespaces[key.namespace] = ns
                raw_key = encode_key(key)
                raw = txn.get(raw_key, db=index.obj)
                if raw_key in seen or (raw is not None and _is_live(raw)):
                    continue
                seen.add(raw_key)
                todo.append((key, payload, digest))
            usage = index.usage(txn)
        for key, payload, _ in todo:  # exact for uncompressed records; compressed ones are checked at commit
            if namespaces[key.namespace].codec_for(key.form) is Codec.NONE:
                usage[key.form].record_bytes += record_length(payload.numel())
        self._check_budget(usage)
        return todo, namespaces

    def _write_batch(self, items: list[Item], namespaces: dict[bytes, NamespaceEntry]) -> None:
        appender, buffers = self.appender, self._ctx.buffers
        now = time.time()
        window = max(2, 2 * self._ctx.config.io_threads)
        pending: collections.deque[Future[_Written]] = collections.deque()
        written: list[_Written] = []
        appender.begin_batch()
        sync_failed = False
        try:
            for key, payload, digest in items:
                codec = namespaces[key.namespace].codec_for(key.form)
                vk = namespaces[key.namespace].version_key.canonical()
                if len(items) == 1:  # a single record: no hop through the pool
                    written.append(self._prepare_and_write(key, payload, digest, codec, vk, now))
                    continue
                if len(pending) >= window:
                    written.append(pending.popleft().result())
                pending.append(
                    self._ctx.executor("write").submit(self._prepare_and_write, key, payload, digest, codec, vk, now)
                )
            while pending:
                written.append(pending.popleft().result())
            try:
                appender.sync_batch()
            except OSError:
                sync_failed = True
                raise
            self._ctx.index.update(lambda txn: self._commit(txn, written))
        except OSError as exc:
            self._drain(pending)
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
            self._drain(pending)
            appender.rewind(abandon=False)
            raise
        finally:
            appender.end_batch()
            for prep, _, _ in written:
                buffers.release(prep.buf)

    def _drain(self, pending: collections.deque[Future[_Written]]) -> None:
        for fut in pending:
            try:
                prep, _, _ = fut.result()
                self._ctx.buffers.release(prep.buf)
            except BaseException:  # the first error is the one reported
                pass
        pending.clear()

    def _prepare_and_write(
        self, key: ObjectKey, payload: torch.Tensor, digest: bytes, codec: Codec, vk: bytes, now: float
    ) -> _Written:
        """Pool task: stage header + payload in an aligned buffer, checksum, place at the tail, pwrite."""
        flat = flat_uint8(payload)
        n = flat.numel()
        stored_bytes: bytes | None = None
        if codec is Codec.ZSTD:
            stored_bytes = zstd_compress(flat.cpu().numpy().data)
            stored_len = len(stored_bytes)
        else:
            stored_len = n
        record_len = record_length(stored_len)
        self._check_free_space(key.form, record_len)
        buf = self._ctx.buffers.acquire(record_len)
        try:
            if stored_bytes is None:
                buf.tensor[HEADER_BYTES : HEADER_BYTES + n].copy_(flat)
            else:
                buf.mv[HEADER_BYTES : HEADER_BYTES + stored_len] = stored_bytes
            pad_at = HEADER_BYTES + stored_len
            buf.mv[pad_at:record_len] = bytes(record_len - pad_at)
            header = RecordHeader(
                key.namespace,
                key.block_hash,
                key.group,
                key.form,
                digest,
                codec,
                n,
                stored_len,
                now,
                payload_checksum(buf.mv[HEADER_BYTES:pad_at]),
                vk,
            )
            header.pack_into(buf.mv)
            prep = _Prepared(key, header, digest, buf)
            place = self.appender.place(record_len)
            place.file.pwrite_all(buf.mv[:record_len], place.offset)
            return prep, place.seg_id, place.offset
        except BaseException:
            self._ctx.buffers.release(buf)
            raise

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
        for prep, seg_id, offset in written:
            h = prep.header
            ns = index.namespace(txn, h.namespace)
            if ns is None or not ns.live:
                raise NamespaceError(f"namespace {h.namespace.hex()} was retired during the write: nothing stored")
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
                prep.layout_digest,
                seq,
                h.created,
            )
            raw_key = encode_key(prep.key)
            old = txn.get(raw_key, db=index.obj)
            if old is not None:  # a quarantined record is replaced
                ledger.forget(old)
            ledger.usage[h.form].add(h.record_len, h.payload_len, h.stored_len, +1)
            ledger.add(seg_id, offset, h.record_len)
            txn.put(raw_key, entry.pack(), db=index.obj)
            txn.delete(raw_key, db=index.gone)  # stored again after an eviction
            txn.put(u64_key(seq), raw_key, db=index.dirty)
            txn.put(raw_key, pack_time(h.created), db=index.atime)
            seq += 1
        self._check_budget(ledger.usage)
        ledger.save()
        index.put_meta_u64(txn, b"seq", seq)

    def _check_budget(self, usage: Usage) -> None:
        cfg = self._ctx.config
        total = sum(u.record_bytes for u in usage.values())
        if cfg.budget_bytes and total > cfg.budget_bytes:
            raise StoreFull(
                f"{self._ctx.root}: write would bring the store to {total} bytes, over its budget of "
                f"{cfg.budget_bytes}: let the cleaner evict, or raise the budget",
                limit="budget",
            )
        for form, quota in self._ctx.quotas.items():
            if usage[form].record_bytes > quota:
                raise StoreFull(
                    f"{self._ctx.root}: {form.value} records would use {usage[form].record_bytes} bytes, over the "
                    f"{form.value} quota of {quota}: let the cleaner evict, or raise the quota",
                    limit=f"quota:{form.value}",
                )

    def close(self) -> None:
        self.appender.close()


def _is_live(raw: bytes) -> bool:
    entry = entry_or_none(raw)
    return entry is not None and entry.state is RecordState.LIVE

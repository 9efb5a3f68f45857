"""The LMDB index: keys, checksummed values, and transactions that survive map growth in any process."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import lmdb
import numpy as np
import xxhash

from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.store.errors import CorruptRecord, FormatVersionError, QuarantineReason, StoreError
from kvtier.store.gil import DurableFirst
from kvtier.store.io import lock_holder
from kvtier.store.record import FORM_CODES, FORMAT_VERSION, FORMS_BY_CODE, HEADER_BYTES, Codec, Flags, leading_h64
from kvtier.store.record_v1 import V1_HEADER_BYTES

log = logging.getLogger(__name__)

T = TypeVar("T")

INDEX_DIR = "index.lmdb"
DB_NAMES = ("meta", "ns", "obj", "seg", "dirty", "atime", "gone")
PREFETCH_INDEX_BYTES = 256 << 20  # larger indexes are left to fault in as they are used
INITIAL_MAP_BYTES = 64 << 20
NAMESPACE_MEMO = 256  # decoded namespace entries an Index keeps (a store holds a few live ones, and the retired)
KEY_PREFIX_BYTES = 33  # namespace(16) + block hash(16) + form code(1), then the group name

_SUM = struct.Struct("<Q")
_U64 = struct.Struct(">Q")  # big-endian so LMDB's byte order is numeric order


def seal(body: bytes) -> bytes:
    """An index value: body followed by xxh3_64(body) (LMDB does not check values)."""
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def unseal(value: bytes | memoryview) -> bytes:
    body = bytes(value[:-8])
    if len(value) < 8 or _SUM.unpack_from(value, len(value) - 8)[0] != xxhash.xxh3_64_intdigest(body):
        raise CorruptRecord(QuarantineReason.INDEX_VALUE, "index value checksum mismatch")
    return body


def sealed_rows(values: Sequence[bytes | memoryview], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """`unseal` for many values at once: values of `dtype`'s size (its last field `seal`) as rows, and whether each
    one's seal checks."""
    joined = b"".join(values)
    rows = np.frombuffer(joined, dtype)
    seals = leading_h64(np.frombuffer(joined, np.uint8).reshape(len(values), dtype.itemsize), dtype.itemsize - 8)
    return rows, seals == rows["seal"]


TIME = struct.Struct("<d")  # body of an `atime` or `gone` value: unix time as f64


def pack_time(t: float) -> bytes:
    return seal(TIME.pack(t))


def unpack_time(value: bytes | memoryview) -> float:
    """A sealed time value; CorruptRecord if its seal or length is wrong."""
    body = unseal(value)
    if len(body) != TIME.size:
        raise CorruptRecord(QuarantineReason.INDEX_VALUE, f"time value of {len(body)} bytes, not {TIME.size}")
    return TIME.unpack(body)[0]


def encode_key(key: ObjectKey) -> bytes:
    """namespace(16) || block hash(16) || form code(1) || group (utf-8, 1..32 B)."""
    return key.namespace + key.block_hash + key_suffix(key.group, key.form)


def key_suffix(group: str, form: CacheForm) -> bytes:
    """An encoded key's bytes after the block hash: the same for every object of a group."""
    return bytes((FORM_CODES[form],)) + group.encode()


def decode_key(raw: bytes) -> ObjectKey:
    return ObjectKey(raw[:16], raw[16:32], raw[33:].decode(), FORMS_BY_CODE[raw[32]])


def u64_key(n: int) -> bytes:
    return _U64.pack(n)


class RecordState(enum.IntEnum):
    LIVE = 0
    QUARANTINED = 1


_STATES = tuple(RecordState)  # by value (0, 1, ...)
_CODECS = tuple(Codec)
_V2_SEALED = struct.Struct("<BBBBBBxxQQQQQ16s16sQddddQQ")  # IndexEntry._V2 and its seal: one value, one unpack
# The same value as a numpy record, for loads that parse a batch's entries at once (kvtier.store.packed); the
# field names are IndexEntry's, `version` and `seal` added.
ENTRY_V2_DTYPE = np.dtype(
    [
        ("version", "u1"),
        ("state", "u1"),
        ("form", "u1"),
        ("codec", "u1"),
        ("quarantine_reason", "u1"),
        ("flags", "u1"),
        ("_pad", "V2"),
        ("segment", "<u8"),
        ("offset", "<u8"),
        ("record_len", "<u8"),
        ("payload_len", "<u8"),
        ("stored_len", "<u8"),
        ("payload_checksum", "V16"),
        ("layout_digest", "V16"),
        ("seq", "<u8"),
        ("created", "<f8"),
        ("verified_at", "<f8"),
        ("pin_until", "<f8"),
        ("quarantined_at", "<f8"),
        ("device_checksum", "<u8"),
        ("seal", "<u8"),
    ]
)
assert ENTRY_V2_DTYPE.itemsize == _V2_SEALED.size


@dataclasses.dataclass(slots=True)
class IndexEntry:
    """Where a record lives and what the index knows about it (one LMDB value in `obj`). Not frozen: one is built
    per object of every load, and a frozen dataclass's __init__ costs twice as much; treat it as read-only."""

    state: RecordState
    form: CacheForm
    codec: Codec
    segment: int
    offset: int
    record_len: int
    payload_len: int
    stored_len: int
    payload_checksum: bytes
    layout_digest: bytes
    seq: int
    created: float
    verified_at: float = 0.0
    pin_until: float = 0.0
    quarantine_reason: int = 0
    quarantined_at: float = 0.0
    record_version: int = FORMAT_VERSION  # the format of the record it points at: 1 (4 KiB header block) or 2
    flags: int = int(Flags.XXH3)  # which checksums the record carries (v2; v1 records have xxh3 only)
    device_checksum: int = 0

    _V1 = struct.Struct("<BBBBBxxxQQQQQ16s16sQdddd")
    _V2 = struct.Struct("<BBBBBBxxQQQQQ16s16sQddddQ")

    @property
    def payload_offset(self) -> int:
        """Where the stored payload starts in the segment."""
        return self.offset + (V1_HEADER_BYTES if self.record_version == 1 else HEADER_BYTES)

    def pack(self) -> bytes:
        if self.record_version == 1:
            head: tuple[int, ...] = (1, self.state, FORM_CODES[self.form], self.codec, self.quarantine_reason)
            tail: tuple[int, ...] = ()
        else:
            head = (2, self.state, FORM_CODES[self.form], self.codec, self.quarantine_reason, self.flags)
            tail = (self.device_checksum,)
        return seal(
            (self._V1 if self.record_version == 1 else self._V2).pack(
                *head,
                self.segment,
                self.offset,
                self.record_len,
                self.payload_len,
                self.stored_len,
                self.payload_checksum,
                self.layout_digest,
                self.seq,
                self.created,
                self.verified_at,
                self.pin_until,
                self.quarantined_at,
                *tail,
            )
        )

    @classmethod
    def unpack(cls, value: bytes | memoryview) -> IndexEntry:
        """Parse a sealed value; CorruptRecord if its seal or any field is wrong. Runs once per object of every
        load: a v2 value is one unpack of body and seal together, the seal checked over the body in place."""
        try:
            if len(value) == _V2_SEALED.size:
                f = _V2_SEALED.unpack(value)
                if f[19] != xxhash.xxh3_64_intdigest(value[:-8]):
                    raise CorruptRecord(QuarantineReason.INDEX_VALUE, "index value checksum mismatch")
                if f[0] != 2:
                    raise ValueError(f"entry version {f[0]}")
                # Fields by position (see _V2): table lookups for the enums, not enum calls.
                return cls(*(_STATES[f[1]], FORMS_BY_CODE[f[2]], _CODECS[f[3]], *f[6:17], f[4], f[17], 2, f[5], f[18]))
            (version, state, form, codec, qr, seg, off, rlen, plen, slen, psum, ld, seq, created, ver, pin, qat) = (
                cls._V1.unpack(unseal(value))
            )
            if version != 1:
                raise ValueError(f"entry version {version}")
            return cls(
                _STATES[state],
                FORMS_BY_CODE[form],
                _CODECS[codec],
                seg,
                off,
                rlen,
                plen,
                slen,
                psum,
                ld,
                seq,
                created,
                ver,
                pin,
                qr,
                qat,
                1,
                int(Flags.XXH3),
            )
        except (struct.error, KeyError, IndexError, ValueError) as exc:
            raise CorruptRecord(QuarantineReason.INDEX_VALUE, f"unparseable index value: {exc}") from None

    @property
    def quarantine(self) -> QuarantineReason | None:
        return QuarantineReason(self.quarantine_reason) if self.state is RecordState.QUARANTINED else None


@dataclasses.dataclass(frozen=True, slots=True)
class NamespaceEntry:
    """A registered namespace: its full version key, live/retired, and codec per form."""

    version_key: VersionKey
    live: bool
    registered_at: float
    retired_at: float = 0.0
    codecs: tuple[tuple[str, str], ...] = ()
    # What an engine tier resolved its identity from (its canonical configuration): shown by audits; the
    # namespace itself depends only on `version_key`, which carries this document's digest.
    identity: Mapping[str, Any] | None = None

    def codec_for(self, form: CacheForm) -> Codec:
        return Codec.parse(dict(self.codecs).get(form.value, "none"))

    def pack(self) -> bytes:
        doc = {
            "version_key": self.version_key.to_dict(),
            "live": self.live,
            "registered_at": self.registered_at,
            "retired_at": self.retired_at,
            "codecs": dict(self.codecs),
        }
        if self.identity is not None:
            doc["identity"] = self.identity
        return seal(json.dumps(doc, sort_keys=True).encode())

    @classmethod
    def unpack(cls, value: bytes | memoryview) -> NamespaceEntry:
        try:
            doc = json.loads(unseal(value))
            return cls(
                VersionKey.from_dict(doc["version_key"]),
                bool(doc["live"]),
                float(doc["registered_at"]),
                float(doc["retired_at"]),
                tuple(sorted(doc["codecs"].items())),
                doc.get("identity"),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptRecord(QuarantineReason.INDEX_VALUE, f"unparseable namespace entry: {exc}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class SegmentEntry:
    """Accounting of one segment file: committed tail, bytes still referenced, last drop's txn id."""

    sealed: bool
    created: float
    tail: int = 0
    referenced: int = 0
    records: int = 0
    last_drop_txn: int = 0

    _S = struct.Struct("<BxxxxxxxdQQQQ")

    def pack(self) -> bytes:
        return seal(
            self._S.pack(self.sealed, self.created, self.tail, self.referenced, self.records, self.last_drop_txn)
        )

    @classmethod
    def unpack(cls, value: bytes | memoryview) -> SegmentEntry:
        sealed, created, tail, ref, n, drop = cls._S.unpack(unseal(value))
        return cls(bool(sealed), created, tail, ref, n, drop)


@dataclasses.dataclass(slots=True)
class FormUsage:
    """Per form: records, bytes on disk (record lengths), payload bytes, stored (post-codec) bytes."""

    records: int = 0
    record_bytes: int = 0
    payload_bytes: int = 0
    stored_bytes: int = 0

    def add(self, record_len: int, payload_len: int, stored_len: int, sign: int) -> None:
        self.records += sign
        self.record_bytes += sign * record_len
        self.payload_bytes += sign * payload_len
        self.stored_bytes += sign * stored_len


Usage = dict[CacheForm, FormUsage]


def pack_usage(usage: Usage) -> bytes:
    rows = {f.value: (u.records, u.record_bytes, u.payload_bytes, u.stored_bytes) for f, u in usage.items()}
    return seal(json.dumps(rows, sort_keys=True).encode())


def unpack_usage(value: bytes | memoryview | None) -> Usage:
    usage = {f: FormUsage() for f in FORM_CODES}
    if value is not None:
        for name, row in json.loads(unseal(value)).items():
            usage[CacheForm(name)] = FormUsage(*row)
    return usage


class _Gate:
    """Shared for transactions, exclusive for set_mapsize (LMDB requires no open txn in this process)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._exclusive = False

    def enter(self) -> None:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._active:
                self._cond.wait()
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


def _prefetch(data_file: str) -> None:
    """Start reading an index of up to PREFETCH_INDEX_BYTES into the page cache in the background: the map is
    opened with readahead off (random lookups of a large index should not drag in neighbours), so a cold
    restore's lookups would otherwise fault its pages in one synchronous read at a time."""
    try:
        fd = os.open(data_file, os.O_RDONLY)
    except OSError:
        return
    try:
        size = os.fstat(fd).st_size
        if 0 < size <= PREFETCH_INDEX_BYTES:
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


class Index:
    """One LMDB environment per process, opened after any fork; short transactions only."""

    def __init__(self, root: str, *, readonly: bool = False, create: bool = True, dirname: str = INDEX_DIR) -> None:
        path = os.path.join(root, dirname)
        if not os.path.isdir(path):
            if readonly or not create:
                raise StoreError(f"no index at {path}: create the store first, or run `kvtier store rebuild-index`")
            os.makedirs(path, exist_ok=True)
        self.path = path
        self.readonly = readonly
        self._gate = _Gate()
        self.writers = DurableFirst()  # the daemon's durable batches commit before the applier's decisions
        self._namespaces: dict[bytes, NamespaceEntry] = {}  # decoded entries by their bytes (see `namespace`)
        try:
            self.env = lmdb.open(
                path,
                map_size=INITIAL_MAP_BYTES,
                max_dbs=len(DB_NAMES),
                readonly=readonly,
                writemap=False,
                readahead=False,
                # read transactions of the load path's threads reuse their reader slots instead of taking
                # LMDB's shared reader-table lock for a new one (which the verifier's reader checks also take)
                max_spare_txns=16,
                # A commit syncs its data pages before it writes the meta page that points at them (never a torn
                # index), but leaves that page's own sync to `update`, after the write lock is released: the
                # lock, which every other writer (the daemon's durable offloads) waits for, then covers one sync
                # a commit, not two. The next commit's data sync covers an unsynced meta page too.
                sync=True,
                metasync=False,
                max_readers=256,
                subdir=True,
            )
        except lmdb.Error as exc:
            if "already open" in str(exc):
                raise StoreError(
                    f"{path} is already open in this process: share that DiskStore, or close it first"
                ) from None
            raise
        _prefetch(os.path.join(path, "data.mdb"))
        if readonly:  # handles opened inside a read txn die with it: open them without one
            dbs = {n: self._open_existing(n) for n in DB_NAMES}
        else:
            with self.env.begin(write=True) as txn:
                dbs = {n: self.env.open_db(n.encode(), txn=txn) for n in DB_NAMES}
        # One handle per named DB (FORMAT.md says what each holds).
        self.meta: Any = dbs["meta"]
        self.ns: Any = dbs["ns"]
        self.obj: Any = dbs["obj"]
        self.seg: Any = dbs["seg"]
        self.dirty: Any = dbs["dirty"]
        self.atime: Any = dbs["atime"]
        self.gone: Any = dbs["gone"]  # None in a read-only store no writer has opened since `gone` was added
        self._check_format()
        # Open for the environment's whole life, never closed before it: closing any descriptor of a file drops
        # every POSIX lock this process holds on it, LMDB's own on lock.mdb included (`_reader_table` queries them).
        self._lock_fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDONLY | os.O_CLOEXEC)

    def _open_existing(self, name: str) -> Any:
        """A named DB of a read-only environment. A store no writer has opened since `gone` was added lacks it:
        None stands in (no eviction tombstones: absent keys read as missing)."""
        try:
            return self.env.open_db(name.encode(), create=False)
        except lmdb.NotFoundError:
            if name != "gone":
                raise
            return None

    def _check_format(self) -> None:
        with self.read() as txn:
            raw = txn.get(b"format_version", db=self.meta)
        if raw is None:
            if self.readonly:
                raise StoreError(f"{self.path} has no format version: it is not a kvtier index")
            self.update(lambda txn: txn.put(b"format_version", seal(_U64.pack(FORMAT_VERSION)), db=self.meta))
            return
        (version,) = _U64.unpack(unseal(raw))
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                f"{self.path} has index format v{version}, this kvtier reads v{FORMAT_VERSION}: upgrade kvtier"
            )
        if version < FORMAT_VERSION and not self.readonly:
            # Its old records stay readable; new ones are v2, so a kvtier that reads only v1 must now refuse it.
            self.update(lambda txn: txn.put(b"format_version", seal(_U64.pack(FORMAT_VERSION)), db=self.meta))
            log.info(
                "%s: index format v%d -> v%d (v%d records stay readable)", self.path, version, FORMAT_VERSION, version
            )

    @contextlib.contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        """A short read transaction (never held across calls: it pins pages). Do not nest with update()."""
        txn = self._enter(write=False)
        try:
            yield txn
        finally:
            txn.abort()
            self._gate.leave()

    def _enter(self, write: bool) -> lmdb.Transaction:
        while True:
            self._gate.enter()
            try:
                return self.env.begin(write=write)
            except lmdb.MapResizedError:
                self._gate.leave()
            except BaseException:
                self._gate.leave()
                raise
            self._resize(0)  # another process grew the map: adopt its size, then retry

    def _resize(self, size: int) -> None:
        with self._gate.exclusive():
            self.env.set_mapsize(size)
        log.info("lmdb map size now %d bytes", self.env.info()["map_size"])

    def update(self, fn: Callable[[lmdb.Transaction], T], *, hold_back: bool = True) -> T:
        """Run fn in a write transaction and commit; on MapFullError grow the map and run it again. Durable when
        it returns: the commit's meta page is synced (`sync`) once the write lock is free for the next writer.
        `hold_back=False`: the caller already waited (`writers.before_write`) before taking a lock that a durable
        batch's commit takes too (the store's observe lock), which it must not hold while it waits."""
        if hold_back:
            self.writers.before_write()
        while True:
            with self.writers.wanting():  # an applier's transaction under way ends at its next item (gil.Piece)
                txn = self._enter(write=True)
            try:
                result = fn(txn)
                txn.commit()
                break
            except lmdb.MapFullError:
                txn.abort()
            except BaseException:
                txn.abort()
                raise
            finally:
                self._gate.leave()
            self._resize(self.env.info()["map_size"] * 2)
        self.sync()
        return result

    def sync(self) -> None:
        """Make every commit so far durable (its meta page synced; fdatasync, outside any write lock). Needed
        before a file the last commits stopped referencing is removed: the index on disk must never point at
        it after a crash."""
        self.env.sync(True)

    def namespace(self, txn: lmdb.Transaction, ns: bytes) -> NamespaceEntry | None:
        """Every batch written and every load looks its namespace up, and decoding the entry (checksum, JSON) cost
        more than the lookup: entries are kept decoded by their bytes, so one retired since is decoded anew (a
        corrupt one raises CorruptRecord each time: it is never kept)."""
        raw = txn.get(ns, db=self.ns)
        if raw is None:
            return None
        raw = bytes(raw)  # (bytes already: no transaction here hands out buffers)
        entry = self._namespaces.get(raw)
        if entry is None:
            if len(self._namespaces) >= NAMESPACE_MEMO:
                self._namespaces.clear()
            entry = self._namespaces[raw] = NamespaceEntry.unpack(raw)
        return entry

    def segment(self, txn: lmdb.Transaction, seg_id: int) -> SegmentEntry | None:
        raw = txn.get(u64_key(seg_id), db=self.seg)
        return None if raw is None else SegmentEntry.unpack(raw)

    def format_version(self) -> int:
        with self.read() as txn:
            return self.get_meta_u64(txn, b"format_version")

    def get_meta_u64(self, txn: lmdb.Transaction, name: bytes, default: int = 0) -> int:
        raw = txn.get(name, db=self.meta)
        return default if raw is None else _U64.unpack(unseal(raw))[0]

    def put_meta_u64(self, txn: lmdb.Transaction, name: bytes, value: int) -> None:
        txn.put(name, seal(_U64.pack(value)), db=self.meta)

    def usage(self, txn: lmdb.Transaction) -> Usage:
        return unpack_usage(txn.get(b"usage", db=self.meta))

    def put_usage(self, txn: lmdb.Transaction, usage: Usage) -> None:
        txn.put(b"usage", pack_usage(usage), db=self.meta)

    def reader_check(self) -> int:
        """Clear reader slots of dead processes; returns how many were cleared. Not in the daemon: LMDB takes its
        reader-table lock here once it finds a dead slot, py-lmdb holds the GIL through the call, and another
        process holds that lock while it registers a reader, and keeps it if stopped there (SIGSTOP, a frozen
        cgroup): every thread of the caller would wait for that process. The daemon clears dead slots in a child
        process (`kvtier.daemon.reader_slots`)."""
        return int(self.env.reader_check())

    def _reader_table(self) -> list[tuple[int, str, bool]]:
        """(pid, txnid or "-", alive) per used slot of LMDB's reader table, read without its lock
        (`env.readers()`); alive as LMDB's own reader check tells it (a process holds the byte at offset pid of
        lock.mdb: every process that registers a reader locks it), this process always."""
        slots = [(int(f[0]), f[2]) for f in map(str.split, self.env.readers().splitlines()[1:]) if len(f) == 3]
        me = os.getpid()
        return [(pid, txnid, pid == me or lock_holder(self._lock_fd, pid, 1) is not None) for pid, txnid in slots]

    def dead_readers(self) -> list[int]:
        """Pids in the reader table whose process is gone (their slots wait for `reader_check`); takes no lock."""
        return sorted({pid for pid, _, alive in self._reader_table() if not alive})

    def oldest_reader_txnid(self) -> int | None:
        """The oldest snapshot any live process is reading (LMDB's reader table), or None if nobody reads. Takes
        no lock: a dead process's slot is skipped rather than cleared (see `reader_check`)."""
        return min((int(txnid) for _, txnid, alive in self._reader_table() if alive and txnid != "-"), default=None)

    def close(self) -> None:
        self.env.close()
        os.close(self._lock_fd)  # after LMDB's locks went with the environment

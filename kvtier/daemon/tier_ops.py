"""The raw tier ops: a client's own keys and namespace served from the daemon's store (no pools, no leases).

`tier_open` registers the namespace and maps the client's staging memfd; `tier_has`, `tier_store` and
`tier_load` then name objects by (block hash, group index) and bytes by offset in that staging region.

No torch at import, nor in `tier_open`, `tier_has` and `tier_keys`: a restarted daemon answers engines' lookups
while torch is still loading behind serving. The staging region becomes a tensor at the first load or store
(which waits for torch's import if it is still under way).
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import mmap
import os
import stat
import threading
from typing import TYPE_CHECKING

from kvtier.core.forms import CacheForm
from kvtier.core.hashing import HASH_BYTES
from kvtier.core.tier import LoadRequest, LowerTier, ObjectKey
from kvtier.core.versions import OPTIONAL_FIELDS, REQUIRED_FIELDS, VersionKey
from kvtier.daemon.session import Session
from kvtier.daemon.tier_stats import TierStats
from kvtier.store import DiskStore, StoreFull, StoreRequestError
from kvtier.wire import messages as P
from kvtier.wire.errors import BadRange, WrongType

if TYPE_CHECKING:
    import torch

    from kvtier.daemon.events import EventPublisher

log = logging.getLogger(__name__)
MAX_KEY_PAGE = 1 << 16  # keys per tier_keys reply: a 16-byte hash and a group byte each, so about a megabyte


@dataclasses.dataclass(slots=True)
class TierConn:
    """A raw tier connection: its namespace, its groups (by index), and the client's staging region mapped here."""

    namespace: bytes
    groups: list[tuple[str, CacheForm]]
    mapping: mmap.mmap | None = None  # None when the client asked for no staging region
    staging: torch.Tensor | None = None  # uint8 over `mapping`, made by the first load or store (`_staging`)

    def keys(self, items: list[P.TierItem]) -> tuple[list[ObjectKey], list[bytes]]:
        keys: list[ObjectKey] = []
        for it in items:
            if not 0 <= it.group < len(self.groups):
                raise WrongType(
                    f"group index {it.group} is not one of the {len(self.groups)} groups sent with tier_open"
                )
            if len(it.block_hash) != HASH_BYTES or len(it.layout_digest) != 16:
                raise WrongType(f"block_hash and layout_digest must be {HASH_BYTES}-byte digests")
            name, form = self.groups[it.group]
            keys.append(ObjectKey(self.namespace, it.block_hash, name, form))
        return keys, [it.layout_digest for it in items]

    def ranges(self, items: list[P.TierItem]) -> list[torch.Tensor]:
        """Each item's bytes in the staging region; any range outside it is a BadRange (nothing is read or written)."""
        size = len(self.mapping) if self.mapping is not None else 0
        for it in items:
            if it.nbytes <= 0 or it.offset < 0 or it.offset + it.nbytes > size:
                raise BadRange(
                    f"bytes [{it.offset}, {it.offset + it.nbytes}) are not a non-empty range"
                    f" of the {size}-byte staging region"
                )
        staging = self._staging()
        return [staging[it.offset : it.offset + it.nbytes] for it in items]

    def _staging(self) -> torch.Tensor:
        """The staging region as a uint8 tensor (the connection's own thread calls this: no lock)."""
        if self.staging is None:
            import torch  # the first load or store of the connection; torch has usually loaded behind serving

            assert self.mapping is not None  # ranges() found the items inside a non-empty region
            self.staging = torch.frombuffer(self.mapping, dtype=torch.uint8)
        return self.staging

    def close(self) -> None:
        self.staging = None
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a load still holds a view; the mapping goes with it
                pass
            self.mapping = None


def _map_staging(fds: list[int], size: int) -> mmap.mmap:
    """Map the client's staging memfd, which must be sealed against shrinking (a shrunk mapping SIGBUSes the daemon)."""
    if len(fds) != 1:
        raise WrongType(f"tier_open with staging_bytes needs exactly one memfd as SCM_RIGHTS, got {len(fds)}")
    fd = fds[0]
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < size:
        raise WrongType(f"the staging descriptor must be a memfd of at least {size} bytes")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise WrongType(
            "the staging memfd must carry F_SEAL_SHRINK (memfd_create with MFD_ALLOW_SEALING, then F_ADD_SEALS)"
        )
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise WrongType(f"cannot map the staging memfd read-write ({exc.strerror}): open it O_RDWR") from None


class TierOps:
    """The raw tier connections of one daemon, by owner (connection), over its store."""

    def __init__(
        self, store: DiskStore, codec: str, lower: LowerTier | None = None, events: EventPublisher | None = None
    ) -> None:
        self.store = store
        self.lower = lower if lower is not None else store  # objects go through the tier chain where there is one
        self.codec = codec
        self.events = events
        self.stats = TierStats()  # per namespace: what engines asked, hit, loaded, stored
        self._lock = threading.Lock()
        self._conns: dict[int, TierConn] = {}

    def open(self, session: Session, req: P.TierOpen, fds: list[int]) -> P.TierOpenOk:
        """Register the client's namespace and map its staging memfd (the server closes `fds` afterwards)."""
        if not set(REQUIRED_FIELDS) <= set(req.version_key) <= {*REQUIRED_FIELDS, *OPTIONAL_FIELDS}:
            raise WrongType(
                f"version_key must have the fields {sorted(REQUIRED_FIELDS)} and may have {sorted(OPTIONAL_FIELDS)}"
            )
        version_key = VersionKey.from_dict(req.version_key)
        groups: list[tuple[str, CacheForm]] = []
        for name, form in req.groups:
            if not name or len(name.encode()) > 32 or name in (g for g, _ in groups):
                raise WrongType(f"group names must be distinct and 1..32 bytes, got {name!r}")
            try:
                groups.append((name, CacheForm(form)))
            except ValueError:
                forms = ", ".join(f.value for f in CacheForm)
                raise WrongType(f"group {name!r}: form must be one of {forms}, not {form!r}") from None
        if not groups:
            raise WrongType("tier_open needs at least one group")
        if req.staging_bytes < 0:
            raise WrongType(f"staging_bytes must be >= 0, got {req.staging_bytes}")
        mapping = _map_staging(fds, req.staging_bytes) if req.staging_bytes else None
        try:
            codecs = {form: self.codec for _, form in groups} if self.codec != "none" else None
            namespace = self.store.register_namespace(version_key, codecs=codecs, identity=req.identity)
        except BaseException:
            if mapping is not None:
                mapping.close()
            raise
        with self._lock:
            old = self._conns.get(session.owner)
            self._conns[session.owner] = TierConn(namespace, groups, mapping)
        if old is not None:  # a second tier_open on the connection replaces the first
            self.stats.closed(old.namespace)
        self.stats.opened(namespace, version_key)
        if self.events is not None:
            self.events.name_groups(namespace, [name for name, _ in groups])
        log.info(
            "connection %d (pid %d): tier namespace %s, %d groups, %d staging bytes",
            session.owner,
            session.peer.pid,
            namespace.hex(),
            len(groups),
            req.staging_bytes,
        )
        return P.TierOpenOk(namespace, str(self.store.root), self.store.io_backend)

    def _conn(self, session: Session) -> TierConn:
        with self._lock:
            return self._conns[session.owner]

    def has(self, session: Session, req: P.TierHas) -> P.TierReasons:
        conn = self._conn(session)
        keys, digests = conn.keys(req.items)
        reasons = self.lower.has(keys, digests)
        self.stats.looked_up(conn.namespace, reasons)
        return P.TierReasons(bytes(reasons))

    def keys(self, session: Session, req: P.TierKeys) -> P.TierKeyPage:
        """A page of the namespace's live keys, for the client's in-memory key set (its groups only)."""
        conn = self._conn(session)
        if not 0 <= req.limit <= MAX_KEY_PAGE:
            raise WrongType(f"tier_keys limit must be 0..{MAX_KEY_PAGE}, got {req.limit}")
        try:
            page = self.store.live_keys(conn.namespace, req.after, req.limit)
        except StoreRequestError as exc:
            raise WrongType(str(exc)) from None
        index = {name: i for i, (name, _) in enumerate(conn.groups)}
        live = [(h, index[g]) for h, g in page.keys if g in index]
        return P.TierKeyPage(b"".join(h for h, _ in live), bytes(i for _, i in live), page.cursor, page.txn)

    def store_many(self, session: Session, req: P.TierStore) -> P.TierStored:
        """Persist the staged objects with one store_many (one fdatasync + one commit); answered after the commit."""
        conn = self._conn(session)
        keys, digests = conn.keys(req.items)
        payloads = conn.ranges(req.items)
        try:
            self.lower.store_many(list(zip(keys, payloads, digests)))
        except StoreFull as exc:
            return P.TierStored(0, exc.limit, str(exc))
        self.stats.stored(conn.namespace, [it.nbytes for it in req.items])
        return P.TierStored(len(keys))

    def load(self, session: Session, req: P.TierLoad) -> P.TierReasons:
        """Read and verify each record into its staged range (a failed one is quarantined: do not use its range)."""
        conn = self._conn(session)
        keys, digests = conn.keys(req.items)
        outs = conn.ranges(req.items)
        reasons = self.lower.load_into([LoadRequest(k, o, d) for k, o, d in zip(keys, outs, digests)])
        self.stats.loaded(conn.namespace, reasons, [it.nbytes for it in req.items])
        return P.TierReasons(bytes(reasons))

    def release_owner(self, owner: int) -> None:
        """Unmap the staging region of a connection that went away."""
        with self._lock:
            conn = self._conns.pop(owner, None)
        if conn is not None:
            self.stats.closed(conn.namespace)
            conn.close()

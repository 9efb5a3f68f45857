"""`TierClient`: the daemon's disk store as a lower tier for an engine that brings its own keys and namespace.

An engine with its own offloading (vLLM) names objects by its own block hashes, under a namespace of its
own version key, and has no use for kvtier's profiles or pools. A `TierClient` opens that namespace on a
connection (`tier_open`) and shares a staging region with the daemon: a sealed memfd mapped by both, so
payload bytes never cross the socket. It answers like a `DiskStore` (`has`, `load_into`, `store_many`),
so a caller swaps one for the other; loads copy out of the staging region only where the daemon verified
the record, so a corrupt record never reaches the caller's buffer.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvtier.client.errors import TierFull
from kvtier.core.forms import CacheForm, Reason
from kvtier.core.tier import KeyPage, LoadRequest, MoreRequests, ObjectKey, every_request
from kvtier.core.versions import VersionKey
from kvtier.wire import Connection
from kvtier.wire import errors as E
from kvtier.wire import messages as P


class TierClient(Connection):
    """One namespace and its groups [(name, form)] served from the daemon's store through a staging region."""

    def __init__(
        self,
        socket_path: str | Path | None,
        version_key: VersionKey,
        groups: Sequence[tuple[str, CacheForm]],
        staging_bytes: int,
        *,
        timeout_s: float | None = 60.0,
        name: str = "",
        identity: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(socket_path, timeout_s=timeout_s, name=name)
        self._groups = {g: i for i, (g, _) in enumerate(groups)}
        self._open_req = P.TierOpen(
            version_key.to_dict(), [(g, f.value) for g, f in groups], max(staging_bytes, 0), identity
        )
        self._staged = threading.Lock()  # the staging region holds one request's bytes at a time
        self._mapping: mmap.mmap | None = None
        self.staging = torch.empty(0, dtype=torch.uint8)
        try:
            with self._lock:
                self._tier_open(None)
        except BaseException:
            self.close()
            raise

    def _tier_open(self, timeout_s: float | None) -> None:
        """Open the namespace on the current connection with a staging region of its own.

        A new connection never reuses the previous one's region: a daemon that answers a timed-out request
        late may still write into the old region, so nothing is ever read from (or staged in) it again.
        """
        size = self._open_req.staging_bytes
        fd = -1
        try:
            if size > 0:
                fd = os.memfd_create("kvtier-tier-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(fd, size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
                mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                self._unmap()
                self._mapping = mapping
                self.staging = torch.frombuffer(mapping, dtype=torch.uint8)
            reply: P.TierOpenOk = self._exchange(
                self._open_req, send_fds=[fd] if fd >= 0 else None, timeout_s=timeout_s
            )
        finally:
            if fd >= 0:
                os.close(fd)
        self.namespace = reply.namespace
        self.store_root = reply.store
        self.io_backend = reply.io_backend

    def _reopened(self, timeout_s: float | None) -> None:
        self._tier_open(timeout_s)

    # -- raw ops: items name bytes in the staging region ---------------------------------------------

    def item(self, key: ObjectKey, layout_digest: bytes, offset: int = 0, nbytes: int = 0) -> P.TierItem:
        """The wire item for `key` (its namespace and group must be the ones this connection opened)."""
        group = self._groups.get(key.group)
        if key.namespace != self.namespace or group is None:
            raise E.WrongType(
                f"key {key.namespace.hex()}/{key.group} is not in the namespace and groups this TierClient opened"
            )
        return P.TierItem(key.block_hash, group, layout_digest, offset, nbytes)

    def load_staged(self, items: list[P.TierItem], epoch: int | None = None) -> list[Reason]:
        """Reasons per item; with `epoch` (from `connected()`), only on the connection whose region was staged."""
        reply: P.TierReasons = self._call(P.TierLoad(items), epoch=epoch)
        return [Reason(r) for r in reply.reasons]

    def store_staged(self, items: list[P.TierItem], epoch: int | None = None) -> int:
        """Objects committed; TierFull (nothing of the batch visible) over the store's budget, a quota or the disk."""
        reply: P.TierStored = self._call(P.TierStore(items), epoch=epoch)
        if reply.full_limit:
            raise TierFull(reply.full_message, limit=reply.full_limit)
        return reply.stored

    # -- what a DiskStore answers ----------------------------------------------------------------------

    def has(self, keys: Sequence[ObjectKey], layout_digests: Sequence[bytes]) -> list[Reason]:
        """Per key: OK if a load would be attempted, else why not (index only)."""
        if len(keys) != len(layout_digests):
            raise E.WrongType("has(): keys and layout_digests differ in length: pass one digest per key")
        reply: P.TierReasons = self._call(P.TierHas([self.item(k, d) for k, d in zip(keys, layout_digests)]))
        return [Reason(r) for r in reply.reasons]

    def live_keys(self, after: bytes = b"", limit: int = 4096) -> KeyPage:
        """A page of the namespace's live keys (as `DiskStore.live_keys` answers, in this connection's groups)."""
        reply: P.TierKeyPage = self._call(P.TierKeys(after, limit))
        names = list(self._groups)
        hashes = reply.hashes
        keys = [(hashes[16 * i : 16 * i + 16], names[g]) for i, g in enumerate(reply.groups)]
        return KeyPage(keys, reply.cursor, reply.txn)

    def load_into(self, requests: Sequence[LoadRequest], more: MoreRequests | None = None) -> list[Reason]:
        """Fill each `out` with its verified payload; an `out` whose reason is not OK is left untouched."""
        requests = every_request(requests, more)
        reasons = [Reason.MISSING] * len(requests)
        outs = [_flat(r.out, writable=True) for r in requests]
        with self._staged:
            for batch in self._batches([o.numel() for o in outs]):
                epoch, staging = self.connected(), self.staging  # the region of the connection the load goes to
                items = [
                    self.item(requests[i].key, requests[i].layout_digest, off, outs[i].numel()) for i, off in batch
                ]
                # read only after an OK answer to this very request (a failed call raises before any copy)
                for (i, off), reason in zip(batch, self.load_staged(items, epoch)):
                    reasons[i] = reason
                    if reason is Reason.OK:
                        outs[i].copy_(staging[off : off + outs[i].numel()])
        return reasons

    def store_many(self, items: Sequence[tuple[ObjectKey, torch.Tensor, bytes]]) -> None:
        """Persist objects; each staging-sized batch is durable (fdatasync + commit) when its reply comes."""
        payloads = [_flat(p) for _, p, _ in items]
        with self._staged:
            for batch in self._batches([p.numel() for p in payloads]):
                epoch, staging = self.connected(), self.staging
                wire = []
                for i, off in batch:
                    n = payloads[i].numel()
                    staging[off : off + n].copy_(payloads[i])
                    wire.append(self.item(items[i][0], items[i][2], off, n))
                self.store_staged(wire, epoch)

    def _batches(self, sizes: list[int]) -> Iterator[list[tuple[int, int]]]:
        """(index, staging offset) runs that fit the staging region, in order."""
        cap = self.staging.numel()
        batch: list[tuple[int, int]] = []
        used = 0
        for i, n in enumerate(sizes):
            if n > cap:
                raise E.WrongType(
                    f"an object of {n} bytes does not fit the {cap}-byte staging region:"
                    " open the TierClient with more staging_bytes"
                )
            if used + n > cap:
                yield batch
                batch, used = [], 0
            batch.append((i, used))
            used += n
        if batch:
            yield batch

    def _unmap(self) -> None:
        self.staging = torch.empty(0, dtype=torch.uint8)
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:  # a caller still holds a view of the staging region; the mapping goes with it
                pass
            self._mapping = None

    def close(self) -> None:
        self._unmap()
        super().close()

    def __enter__(self) -> TierClient:
        return self


def _flat(t: torch.Tensor, *, writable: bool = False) -> torch.Tensor:
    """The bytes of `t` as a flat uint8 view (a copy only for a non-contiguous source)."""
    if not t.is_contiguous():
        if writable:
            raise E.WrongType("load_into needs contiguous destination tensors")
        t = t.contiguous()
    return t.detach().view(torch.uint8).reshape(-1) if t.dtype is not torch.uint8 else t.detach().reshape(-1)

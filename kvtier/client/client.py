"""`kvtier.client.Client`: what an inference engine links to talk to the daemon.

Tensors move through the pools the client maps at attach; the socket carries only hashes, slot
numbers and check vectors. One request at a time per Client (a lock serialises threads); open one
Client per engine process (or per thread that wants its own queue).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
import numpy as np
import torch

from kvtier.client.pools import MappedPool, map_pool
from kvtier.core.checkvector import CheckVector
from kvtier.core.forms import CacheForm, Route
from kvtier.core.hashing import HASH_BYTES, block_hashes
from kvtier.wire import Connection
from kvtier.wire import errors as E
from kvtier.wire import messages as P


@dataclasses.dataclass(frozen=True, slots=True)
class Lease:
    """A handle on one pool slot: valid while its lookup is held (the daemon never evicts a leased slot)."""

    group: str
    form: CacheForm
    block: int
    slot: int
    generation: int
    route: Route


@dataclasses.dataclass(slots=True)
class LookupResult:
    """The check vector and, per (group, block) that is REUSE / RECOVER, the leased slot (-1 elsewhere)."""

    lookup_id: int
    check_vector: CheckVector
    slots: np.ndarray  # int64 (groups, blocks)
    generations: np.ndarray
    released: bool = False
    epoch: int = 0  # the client's connection it was made on: its leases end with that connection

    @property
    def hit_tokens(self) -> int:
        return self.check_vector.hit_tokens

    @property
    def needs_load(self) -> bool:
        return bool((self.check_vector.routes == Route.RECOVER).any())

    @property
    def leases(self) -> list[Lease]:
        cv = self.check_vector
        gi, bi = np.nonzero(self.slots >= 0)
        return [
            Lease(
                cv.group_names[g],
                cv.group_forms[g],
                int(b),
                int(self.slots[g, b]),
                int(self.generations[g, b]),
                Route(int(cv.routes[g, b])),
            )
            for g, b in zip(gi.tolist(), bi.tolist())
        ]


@dataclasses.dataclass(frozen=True, slots=True)
class LoadReport:
    loaded_objects: int
    loaded_bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadReport:
    written: int  # objects copied into pool slots and sealed
    skipped: int  # already cached (or being written by another client): nothing to write
    refused: int  # no slot to be had (admission: everything pinned, leased or in flight); not cached
    persisted: bool  # True when the store committed them (durable=True)


@dataclasses.dataclass(frozen=True, slots=True)
class PrewarmReport:
    check_vector: CheckVector
    loaded_objects: int
    loaded_bytes: int
    pinned: int
    seconds: float

    @property
    def hit_tokens(self) -> int:
        return self.check_vector.hit_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class Attachment:
    profile: str
    namespace: bytes
    hash_block_tokens: int
    device: str
    lease_ttl_s: float
    pools: dict[str, MappedPool]


def _cv(wire: P.CheckVectorWire) -> CheckVector:
    return CheckVector.from_wire(msgspec.structs.asdict(wire))


def _token_ids(tokens: object) -> np.ndarray:
    """A prompt as a 1-D integer array, or WrongType saying what was given instead."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, np.ndarray)):
        raise E.WrongType(
            f"tokens must be token ids (a list of ints, a 1-D numpy array or torch tensor), got {type(tokens).__name__}"
        )
    ids = np.asarray(tokens)
    if ids.ndim != 1:
        raise E.WrongType(f"tokens must be one-dimensional (one prompt), got shape {ids.shape}")
    if ids.size and ids.dtype.kind not in "iu":
        raise E.WrongType(f"tokens must be integer token ids, got {ids.dtype} values")
    return ids


def _lookup_result(result: object, op: str) -> LookupResult:
    if not isinstance(result, LookupResult):
        raise E.WrongType(f"{op}() takes the LookupResult of lookup(), got {type(result).__name__}")
    return result


def _grid(data: bytes, cv: CheckVector) -> np.ndarray:
    return np.frombuffer(data, dtype="<i8").reshape(cv.routes.shape)


class Client(Connection):
    """A connection to the kvtier daemon: `attach` once, then lookup / load / release / offload / prewarm.

    `lookup_timeout_s` bounds a lookup on its own (an engine's scheduler waits at most that long; a hung daemon
    costs a miss: `DaemonTimeout`, which the engine treats as one). After a call times out the connection is
    closed and the next call reconnects and attaches again; lookups made before that hold nothing any more.
    """

    def __init__(
        self,
        socket_path: str | Path | None = None,
        *,
        timeout_s: float | None = 60.0,
        lookup_timeout_s: float | None = None,
        name: str = "",
    ) -> None:
        super().__init__(socket_path, timeout_s=timeout_s, name=name)
        self.lookup_timeout_s = lookup_timeout_s
        self.attachment: Attachment | None = None
        self._attach_req: P.Attach | None = None

    # -- plumbing -----------------------------------------------------------------------------------

    def _attached(self) -> Attachment:
        if self.attachment is None:
            raise E.OutOfOrder("attach(profile) first")
        return self.attachment

    def hashes(self, tokens: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
        """The chained block hashes of every whole block of `tokens`, concatenated (what lookups send)."""
        att = self._attached()
        return b"".join(block_hashes(att.namespace, _token_ids(tokens), att.hash_block_tokens))

    # -- the API ------------------------------------------------------------------------------------

    def attach(self, profile: str) -> Attachment:
        """Attach to a profile the daemon serves and map its pools into this process."""
        req = P.Attach(profile)
        fds: list[int] = []
        try:
            reply: P.AttachOk = self._call(req, fds)
            self._mapped(reply, fds)
        finally:
            for fd in fds:
                os.close(fd)
        self._attach_req = req
        assert self.attachment is not None
        return self.attachment

    def _mapped(self, reply: P.AttachOk, fds: list[int]) -> None:
        pools = {info.group: map_pool(info, fds) for info in reply.pools}
        old, self.attachment = (
            self.attachment,
            Attachment(reply.profile, reply.namespace, reply.hash_block_tokens, reply.device, reply.lease_ttl_s, pools),
        )
        if old is not None:
            for pool in old.pools.values():
                pool.close()

    def _reopened(self, timeout_s: float | None) -> None:
        """Attach again on the fresh connection (the daemon may serve a newer namespace by now)."""
        if self._attach_req is None:
            return
        fds: list[int] = []
        try:
            self._mapped(self._exchange(self._attach_req, fds, timeout_s=timeout_s), fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _current(self, result: LookupResult) -> None:
        if result.epoch != self.epoch:
            raise E.OutOfOrder(
                f"lookup {result.lookup_id} was made on a connection closed since (a call failed);"
                " its leases are gone: look up again"
            )

    def lookup(
        self, tokens: Sequence[int] | np.ndarray | torch.Tensor | None = None, *, hashes: bytes | None = None
    ) -> LookupResult:
        """Longest usable hit for `tokens` (or precomputed concatenated `hashes`); leases every REUSE / RECOVER slot."""
        self.connected(self.lookup_timeout_s)  # a reconnect may bring a new namespace: hash under the lookup's one
        if hashes is None:
            hashes = self.hashes(tokens)
        reply: P.LookupOk = self._call(P.Lookup(hashes), timeout_s=self.lookup_timeout_s)
        cv = _cv(reply.check_vector)
        return LookupResult(reply.lookup_id, cv, _grid(reply.slots, cv), _grid(reply.generations, cv), epoch=self.epoch)

    def load(self, result: LookupResult) -> LoadReport:
        """Recover the RECOVER objects into their leased slots; `result` is updated (REUSE now, or a shorter hit)."""
        result = _lookup_result(result, "load")
        self._current(result)
        reply: P.LoadOk = self._call(P.Load(result.lookup_id), epoch=result.epoch)
        cv = _cv(reply.check_vector)
        result.check_vector, result.slots, result.generations = cv, _grid(reply.slots, cv), _grid(reply.generations, cv)
        return LoadReport(reply.loaded_objects, reply.loaded_bytes, reply.seconds)

    def read(self, result: LookupResult, group: str, block: int) -> torch.Tensor:
        """A view of one REUSE object in the mapped pool; valid until `release(result)`."""
        result = _lookup_result(result, "read")
        if result.released:
            raise E.OutOfOrder(f"lookup {result.lookup_id} was released; look up again")
        self._current(result)
        cv = result.check_vector
        if group not in cv.group_names:
            raise E.WrongType(f"no cache group {group!r} in this profile; its groups: {', '.join(cv.group_names)}")
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
            raise E.WrongType(f"block must be a block index (int), got {type(block).__name__}")
        if not 0 <= block < cv.num_blocks:
            raise E.BadRange(f"block {block} is outside this lookup's {cv.num_blocks} blocks (0..{cv.num_blocks - 1})")
        route = cv.route(group, int(block))
        if route is not Route.REUSE:
            hint = "call load(result) first" if route is Route.RECOVER else "recompute it"
            raise E.OutOfOrder(f"{group} block {block} is {route.name}, not REUSE: {hint}")
        gi = cv.group_names.index(group)
        return self._attached().pools[group].object_view(int(result.slots[gi, block]))

    def release(self, result: LookupResult) -> int:
        """Give the lookup's leases back (idempotent); returns 1 if this call released them, 0 if already released."""
        result = _lookup_result(result, "release")
        if result.released:
            return 0
        if result.epoch != self.epoch:  # its connection is gone, and the daemon released everything it held
            result.released = True
            return 0
        reply: P.Released = self._call(P.Release(result.lookup_id), epoch=result.epoch)
        result.released = True
        return reply.released

    def offload(
        self,
        tokens: Sequence[int] | np.ndarray | torch.Tensor,
        caches: Mapping[str, Mapping[int, torch.Tensor]],
        durable: bool = False,
    ) -> OffloadReport:
        """Write new objects: `caches[group][block]` is that block's object (any dtype, exactly the layout's bytes).

        Acknowledged after the pool write; with `durable`, after the store commit.
        """
        epoch = self.connected()  # first: a reconnect may bring a new namespace (hashes) and pool mappings
        att = self._attached()
        hashes = self.hashes(tokens)
        n_blocks = len(hashes) // HASH_BYTES
        if not isinstance(caches, Mapping) or not all(isinstance(c, Mapping) for c in caches.values()):
            raise E.WrongType(
                f"caches must map group name -> {{block index: tensor}}, got {type(caches).__name__}"
                + ("" if not isinstance(caches, Mapping) else " of non-mappings")
            )
        groups = list(caches)
        blocks = [sorted(caches[g]) for g in groups]
        for g, bs in zip(groups, blocks):
            if g not in att.pools:
                raise E.WrongType(f"profile {att.profile} has no cache group {g!r}; its groups: {', '.join(att.pools)}")
            bad = next((caches[g][b] for b in bs if not isinstance(caches[g][b], torch.Tensor)), None)
            if bad is not None:
                raise E.WrongType(f"{g}: each block's object must be a torch.Tensor, got {type(bad).__name__}")
            if bs and (bs[0] < 0 or bs[-1] >= n_blocks):
                raise E.BadRange(f"{g}: block indices must be within the {n_blocks} whole blocks of tokens")
            need = att.pools[g].info.object_bytes
            for b in bs:
                t = caches[g][b]
                if t.numel() * t.element_size() != need:
                    raise E.WrongType(f"{g} block {b}: {t.numel() * t.element_size()} bytes, the layout needs {need}")
        reply: P.OffloadOk = self._call(P.Offload(hashes, groups, blocks), epoch=epoch)
        written = 0
        try:
            for g, bs, slots in zip(groups, blocks, reply.slots):
                pool = att.pools[g]
                for b, slot in zip(bs, slots):
                    if slot >= 0:
                        pool.object_bytes(slot).copy_(caches[g][b].detach().contiguous().view(torch.uint8).reshape(-1))
                        written += 1
            if att.device != "cpu":
                torch.cuda.synchronize()
        except BaseException:
            self._call(P.Release(reply.offload_id), epoch=epoch)  # give the reserved slots back unsealed
            raise
        # the offload is this connection's: sealing it on another would name a stranger's (or no) reservation
        sealed: P.SealOk = self._call(P.Seal(reply.offload_id, durable), epoch=epoch)
        skipped = sum(len(bs) for bs in blocks) - written - reply.refused
        return OffloadReport(sealed.sealed, skipped, reply.refused, sealed.persisted)

    def prewarm(
        self,
        tokens: Sequence[int] | np.ndarray | torch.Tensor | None = None,
        *,
        hashes: bytes | None = None,
        ttl_s: float = 600.0,
    ) -> PrewarmReport:
        """Longest usable hit loaded into the pool and pinned for `ttl_s` (nothing leased to this client)."""
        if hashes is None:
            hashes = self.hashes(tokens)
        reply: P.PrewarmOk = self._call(P.Prewarm(hashes, ttl_s))
        return PrewarmReport(
            _cv(reply.check_vector), reply.loaded_objects, reply.loaded_bytes, reply.pinned, reply.seconds
        )

    def flush(self, timeout_s: float = 60.0) -> int:
        """Wait until every sealed object is committed to the store; returns how many were persisted meanwhile."""
        reply: P.FlushOk = self._call(P.Flush(timeout_s))
        if reply.pending:
            raise E.RemoteError(
                "flush_timeout", f"{reply.pending} objects still waiting for the store after {timeout_s}s"
            )
        return reply.persisted

    def close(self) -> None:
        """Disconnect; the daemon releases every lease this client still holds."""
        if self.attachment is not None:
            for pool in self.attachment.pools.values():
                pool.close()
        super().close()

    def __enter__(self) -> Client:
        return self

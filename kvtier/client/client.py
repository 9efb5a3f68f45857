"""`kvtier.client.Client`: what an inference engine links to talk to the daemon.

Tensors move through the pools the client maps at attach; the socket carries only hashes, slot
numbers and check vectors. One request at a time per Client (a lock serialises threads); open one
Client per engine process (or per thread that wants its own queue).

Reads: a lookup's leases hold while this client renews them (a heartbeat thread does, every third of
the daemon's lease TTL) and end when it releases them, closes, or stops renewing for a TTL. Every read
re-validates against the daemon's slot generation table in shared memory: `read_into` copies an object
out and checks the generation before and after the copy; `read` returns a view that is good only while
the lease holds (check `valid` after using it). Both raise `StaleHandle` when the object is gone.

Writes (cpu): the pools are mapped read-only; an offload's bytes go into a staging memfd that this client
fills, unmaps and hands to the daemon with `seal`; the daemon seals the memfd against writes, checks every
object is whole and copies it into its reserved slot. On cuda the reserved slots are written in place.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
import numpy as np
import torch

from kvtier.client.pools import MappedPool, map_generations, map_pool
from kvtier.core.checkvector import CheckVector
from kvtier.core.errors import NotDurable, StaleHandle
from kvtier.core.forms import CacheForm, Route
from kvtier.core.hashing import HASH_BYTES, block_hashes
from kvtier.core.not_durable import NotDurableCause, NotDurableCount
from kvtier.wire import Connection
from kvtier.wire import errors as E
from kvtier.wire import messages as P

log = logging.getLogger(__name__)


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
    persisted: bool  # durable=True: every object the call named is committed in the store
    durable: int = 0  # durable=True: named objects committed in the store (written here or by others)
    not_durable: int = 0  # durable=True: named objects not in the store, never acknowledged
    why: tuple[NotDurableCount, ...] = ()  # how many for each typed cause

    @property
    def reasons(self) -> tuple[str, ...]:
        """Why objects are not durable, for humans (act on `why`'s causes)."""
        return tuple(map(str, self.why))


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


def _stage(tensors: list[torch.Tensor]) -> tuple[int, list[int]]:
    """A sealable memfd holding the tensors' bytes back to back (written with pwrite: this process never maps
    it, so the daemon can freeze it); returns it and the bytes written per tensor."""
    fd = os.memfd_create("kvtier-offload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        offset = 0
        written: list[int] = []
        for t in tensors:
            view = t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy().data
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
            written.append(done)
            offset += done
        return fd, written
    except BaseException:
        os.close(fd)
        raise


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
        heartbeat: bool = True,
    ) -> None:
        super().__init__(socket_path, timeout_s=timeout_s, name=name)
        self.lookup_timeout_s = lookup_timeout_s
        self.attachment: Attachment | None = None
        self._attach_req: P.Attach | None = None
        self._heartbeat = heartbeat
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # -- plumbing -----------------------------------------------------------------------------------

    def _attached(self) -> Attachment:
        if self.attachment is None:
            raise E.OutOfOrder("attach(profile) first")
        return self.attachment

    def hashes(self, tokens: Sequence[int] | np.ndarray | torch.Tensor | None) -> bytes:
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
        if self._heartbeat and self._beat is None:
            # The heartbeat holds the client weakly, stops when it is collected, and close() joins it: a heartbeat
            # that dropped the last reference would free the client's mapped pool tensors on its own thread, and
            # at interpreter exit torch's release of the GIL there tore the thread down through C++ frames
            # (SIGABRT, "terminate called without an active exception": pytorch/pytorch#38228).
            self._beat = threading.Thread(
                target=_heartbeat,
                args=(weakref.ref(self), self._stop, reply.lease_ttl_s / 3),
                name="kvtier-heartbeat",
                daemon=True,
            )
            weakref.finalize(self, self._stop.set)
            self._beat.start()
        return self.attachment

    def renew(self) -> int:
        """Renew every lease and reserved write of this client (the heartbeat does this); how many it holds."""
        reply: P.Renewed = self._call(P.Renew())
        return reply.held

    def _mapped(self, reply: P.AttachOk, fds: list[int]) -> None:
        pools = {}
        if reply.pools:
            gens = map_generations(reply.pools[0], fds)
            pools = {info.group: map_pool(info, fds, gens) for info in reply.pools}
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

    def _object(self, result: LookupResult, group: str, block: int, op: str) -> tuple[MappedPool, int, int]:
        """The pool, slot and leased generation of one REUSE object of a live lookup."""
        result = _lookup_result(result, op)
        if result.released:
            raise StaleHandle(f"lookup {result.lookup_id} was released; look the prefix up again")
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
        return self._attached().pools[group], int(result.slots[gi, block]), int(result.generations[gi, block])

    @staticmethod
    def _check(pool: MappedPool, slot: int, generation: int, group: str, block: int) -> None:
        if pool.generation(slot) != generation:
            raise StaleHandle(
                f"{group} block {block}: its slot was reused (the lease expired or was released); look up again"
            )

    def read(self, result: LookupResult, group: str, block: int) -> torch.Tensor:
        """A view of one REUSE object in the mapped pool, good only while the lease holds: the bytes can change
        under it once the lease ends. Check `valid` after using it, or copy out with `read_into`."""
        pool, slot, gen = self._object(result, group, block, "read")
        self._check(pool, slot, gen, group, block)
        return pool.object_view(slot)

    def read_into(self, result: LookupResult, group: str, block: int, out: torch.Tensor) -> torch.Tensor:
        """Copy one REUSE object into `out` (contiguous, exactly the object's bytes, any dtype / device) and
        return it; raises StaleHandle unless the slot held the leased object for the whole copy (seqlock:
        the generation is checked before and after)."""
        pool, slot, gen = self._object(result, group, block, "read_into")
        if not out.is_contiguous() or out.numel() * out.element_size() != pool.info.object_bytes:
            raise E.WrongType(f"{group}: out must be contiguous and {pool.info.object_bytes} bytes")
        self._check(pool, slot, gen, group, block)
        out.view(torch.uint8).reshape(-1).copy_(pool.object_bytes(slot))
        if out.device.type == "cuda" or self._attached().device != "cpu":
            torch.cuda.synchronize()  # the copy must be done before the second check means anything
        self._check(pool, slot, gen, group, block)
        return out

    def valid(self, result: LookupResult, group: str, block: int) -> bool:
        """Whether the object still sits in its leased slot (check after using a `read` view)."""
        try:
            pool, slot, gen = self._object(result, group, block, "valid")
        except StaleHandle:
            return False
        return pool.generation(slot) == gen

    def release(self, result: LookupResult) -> int:
        """Give the lookup's leases back (idempotent); returns 1 if this call released them, 0 if already released
        (here, with its connection, or by the daemon when the lease expired)."""
        result = _lookup_result(result, "release")
        if result.released:
            return 0
        if result.epoch != self.epoch:  # its connection is gone, and the daemon released everything it held
            result.released = True
            return 0
        try:
            reply: P.Released = self._call(P.Release(result.lookup_id), epoch=result.epoch)
        except E.OutOfOrder:  # the daemon holds no such lookup any more: its lease expired (renewals stopped)
            result.released = True
            return 0
        result.released = True
        return reply.released

    def offload(
        self,
        tokens: Sequence[int] | np.ndarray | torch.Tensor,
        caches: Mapping[str, Mapping[int, torch.Tensor]],
        durable: bool = False,
    ) -> OffloadReport:
        """Write new objects: `caches[group][block]` is that block's object (any dtype, exactly the layout's bytes).

        Acknowledged after the pool write; with `durable`, after the store commit, with every named object
        counted durable or not (see `OffloadReport`). Objects another connection had reserved and then
        abandoned (it died mid-copy) are offloaded once more from `caches`.
        """
        report = self._offload_once(tokens, caches, durable)
        if durable and any(w.cause is NotDurableCause.ABANDONED for w in report.why):
            again = self._offload_once(tokens, caches, durable)
            report = dataclasses.replace(again, written=report.written + again.written, skipped=report.skipped)
        return report

    def _offload_once(
        self,
        tokens: Sequence[int] | np.ndarray | torch.Tensor,
        caches: Mapping[str, Mapping[int, torch.Tensor]],
        durable: bool,
    ) -> OffloadReport:
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
        objects = [
            (att.pools[g], slot, caches[g][b])
            for g, bs, slots in zip(groups, blocks, reply.slots)
            for b, slot in zip(bs, slots)
            if slot >= 0
        ]
        staging: int | None = None
        try:
            if objects and not objects[0][0].writable:
                staging, written = _stage([t for _, _, t in objects])
            else:  # cuda: the reserved slots are written in place through the IPC mapping
                written = []
                for pool, slot, t in objects:
                    pool.object_bytes(slot).copy_(t.detach().contiguous().view(torch.uint8).reshape(-1))
                    written.append(pool.info.object_bytes)
                if objects:
                    torch.cuda.synchronize()
            # the offload is this connection's: sealing it on another would name a stranger's (or no) reservation
            sealed: P.SealOk = self._call(
                P.Seal(reply.offload_id, durable, written),
                send_fds=[staging] if staging is not None else None,
                epoch=epoch,
            )
        except E.DaemonUnavailable:
            raise
        except BaseException:
            try:
                self._call(P.Release(reply.offload_id), epoch=epoch)  # give the reserved slots back unsealed
            except (E.ProtocolError, E.DaemonUnavailable):  # answered and failed, or the connection is gone:
                pass  # either way the daemon holds nothing of it any more
            raise
        finally:
            if staging is not None:
                os.close(staging)
        skipped = sum(len(bs) for bs in blocks) - len(objects) - reply.refused
        return OffloadReport(
            sealed.sealed,
            skipped,
            reply.refused,
            sealed.persisted,
            sealed.durable,
            sealed.not_durable,
            tuple(sealed.why),
        )

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
            raise NotDurable(
                f"{reply.pending} sealed objects are not in the store: {'; '.join(map(str, reply.why))}",
                pending=reply.pending,
                why=tuple(reply.why),
            )
        return reply.persisted

    def close(self) -> None:
        """Disconnect; the daemon releases every lease this client still holds. Waits for a renewal in flight
        (at most the connection's timeout) so that no heartbeat outlives the client."""
        self._stop.set()
        beat = self._beat
        # Only a running heartbeat is joined: a signal (Ctrl-C) raised while attach() was starting it leaves a
        # thread that never ran, or whose start was cut off before it said so, and join() raises RuntimeError on
        # such a thread, which would replace the KeyboardInterrupt unwinding the caller. One that never ran
        # stops at its first wait, as the stop event is set above.
        if beat is not None and beat is not threading.current_thread() and beat.is_alive():
            beat.join(self.timeout_s)
        if self.attachment is not None:
            for pool in self.attachment.pools.values():
                pool.close()
        super().close()

    def __enter__(self) -> Client:
        return self


def _heartbeat(client: weakref.ref[Client], stop: threading.Event, every_s: float) -> None:
    """Renew the client's leases every `every_s` until it is closed or collected (holding it only to renew)."""
    while not stop.wait(every_s):
        c = client()
        if c is None:
            return
        try:
            c.renew()
        except Exception as exc:  # the next call reports a lost daemon; the heartbeat only keeps trying
            log.debug("lease renewal failed: %s", exc)
        del c

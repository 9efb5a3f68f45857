"""The Mooncake Store client as the cluster tier needs it: batched, deadline-bound, staging in registered buffers.

Objects move through two registered staging buffers (one for gets, one for puts) and never straight into
a pool slot: a get that outlives its deadline may still be writing, and it writes only into staging
that its lane keeps until the call returns.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvtier.cluster.errors import ClusterSetupError, ClusterUnavailable
from kvtier.cluster.lane import Breaker, Calls, Lane, Probes
from kvtier.core.cluster_config import ClusterConfig

log = logging.getLogger(__name__)

# Mooncake's result codes this module tells apart (its ErrorCode enum); any other negative code is an error.
NOT_FOUND = -704
BUFFER_TOO_SMALL = -600
TOO_LARGE = -(1 << 30)  # ours: the object cannot fit the staging buffer at all

# Clients closed while a call of theirs still ran: never torn down (nor collected) in this process.
_LEFT_OPEN: list[object] = []


def require_mooncake() -> None:
    """Raise ClusterSetupError, saying how to install it, where Mooncake cannot be imported."""
    _import_store()


def _import_store():  # the extension module has no stubs
    try:
        from mooncake import store
    except ImportError as exc:
        raise ClusterSetupError(
            f"the cluster tier needs Mooncake: pip install 'kvtier[cluster]' (and Debian libibverbs1): {exc}"
        ) from None
    return store


class _Staging:
    """A CPU buffer registered with the transfer engine, handed out in consecutive chunks."""

    def __init__(self, client: Any, nbytes: int) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.ptr = self.buf.data_ptr()
        if client.register_buffer(self.ptr, nbytes) != 0:
            raise ClusterSetupError(f"could not register a {nbytes}-byte staging buffer with Mooncake")


def chunks(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Indices grouped so each group fits `limit` bytes as laid out by _offsets; a size over it is a group alone."""
    out: list[list[int]] = []
    used = limit + 1
    for i, n in enumerate(sizes):
        n = _aligned(n)
        if used + n > limit:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


class MooncakeClient:
    """A client node of a Mooncake Store (it contributes no memory to the pool; holders do)."""

    def __init__(self, cfg: ClusterConfig) -> None:
        store = _import_store()
        self.cfg = cfg
        if cfg.local_hostname.startswith("127.") and "MC_TCP_BIND_ADDRESS" not in os.environ:
            # A loopback node must not listen on other interfaces (the transfer engine picks one by itself).
            os.environ["MC_TCP_BIND_ADDRESS"] = cfg.local_hostname
        self._client = store.MooncakeDistributedStore()
        rc = self._client.setup(
            cfg.local_hostname,
            cfg.metadata,
            0,
            cfg.transfer_buffer_bytes,
            cfg.protocol,
            cfg.device,
            cfg.master_address,
        )
        if rc != 0:
            raise ClusterSetupError(
                f"Mooncake setup against {cfg.master_address} failed (code {rc}): is the master up?"
            )
        self._replicate = store.ReplicateConfig()
        self._replicate.replica_num = cfg.replicas
        self._get_buf = _Staging(self._client, cfg.staging_bytes)
        self._put_buf = _Staging(self._client, cfg.staging_bytes)
        self.breaker = Breaker(cfg.retry_s)
        self._lookup = Lane("lookup", self.breaker)
        # The probe has threads of its own: it neither waits behind a lookup nor delays one, and a call still
        # running past its deadline does not hide the master's health from it.
        self._probes = Probes(self.breaker)
        self._get = Lane("get", self.breaker)
        self._put = Lane("put", self.breaker)

    def exists(self, names: Sequence[str]) -> list[bool | None]:
        """One batched existence call: True / False, None where the cluster answered with an error."""
        with self._lookup.hold(time.monotonic() + self.cfg.lookup_timeout_s) as run:
            codes = run(lambda: self._client.batch_is_exist(list(names)))
        out = [True if c == 1 else False if c == 0 else None for c in codes]
        self._judge(bool(names) and all(o is None for o in out), f"lookup answered error codes {sorted(set(codes))}")
        return out

    def probe(self) -> bool:
        """One existence call for a name no writer uses, let through even while the cluster is marked down:
        the answer (or the lack of one within lookup_timeout_s) is the link's health. True when it answered."""
        name = f"{self.cfg.key_prefix}/probe"
        deadline = time.monotonic() + self.cfg.lookup_timeout_s
        try:
            (code,) = self._probes.run(lambda: self._client.batch_is_exist([name]), deadline)
        except ClusterUnavailable:
            return False  # Probes marked the breaker down, with its reason
        self._judge(code not in (0, 1), f"probe answered error code {code}")
        return code in (0, 1)

    def get(self, names: Sequence[str], sizes: Sequence[int], sink: Callable[[int, memoryview | int], None]) -> None:
        """Fetch objects of at most `sizes[i]` bytes; `sink(i, bytes read or negative code)` runs while staging is ours.

        Pipelined over the two halves of staging: while the sink verifies and copies one batch, the next batch's
        transfer runs into the other half (the lane's worker makes the calls, this thread runs the sink). An
        object larger than half of staging is fetched alone, into the whole of it, with nothing in flight.
        A chunk that misses the deadline raises ClusterUnavailable (the sink has then seen the earlier chunks).
        """
        staging = self._get_buf
        half = self.cfg.staging_bytes // 2
        with self._get.hold(time.monotonic() + self.cfg.load_timeout_s) as calls:
            flight: list[tuple[list[int], list[int], Future]] = []  # at most one batch in flight, oldest first
            half_at = 0  # which half the next batch goes into
            for n, group in enumerate(chunks(sizes, half)):
                if n:  # as each call of its own would: a batch that failed marks the cluster down, and the rest miss
                    self.breaker.check(self._get.name)
                whole = _aligned(sizes[group[0]])
                if whole > self.cfg.staging_bytes:
                    sink(group[0], TOO_LARGE)
                    continue
                if whole > half:  # the whole of staging: nothing may be writing into it
                    self._drain(calls, flight, sink)
                    base = 0
                else:
                    base, half_at = half_at * half, 1 - half_at
                offsets = [base + o for o in _offsets([sizes[i] for i in group])]
                fetch = functools.partial(
                    self._client.batch_get_into,
                    [names[i] for i in group],
                    [staging.ptr + o for o in offsets],
                    [sizes[i] for i in group],
                )
                batch = [(group, offsets, calls.start(fetch))]
                if whole > half:
                    self._drain(calls, batch, sink)
                    continue
                self._drain(calls, flight, sink)  # the batch before, in the other half, while this one transfers
                flight = batch
            self._drain(calls, flight, sink)

    def _drain(
        self,
        calls: Calls,
        flight: list[tuple[list[int], list[int], Future]],
        sink: Callable[[int, memoryview | int], None],
    ) -> None:
        """Wait for each batch in `flight` (in order), hand its objects to the sink, and empty `flight`."""
        view = self._get_buf.buf.numpy().data
        while flight:
            group, offsets, fut = flight.pop(0)
            codes: list[int] = calls.wait(fut)
            for i, off, code in zip(group, offsets, codes):
                sink(i, view[off : off + code] if code >= 0 else code)
            self._judge(
                all(c < 0 and c not in (NOT_FOUND, BUFFER_TOO_SMALL) for c in codes),
                f"get answered error codes {sorted(set(codes))}",
            )

    def put(self, names: Sequence[str], fill: Callable[[int, memoryview], None], sizes: Sequence[int]) -> list[int]:
        """Put objects of `sizes[i]` bytes, each written by `fill(i, buffer)` into staging; codes per object (0: ok).

        Mooncake keeps an existing key's object (puts never overwrite): kvtier's keys are content addresses.
        """
        deadline = time.monotonic() + self.cfg.put_timeout_s
        staging = self._put_buf
        codes = [TOO_LARGE] * len(names)
        for group in chunks(sizes, self.cfg.staging_bytes):
            if _aligned(sizes[group[0]]) > self.cfg.staging_bytes:
                continue
            offsets = _offsets([sizes[i] for i in group])
            with self._put.hold(deadline) as run:
                view = staging.buf.numpy().data
                for i, off in zip(group, offsets):
                    fill(i, view[off : off + sizes[i]])
                keys, ptrs, lens = (
                    [names[i] for i in group],
                    [staging.ptr + o for o in offsets],
                    [sizes[i] for i in group],
                )
                got = run(functools.partial(self._client.batch_put_from, keys, ptrs, lens, self._replicate))
            for i, code in zip(group, got):
                codes[i] = code
            self._judge(all(c < 0 for c in got), f"put answered error codes {sorted(set(got))}")
        return codes

    def remove(self, names: Sequence[str]) -> int:
        """Remove objects now (even if a lease holds them); how many existed."""
        with self._put.hold(time.monotonic() + self.cfg.put_timeout_s) as run:
            codes = run(lambda: self._client.batch_remove(list(names), True))
        return sum(1 for c in codes if c == 0)

    def _judge(self, failed: bool, why: str) -> None:
        if failed:
            self.breaker.failed(why)
        else:
            self.breaker.succeeded()

    def close(self, wait_s: float = 5.0) -> None:
        """Close once no call runs. A call still running after `wait_s` (a master that stopped answering) keeps the
        client open for good: tearing it down under that call crashes the process."""
        deadline = time.monotonic() + wait_s
        busy = [lane.name for lane in (self._lookup, self._get, self._put) if not lane.close(deadline)]
        if not self._probes.close(deadline):
            busy.append("probe")
        if busy:
            log.warning("mooncake client left open: %s still running after %gs", ", ".join(busy), wait_s)
            _LEFT_OPEN.append(self._client)
            return
        # Mooncake's close holds the GIL and, with HA masters, waits out its leader watch (up to 30 s).
        try:
            self._client.close()
        except RuntimeError as exc:
            log.debug("mooncake close: %s", exc)


def _offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each object in staging, 64-byte aligned (the checksum and copies run faster on aligned data)."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += _aligned(n)
    return out


def _aligned(n: int) -> int:
    return (n + 63) & ~63

"""An engine tier's store through the kvtier daemon: what a `DiskStore` answers, over the daemon's raw tier ops.

A node running `kvtier serve` has the daemon as its store's one writer; an engine plug-in on that node
stores and loads through it instead of opening the store itself. Three connections, one per calling
thread (the engine's scheduler looks up, a load worker loads, a store worker stores), so a lookup never
waits behind a store's fdatasync.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvtier.client import Client, TierClient, TierFull
from kvtier.core.forms import CacheForm, Reason
from kvtier.core.tier import KeyPage, LoadRequest, MoreRequests, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.store import StoreFull


class DaemonStore:
    """`has` / `load_into` / `store_many` of one namespace, served by the daemon on `socket_path`."""

    is_writer = True  # the daemon writes; it refuses with a typed error where it cannot

    def __init__(
        self,
        socket_path: str | Path,
        version_key: VersionKey,
        groups: Sequence[tuple[str, CacheForm]],
        staging_bytes: int,
        *,
        lookup_timeout_s: float = 2.0,
        identity: dict[str, Any] | None = None,
    ) -> None:
        self.socket_path = Path(socket_path)
        self._clients: list[TierClient] = []
        try:
            # a lookup has a short deadline of its own: a hung daemon costs the scheduler a miss, not a stall
            roles = (("lookups", 0, lookup_timeout_s), ("loads", staging_bytes, 60.0), ("stores", staging_bytes, 60.0))
            for role, staging, timeout_s in roles:
                self._clients.append(
                    TierClient(
                        self.socket_path,
                        version_key,
                        groups,
                        staging,
                        timeout_s=timeout_s,
                        name=f"engine tier {role}",
                        identity=identity,
                    )
                )
            with Client(self.socket_path, timeout_s=lookup_timeout_s * 5) as conn:
                self.has_cluster = bool(conn.stats().cluster)  # the daemon's chain ends in a cluster tier
        except BaseException:
            self.close()
            raise
        self._lookups, self._loads, self._stores = self._clients
        # The lookups connection serves two threads of an engine tier (its key set's refresh, and on a node with
        # a cluster its remote lookups): one request at a time on it.
        self._lookup_lock = threading.Lock()
        self.root = f"{self._lookups.store_root} (through the daemon on {self.socket_path})"
        self.io_backend = self._lookups.io_backend

    def has(self, keys: Sequence[ObjectKey], layout_digests: Sequence[bytes]) -> list[Reason]:
        with self._lookup_lock:
            return self._lookups.has(keys, layout_digests)

    def live_keys(self, after: bytes = b"", limit: int = 4096) -> KeyPage:
        with self._lookup_lock:
            return self._lookups.live_keys(after, limit)

    def load_into(self, requests: Sequence[LoadRequest], more: MoreRequests | None = None) -> list[Reason]:
        return self._loads.load_into(requests, more)

    def store_many(self, items: Sequence[tuple[ObjectKey, torch.Tensor, bytes]]) -> None:
        try:
            self._stores.store_many(items)
        except TierFull as exc:  # the store's own error, as a DiskStore raises it: callers swap one for the other
            raise StoreFull(str(exc), limit=exc.limit) from None

    def stats(self) -> dict[str, Any]:
        return {"daemon": self._lookups.daemon, "socket": str(self.socket_path)}

    def close(self) -> None:
        for client in self._clients:
            client.close()

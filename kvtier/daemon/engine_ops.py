"""Prewarm and explain for engine namespaces (vLLM tiers', SGLang backends'): the daemon's side.

The operator's CLI computes the engine's own keys (kvtier.integrations.vllm.keys / sglang.keys) and sends
them; the daemon answers per object whether it is stored and loadable, and for a prewarm:

- loads what only the cluster holds to local disk (through the tier chain, which promotes what it loads;
  `pin` waits for those promotions), each group's records checked against the layout digest and size the
  CLI derived from the namespace's version key, as the engine's tier derives them;
- pins every stored object against eviction for the TTL (the store's pins expire on their own);
- warms the local extents: on a store read through the page cache (io_backend "buffered") each record's
  extent is advised into it (posix_fadvise WILLNEED); O_DIRECT and GDS reads bypass the page cache, so
  there the index entries, read here, are what is warm.

No pools and no leases: an engine loads through its own tier connection later.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from kvtier.core.forms import CacheForm, Reason
from kvtier.core.hashing import HASH_BYTES
from kvtier.core.tier import LoadRequest, LowerTier, ObjectKey
from kvtier.store import DiskStore, IndexEntry, RecordState, segment_name
from kvtier.wire import messages as P
from kvtier.wire.errors import WrongType

ENGINE_ABI_PREFIXES = ("vllm ", "sglang-")  # what an engine tier's version key starts its kernel_abi with
MAX_KEYS = 1 << 20


def is_engine(kernel_abi: str) -> bool:
    return kernel_abi.startswith(ENGINE_ABI_PREFIXES)


class EngineOps:
    """`engine_namespaces` and `engine_keys` over the daemon's store and the tier below its pools."""

    def __init__(self, store: DiskStore, lower: LowerTier) -> None:
        self.store = store
        self.lower = lower

    def namespaces(self) -> P.EngineNamespacesOk:
        out = []
        for ns, entry in sorted(self.store.namespaces().items()):
            vk = entry.version_key
            if not is_engine(vk.kernel_abi):
                continue
            pools = (entry.identity or {}).get("pools") if vk.kernel_abi.startswith("sglang-") else None
            out.append(P.EngineNamespace(ns, entry.live, vk.to_dict(), pools if isinstance(pools, dict) else {}))
        return P.EngineNamespacesOk(out)

    def keys(self, req: P.EngineKeys) -> P.EngineKeysOk:
        started = time.perf_counter()
        keys, digests, sizes = self._keys(req)
        reasons = self.lower.has(keys, digests) if keys else []
        if not req.prewarm:
            return P.EngineKeysOk(bytes(reasons), seconds=time.perf_counter() - started)
        if req.ttl_s <= 0:
            raise WrongType(f"ttl_s must be > 0, got {req.ttl_s}")
        entries = self._entries(keys)
        # stored below local disk only (the cluster): load it, which promotes it to local disk
        remote = [i for i, (r, e) in enumerate(zip(reasons, entries)) if r is Reason.OK and e is None]
        got = self._load_remote([keys[i] for i in remote], [digests[i] for i in remote], sizes)
        for i, r in zip(remote, got):
            reasons[i] = r  # a cluster copy that failed its checks is a miss, as a load would find it
        loaded = [i for i, r in zip(remote, got) if r is Reason.OK]
        loaded_bytes = sum(sizes[keys[i].group] for i in loaded)
        stored = [k for k, r in zip(keys, reasons) if r is Reason.OK]
        pinned = self.lower.pin(stored, req.ttl_s) if stored else 0
        warmed = self._warm(self._entries(stored))
        return P.EngineKeysOk(bytes(reasons), len(loaded), loaded_bytes, pinned, warmed, time.perf_counter() - started)

    # -- parts ---------------------------------------------------------------------------------------

    def _keys(self, req: P.EngineKeys) -> tuple[list[ObjectKey], list[bytes], dict[str, int]]:
        """The request's object keys, each one's layout digest, and each group's record payload bytes."""
        entry = self.store.namespaces().get(req.namespace)
        if entry is None or not is_engine(entry.version_key.kernel_abi):
            raise WrongType(
                f"namespace {req.namespace.hex()} is no engine namespace of this store: list them with "
                "`kvtier namespace`"
            )
        if len(req.hashes) % HASH_BYTES or len(req.hashes) // HASH_BYTES != len(req.group_of):
            raise WrongType(f"hashes must be one {HASH_BYTES}-byte hash per group_of byte")
        if len(req.group_of) > MAX_KEYS:
            raise WrongType(f"at most {MAX_KEYS} keys per engine_keys request: split the prompt")
        groups: list[tuple[str, CacheForm, bytes]] = []
        sizes: dict[str, int] = {}
        for name, form, digest, size in req.groups:
            if len(digest) != 16 or size <= 0:
                raise WrongType(f"group {name!r}: the layout digest must be 16 bytes and the payload size > 0")
            try:
                groups.append((name, CacheForm(form), digest))
            except ValueError:
                raise WrongType(f"group {name!r}: {form!r} is no kvtier form") from None
            sizes[name] = size
        keys, digests = [], []
        for i, g in enumerate(req.group_of):
            if g >= len(groups):
                raise WrongType(f"group_of names group {g}, but {len(groups)} groups were sent")
            name, group_form, digest = groups[g]
            try:
                keys.append(
                    ObjectKey(req.namespace, req.hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES], name, group_form)
                )
            except ValueError as exc:
                raise WrongType(str(exc)) from None
            digests.append(digest)
        return keys, digests, sizes

    def _entries(self, keys: Sequence[ObjectKey]) -> list[IndexEntry | None]:
        """Each key's local index entry, None where it is not on local disk, quarantined, or unreadable."""
        infos = self.store.records(keys) if keys else []
        return [
            i.entry if i is not None and i.entry is not None and i.entry.state is not RecordState.QUARANTINED else None
            for i in infos
        ]

    def _load_remote(self, keys: list[ObjectKey], digests: list[bytes], sizes: dict[str, int]) -> list[Reason]:
        """Load each key through the tier chain (its cluster copy, verified; promoted to local disk after)."""
        if not keys or self.lower is self.store:
            return [Reason.OK] * len(keys)  # nothing below local disk: has() found them there
        import torch  # only with a cluster below local disk

        requests = [LoadRequest(k, torch.empty(sizes[k.group], dtype=torch.uint8), d) for k, d in zip(keys, digests)]
        return self.lower.load_into(requests)

    def _warm(self, entries: Sequence[IndexEntry | None]) -> int:
        """Advise the local extents into the page cache where reads go through it; bytes advised."""
        if self.store.io_backend != "buffered":
            return 0
        by_segment: dict[int, list[IndexEntry]] = {}
        for e in entries:
            if e is not None:
                by_segment.setdefault(e.segment, []).append(e)
        warmed = 0
        for seg, es in by_segment.items():
            try:
                fd = os.open(os.path.join(self.store.segment_dir, segment_name(seg)), os.O_RDONLY)
            except OSError:
                continue  # reclaimed since: the load will miss, as it would have
            try:
                for e in es:
                    os.posix_fadvise(fd, e.offset, e.record_len, os.POSIX_FADV_WILLNEED)
                    warmed += e.record_len
            finally:
                os.close(fd)
        return warmed

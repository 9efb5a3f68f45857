"""Test-only: lets vLLM's tiering offload run on the CPU platform, where the stock worker refuses.

The stock `CPUOffloadingWorker` copies device blocks with CUDA streams. Here the "device" KV cache
is itself in host memory, so a synchronous torch copy into the same shared region is the whole job;
the scheduler side (primary tier, promotions, secondary tiers) is vLLM's own, unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class SyncCopyWorker(OffloadingWorker):
    """Copies whole blocks between the engine's KV tensors and the primary tier's shared region."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion) -> None:
        self._region = region
        self._per_chunk = blocks_per_chunk
        self._group_refs = kv_caches.group_data_refs
        self._device: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            self._device.append(t.tensor.view(torch.int8).view(-1, page))
            host = region.create_next_worker_view(page * blocks_per_chunk)
            self._host.append(host.unflatten(1, (blocks_per_chunk, page)))
        self._finished: list[TransferResult] = []

    def _copy(self, job_id: int, device: GPULoadStoreSpec, host: LoadStoreSpec, to_host: bool) -> bool:
        assert isinstance(host, CPULoadStoreSpec)
        per_chunk, block_ids, chunk_ids = self._per_chunk, device.block_ids, host.block_ids
        dev_at = host_at = moved = 0
        for group, (count, first) in enumerate(zip(device.group_sizes, device.block_indices)):
            if count == 0:
                continue
            # The first chunk of a group may be entered part-way (offloaded chunks can span blocks).
            sub = np.arange(first % per_chunk, first % per_chunk + count)
            chunks = torch.from_numpy(chunk_ids[host_at + sub // per_chunk].astype(np.int64))
            subs = torch.from_numpy(sub % per_chunk)
            blocks = torch.from_numpy(block_ids[dev_at : dev_at + count].astype(np.int64))
            for ref in self._group_refs[group]:
                dev, hst, size = self._device[ref.tensor_idx], self._host[ref.tensor_idx], ref.page_size_bytes
                if to_host:
                    hst[chunks, subs, :size] = dev[blocks, :size]
                else:
                    dev[blocks, :size] = hst[chunks, subs, :size]
                moved += count * size
            dev_at += count
            host_at += -(-(first % per_chunk + count) // per_chunk)
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=moved, transfer_time=0.0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return

    def shutdown(self) -> None:
        self._region.cleanup()


class SyncCpuTieringSpec(TieringOffloadingSpec):
    """vLLM's tiering spec with the synchronous host-copy worker in place of the CUDA one."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            assert not self.config.canonical_layout, "the test shim copies the direct layout only"
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._worker = SyncCopyWorker(kv_caches, self.blocks_per_chunk, region)
        return self._worker

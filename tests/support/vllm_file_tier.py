"""Test-only: the simplest real secondary tier (one file per key, synchronous) to prove the harness."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob


class PlainFileTier(SecondaryTierManager):
    """Chunk bytes in `<root>/<key hex>`; lookups are a stat; no checks of any kind."""

    def __init__(
        self, offloading_spec, primary_kv_view: memoryview, tier_type: str, root: str, backpressure_detector=None
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True)
        self._bytes = primary_kv_view.cast("B")
        self._done: list[JobResult] = []

    def _chunk(self, chunk_id: int) -> memoryview:
        size = self.block_size_bytes
        return self._bytes[chunk_id * size : (chunk_id + 1) * size]

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if (self._root / key.hex()).exists() else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        for key, chunk in zip(job.keys, job.chunk_ids):
            tmp = self._root / f".{key.hex()}.tmp"
            tmp.write_bytes(self._chunk(int(chunk)))
            os.replace(tmp, self._root / key.hex())
        self._done.append(JobResult(job_id=job.job_id, success=True))

    def submit_load(self, job: TransferJob) -> None:
        for key, chunk in zip(job.keys, job.chunk_ids):
            with open(self._root / key.hex(), "rb") as f:
                f.readinto(self._chunk(int(chunk)))
        self._done.append(JobResult(job_id=job.job_id, success=True))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done, self._done = self._done, []
        return done

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        return

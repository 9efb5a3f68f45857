"""KV events with vLLM's own classes (issue 39): the tier's `take_events` through vLLM's events tracker, and the
daemon's ZeroMQ stream decoded with vLLM's `msgspec.msgpack.Decoder(KVEventBatch)`.

No engine: vLLM's config and key types, a primary buffer, jobs submitted as vLLM's tiering manager submits them
(tests/vllm/test_vllm_tier_unit.py's way), over a real store and a real daemon.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import xxhash
import zmq

from support.vllm_harness import require_vllm

require_vllm()

from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    Medium,
    OffloadingKVEventsConfig,
    ReqContext,
    get_offload_block_hash,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from kvtier.integrations.vllm.tier import KvtierSecondaryTier  # noqa: E402
from support.daemon import DaemonProc  # noqa: E402
from support.vllm_harness import flip_payload_byte  # noqa: E402
from support.vllm_unit_tier import CHUNKS, FULL, ROW, SWA, gemma2_engine, make_tier, write_model  # noqa: E402

_job_ids = iter(range(1_000_000))


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory: pytest.TempPathFactory) -> VllmConfig:
    return gemma2_engine(tmp_path_factory.mktemp("gemma2"))


def _tier(tmp: Path, primary: np.ndarray, engine: VllmConfig, *, vllm_events: bool, **options) -> KvtierSecondaryTier:
    """A tier over the store `options` name (`store_dir` or `daemon_socket`), vLLM's own events on or off."""
    weights = write_model(tmp / "model", b"weights" * 1000)
    return make_tier(weights, None, primary, engine, vllm_events=vllm_events, **options)


def _primary() -> np.ndarray:
    primary = np.zeros((CHUNKS, ROW), dtype=np.uint8)
    primary[:8] = np.random.default_rng(0).integers(0, 256, (8, ROW), dtype=np.uint8)
    return primary


def key(i: int, group: int = FULL) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), group)


def job(keys: list[bytes], chunks: list[int], promotion: bool = False) -> TransferJob:
    return TransferJob(next(_job_ids), keys, np.array(chunks, dtype=np.int32), promotion, ReqContext("r"))


def finish(tier: KvtierSecondaryTier) -> list:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def test_take_events_reports_stores_and_bad_loads_through_vllms_tracker(tmp_path: Path, engine_config) -> None:
    primary = _primary()
    tier = _tier(
        tmp_path, primary, engine_config, vllm_events=True, store_dir=str(tmp_path / "store"), enable_kv_events=True
    )
    quiet = _tier(
        tmp_path, primary, engine_config, vllm_events=False, store_dir=str(tmp_path / "store2"), enable_kv_events=True
    )  # vLLM's events off: take_events is never drained, nothing is kept
    try:
        assert list(tier.take_events()) == []
        tier.submit_store(job([key(0), key(1)], [0, 1]))
        quiet.submit_store(job([key(0)], [0]))
        assert all(r.success for r in finish(tier) + finish(quiet))
        assert list(quiet.take_events()) == []
        (ev,) = list(tier.take_events())
        assert (ev.keys, ev.medium, ev.removed, ev.ownership) == ([key(0), key(1)], Medium.STORAGE, False, "kvtier")
        assert list(tier.take_events()) == []  # taken once

        tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
        events = list(tracker.take_events([ev]))
        assert [type(e) for e in events] == [BlockStored, BlockStored]
        assert [e.block_hashes for e in events] == [
            [maybe_convert_block_hash(get_offload_block_hash(k))] for k in ev.keys
        ]
        assert {(e.medium, e.group_idx) for e in events} == {("STORAGE", FULL)}
        batch = KVEventBatch(ts=time.time(), events=events)
        decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.Encoder().encode(batch))
        assert decoded.events == events

        # a record gone bad: the load finds out, and the tier reports the chunk removed from its medium
        flip_payload_byte(tmp_path / "store", "vllm.g1.full", nth=0, store=tier._store)
        tier.submit_load(job([key(0), key(1)], [10, 11], promotion=True))
        (result,) = finish(tier)
        assert not result.success and len(result.successful_keys) == 1
        (bad,) = {key(0), key(1)} - set(result.successful_keys)
        (gone,) = list(tier.take_events())
        assert gone.removed and gone.keys == [bad]
        (removed,) = list(tracker.take_events([gone]))
        assert isinstance(removed, BlockRemoved) and removed.block_hashes == [
            maybe_convert_block_hash(get_offload_block_hash(bad))
        ]
    finally:
        tier.shutdown()
        quiet.shutdown()


def test_an_eviction_the_key_set_notices_is_reported_removed(tmp_path: Path, engine_config) -> None:
    """The store evicts a chunk (as the cleaner does): the tier's key-set refresh notices, and take_events
    reports that chunk removed, with vLLM's key, once; the chunk it did not evict stays announced."""
    tier = _tier(
        tmp_path,
        _primary(),
        engine_config,
        vllm_events=True,
        store_dir=str(tmp_path / "store"),
        enable_kv_events=True,
        lookup_cache_s=0.05,
    )
    try:
        tier.submit_store(job([key(0), key(1)], [0, 1]))
        assert all(r.success for r in finish(tier))
        assert [e.removed for e in tier.take_events()] == [False]
        assert tier._store.evict([tier._object_key(key(0), tier._plans[FULL])]) == 1
        removed: list = []
        deadline = time.monotonic() + 20
        while not removed:
            assert time.monotonic() < deadline, "the eviction was not reported"
            removed = list(tier.take_events())
            time.sleep(0.05)  # polling a condition with a deadline
        assert [(e.keys, e.removed, e.medium) for e in removed] == [([key(0)], True, Medium.STORAGE)]
        time.sleep(0.3)  # several refresh periods: nothing more may come (not synchronisation: a negative check)
        assert list(tier.take_events()) == []
    finally:
        tier.shutdown()


def test_daemon_events_decode_with_vllms_classes(tmp_path: Path, engine_config) -> None:
    """The daemon announces what an engine's tier stored: vLLM's decoder reads the batches; each block hash is the
    key the tier sent (xxh3-128 of vLLM's block hash) and group_idx is vLLM's group id."""
    (tmp_path / "daemon").mkdir()
    endpoint = f"ipc://{tmp_path}/events.sock"
    daemon = DaemonProc(tmp_path / "daemon", extra_toml=f'[events]\nendpoint = "{endpoint}"\ntopic = "kv@node1"\n')
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(endpoint)
    tier = None
    try:
        tier = _tier(tmp_path, _primary(), engine_config, vllm_events=False, daemon_socket=str(daemon.socket))
        keys = [key(0), key(1), key(2), key(3, SWA)]
        tier.submit_store(job(keys, [0, 1, 2, 3]))
        assert all(r.success for r in finish(tier))
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        got: list[BlockStored] = []
        seqs: list[int] = []
        deadline = time.monotonic() + 30
        while len(got) < len(keys):
            assert time.monotonic() < deadline, f"{len(got)} events of {len(keys)}"
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv@node1"
                seqs.append(int.from_bytes(seq, "big"))
                got += decoder.decode(payload).events
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert all(isinstance(e, BlockStored) and e.medium == "kvtier_disk" and e.locality == "LOCAL" for e in got)
        want = {(xxhash.xxh3_128_digest(get_offload_block_hash(k)), g) for k, g in zip(keys, [FULL] * 3 + [SWA])}
        assert {(bytes(e.block_hashes[0]), e.group_idx) for e in got} == want
        assert {e.ownership for e in got} == {tier._namespace.hex()}
    finally:
        if tier is not None:
            tier.shutdown()
        sub.close(linger=0)
        ctx.term()
        assert daemon.terminate() == 0


def test_kvtiers_structs_encode_byte_for_byte_as_vllms() -> None:
    """Every event kind kvtier can publish encodes to the bytes vLLM's own classes give the same batch, and
    vLLM's decoder reads kvtier's payload back to equal events."""
    from vllm.distributed.kv_events import AllBlocksCleared

    from kvtier.daemon import kv_events as E

    ns, h = bytes(range(16)), b"\x01" * 16
    ours = E.KVEventBatch(
        ts=1.5,
        events=[
            E.stored(h, E.MEDIUM_DISK, E.LOCAL, ns, 1),
            E.removed(h, E.MEDIUM_CLUSTER, E.REMOTE, ns, None),
            E.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    theirs = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[h],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium="kvtier_disk",
                lora_name=None,
                group_idx=1,
                locality="LOCAL",
                ownership=ns.hex(),
            ),
            BlockRemoved(block_hashes=[h], medium="kvtier_cluster", locality="REMOTE", ownership=ns.hex()),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    payload = E.encode_batch(ours)
    assert payload == msgspec.msgpack.Encoder().encode(theirs)
    assert msgspec.msgpack.Decoder(KVEventBatch).decode(payload) == theirs

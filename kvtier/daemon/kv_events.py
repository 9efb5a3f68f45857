"""vLLM's KV-events wire format, spelled with msgspec: what the daemon publishes is what vLLM's own publisher sends.

The structs mirror `vllm.distributed.kv_events` (EventBatch, BlockStored, BlockRemoved, AllBlocksCleared): the
same class names (msgspec tags a struct by its class name), the same fields in the same order, the same struct
options (batches are msgpack arrays, events tagged maps without their default fields). A subscriber decodes the
daemon's payloads with vLLM's `msgspec.msgpack.Decoder(KVEventBatch)` unchanged; tests hold the two equal.

Encoded with msgspec, not the `msgpack` package: it is the encoder vLLM's publisher itself uses, so the bytes on
the wire are the ones vLLM would send for the same batch, and kvtier already depends on it.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_DISK = "kvtier_disk"  # the node's disk store (LMDB index + segments)
MEDIUM_CLUSTER = "kvtier_cluster"  # the cluster tier (Mooncake Store) the node writes through to
LOCAL = "LOCAL"
REMOTE = "REMOTE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; tagged `{"type": "<class name>"}` as vLLM's are."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def stored(block_hash: bytes, medium: str, locality: str, namespace: bytes, group_idx: int | None) -> BlockStored:
    """One object now served: vLLM's placeholder shape (no tokens, no parent, block_size 0), since the tier holds
    a key, never the tokens behind it; `ownership` names the kvtier namespace the key lives in."""
    return BlockStored(
        block_hashes=[block_hash],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group_idx,
        locality=locality,
        ownership=namespace.hex(),
    )


def removed(block_hash: bytes, medium: str, locality: str, namespace: bytes, group_idx: int | None) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=[block_hash], medium=medium, group_idx=group_idx, locality=locality, ownership=namespace.hex()
    )

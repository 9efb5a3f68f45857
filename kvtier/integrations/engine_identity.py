"""The engine identity behind a vLLM tier's namespace: checkpoint bytes, KV dtype and chunk layout, vLLM and kernel.

Two engines share records only when every field here is equal; a new checkpoint written under the same
path changes `weights_digest`, so it is a new namespace (never a hit across weights).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from kvtier.core.versions import VersionKey
from kvtier.integrations.errors import VllmTierError
from kvtier.integrations.kv_groups import EngineGroup, GroupPlan, is_dsv4, plan_groups, text_config

log = logging.getLogger("vllm.kvtier")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_FILE = "config.json"
_READ_BYTES = 16 << 20


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The files whose bytes fix what the model computes: config.json and the top-level weight files, by name."""
    files = sorted(
        p for p in model_dir.iterdir() if p.is_file() and (p.name == CONFIG_FILE or p.name.endswith(WEIGHT_SUFFIXES))
    )
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        raise VllmTierError(
            f"{model_dir} holds no weight files ({', '.join(WEIGHT_SUFFIXES)}): "
            "point model_dir at the checkpoint vLLM loads"
        )
    return files


def weights_digest(model_dir: Path) -> str:
    """xxh3-128 over (name, size, bytes) of every checkpoint file, in name order."""
    started = time.monotonic()
    h = xxhash.xxh3_128()
    total = 0
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    for path in checkpoint_files(model_dir):
        size = path.stat().st_size
        h.update(path.name.encode() + b"\0" + size.to_bytes(8, "little"))
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
                total += n
    log.info("kvtier: digested %d checkpoint bytes of %s in %.2f s", total, model_dir, time.monotonic() - started)
    return f"xxh3_128:{h.hexdigest()}"


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise VllmTierError(f"cannot read {path} ({exc}): point model_dir at the checkpoint vLLM loads") from None


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkLayout:
    """The bytes of one offloaded chunk as vLLM's workers lay them out in the primary tier's rows."""

    kv_dtype: str
    kv_cache_layout: str
    chunk_bytes: int
    worker_kv_bytes_per_block: int
    blocks_per_chunk: int
    tokens_per_hash: int
    parallel: str

    def describe(self, plans: Sequence[GroupPlan]) -> str:
        groups = ",".join(p.describe() for p in plans)
        return (
            f"{self.kv_dtype};layout={self.kv_cache_layout};chunk={self.chunk_bytes}B/{self.blocks_per_chunk}blk;"
            f"block={self.worker_kv_bytes_per_block}B;hash={self.tokens_per_hash}t;{self.parallel};groups={groups}"
        )


# config.json keys that change what DSV4's compressor and indexer write (and so every stored byte of them).
_DSV4_COMPRESSOR_KEYS = ("compress_ratios", "compress_rope_theta", "sliding_window", "head_dim", "qk_rope_head_dim")
_DSV4_INDEXER_KEYS = ("index_n_heads", "index_head_dim", "index_topk")


def compression_versions(hf_config: Mapping[str, Any]) -> tuple[str, str]:
    """(compression_version, indexer_version) of a checkpoint: "none" for uncompressed models; for DSV4 the
    compressor's and the indexer's configuration, so a change of any of them is a new namespace."""
    cfg = text_config(hf_config)
    if not is_dsv4(cfg):
        return "none", "none"

    def pick(keys: Sequence[str]) -> str:
        return json.dumps({k: cfg.get(k) for k in keys}, sort_keys=True, separators=(",", ":"))

    return f"dsv4:{pick(_DSV4_COMPRESSOR_KEYS)}", f"dsv4:{pick(_DSV4_INDEXER_KEYS)}"


@dataclasses.dataclass(frozen=True, slots=True)
class EngineIdentity:
    """The namespace's version key, each group's plan, and each group's layout digest."""

    version_key: VersionKey
    plans: Mapping[int, GroupPlan]
    layout_digests: Mapping[int, bytes]

    @property
    def namespace(self) -> bytes:
        return self.version_key.namespace


def derive_identity(
    model_id: str,
    model_dir: Path,
    groups: Sequence[EngineGroup],
    layout: ChunkLayout,
    kernel_abi: str,
    weights: str | None = None,
) -> EngineIdentity:
    """Namespace and group plans of one engine.

    `weights` skips digesting the checkpoint (a digest the operator computed)."""
    if not model_dir.is_dir():
        raise VllmTierError(
            f"model '{model_id}' is not a local checkpoint directory: set model_dir in the kvtier tier config "
            "to the snapshot directory vLLM loads"
        )
    hf_config = read_hf_config(model_dir)
    plans = plan_groups(groups, hf_config, layout.blocks_per_chunk)
    ordered = [plans[g] for g in sorted(plans)]
    dtype_layout = layout.describe(ordered)
    compression, indexer = compression_versions(hf_config)
    key = VersionKey(
        model_id=model_id,
        weights_digest=weights or weights_digest(model_dir),
        kernel_abi=kernel_abi,
        compression_version=compression,
        indexer_version=indexer,
        dtype_layout=dtype_layout,
    )
    digests = {
        p.group_id: hashlib.blake2b(
            f"{kernel_abi}|{dtype_layout}|{p.describe()}".encode(), digest_size=16, person=b"kvtier-vllm-lay1"
        ).digest()
        for p in ordered
    }
    return EngineIdentity(key, plans, digests)

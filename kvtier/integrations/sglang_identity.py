"""The engine identity behind an SGLang HiCache backend's namespace. Plain Python: imports no SGLang.

Records are shared only between engines that agree on every field: checkpoint bytes, the compressor and
indexer configuration (DSV4's `compress_ratios`, window, `index_*`), KV dtype and page layout, SGLang's
version and page size, and the shard of the model a rank holds. Any change is a new namespace, so an
engine never loads bytes another configuration wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.core.versions import VersionKey
from kvtier.integrations.engine_identity import read_hf_config, weights_digest
from kvtier.integrations.errors import VllmTierError
from kvtier.integrations.kv_groups import text_config
from kvtier.integrations.sglang_pools import SglangStorageError

# config.json keys that change what the compressor (and the windows around it) or the indexer write.
_COMPRESSOR_KEYS = re.compile(r"compress|window|kv_lora_rank|rope_head_dim|head_dim")
_INDEXER_KEYS = re.compile(r"index")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineShape:
    """What SGLang's `HiCacheStorageConfig` and the anchor pool say of this rank's engine."""

    model_name: str
    sglang_version: str
    page_size: int
    kv_cache_dtype: str
    is_mla_model: bool
    is_page_first_layout: bool
    shard: str  # the part of the model this rank's pages hold ("replicated" for MLA ranks sharing pages)


def config_digest(cfg: Mapping[str, Any], pattern: re.Pattern[str]) -> str:
    """blake2b-16 over the config.json entries whose key matches `pattern`, or 'none' when none does."""
    picked = {k: v for k, v in cfg.items() if pattern.search(k)}
    if not picked:
        return "none"
    canonical = json.dumps(picked, sort_keys=True, separators=(",", ":")).encode()
    return "blake2b16:" + hashlib.blake2b(canonical, digest_size=16).hexdigest()


def version_key(model_dir: Path, shape: EngineShape, weights: str | None = None) -> VersionKey:
    """The namespace's version key; `weights` skips digesting the checkpoint (a digest the operator computed)."""
    if not model_dir.is_dir():
        raise SglangStorageError(
            f"'{model_dir}' is not a local checkpoint directory: set model_dir in "
            "--hicache-storage-backend-extra-config to the checkpoint SGLang serves"
        )
    try:
        cfg = text_config(read_hf_config(model_dir))
        digest = weights or weights_digest(model_dir)
    except VllmTierError as exc:  # the shared checkpoint helpers' error; its advice names vLLM's setting
        raise SglangStorageError(f"cannot identify the checkpoint at {model_dir}: {exc}") from None
    layout = (
        f"kv={shape.kv_cache_dtype};page={shape.page_size}t;mla={int(shape.is_mla_model)};"
        f"page_first={int(shape.is_page_first_layout)};shard={shape.shard}"
    )
    return VersionKey(
        model_id=shape.model_name or str(model_dir),
        weights_digest=digest,
        kernel_abi=f"sglang-{shape.sglang_version}",
        compression_version=config_digest(cfg, _COMPRESSOR_KEYS),
        indexer_version=config_digest(cfg, _INDEXER_KEYS),
        dtype_layout=layout,
    )

"""DeepSeek-V4's HiCache host pools as fakes with the members HiCacheFile uses, and the calls SGLang makes.

The fakes stand in for `DeepSeekV4PagedHostPool` / `DeepSeekV4StateHostPool` (which need a CUDA device
to allocate): `page_size`, `get_data_page`, `get_dummy_flat_data_page`, `set_from_flat_data_page`, over a
page-first uint8 buffer. Every pool pages 256 tokens (SGLang asserts a 256-token page for paged DSV4);
bytes per layer per page are DeepSeek-V4-Flash's: a 584 B compressed row, a 132 B indexer row, fp32
compressor states of 2 * coff * head_dim per position over an 8-position C4 ring.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import pytest

REQUIRED_ENV = "KVTIER_SGLANG_REQUIRED"  # set by run.sh: there a missing SGLang fails, never skips


def require_sglang() -> None:
    """Skip the calling module unless SGLang's real HiCache classes import (not a namespace folder `sglang`)."""
    if os.environ.get(REQUIRED_ENV) == "1":
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401

        return
    pytest.importorskip(
        "sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed here: run tests/sglang/run.sh"
    )


require_sglang()


def _stand_in_for_torchvision() -> None:
    """SGLang's config package imports torchvision's transforms at module level for multimodal preprocessing.

    PyPI's torchvision wheels are CUDA builds that do not load beside the CPU torch on these hosts, so the
    test venv has none; kvtier's code path never touches images. The stand-in goes in only after
    transformers has looked for torchvision (it answers "not installed" there) and only when the real one
    does not import.
    """
    import importlib.util
    import sys
    import types

    import sglang  # noqa: F401  (imports transformers first)

    if importlib.util.find_spec("torchvision") is not None:
        return
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    mods = {name: types.ModuleType(name) for name in names}
    interpolation = type("InterpolationMode", (), {"BICUBIC": "bicubic", "BILINEAR": "bilinear", "NEAREST": "nearest"})

    def _any(name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})

    for mod in mods.values():
        mod.__path__ = []  # type: ignore[attr-defined]
        mod.__getattr__ = _any  # type: ignore[method-assign]
        mod.InterpolationMode = interpolation  # type: ignore[attr-defined]
    mods["torchvision"].transforms = mods["torchvision.transforms"]  # type: ignore[attr-defined]
    mods["torchvision.transforms"].functional = mods["torchvision.transforms.functional"]  # type: ignore[attr-defined]
    sys.modules.update(mods)


_stand_in_for_torchvision()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.runtime_context import publish  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.utils.hf_transformers.config import get_config  # noqa: E402

# SGLang's HiCache interface as kvtier's backend imports it (one list of its names), and the backend itself,
# re-exported for the tests: they import SGLang, so they come after the skip above
from kvtier.integrations.sglang.backend import (  # noqa: E402, F401
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    KvtierHiCacheStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

PAGE = 256
ALL, TRAILING = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES


@dataclasses.dataclass(frozen=True)
class PoolGeometry:
    name: PoolName
    item_bytes: int  # per layer per 256-token page
    policy: PoolHitPolicy


# The six data pools of `build_deepseek_v4_hicache_stack` (FP8 indexer: no separate scale pool).
DSV4_POOLS = (
    PoolGeometry(PoolName.SWA, PAGE * 584, TRAILING),
    PoolGeometry(PoolName.DEEPSEEK_V4_C4, (PAGE // 4) * 584, ALL),
    PoolGeometry(PoolName.DEEPSEEK_V4_C4_INDEXER, (PAGE // 4) * 132, ALL),
    PoolGeometry(PoolName.DEEPSEEK_V4_C4_STATE, 8 * 2 * 2 * 512 * 4, TRAILING),
    PoolGeometry(PoolName.DEEPSEEK_V4_C4_INDEXER_STATE, 8 * 2 * 2 * 128 * 4, TRAILING),
    PoolGeometry(PoolName.DEEPSEEK_V4_C128, (PAGE // 128) * 584, ALL),
)

# DeepSeek-V4.1's pools in SGLang 0.5.23 (`_dsv4_low_ratio_entries`): the ratio-1 and ratio-2 shared source
# KV and their indexer keys mirror the KV anchor (ALL_PAGES); the sliding window is state. Row bytes as
# DSV4's (a 584 B KV row, a 132 B fp8 indexer row).
DSV41_POOLS = (
    PoolGeometry(PoolName.SWA, PAGE * 584, TRAILING),
    PoolGeometry(PoolName.DEEPSEEK_V4_C1, PAGE * 584, ALL),
    PoolGeometry(PoolName.DEEPSEEK_V4_C1_INDEXER, PAGE * 132, ALL),
    PoolGeometry(PoolName.DEEPSEEK_V4_C2, (PAGE // 2) * 584, ALL),
    PoolGeometry(PoolName.DEEPSEEK_V4_C2_INDEXER, (PAGE // 2) * 132, ALL),
)


class FakePagedPool:
    """A host pool of `num_pages` pages of `layer_num` x `item_bytes` bytes, page-first, in FULL token indices."""

    def __init__(self, item_bytes: int, layer_num: int, num_pages: int, page_size: int = PAGE) -> None:
        self.page_size = page_size
        self.layer_num = layer_num
        self.item_bytes = item_bytes
        self.layout = "page_first"
        self.kv_buffer = torch.zeros(num_pages, layer_num, item_bytes, dtype=torch.uint8)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[int(index) // self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.layer_num * self.item_bytes, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[int(index) // self.page_size].copy_(data_page.view(torch.uint8).reshape(self.layer_num, -1))


class FakeAnchorPool:
    """DSV4's logical KV anchor (`LogicalHostPool`): indices only, pages of no bytes."""

    page_size = PAGE
    layout = "page_first"

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        pass


class Dsv4Host:
    """The anchor and the six pools (or `geometry`'s), `num_pages` host pages each."""

    def __init__(self, num_pages: int, layer_num: int = 1, geometry: tuple[PoolGeometry, ...] = DSV4_POOLS) -> None:
        self.anchor = FakeAnchorPool()
        self.geometry = geometry
        self.pools = {g.name: FakePagedPool(g.item_bytes, layer_num, num_pages) for g in geometry}

    def fill(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for pool in self.pools.values():
            pool.kv_buffer.copy_(torch.randint(0, 256, pool.kv_buffer.shape, dtype=torch.uint8, generator=gen))

    def clear(self) -> None:
        for pool in self.pools.values():
            pool.kv_buffer.fill_(0xA5)

    def snapshot(self) -> dict[PoolName, torch.Tensor]:
        return {name: pool.kv_buffer.clone() for name, pool in self.pools.items()}

    def attach(self, backend: HiCacheStorage) -> HiCacheStorage:
        """Register pools the way HybridCacheController.attach_storage_backend does."""
        backend.register_mem_pool_host(self.anchor)
        for name, pool in self.pools.items():
            backend.register_mem_host_pool_v2(pool, name)
        backend.on_host_pools_registered()
        return backend


def chain(tokens_seed: str, pages: int, parent: str = "") -> list[str]:
    """Chained page hashes as SGLang keys pages (hex sha256 of the previous hash and the page's tokens)."""
    out = []
    for i in range(pages):
        parent = hashlib.sha256(f"{parent}|{tokens_seed}|{i}".encode()).hexdigest()
        out.append(parent)
    return out


def page_indices(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int64) for p in pages])


def backup(
    backend: HiCacheStorage, host: Dsv4Host, keys: list[str], slots: list[int], state_at: set[int]
) -> dict[PoolName, list[bool]]:
    """What `_page_backup` does for one node: history pools for every page, state pools for the pages in
    `state_at` (a node's trailing host pages), then the KV anchor through the generic page path."""
    transfers = []
    for g in host.geometry:
        pick = range(len(keys)) if g.policy is ALL else sorted(state_at)
        if pick:
            transfers.append(
                PoolTransfer(
                    name=g.name,
                    host_indices=page_indices([slots[i] for i in pick]),
                    keys=[keys[i] for i in pick],
                    hit_policy=g.policy,
                )
            )
    results = backend.batch_set_v2(transfers, extra_info=HiCacheStorageExtraInfo(prefix_keys=None))
    assert backend.batch_set(keys, [host.anchor.get_data_page(s * PAGE) for s in slots])
    return results


def query(
    backend: HiCacheStorage,
    keys: list[str],
    prefix: list[str] | None = None,
    window_pages: int = 1,
    geometry: tuple[PoolGeometry, ...] = DSV4_POOLS,
) -> tuple[int, list[int] | None]:
    """`batch_exists_v2` as the prefetch thread asks it: every pool, state pools with their window."""
    transfers = [
        PoolTransfer(
            name=g.name, keys=["__placeholder__"] * window_pages if g.policy is TRAILING else None, hit_policy=g.policy
        )
        for g in geometry
    ]
    result = backend.batch_exists_v2(keys, transfers, HiCacheStorageExtraInfo(prefix_keys=prefix))
    return result.kv_hit_pages, result.restorable_prefix_pages


def load(backend: HiCacheStorage, host: Dsv4Host, keys: list[str], slots: list[int]) -> dict[PoolName, list[bool]]:
    """KV-derived pools for every page, state pools for the last page (a 1-page window at the boundary)."""
    transfers = [
        PoolTransfer(
            name=g.name,
            host_indices=page_indices(slots if g.policy is ALL else slots[-1:]),
            keys=keys if g.policy is ALL else keys[-1:],
            hit_policy=g.policy,
        )
        for g in host.geometry
    ]
    return backend.batch_get_v2(transfers, extra_info=HiCacheStorageExtraInfo(prefix_keys=None))


def storage_config(extra: dict, model_name: str = "deepseek-ai/DeepSeek-V4-Flash") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=True,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model_name,
        extra_config=extra,
    )


def kvtier_backend(host: Dsv4Host, model_dir: Path, **options) -> HiCacheStorage:
    """Loaded the way SGLang loads `--hicache-storage-backend dynamic`."""
    extra = {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierHiCacheStorage",
        "model_dir": str(model_dir),
        "weights_digest": "xxh3_128:test",
        **options,
    }
    return host.attach(StorageBackendFactory.create_backend("dynamic", storage_config(extra), host.anchor))


def file_backend(host: Dsv4Host, path: Path) -> HiCacheFile:
    return host.attach(HiCacheFile(storage_config({"file_storage_path": str(path)}), file_path=str(path)))


def launch(model_dir: Path, **server_args) -> dict:
    """What SGLang's scheduler process does before it builds its caches: resolve the launch's ServerArgs
    and publish them for this process (`run_scheduler_process`). The backend reads them back from there.
    Returns the resolved arguments (`page_size` as SGLang settled it, ...)."""
    get_config.cache_clear()  # SGLang caches config.json per process; each launch is a new process
    args = ServerArgs(model_path=str(model_dir), device="cpu", skip_tokenizer_init=True, **server_args)
    return publish(args, role="scheduler").resolved_server_args_dict()


def launched_dsv4(model_dir: Path) -> Path:
    """A DSV4 checkpoint written into `model_dir` and launched: its resolved ServerArgs published as SGLang's
    scheduler does, so a backend built next identifies it."""
    launch(write_checkpoint(model_dir))
    return model_dir


def write_qwen3_checkpoint(model_dir: Path, **overrides) -> Path:
    """A tiny Qwen3 (plain KV pool) config.json and a small weight file."""
    import json

    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
        **overrides,
    }
    (model_dir / "config.json").write_text(json.dumps(cfg))
    (model_dir / "model.safetensors").write_bytes(b"\0" * 64)
    return model_dir


def write_v41_checkpoint(model_dir: Path, **overrides) -> Path:
    """A DeepSeek-V4.1-shaped config.json (compress ratios 0/1/2, cross-layer KV and indexer sources)."""
    import json

    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "num_hidden_layers": 6,
        "hidden_size": 64,
        "vocab_size": 256,
        "num_attention_heads": 4,
        "compress_ratios": [0, 1, 2, 1, 2, 0],
        "kv_source_layer_ids": [0, 1, 2, 1, 2, 5],
        "index_source_layer_ids": [0, 1, 2, 1, 2, 5],
        "sliding_window": 128,
        "index_topk": 512,
        "index_head_dim": 128,
        "kv_lora_rank": 512,
        **overrides,
    }
    (model_dir / "config.json").write_text(json.dumps(cfg))
    (model_dir / "model.safetensors").write_bytes(b"\0" * 64)
    return model_dir


def write_checkpoint(model_dir: Path, **overrides) -> Path:
    """A DSV4-shaped config.json (what SGLang's ModelConfig needs to build) and a small weight file."""
    import json

    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_hidden_layers": 8,
        "hidden_size": 64,
        "vocab_size": 256,
        "num_attention_heads": 4,
        "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 0],
        "sliding_window": 128,
        "index_topk": 512,
        "index_head_dim": 128,
        "kv_lora_rank": 512,
        **overrides,
    }
    (model_dir / "config.json").write_text(json.dumps(cfg))
    (model_dir / "model.safetensors").write_bytes(b"\0" * 64)
    return model_dir

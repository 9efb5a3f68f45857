"""An engine tier's namespace and records as the vLLM tier writes them, without vLLM: for prewarm / explain tests.

The version key carries a vLLM tier's kernel ABI and chunk layout (two groups: a full-attention history group
and a 64-token sliding window, 32-token chunks); records are stored through a raw tier connection, under the
keys vLLM's chunks get and with the layout digest the tier derives, as a real engine's tier stores them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kvtier.client import TierClient
from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.integrations.checkpoint import weights_digest
from kvtier.integrations.vllm import keys as vl

CHUNK = 32
CHUNKS = 10
OBJ = 4096
LAYOUT = (
    f"bfloat16;layout=NHD;chunk={OBJ}B/1blk;block={OBJ}B;hash={CHUNK}t;agnostic;replicated=0;canonical=1;"
    "groups=vllm.g0.full:compressed:32t:layers-0a1b2c3d,vllm.g1.swa64:swa:32t:layers-4e5f6a7b"
)
GROUPS = [("vllm.g0.full", CacheForm.COMPRESSED), ("vllm.g1.swa64", CacheForm.SWA)]


def engine_model(path: Path, seed: int) -> Path:
    """A checkpoint directory (config.json and a weight file): what the namespace's weights digest covers."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    (path / "model.safetensors").write_bytes(os.urandom(1024))
    return path


def engine_vkey(model: Path, engine_config: str = "cfg-a") -> VersionKey:
    return VersionKey(
        str(model), weights_digest(model), "vllm 0.32.0;cpu;attn=CPU", "in engine_config", "in engine_config",
        LAYOUT, engine_config,
    )  # fmt: skip


def engine_tokens(seed: int, n: int = CHUNKS * CHUNK + 5) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def store_engine_records(
    sock: Path, vkey: VersionKey, tokens: list[int], skip: dict[str, set[int]], wrong: tuple[str, ...] = ()
) -> list[ObjectKey]:
    """Store the prompt's chunks of both groups under vLLM's keys, but the chunks in `skip` (per group); the
    groups in `wrong` with another layout's digest."""
    layout = vl.parse_layout(LAYOUT)
    hashes = vl.block_hashes(tokens, layout.tokens_per_hash, "sha256")
    keys, digests = [], []
    for g in layout.groups:
        digest = bytes(16) if g.name in wrong else vl.layout_digest(vkey.kernel_abi, LAYOUT, g)
        for i, h in enumerate(vl.chunk_hashes(hashes, layout, g)):
            if i not in skip.get(g.name, set()):
                keys.append(ObjectKey(vkey.namespace, h, g.name, g.form))
                digests.append(digest)
    with TierClient(sock, vkey, GROUPS, OBJ * 4, identity={"model_config": {}}) as c:
        items = [(k, torch.full((OBJ,), i % 251, dtype=torch.uint8), d) for i, (k, d) in enumerate(zip(keys, digests))]
        if items:
            c.store_many(items)
    return keys

"""The checkpoint's own bytes as an identity: a digest over config.json and the top-level weight files.

Both engine tiers put it in the namespace, so a new checkpoint written under the same path is a new namespace
(never a hit across weights), whatever the engine's configuration says.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import xxhash

from kvtier.integrations.errors import VllmTierError

log = logging.getLogger("kvtier.integrations")

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

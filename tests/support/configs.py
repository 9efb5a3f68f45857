"""The small daemon config the CLI tests start from, written by the schema's `config_text` (one shape, checked
keys) instead of a TOML template per test file."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.core.config import config_text


def tiny_config(
    d: Path, keys: Mapping[str, Any] | None = None, *, compressed: str = "64KiB", check: bool = True
) -> str:
    """cpu, the socket and store under `d`, no verifier, pools of a few KiB; `keys` (dotted names) laid over it.
    `check=False` writes a planted bad key or value as given."""
    base: dict[str, Any] = {
        "device": "cpu",
        "server.socket": d / "k.sock",
        "store.root": d / "store",
        "verifier.mode": "off",
        "pool.budget_bytes": {"compressed": compressed, "indexer": "16KiB", "tail": "64KiB", "swa": "128KiB"},
    }
    return config_text({**base, **(keys or {})}, check=check)


def write_tiny_config(d: Path, keys: Mapping[str, Any] | None = None, **kw: Any) -> Path:
    """`tiny_config` written to d/k.toml."""
    path = d / "k.toml"
    path.write_text(tiny_config(d, keys, **kw))
    return path

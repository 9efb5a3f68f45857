"""Prompts from files, as `kvtier prewarm` and `kvtier explain` read them: a JSONL manifest, or a token file.

Manifest lines are `{"name", "profile", "tokens" | "token_file", "ttl_s"}`; a token file is `.npy`, or integers
separated by spaces or commas. Every problem is a ConfigError naming the file and line (exit 2).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.core.errors import ConfigError

KEYS = ("name", "profile", "tokens", "token_file", "ttl_s")
MAX_TOKEN_ID = 2**63 - 1  # token ids travel as int64


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    """One manifest line: a named prompt of one profile, and how long a prewarm pins it."""

    name: str
    profile: str
    tokens: np.ndarray  # int64
    ttl_s: float
    where: str  # FILE:LINE, for messages about this prompt


def read_token_file(path: Path, where: str | None = None) -> np.ndarray:
    """Token ids from `.npy` or a text file of integers; int64, one-dimensional."""
    source = where or str(path)
    try:
        if path.suffix == ".npy":
            raw = np.load(path, allow_pickle=False)
            if raw.dtype.kind not in "iu":
                raise ValueError(f"holds {raw.dtype} values, not integers")
            values = raw.reshape(-1)
        else:
            values = np.asarray([int(t) for t in path.read_text().replace(",", " ").split()], dtype=object)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read token file {path}: {exc} (.npy, or integers separated by spaces or commas)",
            key="token_file",
            source=source,
        ) from None
    return _token_ids(list(values.tolist()), "token_file", source)


def _token_ids(values: list[Any], key: str, where: str) -> np.ndarray:
    bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise ConfigError(f"token ids must be integers in 0..2**63-1, got {bad!r}", key=key, source=where)
    if not values:
        raise ConfigError("no token ids", key=key, source=where)
    return np.asarray(values, dtype=np.int64)


def _prompt(entry: Any, base: Path, where: str, line: int) -> Prompt:
    if not isinstance(entry, dict) or not isinstance(entry.get("profile"), str) or not entry["profile"]:
        raise ConfigError("each line must be an object with a 'profile'", key="profile", source=where)
    unknown = sorted(set(entry) - set(KEYS))
    if unknown:
        raise ConfigError(f"unknown key (known: {', '.join(KEYS)})", key=unknown[0], source=where)
    if ("tokens" in entry) == ("token_file" in entry):
        raise ConfigError("give exactly one of 'tokens' and 'token_file'", source=where)
    if "tokens" in entry:
        if not isinstance(entry["tokens"], list):
            raise ConfigError("must be a list of token ids", key="tokens", source=where)
        tokens = _token_ids(entry["tokens"], "tokens", where)
    else:
        if not isinstance(entry["token_file"], str):
            raise ConfigError("must be a path string", key="token_file", source=where)
        tokens = read_token_file(base / entry["token_file"], where)
    ttl = entry.get("ttl_s", 600.0)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0:
        raise ConfigError(f"must be a positive number of seconds, got {ttl!r}", key="ttl_s", source=where)
    return Prompt(str(entry.get("name", f"line {line}")), entry["profile"], tokens, float(ttl), where)


def read_manifest(path: Path, only_line: int | None = None) -> list[Prompt]:
    """Every prompt of a JSONL manifest (blank and `#` lines skipped), or the one on `only_line`; never empty."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"cannot read the manifest: {getattr(exc, 'strerror', None) or exc}", source=str(path)
        ) from None
    prompts = []
    for i, text in enumerate(lines, 1):
        if (only_line is not None and i != only_line) or not text.strip() or text.lstrip().startswith("#"):
            continue
        where = f"{path}:{i}"
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"not a JSON object: {exc.msg}", source=where) from None
        prompts.append(_prompt(entry, path.parent, where, i))
    if not prompts:
        what = f"no prompt on line {only_line}" if only_line is not None else "no prompts (every line blank or #)"
        raise ConfigError(f'{what}; a line is {{"profile": ..., "tokens": [...]}}', source=str(path))
    return prompts

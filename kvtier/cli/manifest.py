"""Prompts from files, as `kvtier prewarm` and `kvtier explain` read them: a JSONL manifest, or a token file.

Manifest lines are `{"name", "profile", "tokens" | "token_file", "ttl_s"}`; a token file is `.npy`, or integers
separated by spaces or commas. A line for an engine namespace names `"engine"` (vllm | sglang) and `"model_dir"`
instead of a profile, the engine settings that shape its keys, and may give the prompt as `"text"` or chat
`"messages"` (the checkpoint's tokenizer; docs/vllm.md, docs/sglang.md). Every problem is a ConfigError naming
the file and line (exit 2).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.core.errors import ConfigError

KEYS = ("name", "profile", "tokens", "token_file", "ttl_s")
PROMPT_KEYS = ("tokens", "token_file", "text", "messages")
ENGINE_KEYS = {
    "vllm": ("hash_algo", "hash_seed", "block_size", "chunk_tokens", "cache_salt"),
    "sglang": ("page_size", "extra_key", "cache_salt"),
}
MAX_TOKEN_ID = 2**63 - 1  # token ids travel as int64


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSpec:
    """An engine namespace a manifest line names, and the settings that shape the engine's keys.

    `block_size`, `chunk_tokens` and `page_size` are checked against what the namespace itself records; the
    hash algorithm and seed, and a request's salt or extra key, are not in the namespace and come from here."""

    kind: str  # vllm | sglang
    model_dir: Path
    namespace: str | None = None  # hex prefix, where several namespaces of the checkpoint are live
    hash_algo: str = "sha256"  # vLLM's prefix_caching_hash_algo
    hash_seed: str | None = None  # the vLLM engine's PYTHONHASHSEED, where it had one
    block_size: int | None = None
    chunk_tokens: int | None = None  # the offloading connector's chunk (block_size x blocks_per_chunk)
    page_size: int | None = None
    cache_salt: str | None = None
    extra_key: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    """One manifest line: a named prompt of one profile, and how long a prewarm pins it."""

    name: str
    profile: str
    tokens: np.ndarray  # int64
    ttl_s: float
    where: str  # FILE:LINE, for messages about this prompt
    engine: EngineSpec | None = None  # an engine namespace's line (then `profile` is "")


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


def _ttl(entry: dict[str, Any], where: str) -> float:
    ttl = entry.get("ttl_s", 600.0)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0:
        raise ConfigError(f"must be a positive number of seconds, got {ttl!r}", key="ttl_s", source=where)
    return float(ttl)


def _tokens(entry: dict[str, Any], base: Path, where: str, model_dir: Path | None = None) -> np.ndarray:
    given = [k for k in PROMPT_KEYS if k in entry]
    allowed = PROMPT_KEYS if model_dir is not None else PROMPT_KEYS[:2]
    if len(given) != 1 or given[0] not in allowed:
        names = [repr(k) for k in allowed]
        raise ConfigError(f"give exactly one of {', '.join(names[:-1])} and {names[-1]}", source=where)
    key = given[0]
    if key == "tokens":
        if not isinstance(entry["tokens"], list):
            raise ConfigError("must be a list of token ids", key="tokens", source=where)
        return _token_ids(entry["tokens"], "tokens", where)
    if key == "token_file":
        if not isinstance(entry["token_file"], str):
            raise ConfigError("must be a path string", key="token_file", source=where)
        return read_token_file(base / entry["token_file"], where)
    from kvtier.cli.prompt_text import text_tokens  # transformers, only where a prompt is text

    assert model_dir is not None
    if key == "text":
        if not isinstance(entry["text"], str) or not entry["text"]:
            raise ConfigError("must be a non-empty string", key="text", source=where)
        return _token_ids(text_tokens(model_dir, entry["text"], None, where), "text", where)
    msgs = entry["messages"]
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise ConfigError('must be a list of {"role": ..., "content": ...} objects', key="messages", source=where)
    return _token_ids(text_tokens(model_dir, None, msgs, where), "messages", where)


def _engine_prompt(entry: dict[str, Any], base: Path, where: str, line: int) -> Prompt:
    kind = entry["engine"]
    if kind not in ENGINE_KEYS:
        raise ConfigError(f"must be one of {', '.join(ENGINE_KEYS)}, got {kind!r}", key="engine", source=where)
    known = ("name", "engine", "model_dir", "namespace", "ttl_s", *PROMPT_KEYS, *ENGINE_KEYS[kind])
    unknown = sorted(set(entry) - set(known))
    if unknown:
        raise ConfigError(f"unknown key for a {kind} line (known: {', '.join(known)})", key=unknown[0], source=where)
    if not isinstance(entry.get("model_dir"), str) or not entry["model_dir"]:
        raise ConfigError(
            "an engine line needs the checkpoint's directory as 'model_dir'", key="model_dir", source=where
        )
    model_dir = base / entry["model_dir"]
    if not model_dir.is_dir():
        raise ConfigError(
            f"{model_dir} is not a directory: the checkpoint the engine loads", key="model_dir", source=where
        )
    settings: dict[str, Any] = {}
    for k in ENGINE_KEYS[kind] + ("namespace",):
        if k not in entry:
            continue
        v = entry[k]
        want_int = k in ("block_size", "chunk_tokens", "page_size")
        if want_int and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ConfigError(f"must be a positive integer, got {v!r}", key=k, source=where)
        if not want_int and not isinstance(v, str):
            raise ConfigError(f"must be a string, got {v!r}", key=k, source=where)
        settings[k] = v
    if kind == "vllm":
        from kvtier.integrations.vllm.keys import HASH_ALGOS

        if settings.get("hash_algo", "sha256") not in HASH_ALGOS:
            raise ConfigError(f"must be one of {', '.join(HASH_ALGOS)}", key="hash_algo", source=where)
    spec = EngineSpec(kind, model_dir, **settings)
    tokens = _tokens(entry, base, where, model_dir)
    return Prompt(str(entry.get("name", f"line {line}")), "", tokens, _ttl(entry, where), where, spec)


def _prompt(entry: Any, base: Path, where: str, line: int) -> Prompt:
    if isinstance(entry, dict) and "engine" in entry and "profile" not in entry:
        return _engine_prompt(entry, base, where, line)
    if not isinstance(entry, dict) or not isinstance(entry.get("profile"), str) or not entry["profile"]:
        raise ConfigError("each line must be an object with a 'profile' (or an 'engine')", key="profile", source=where)
    unknown = sorted(set(entry) - set(KEYS))
    if unknown:
        raise ConfigError(f"unknown key (known: {', '.join(KEYS)})", key=unknown[0], source=where)
    tokens = _tokens(entry, base, where)
    return Prompt(str(entry.get("name", f"line {line}")), entry["profile"], tokens, _ttl(entry, where), where)


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

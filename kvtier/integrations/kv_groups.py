"""vLLM KV cache groups as kvtier groups: full attention is a history form, sliding-window attention the `swa` state form.

vLLM's offloading config names each group's layers but not their attention type; the checkpoint's
`config.json` does (`layer_types` + `sliding_window`), so the two are matched by layer index.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvtier.core.forms import CacheForm
from kvtier.integrations.errors import VllmTierError

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineGroup:
    """What vLLM's offloading config says of one KV cache group."""

    group_id: int
    tokens_per_block: int
    layer_names: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class GroupPlan:
    """How kvtier files one vLLM group: object group name, form, chunk span and (state form) window."""

    group_id: int
    name: str
    form: CacheForm
    tokens_per_chunk: int
    window_tokens: int  # 0: full attention
    layers_digest: str

    @property
    def window_chunks(self) -> int:
        """Trailing chunks a continuation needs: 0 for history (every chunk from 0), else ceil(window / chunk)."""
        return -(-self.window_tokens // self.tokens_per_chunk) if self.window_tokens else 0

    def describe(self) -> str:
        return f"{self.name}:{self.form.value}:{self.tokens_per_chunk}t:layers-{self.layers_digest}"


def text_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a checkpoint config (multimodal configs nest it as `text_config`)."""
    nested = hf_config.get("text_config")
    return nested if isinstance(nested, Mapping) else hf_config


def layer_index(layer_name: str) -> int:
    """`model.layers.7.self_attn.attn` -> 7."""
    m = _LAYER_INDEX.search(layer_name)
    if m is None:
        raise VllmTierError(
            f"KV layer '{layer_name}' has no 'layers.<n>' index: this model's layers cannot be matched to config.json"
        )
    return int(m.group(1))


def layer_window(cfg: Mapping[str, Any], index: int) -> int:
    """Sliding window of layer `index` in tokens, 0 for full attention.

    `layer_types` decides where present; otherwise every layer is windowed when `sliding_window` is set
    and not switched off by `use_sliding_window: false` (Mistral- and Qwen2-style configs).
    """
    window = cfg.get("sliding_window") or 0
    types = cfg.get("layer_types")
    if types is not None:
        if not 0 <= index < len(types):
            raise VllmTierError(
                f"layer {index} is beyond config.json's layer_types ({len(types)} entries): is model_dir the checkpoint vLLM loaded?"
            )
        kind = types[index]
        if kind == "full_attention":
            return 0
        if kind == "sliding_attention" and isinstance(window, int) and window > 0:
            return window
        raise VllmTierError(
            f"layer {index} has attention type '{kind}' (sliding_window={window!r}): the kvtier vLLM tier serves full and sliding-window attention only"
        )
    if cfg.get("use_sliding_window") is False or not isinstance(window, int):
        return 0
    return max(window, 0)


def plan_groups(
    groups: Sequence[EngineGroup], hf_config: Mapping[str, Any], blocks_per_chunk: int
) -> dict[int, GroupPlan]:
    """One plan per vLLM group id; every layer of a group must share one window."""
    cfg = text_config(hf_config)
    plans: dict[int, GroupPlan] = {}
    for g in groups:
        if not g.layer_names:
            raise VllmTierError(f"KV group {g.group_id} names no layers: the kvtier vLLM tier cannot classify it")
        windows = {layer_window(cfg, layer_index(n)) for n in g.layer_names}
        if len(windows) != 1:
            raise VllmTierError(
                f"KV group {g.group_id} mixes sliding windows {sorted(windows)}: the kvtier vLLM tier needs one attention type per group"
            )
        window = windows.pop()
        name = f"vllm.g{g.group_id}.swa{window}" if window else f"vllm.g{g.group_id}.full"
        layers = hashlib.blake2b("\n".join(g.layer_names).encode(), digest_size=4).hexdigest()
        plans[g.group_id] = GroupPlan(
            g.group_id,
            name,
            CacheForm.SWA if window else CacheForm.COMPRESSED,
            g.tokens_per_block * blocks_per_chunk,
            window,
            layers,
        )
    return plans


def in_complete_window(end: int, plan: GroupPlan, servable: Callable[[int], bool]) -> bool:
    """Whether the state chunk ending at token `end` lies in a window some continuation could load whole.

    A continuation at boundary L needs the chunks ending in (L - n*t, L] (from the first chunk when L is
    small); the chunk ending at `end` belongs to the windows of L = end, end + t, ..., end + (n-1)*t.
    `servable(e)` says whether this request's chunk ending at token e is stored and loadable.
    """
    t, n = plan.tokens_per_chunk, plan.window_chunks
    return any(
        all(servable(e) for e in range(max(t, boundary - (n - 1) * t), boundary + 1, t))
        for boundary in range(end, end + n * t, t)
    )

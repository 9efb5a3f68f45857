"""vLLM KV cache groups as kvtier groups: history forms (every chunk from 0) or state forms (a trailing window).

The rule is read off each group's cache spec where the caller has vLLM's `KVCacheConfig`
(`integrations/vllm/specs.py` turns its specs into `LayerSpec`s): a spec that keeps a block for every
token is history, whatever its compression ratio or sharing; a sliding-window spec is a state form with
the spec's window; a spec vLLM does not key by prefix is refused, naming the layer; any other spec is
served as a plain "all blocks" history group. So a model vLLM groups in a new way (DeepSeek-V4.1's ratio
1 and 2 caches) is classified by what vLLM allocates, not by a list of known ratios.

Without specs (a caller that has only the offloading config), the checkpoint's `config.json` is matched to
the layers by index: `layer_types` + `sliding_window` for full / sliding-window models, and for
DeepSeek-V4 (`compress_ratios`) the cache module's name suffix with that layer's compression ratio. A
layer that fits neither is refused, naming the layer.
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
class LayerSpec:
    """What vLLM's KV cache spec says of one layer's cache, as plain data (specs.layer_spec builds it)."""

    family: str  # "attention" (a block per token span), "sliding_window", "chunked_local", "ring", "mamba", "other"
    spec_class: str  # vLLM's spec class, e.g. "MLAAttentionSpec"
    block_size: int  # tokens per block
    sliding_window: int = 0  # tokens; 0: none
    tokens_per_state: str = "1"  # tokens per stored row: the compression ratio ("2"), or a fraction ("1/4")
    page_bytes: int = 0
    dtype: str = ""
    cache_dtype: str = ""
    prefix_cacheable: bool = True  # False: vLLM does not key the blocks by prefix (a per-request ring)

    def describe(self) -> str:
        return f"{self.spec_class}:r{self.tokens_per_state}:{self.page_bytes}B"


@dataclasses.dataclass(frozen=True, slots=True)
class EngineGroup:
    """What vLLM says of one KV cache group: the offloading config's block span and layers, and the cache specs.

    `layer_specs` holds one spec per layer name, in order, or one spec for every layer of the group (vLLM's
    scheduler-side `KVCacheConfig` keeps a group's merged spec only); empty when the caller has no specs.
    """

    group_id: int
    tokens_per_block: int
    layer_names: tuple[str, ...]
    layer_specs: tuple[LayerSpec, ...] = ()

    def specs_by_layer(self) -> dict[str, LayerSpec]:
        if len(self.layer_specs) == len(self.layer_names):
            return dict(zip(self.layer_names, self.layer_specs))
        if len(self.layer_specs) == 1:
            return dict.fromkeys(self.layer_names, self.layer_specs[0])
        raise VllmTierError(
            f"KV group {self.group_id} has {len(self.layer_specs)} specs for {len(self.layer_names)} layers: "
            "give one spec per layer or one for the whole group"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class GroupPlan:
    """How kvtier files one vLLM group: object group name, form, chunk span and (state form) window."""

    group_id: int
    name: str
    form: CacheForm
    tokens_per_chunk: int
    window_tokens: int  # 0: a history group (every chunk from 0); else the state window in tokens
    layers_digest: str
    kinds: str = ""  # DSV4: the cache modules the group holds, e.g. "c4+c128+indexer" (part of the layout)

    @property
    def window_chunks(self) -> int:
        """Trailing chunks a continuation needs: 0 for history (every chunk from 0), else ceil(window / chunk)."""
        return -(-self.window_tokens // self.tokens_per_chunk) if self.window_tokens else 0

    def describe(self) -> str:
        kinds = f":{self.kinds}" if self.kinds else ""
        return f"{self.name}:{self.form.value}:{self.tokens_per_chunk}t{kinds}:layers-{self.layers_digest}"


@dataclasses.dataclass(frozen=True, slots=True)
class LayerKind:
    """What one KV layer holds, as kvtier files it: form, window (0: history) and the module kind it came from."""

    form: CacheForm
    window: int
    kind: str  # "full", "swa", "c4", "c128", "indexer", "c4-state", "c128-state", "indexer-c4-state", ...


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
                f"layer {index} is beyond config.json's layer_types ({len(types)} entries): "
                "is model_dir the checkpoint vLLM loaded?"
            )
        kind = types[index]
        if kind == "full_attention":
            return 0
        if kind == "sliding_attention" and isinstance(window, int) and window > 0:
            return window
        raise VllmTierError(
            f"layer {index} has attention type '{kind}' (sliding_window={window!r}): "
            "the kvtier vLLM tier serves full and sliding-window attention only"
        )
    if cfg.get("use_sliding_window") is False or not isinstance(window, int):
        return 0
    return max(window, 0)


# DeepSeek-V4 cache modules by layer-name suffix, longest first (".attn" ends every other one's parent).
_DSV4_SUFFIXES = (
    (".indexer.compressor.state_cache", "indexer-state"),
    (".compressor.state_cache", "state"),
    (".indexer.k_cache", "indexer"),
    (".swa_cache", "swa"),
    (".attn", "attn"),
)
# Suffixes of cache modules that are not attention KV: outside DSV4 nothing may read them as full / sliding.
_NON_ATTENTION_SUFFIXES = ("state_cache", "k_cache", "swa_cache", "compressor", "indexer")


def is_dsv4(cfg: Mapping[str, Any]) -> bool:
    """DeepSeek-V4-style checkpoint: per-layer compression ratios (compressed MLA + indexer + SWA + states)."""
    return "compress_ratios" in cfg or cfg.get("model_type") == "deepseek_v4"


def _dsv4_ratio(cfg: Mapping[str, Any], index: int, layer_name: str) -> int:
    ratios = cfg.get("compress_ratios")
    if not isinstance(ratios, list) or not 0 <= index < len(ratios):
        raise VllmTierError(
            f"KV layer '{layer_name}': config.json's compress_ratios has no entry {index}: "
            "is model_dir the checkpoint vLLM loaded?"
        )
    return int(ratios[index])


def dsv4_layer_kind(cfg: Mapping[str, Any], layer_name: str) -> LayerKind:
    """Classify one DSV4 KV layer by its cache module and its layer's compression ratio.

    C4 / C128 attention and indexer keys are history; the SWA cache is `swa` with the model's window;
    compressor states are `tail` with vLLM's state window (2 x ratio for C4, ratio for C128). The model's
    `sliding_window` applies to the SWA cache only: it never turns a history layer into a window.
    """
    index = layer_index(layer_name)
    module = next((kind for suffix, kind in _DSV4_SUFFIXES if layer_name.endswith(suffix)), None)
    if module is None:
        raise VllmTierError(f"KV layer '{layer_name}' is no DeepSeek-V4 cache module kvtier knows: cannot classify it")
    if module == "swa":
        window = cfg.get("sliding_window")
        if not isinstance(window, int) or window <= 0:
            raise VllmTierError(
                f"KV layer '{layer_name}' is a sliding-window cache but config.json's sliding_window is {window!r}"
            )
        return LayerKind(CacheForm.SWA, window, "swa")
    ratio = _dsv4_ratio(cfg, index, layer_name)
    if ratio not in (4, 128):
        raise VllmTierError(
            f"KV layer '{layer_name}' has compress ratio {ratio}: kvtier knows DeepSeek-V4's C4 and C128 caches only"
        )
    if module == "attn":
        return LayerKind(CacheForm.COMPRESSED, 0, f"c{ratio}")
    if module == "indexer":
        return LayerKind(CacheForm.COMPRESSED, 0, f"indexer-c{ratio}")
    window = ratio * (2 if ratio == 4 else 1)  # vLLM's CompressorStateCache: coff * ratio, coff = 2 for C4
    prefix = "indexer-" if module == "indexer-state" else ""
    return LayerKind(CacheForm.TAIL, window, f"{prefix}c{ratio}-state")


def spec_layer_kind(layer_name: str, spec: LayerSpec) -> LayerKind:
    """Classify one KV layer by its cache spec.

    A spec that keeps a block for every token span (full attention, MLA, compressed caches of any ratio,
    indexer keys) is history. A sliding-window spec is a state form with the spec's window: `tail` for a
    compressor's running state (a `*.state_cache` module), `swa` otherwise. A spec vLLM does not key by
    prefix, or a per-request ring, has no bytes a prefix hash could name: refused. Anything else (chunked-local,
    Mamba, a spec newer than this code) is served as "all blocks" history: a hit then needs every block up
    to it stored, which vLLM asks for only where it needs the block, so a hit never lacks what the group needs.
    """
    if not spec.prefix_cacheable or spec.family == "ring":  # a ring's slots follow no token position
        raise VllmTierError(
            f"KV layer '{layer_name}' has a {spec.spec_class} cache ({spec.family}) that vLLM does not key by "
            "token prefix: kvtier cannot store it; run this model without the kvtier tier"
        )
    if spec.family == "sliding_window":
        if spec.sliding_window <= 0:
            raise VllmTierError(
                f"KV layer '{layer_name}' has a sliding-window spec with window {spec.sliding_window}: "
                "cannot tell which blocks a continuation needs"
            )
        form = CacheForm.TAIL if layer_name.endswith("state_cache") else CacheForm.SWA
        return LayerKind(form, spec.sliding_window, spec.describe())
    if spec.family == "attention":
        return LayerKind(CacheForm.COMPRESSED, 0, spec.describe())
    return LayerKind(CacheForm.COMPRESSED, 0, f"all-blocks:{spec.describe()}")


def layer_kind(cfg: Mapping[str, Any], layer_name: str) -> LayerKind:
    """Classify one KV layer of any supported model (DSV4 by cache module, others by attention type)."""
    if is_dsv4(cfg):
        return dsv4_layer_kind(cfg, layer_name)
    if layer_name.rsplit(".", 1)[-1] in _NON_ATTENTION_SUFFIXES or any(
        f".{s}." in layer_name for s in _NON_ATTENTION_SUFFIXES
    ):
        raise VllmTierError(
            f"KV layer '{layer_name}' is a cache module, not attention KV, and config.json has no "
            "compress_ratios: cannot classify it"
        )
    window = layer_window(cfg, layer_index(layer_name))
    return LayerKind(CacheForm.SWA, window, "swa") if window else LayerKind(CacheForm.COMPRESSED, 0, "full")


def plan_groups(
    groups: Sequence[EngineGroup], hf_config: Mapping[str, Any], blocks_per_chunk: int
) -> dict[int, GroupPlan]:
    """One plan per vLLM group id; every layer of a group must share one form and one window.

    A history group is `compressed` (its chunks are valid as a prefix from chunk 0); a DSV4 history group
    holding C4 / C128 attention and indexer keys in one packed row keeps them in one record (the indexer's
    keys ride with the compressed KV they route over, see docs/vllm.md). State groups (`swa`, `tail`) are
    valid only as a whole window ending at the resume boundary. Groups that carry their cache specs are
    classified by them (`spec_layer_kind`), `hf_config` unused; otherwise by `config.json` (`layer_kind`).
    """
    cfg = text_config(hf_config)
    dsv4 = is_dsv4(cfg)
    by_spec = any(g.layer_specs for g in groups)  # then every group must carry its specs
    plans: dict[int, GroupPlan] = {}
    for g in groups:
        if not g.layer_names:
            raise VllmTierError(f"KV group {g.group_id} names no layers: the kvtier vLLM tier cannot classify it")
        if by_spec:
            plans[g.group_id] = _plan_by_spec(g, blocks_per_chunk)
            continue
        kinds = {n: layer_kind(cfg, n) for n in g.layer_names}
        first = kinds[g.layer_names[0]]
        odd = next((n for n, k in kinds.items() if (k.form, k.window) != (first.form, first.window)), None)
        if odd is not None:
            raise VllmTierError(
                f"KV group {g.group_id} mixes {'forms or windows' if dsv4 else 'sliding windows'} "
                f"({g.layer_names[0]}: {first.form.value}/{first.window}, {odd}: {kinds[odd].form.value}/"
                f"{kinds[odd].window}): the kvtier vLLM tier needs one attention type per group"
            )
        form, window = first.form, first.window
        kind_set = "+".join(sorted({k.kind for k in kinds.values()}))
        if not dsv4:
            name, kind_set = (f"vllm.g{g.group_id}.swa{window}" if window else f"vllm.g{g.group_id}.full"), ""
        elif form is CacheForm.COMPRESSED:
            name = f"vllm.g{g.group_id}.history"
        else:
            name = f"vllm.g{g.group_id}.{form.value}{window}"
        layers = hashlib.blake2b("\n".join(g.layer_names).encode(), digest_size=4).hexdigest()
        plans[g.group_id] = GroupPlan(
            g.group_id, name, form, g.tokens_per_block * blocks_per_chunk, window, layers, kind_set
        )
    return plans


def _plan_by_spec(g: EngineGroup, blocks_per_chunk: int) -> GroupPlan:
    """One group's plan from its layers' specs; every layer must land in one form with one window."""
    specs = g.specs_by_layer()
    kinds = {n: spec_layer_kind(n, s) for n, s in specs.items()}
    first_name = g.layer_names[0]
    first = kinds[first_name]
    odd = next((n for n, k in kinds.items() if (k.form, k.window) != (first.form, first.window)), None)
    if odd is not None:
        raise VllmTierError(
            f"KV group {g.group_id} mixes forms or windows ({first_name}: {first.form.value}/{first.window}, "
            f"{odd}: {kinds[odd].form.value}/{kinds[odd].window}): the kvtier vLLM tier needs one per group"
        )
    form, window = first.form, first.window
    if form is not CacheForm.COMPRESSED:
        name = f"vllm.g{g.group_id}.{form.value}{window}"
    elif all(s.family == "attention" and s.tokens_per_state == "1" for s in specs.values()):
        name = f"vllm.g{g.group_id}.full"
    else:
        name = f"vllm.g{g.group_id}.history"
    layers = hashlib.blake2b("\n".join(g.layer_names).encode(), digest_size=4).hexdigest()
    kind_set = "+".join(sorted({k.kind for k in kinds.values()}))
    return GroupPlan(g.group_id, name, form, g.tokens_per_block * blocks_per_chunk, window, layers, kind_set)


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

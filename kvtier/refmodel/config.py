"""The reference model's shape, read from a profile: the `[model]` table plus the cache groups' geometry."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvtier.core.errors import ProfileError
from kvtier.core.forms import CacheForm
from kvtier.core.profile import CacheGroup, ModelProfile

_MODEL_KEYS = (
    "vocab_size",
    "d_model",
    "n_heads",
    "head_dim",
    "latent_dim",
    "index_dim",
    "index_topk",
    "ffn_dim",
    "prefill_chunk",
)


@dataclasses.dataclass(frozen=True, slots=True)
class SwaSpec:
    """A sliding-window layer: multi-head attention over the last `window` tokens."""

    layer: int
    group: str
    window: int
    keep: int  # tokens of K/V kept in the running state: what the trailing n_s exported blocks hold


@dataclasses.dataclass(frozen=True, slots=True)
class CompressedSpec:
    """A compressed layer: attention over compressed rows (top-k via an indexer when sparse) plus the current
    group's raw tokens."""

    layer: int
    group: str
    tail_group: str
    index_group: str | None
    ratio: int

    @property
    def sparse(self) -> bool:
        return self.index_group is not None


LayerSpec = SwaSpec | CompressedSpec


@dataclasses.dataclass(frozen=True, slots=True)
class RefConfig:
    """Every number the reference model is built from; `layers[i]` is layer i."""

    vocab_size: int
    d_model: int
    n_heads: int
    head_dim: int
    latent_dim: int
    index_dim: int
    index_topk: int
    ffn_dim: int
    seed: int
    prefill_chunk: int
    hash_block_tokens: int
    layers: tuple[LayerSpec, ...]

    @classmethod
    def from_profile(cls, profile: ModelProfile) -> RefConfig:
        """Validate the profile against the architecture; every mismatch is a ProfileError naming the field."""
        src = f"<profile {profile.name}>"
        values = {key: _model_int(profile.model, key, src) for key in _MODEL_KEYS}
        seed = _model_int(profile.model, "seed", src, allow_zero=True)
        h = profile.hash_block_tokens
        if values["prefill_chunk"] % h:
            raise ProfileError(
                f"must be a multiple of the hash block ({h} tokens)", field="model.prefill_chunk", source=src
            )
        by_layer: dict[int, LayerSpec] = {}
        for g in profile.groups_of(CacheForm.SWA):
            _row(g, (2, values["n_heads"] * values["head_dim"]), src)
            n_s = g.blocks_needed(h)
            keep = (n_s - 1) * h + min(g.window, h)
            for layer in g.layer_ids:
                _claim(by_layer, layer, SwaSpec(layer, g.name, g.window, keep), src)
        tails = profile.groups_of(CacheForm.TAIL)
        indexers = profile.groups_of(CacheForm.INDEXER)
        for g in profile.groups_of(CacheForm.COMPRESSED):
            _row(g, (values["latent_dim"],), src)
            tail = _partner(g, tails, "tail", src)
            _row(tail, (2 * values["latent_dim"],), src)
            if tail.window != g.ratio or tail.window > h:
                raise ProfileError(
                    f"the tail of {g.name} holds the last ratio ({g.ratio}) tokens, got window {tail.window}",
                    field=f"groups.{tail.name}.window",
                    source=src,
                )
            index = next((i for i in indexers if i.layer_ids == g.layer_ids), None)
            if index is not None:
                _row(index, (values["index_dim"],), src)
                if index.ratio != g.ratio:
                    raise ProfileError(
                        f"must equal {g.name}'s ratio {g.ratio}", field=f"groups.{index.name}.ratio", source=src
                    )
            for layer in g.layer_ids:
                _claim(
                    by_layer,
                    layer,
                    CompressedSpec(layer, g.name, tail.name, index.name if index else None, g.ratio),
                    src,
                )
        if sorted(by_layer) != list(range(len(by_layer))) or not by_layer:
            raise ProfileError(
                f"layers must be 0..n-1 with no gaps, got {sorted(by_layer)}", field="groups.layers", source=src
            )
        return cls(**values, seed=seed, hash_block_tokens=h, layers=tuple(by_layer[i] for i in range(len(by_layer))))


def _model_int(model: dict[str, Any], key: str, src: str, *, allow_zero: bool = False) -> int:
    value = model.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (value == 0 and not allow_zero):
        raise ProfileError(
            f"the reference model needs a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}",
            field=f"model.{key}",
            source=src,
        )
    return value


def _row(group: CacheGroup, shape: tuple[int, ...], src: str) -> None:
    if group.row.dtype != "float32" or group.row.shape != shape:
        raise ProfileError(
            f"the reference model writes float32 rows of shape {list(shape)}, "
            f"got {group.row.dtype} {list(group.row.shape)}",
            field=f"groups.{group.name}.row",
            source=src,
        )


def _partner(group: CacheGroup, candidates: tuple[CacheGroup, ...], what: str, src: str) -> CacheGroup:
    for c in candidates:
        if c.layer_ids == group.layer_ids:
            return c
    raise ProfileError(
        f"no {what} group covers layers {list(group.layer_ids)}", field=f"groups.{group.name}.layers", source=src
    )


def _claim(by_layer: dict[int, LayerSpec], layer: int, spec: LayerSpec, src: str) -> None:
    if layer in by_layer:
        raise ProfileError(f"layer {layer} is in two attention groups", field="groups.layers", source=src)
    by_layer[layer] = spec

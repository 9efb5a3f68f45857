"""Export and import of the five-form cache objects, each a flat uint8 tensor laid out as `profile.layout(group)`.

History groups (compressed, indexer): one object per hash block j, rows of tokens [jH, (j+1)H).
State groups at a checkpoint boundary L = kH: `swa` objects for the trailing n_s blocks, each the
K/V of the last min(window, H) tokens of its block; `tail` objects for block k-1, the compressor's
earlier-half projections of the last `ratio` tokens. Values are float32, native (little) endian.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from kvtier.core.errors import LayoutError
from kvtier.core.forms import CacheForm, GroupKind
from kvtier.core.profile import CacheGroup, ModelProfile
from kvtier.refmodel.compressed import CompressedState
from kvtier.refmodel.errors import BoundaryError, CorruptObjectError, MissingObjectError
from kvtier.refmodel.state import ObjectId, RefState
from kvtier.refmodel.swa import SwaState

log = logging.getLogger(__name__)

Payload = torch.Tensor | bytes | bytearray | memoryview


def required_objects(profile: ModelProfile, boundary_blocks: int) -> list[ObjectId]:
    """Every object a resume at L = boundary_blocks * H reads: history from block 0, state over its trailing window."""
    k, h = boundary_blocks, profile.hash_block_tokens
    out: list[ObjectId] = []
    for g in profile.groups:
        first = 0 if g.kind is GroupKind.HISTORY else max(0, k - g.blocks_needed(h))
        out.extend((g.name, j) for j in range(first, k))
    return out


def export_history(profile: ModelProfile, state: RefState, blocks: Iterable[int]) -> dict[ObjectId, torch.Tensor]:
    """History objects (compressed, indexer) of whole blocks already seen."""
    h = profile.hash_block_tokens
    out: dict[ObjectId, torch.Tensor] = {}
    for j in blocks:
        if (j + 1) * h > state.pos:
            raise BoundaryError(
                f"block {j} ends at token {(j + 1) * h}, past the {state.pos} tokens seen: prefill it first"
            )
        for g in profile.groups:
            if g.kind is GroupKind.HISTORY:
                rows = g.rows_per_hash_block(h)
                out[(g.name, j)] = _pack(_history(state, g, layer)[j * rows : (j + 1) * rows] for layer in g.layer_ids)
    return out


def export_checkpoint(profile: ModelProfile, state: RefState) -> dict[ObjectId, torch.Tensor]:
    """State objects (swa, tail) at the state's current position, which must be a hash-block boundary."""
    h, pos = profile.hash_block_tokens, state.pos
    if pos == 0 or pos % h:
        raise BoundaryError(f"token {pos} is not a hash-block boundary (multiples of {h}): checkpoint there instead")
    k = pos // h
    out: dict[ObjectId, torch.Tensor] = {}
    for g in profile.groups:
        if g.form is CacheForm.SWA:
            width = min(g.window, h)
            for j in range(max(0, k - g.blocks_needed(h)), k):
                parts = []
                for layer in g.layer_ids:
                    kv = _swa(state, layer).kv
                    first = (j + 1) * h - width - (pos - kv.shape[0])
                    parts.append(kv[first : first + width])
                out[(g.name, j)] = _pack(parts)
        elif g.form is CacheForm.TAIL:
            out[(g.name, k - 1)] = _pack(_compressed(state, layer).early for layer in g.layer_ids)
    return out


def restore_state(
    profile: ModelProfile,
    fresh: RefState,
    objects: Mapping[ObjectId, Payload],
    boundary_blocks: int,
    *,
    allow_missing: bool = False,
) -> RefState:
    """Fill `fresh` (a new state) from the objects of boundary L = boundary_blocks * H.

    Every object of `required_objects` must be present with exactly its layout's bytes and finite
    values; otherwise a typed error. `allow_missing` (degraded resume, for tests and demos of what a
    missing form does) substitutes zeros for absent objects instead.
    """
    if isinstance(boundary_blocks, bool) or not isinstance(boundary_blocks, int) or boundary_blocks < 0:
        raise BoundaryError(f"boundary must be a non-negative block count, got {boundary_blocks!r}")
    h, k = profile.hash_block_tokens, boundary_blocks
    needed = required_objects(profile, k)
    missing = [oid for oid in needed if oid not in objects]
    if missing and not allow_missing:
        raise MissingObjectError(k * h, missing)
    if missing:
        log.info("degraded resume at token %d: zeros for %d missing objects %s", k * h, len(missing), missing)
    values = {oid: _unpack(profile, profile.group(oid[0]), oid, objects.get(oid)) for oid in needed}
    for g in profile.groups:
        blocks = [values[(g.name, j)] for j in range(k) if (g.name, j) in values]
        for li, layer in enumerate(g.layer_ids):
            if not blocks:
                continue
            if g.form is CacheForm.SWA:
                _swa(fresh, layer).kv = torch.cat([b[li] for b in blocks])
            elif g.form is CacheForm.TAIL:
                _compressed(fresh, layer).early = blocks[-1][li].clone()
            elif g.form is CacheForm.COMPRESSED:
                _compressed(fresh, layer).rows = torch.cat([b[li] for b in blocks])
            else:
                _compressed(fresh, layer).index_keys = torch.cat([b[li] for b in blocks])
    fresh.pos = k * h
    return fresh


def _pack(parts: Iterable[torch.Tensor]) -> torch.Tensor:
    """Stack per-layer rows into (layers, rows, *row) and return its bytes as a fresh flat uint8 tensor."""
    return torch.stack(list(parts)).view(torch.uint8).reshape(-1)


def _unpack(profile: ModelProfile, group: CacheGroup, oid: ObjectId, value: Payload | None) -> torch.Tensor:
    layout = profile.layout(group)
    if value is None:
        return torch.zeros(layout.shape)
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.uint8:
            raise LayoutError(f"object {oid} is a {value.dtype} tensor: pass its bytes as uint8")
        raw = value.detach().reshape(-1).clone()
    else:
        raw = torch.from_numpy(np.frombuffer(value, dtype=np.uint8).copy())
    if raw.numel() != layout.nbytes:
        raise LayoutError(
            f"object {oid} has {raw.numel()} bytes, layout {layout.abi} {list(layout.shape)} {layout.dtype} needs "
            f"{layout.nbytes}: it was written for another profile or truncated; drop it and recompute"
        )
    out = raw.view(torch.float32).reshape(layout.shape)
    if not torch.isfinite(out).all():
        raise CorruptObjectError(f"object {oid} holds NaN or infinite values: drop it and recompute")
    return out


def _history(state: RefState, group: CacheGroup, layer: int) -> torch.Tensor:
    cs = _compressed(state, layer)
    out = cs.rows if group.form is CacheForm.COMPRESSED else cs.index_keys
    assert out is not None  # an indexer group exists only over layers that have an indexer
    return out


def _swa(state: RefState, layer: int) -> SwaState:
    s = state.layers[layer]
    assert isinstance(s, SwaState), f"layer {layer} is not a sliding-window layer"
    return s


def _compressed(state: RefState, layer: int) -> CompressedState:
    s = state.layers[layer]
    assert isinstance(s, CompressedState), f"layer {layer} is not a compressed layer"
    return s

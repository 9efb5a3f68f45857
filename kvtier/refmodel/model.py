"""The reference hybrid-attention model: chunked prefill, decode, export and resume at hash-block boundaries."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from kvtier.core.profile import ModelProfile
from kvtier.core.versions import VersionKey
from kvtier.refmodel.compressed import CompressedLayer
from kvtier.refmodel.config import RefConfig, SwaSpec
from kvtier.refmodel.errors import BoundaryError, TokenError
from kvtier.refmodel.objects import Payload, export_checkpoint, export_history, restore_state
from kvtier.refmodel.state import ObjectId, RefState
from kvtier.refmodel.swa import SwaLayer
from kvtier.refmodel.weights import CompressedWeights, SwaWeights, build_weights

Tokens = Sequence[int] | np.ndarray | torch.Tensor


@dataclasses.dataclass(slots=True)
class PrefillResult:
    """Logits of every prefilled token, and the cache objects the prefill produced.

    `objects` holds the history objects of every block completed by this prefill and the state
    objects of every checkpoint boundary it passed, as flat uint8 tensors (see `objects`).
    """

    logits: torch.Tensor  # (tokens, vocab) float32
    objects: dict[ObjectId, torch.Tensor]


class RefModel:
    """Decoder-only: per layer pre-norm attention (SWA or compressed) and a SiLU MLP; float32 on CPU.

    Prefill runs in chunks that end on multiples of `chunk_tokens` and at every checkpoint, so the
    state at a checkpoint is exactly what a resume from its exported objects rebuilds, and the run
    after it is the same computation either way (bitwise).
    """

    def __init__(
        self, profile: ModelProfile, version: VersionKey | None = None, *, chunk_tokens: int | None = None
    ) -> None:
        self.profile = profile
        self.version = version or profile.version
        self.config = RefConfig.from_profile(profile)
        self.chunk_tokens = chunk_tokens or self.config.prefill_chunk
        if self.chunk_tokens <= 0 or self.chunk_tokens % self.hash_block_tokens:
            raise ValueError(
                f"chunk_tokens must be a positive multiple of {self.hash_block_tokens}, got {self.chunk_tokens}"
            )
        self.weights = build_weights(self.config, self.version)
        self.layers = tuple(
            SwaLayer(self.config, spec, cast(SwaWeights, bw.attn))  # build_weights pairs each spec with its kind
            if isinstance(spec, SwaSpec)
            else CompressedLayer(self.config, spec, cast(CompressedWeights, bw.attn))
            for spec, bw in zip(self.config.layers, self.weights.blocks)
        )

    @property
    def hash_block_tokens(self) -> int:
        return self.config.hash_block_tokens

    def new_state(self) -> RefState:
        return RefState(0, [layer.new_state() for layer in self.layers])

    def schedule(self, start: int, end: int, checkpoints: Iterable[int] = ()) -> list[tuple[int, int]]:
        """Chunks [a, b) covering [start, end): cut at every multiple of chunk_tokens and at every checkpoint."""
        c = self.chunk_tokens
        cuts = sorted({*range((start // c + 1) * c, end, c), *checkpoints, end})
        return list(zip([start, *cuts[:-1]], cuts))

    def forward(self, state: RefState, tokens: torch.Tensor) -> torch.Tensor:
        """One chunk: logits (T, vocab) for tokens [pos, pos + T); advances the state."""
        x = self.weights.embed[tokens]
        for layer, layer_state, block in zip(self.layers, state.layers, self.weights.blocks):
            x = x + layer.forward(layer_state, _rms_norm(x), state.pos)  # type: ignore[arg-type]
            x = x + F.silu(_rms_norm(x) @ block.w1) @ block.w2
        state.pos += tokens.shape[0]
        return _rms_norm(x) @ self.weights.lm_head

    def prefill(self, state: RefState, tokens: Tokens, *, checkpoints: Iterable[int] = ()) -> PrefillResult:
        """Prefill `tokens` after the state's position; export state objects at each checkpoint (absolute token
        index)."""
        ids = self._tokens(tokens)
        start, end, h = state.pos, state.pos + ids.shape[0], self.hash_block_tokens
        cps = set(checkpoints)
        bad = sorted(c for c in cps if not (start < c <= end) or c % h)
        if bad:
            raise BoundaryError(
                f"checkpoints {bad} are not hash-block boundaries (multiples of {h}) in ({start}, {end}]"
            )
        logits, objects = [], {}
        for a, b in self.schedule(start, end, cps):
            logits.append(self.forward(state, ids[a - start : b - start]))
            if b in cps:
                objects.update(export_checkpoint(self.profile, state))
        objects.update(export_history(self.profile, state, range(start // h, end // h)))
        out = torch.cat(logits) if logits else torch.zeros(0, self.config.vocab_size)
        return PrefillResult(out, objects)

    def decode(self, state: RefState, token: int) -> torch.Tensor:
        """Logits (vocab,) after appending one token."""
        return self.forward(state, self._tokens([token]))[0]

    def restore(
        self, objects: Mapping[ObjectId, Payload], boundary_blocks: int, *, allow_missing: bool = False
    ) -> RefState:
        """A state at token boundary_blocks * H rebuilt from exported objects (see `objects.restore_state`)."""
        return restore_state(self.profile, self.new_state(), objects, boundary_blocks, allow_missing=allow_missing)

    def _tokens(self, tokens: Tokens) -> torch.Tensor:
        ids = torch.as_tensor(np.asarray(tokens) if not isinstance(tokens, torch.Tensor) else tokens)
        if ids.ndim != 1 or (ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)):
            raise TokenError(f"tokens must be a flat sequence of integer ids, got {tuple(ids.shape)} {ids.dtype}")
        ids = ids.to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise TokenError(
                f"token ids must be in [0, {self.config.vocab_size}), got {int(ids.min())}..{int(ids.max())}"
            )
        return ids


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)

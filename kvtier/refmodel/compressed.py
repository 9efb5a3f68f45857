"""Compressed attention layers: an overlapping compressor, an optional indexer (sparse top-k), and their running state.

Row i of a layer with ratio r pools tokens [r(i-1), r(i+1)): the earlier r tokens through their
(kv_a, sc_a) projections, the later r through (kv_b, sc_b), softmax-gated per channel over the 2r
tokens. Row i is complete once token r(i+1)-1 is seen, so at a boundary L (a multiple of r) the
only input not yet folded into a row is (kv_a, sc_a) of tokens [L - r, L): that is the tail.
A query at t attends to the complete rows i < floor(t/r) (all of them when dense, the indexer's
top-k when sparse) and to the raw latents of tokens [r*floor(t/r), t] not yet compressed.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from kvtier.refmodel.config import CompressedSpec, RefConfig
from kvtier.refmodel.weights import CompressedWeights

_NEG_INF = float("-inf")


@dataclasses.dataclass(slots=True)
class CompressedState:
    """Everything a compressed layer carries across chunks; base = r * floor(pos / r)."""

    early: torch.Tensor  # (r, 2 * latent): [kv_a | sc_a] of tokens [base - r, base): the `tail` form at a boundary
    pending: torch.Tensor  # (pos - base, 4 * latent): compressor projections of tokens [base, pos); empty at a boundary
    local: torch.Tensor  # (pos - base, latent): raw latents of tokens [base, pos); empty at a boundary
    rows: torch.Tensor  # (pos // r, latent): every complete compressed row: the `compressed` form
    index_keys: torch.Tensor | None  # (pos // r, index_dim): the indexer's key per row: the `indexer` form


class CompressedLayer:
    """MQA over shared K=V latents: compressed rows (dense, or indexer top-k) plus the current group's raw tokens."""

    __slots__ = ("heads", "index_dim", "latent", "scale", "spec", "topk", "w")

    def __init__(self, cfg: RefConfig, spec: CompressedSpec, weights: CompressedWeights) -> None:
        self.spec, self.w = spec, weights
        self.heads, self.latent, self.index_dim, self.topk = cfg.n_heads, cfg.latent_dim, cfg.index_dim, cfg.index_topk
        self.scale = 1.0 / math.sqrt(cfg.latent_dim)

    def new_state(self) -> CompressedState:
        r, lat = self.spec.ratio, self.latent
        # Row 0 has no earlier tokens: zero values under -inf scores take no weight in its softmax.
        early = torch.cat((torch.zeros(r, lat), torch.full((r, lat), _NEG_INF)), dim=1)
        keys = torch.zeros(0, self.index_dim) if self.spec.sparse else None
        return CompressedState(early, torch.zeros(0, 4 * lat), torch.zeros(0, lat), torch.zeros(0, lat), keys)

    def forward(self, state: CompressedState, x: torch.Tensor, pos: int) -> torch.Tensor:
        """Attend for tokens [pos, pos + T) (x: (T, d_model)) and advance the state past them."""
        r = self.spec.ratio
        base = pos - state.pending.shape[0]
        proj = torch.cat((state.pending, x @ self.w.compressor.proj))
        local = torch.cat((state.local, x @ self.w.wraw))
        done = proj.shape[0] // r * r
        early = torch.cat((state.early, proj[:, : 2 * self.latent]))
        if done:
            state.rows, state.index_keys = self._compress(state, early[:done], proj[:done, 2 * self.latent :])
        out = self._attend(state, x, pos, base, local)
        state.early = early[done : done + r].clone()
        state.pending = proj[done:].clone()
        state.local = local[done:].clone()
        return out

    def _compress(
        self, state: CompressedState, early: torch.Tensor, late: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fold m = len(late) / r new rows: early / late hold [kv | sc] of each row's earlier / later r tokens."""
        r, lat = self.spec.ratio, self.latent
        window = torch.cat((early.view(-1, r, 2 * lat), late.reshape(-1, r, 2 * lat)), dim=1)
        gate = torch.softmax(window[..., lat:] + self.w.compressor.ape, dim=1)
        new_rows = (gate * window[..., :lat]).sum(dim=1)
        rows = torch.cat((state.rows, new_rows))
        if self.w.indexer is None:
            return rows, None
        assert state.index_keys is not None  # a layer with an indexer keeps its keys
        return rows, torch.cat((state.index_keys, new_rows @ self.w.indexer.wk))

    def _attend(
        self, state: CompressedState, x: torch.Tensor, pos: int, base: int, local: torch.Tensor
    ) -> torch.Tensor:
        t, r, h = x.shape[0], self.spec.ratio, self.heads
        q = (x @ self.w.wq).view(t, h, self.latent)
        qpos = torch.arange(pos, pos + t).unsqueeze(1)
        group_start = qpos // r * r
        lpos = torch.arange(base, base + local.shape[0]).unsqueeze(0)
        local_scores = torch.einsum("thd,sd->ths", q, local).mul_(self.scale)
        local_scores.masked_fill_(((lpos > qpos) | (lpos < group_start)).unsqueeze(1), _NEG_INF)
        rows = state.rows
        n_rows = rows.shape[0]
        hidden = torch.arange(n_rows).unsqueeze(0) >= qpos // r  # (T, rows): row i is visible to t iff i < floor(t / r)
        if self.w.indexer is None:
            row_scores = (
                torch.einsum("thd,rd->thr", q, rows).mul_(self.scale).masked_fill_(hidden.unsqueeze(1), _NEG_INF)
            )
            probs = torch.softmax(torch.cat((row_scores, local_scores), dim=-1), dim=-1)
            out = torch.einsum("thr,rd->thd", probs[..., :n_rows], rows)
        else:
            assert state.index_keys is not None  # a layer with an indexer keeps its keys
            relevance = (x @ self.w.indexer.wq) @ state.index_keys.T
            picked_scores, picked = relevance.masked_fill_(hidden, _NEG_INF).topk(min(self.topk, n_rows), dim=-1)
            chosen = rows[picked]  # (T, k, latent)
            row_scores = torch.einsum("thd,tkd->thk", q, chosen).mul_(self.scale)
            row_scores.masked_fill_(torch.isneginf(picked_scores).unsqueeze(1), _NEG_INF)
            probs = torch.softmax(torch.cat((row_scores, local_scores), dim=-1), dim=-1)
            n_rows = chosen.shape[1]
            out = torch.einsum("thk,tkd->thd", probs[..., :n_rows], chosen)
        out = out + torch.einsum("ths,sd->thd", probs[..., n_rows:], local)
        return out.reshape(t, h * self.latent) @ self.w.wo

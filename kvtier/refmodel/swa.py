"""Sliding-window attention layer and its running state (the `swa` form)."""

from __future__ import annotations

import dataclasses
import math

import torch

from kvtier.refmodel.config import RefConfig, SwaSpec
from kvtier.refmodel.weights import SwaWeights


@dataclasses.dataclass(slots=True)
class SwaState:
    """K and V of the last min(pos, keep) tokens, rows laid out as the `swa` group's (2, heads * head_dim)."""

    kv: torch.Tensor


class SwaLayer:
    """Multi-head attention of each token over the `window` tokens ending at itself."""

    __slots__ = ("head_dim", "heads", "scale", "spec", "w")

    def __init__(self, cfg: RefConfig, spec: SwaSpec, weights: SwaWeights) -> None:
        self.spec, self.w = spec, weights
        self.heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def new_state(self) -> SwaState:
        return SwaState(torch.zeros(0, 2, self.heads * self.head_dim))

    def forward(self, state: SwaState, x: torch.Tensor, pos: int) -> torch.Tensor:
        """Attend for tokens [pos, pos + T) (x: (T, d_model)) and advance the state past them."""
        t, h, hd = x.shape[0], self.heads, self.head_dim
        q = (x @ self.w.wq).view(t, h, hd)
        kv = torch.cat((state.kv, torch.stack((x @ self.w.wk, x @ self.w.wv), dim=1)))
        n_old = state.kv.shape[0]
        k, v = kv[:, 0].view(-1, h, hd), kv[:, 1].view(-1, h, hd)
        qpos = torch.arange(pos, pos + t).unsqueeze(1)
        kpos = torch.arange(pos - n_old, pos + t).unsqueeze(0)
        hidden = (kpos > qpos) | (kpos <= qpos - self.spec.window)
        scores = torch.einsum("thd,shd->hts", q, k).mul_(self.scale).masked_fill_(hidden, float("-inf"))
        out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v).reshape(t, h * hd)
        state.kv = kv[-self.spec.keep :].clone()
        return out @ self.w.wo

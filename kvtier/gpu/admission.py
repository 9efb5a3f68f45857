"""Admission caps: a global entry cap, per-form slot quotas rebalanced by load, and the recovery caps."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Caps on what the pools admit.

    `max_entries`: occupied slots across all pools (None: their capacity). Per-form quotas split it
    into reservations, starting in proportion to capacity and rebalanced toward demand every
    `rebalance_every` allocations, never below `min_form_share`: when the cap is reached, the victim
    comes from a form above its reservation (state forms first, LRU), so no form starves another.
    `max_recovering`: slots RECOVERING at once (a recovery beyond it waits, up to `recover_wait_s`);
    one recovery loads what the cap lets it claim as one batch, so the default takes a whole
    lookup's queue (`max_recover_queue`): the store then reads it in as few large runs as it lies in.
    `max_recover_queue`: RECOVER objects a lookup may hand out while others are pending; the excess
    is routed RECOMPUTE `admission`.
    `state_probe_boundaries`: boundaries below the history hit at which the lower tier is asked
    for missing state objects before settling for a resident checkpoint.
    """

    max_entries: int | None = None
    min_form_share: float = 0.05
    rebalance_every: int = 1024
    max_recovering: int = 4096
    max_recover_queue: int = 4096
    recover_wait_s: float = 30.0
    state_probe_boundaries: int = 16

    def __post_init__(self) -> None:
        if self.max_entries is not None and self.max_entries < 1:
            raise ValueError("max_entries must be >= 1 (or None for the pools' capacity)")
        if not 0.0 <= self.min_form_share <= 1.0:
            raise ValueError("min_form_share must be in [0, 1]")
        if self.rebalance_every < 1 or self.max_recovering < 1 or self.max_recover_queue < 0:
            raise ValueError("rebalance_every and max_recovering must be >= 1, max_recover_queue >= 0")


class FormQuotas:
    """Occupied-slot counts per form against per-form quotas and the global cap."""

    __slots__ = ("_cfg", "_demand", "_since", "capacity", "max_entries", "quota", "share", "used")

    def __init__(self, capacity: np.ndarray, cfg: AdmissionConfig) -> None:
        self._cfg = cfg
        self.capacity = capacity.astype(np.int64)
        total = int(self.capacity.sum())
        self.max_entries = total if cfg.max_entries is None else min(cfg.max_entries, total)
        self.used = np.zeros_like(self.capacity)
        self.share = self.capacity / max(total, 1)
        self.quota = self.capacity.copy()
        self._demand = np.zeros_like(self.capacity)
        self._since = 0
        self._apply()

    def _apply(self) -> None:
        self.quota = np.minimum(self.capacity, np.maximum(1, np.round(self.share * self.max_entries))).astype(np.int64)

    def demand(self, form: int) -> None:
        """Count one allocation request; every `rebalance_every` of them, move quota toward demand."""
        self._demand[form] += 1
        self._since += 1
        self._rebalance_if_due()

    def demand_counts(self, per_form: np.ndarray) -> None:
        """`demand` for a batch: `per_form[f]` allocation requests of form f."""
        self._demand += per_form
        self._since += int(per_form.sum())
        self._rebalance_if_due()

    def _rebalance_if_due(self) -> None:
        if self._since >= self._cfg.rebalance_every and self.max_entries < int(self.capacity.sum()):
            observed = self._demand / self._demand.sum()
            share = np.maximum(0.5 * self.share + 0.5 * observed, self._cfg.min_form_share)
            self.share = share / share.sum()
            self._apply()
            self._demand[:] = 0
            self._since = 0

    def over_quota(self) -> np.ndarray:
        """Per form: whether it holds more than its reservation (where a capped allocation may evict)."""
        return self.used > self.quota

    def global_full(self) -> bool:
        return int(self.used.sum()) >= self.max_entries

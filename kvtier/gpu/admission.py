"""Admission caps: a global entry cap, per-form slot quotas rebalanced by load, and the recovery caps.

Their record, `AdmissionConfig`, is the config's `[admission]` table (`kvtier.core.config`)."""

from __future__ import annotations

import numpy as np

from kvtier.core.config import AdmissionConfig

__all__ = ["AdmissionConfig", "FormQuotas"]


class FormQuotas:
    """Occupied-slot counts per form against per-form quotas and the global cap."""

    __slots__ = ("_cfg", "_demand", "_since", "capacity", "max_entries", "quota", "share", "used")

    def __init__(self, capacity: np.ndarray, cfg: AdmissionConfig) -> None:
        self._cfg = cfg
        self.capacity = capacity.astype(np.int64)
        total = int(self.capacity.sum())
        self.max_entries = min(cfg.max_entries, total) if cfg.max_entries else total  # 0: the capacity
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

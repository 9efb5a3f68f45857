"""Per-form counters: objects looked up and their routes/reasons, recoveries, evictions, recovery latency."""

from __future__ import annotations

import msgspec
import numpy as np

from kvtier.core.forms import CacheForm, Reason, Route

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# One code per (route, reason) a check vector can hold: route + reason, so REUSE=0, RECOVER=1, RECOMPUTE:r = 2 + r.
N_CODES = int(Route.RECOMPUTE) + max(Reason) + 1
_EVENTS = ("recovers_ok", "recovers_failed", "evictions", "writes_sealed", "writes_aborted")


class LatencySnapshot(msgspec.Struct):
    """Recovery latency: per-bucket (not cumulative) counts for the upper bounds `le` (seconds, the last inf)."""

    le: list[float]
    counts: list[int]
    sum: float
    count: int


class FormCounts(msgspec.Struct):
    """One form's counters: objects looked up and their routes (RECOMPUTE by reason label), events, latency."""

    objects_looked_up: int
    reuse: int
    recover: int
    recompute: dict[str, int]
    recovers_ok: int
    recovers_failed: int
    evictions: int
    writes_sealed: int
    writes_aborted: int
    recovery_latency_s: LatencySnapshot


class CounterSnapshot(msgspec.Struct):
    """The counters at one instant; the pool-state fields at the end are filled in by the manager."""

    lookups: int
    leases_expired: int
    writes_expired: int
    leases_released: int
    forms: dict[str, FormCounts]
    topology_epoch: int = 0
    recovering: int = 0
    recover_queue: int = 0
    live_leases: int = 0
    quota_slots: dict[str, int] = {}
    used_slots: dict[str, int] = {}


class Counters:
    """Monotonic counters; `record_lookup` is one vectorised bincount, the rest are integer bumps."""

    __slots__ = ("_codes", "_events", "_group_form", "_lat_counts", "_lat_sum", "_offsets", "forms", "totals")

    def __init__(self, group_forms: tuple[CacheForm, ...]) -> None:
        self.forms = tuple(dict.fromkeys(group_forms))
        self._group_form = np.array([self.forms.index(f) for f in group_forms], dtype=np.intp)
        g = len(group_forms)
        self._codes = np.zeros((g, N_CODES), dtype=np.int64)
        wide = g * N_CODES > np.iinfo(np.int8).max
        self._offsets = (np.arange(g, dtype=np.int16 if wide else np.int8) * N_CODES)[:, None]
        self._events = {name: np.zeros(len(self.forms), dtype=np.int64) for name in _EVENTS}
        self._lat_counts = np.zeros((len(self.forms), len(LATENCY_BUCKETS_S) + 1), dtype=np.int64)
        self._lat_sum = np.zeros(len(self.forms), dtype=np.float64)
        self.totals = {"lookups": 0, "leases_expired": 0, "writes_expired": 0, "leases_released": 0}

    def form_index(self, form: CacheForm) -> int:
        return self.forms.index(form)

    def record_lookup(self, routes: np.ndarray, reasons: np.ndarray) -> None:
        """Count every (group, route, reason) of a check vector, by runs: rows are a few long runs."""
        codes = routes + reasons  # 0..N_CODES-1 (RECOMPUTE always carries a reason)
        codes = codes + self._offsets  # distinct per group, so group edges are run edges
        flat = codes.ravel()
        if flat.size:
            starts = np.flatnonzero(flat[1:] != flat[:-1]) + 1
            bounds = np.concatenate(([0], starts, [flat.size]))
            np.add.at(self._codes.ravel(), flat[bounds[:-1]], np.diff(bounds))
        self.totals["lookups"] += 1

    def event(self, name: str, form_index: int, n: int = 1) -> None:
        self._events[name][form_index] += n

    def recovered(self, form_indexes: np.ndarray, seconds: np.ndarray) -> None:
        """A batch of verified recoveries: `recovers_ok` and the latency histogram, in a few array ops."""
        forms = np.asarray(form_indexes, dtype=np.intp)
        secs = np.asarray(seconds, dtype=np.float64)
        np.add.at(self._events["recovers_ok"], forms, 1)
        np.add.at(self._lat_counts, (forms, np.searchsorted(LATENCY_BUCKETS_S, secs)), 1)
        np.add.at(self._lat_sum, forms, secs)

    def snapshot(self) -> CounterSnapshot:
        per_form = np.zeros((len(self.forms), N_CODES), dtype=np.int64)
        np.add.at(per_form, self._group_form, self._codes)
        forms: dict[str, FormCounts] = {}
        for fi, form in enumerate(self.forms):
            codes = per_form[fi]
            forms[form.value] = FormCounts(
                objects_looked_up=int(codes.sum()),
                reuse=int(codes[Route.REUSE]),
                recover=int(codes[Route.RECOVER]),
                recompute={
                    Reason(r).label: int(codes[Route.RECOMPUTE + r])
                    for r in range(1, max(Reason) + 1)
                    if codes[Route.RECOMPUTE + r]
                },
                **{name: int(arr[fi]) for name, arr in self._events.items()},
                recovery_latency_s=LatencySnapshot(
                    le=[*LATENCY_BUCKETS_S, float("inf")],
                    counts=[int(c) for c in self._lat_counts[fi]],
                    sum=float(self._lat_sum[fi]),
                    count=int(self._lat_counts[fi].sum()),
                ),
            )
        t = self.totals
        return CounterSnapshot(
            lookups=t["lookups"],
            leases_expired=t["leases_expired"],
            writes_expired=t["writes_expired"],
            leases_released=t["leases_released"],
            forms=forms,
        )

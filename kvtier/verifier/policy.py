"""Eviction order: quarantined first, then state forms and least recently used, pinned entries last."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from kvtier.core.forms import CacheForm, GroupKind
from kvtier.core.tier import ObjectKey
from kvtier.store import StoreLimits


@dataclasses.dataclass(slots=True)
class Candidate:
    """One indexed record the cleaner may drop: serving, or quarantined (then it serves nothing)."""

    key: ObjectKey
    seq: int
    record_len: int
    atime: float
    pin_until: float
    segment: int
    quarantined: bool = False
    quarantined_at: float = 0.0

    def pinned(self, now: float) -> bool:
        return self.pin_until > now

    def rank(self, now: float) -> tuple[int, float]:
        if self.quarantined:
            tier = 0
        elif self.pinned(now):
            tier = 3
        else:
            tier = 1 if self.key.form.kind is GroupKind.STATE else 2
        return tier, self.atime


@dataclasses.dataclass(frozen=True, slots=True)
class Pressure:
    """Bytes to free: `soft` down to the low watermark (unpinned only), `hard` down to the limit itself (pins too)."""

    soft: int
    hard: int


def pressure(used: int, limit: int, high: float, low: float) -> Pressure:
    if limit <= 0 or used < high * limit:
        return Pressure(0, max(0, used - limit) if limit > 0 else 0)
    return Pressure(max(0, used - int(low * limit)), max(0, used - limit))


def plan_eviction(
    candidates: Iterable[Candidate], usage: Mapping[CacheForm, int], limits: StoreLimits, now: float,
    *, high: float = 0.95, low: float = 0.85,
) -> list[Candidate]:
    """The records to drop so the store gets under its budget and every per-form quota.

    Unpinned records are taken while they help bring the total or their form's usage to the low watermark;
    a pinned record is taken only while the store (or its form) is over the hard limit itself.
    """
    total = pressure(sum(usage.values()), limits.budget_bytes, high, low)
    forms = {f: pressure(usage.get(f, 0), q, high, low) for f, q in limits.form_quotas}
    soft_total, hard_total = total.soft, total.hard
    soft = {f: p.soft for f, p in forms.items()}
    hard = {f: p.hard for f, p in forms.items()}
    if not (soft_total or hard_total or any(soft.values()) or any(hard.values())):
        return []
    victims: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: c.rank(now)):
        form = c.key.form
        if c.pinned(now) and not c.quarantined:
            wanted = hard_total > 0 or hard.get(form, 0) > 0
        else:
            wanted = soft_total > 0 or hard_total > 0 or soft.get(form, 0) > 0 or hard.get(form, 0) > 0
        if not wanted:
            continue
        victims.append(c)
        soft_total -= c.record_len
        hard_total -= c.record_len
        if form in soft:
            soft[form] -= c.record_len
            hard[form] -= c.record_len
        if soft_total <= 0 and hard_total <= 0 and all(v <= 0 for v in soft.values()) and all(v <= 0 for v in hard.values()):
            break
    return victims

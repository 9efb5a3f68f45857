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
    candidates: Iterable[Candidate],
    usage: Mapping[CacheForm, int],
    limits: StoreLimits,
    now: float,
    *,
    high: float = 0.95,
    low: float = 0.85,
) -> list[Candidate]:
    """The records to drop so the store gets under its budget and every per-form quota, in rank order.

    First each form over its quota gives up its own records, then the store as a whole gives up records
    in rank order: unpinned records are taken while they help bring the total (or their form) to the low
    watermark; a pinned record only while the store (or its form) is over the hard limit itself.
    """
    total = pressure(sum(usage.values()), limits.budget_bytes, high, low)
    forms = {f: pressure(usage.get(f, 0), q, high, low) for f, q in limits.form_quotas}
    soft = {f: p.soft for f, p in forms.items()}
    hard = {f: p.hard for f, p in forms.items()}
    totals = [total.soft, total.hard]
    if not (any(totals) or any(soft.values()) or any(hard.values())):
        return []
    ordered = sorted(candidates, key=lambda c: c.rank(now))
    chosen: set[int] = set()
    victims: list[Candidate] = []

    def take(c: Candidate) -> None:
        chosen.add(id(c))
        victims.append(c)
        totals[0] -= c.record_len
        totals[1] -= c.record_len
        if c.key.form in soft:
            soft[c.key.form] -= c.record_len
            hard[c.key.form] -= c.record_len

    for c in ordered:  # per-form quotas, from the form itself
        form = c.key.form
        if form in soft and (hard[form] > 0 or (soft[form] > 0 and not (c.pinned(now) and not c.quarantined))):
            take(c)
    for c in ordered:  # the store's budget, from anything
        if totals[0] <= 0 and totals[1] <= 0:
            break
        if id(c) not in chosen and (totals[1] > 0 or (totals[0] > 0 and not (c.pinned(now) and not c.quarantined))):
            take(c)
    victims.sort(key=lambda c: c.rank(now))
    return victims

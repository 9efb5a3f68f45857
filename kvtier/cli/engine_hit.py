"""The hit an engine can restore from kvtier, per group, from what the daemon says of each of its objects.

An engine namespace's groups (vLLM KV cache groups, SGLang host pools) each store one object per unit of the
prompt (a vLLM offloading chunk, an SGLang page). A restore up to token boundary L needs, per group:

- history (`compressed`, `indexer`): every unit from 0 up to L;
- state (`swa`, `tail`): the units of its trailing window before L (`window_units`; from unit 0 when L is
  small).

The hit is the largest boundary every group allows, boundaries being whole units of every group. Where it
stops short of the prompt's last whole boundary, the next boundary names the group, the unit and the reason
the engine would recompute from there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from kvtier.cli.explain import FIXES, STATE_MISSING_FIX
from kvtier.core.forms import Reason


@dataclasses.dataclass(frozen=True, slots=True)
class GroupUnits:
    """One group over the prompt: its units' size, its window, and the daemon's reason per whole unit."""

    name: str
    form: str
    tokens_per_unit: int
    window_units: int  # 0: history
    reasons: Sequence[Reason]  # OK: stored and loadable, else why not


@dataclasses.dataclass(frozen=True, slots=True)
class GroupReport:
    group: str
    form: str
    kind: str  # history | state
    tokens_per_unit: int
    units: int  # whole units of the prompt
    stored: int  # units the daemon holds (loadable)
    restorable_tokens: int  # what this group alone allows
    needed: int  # units of this group the usable hit loads


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStop:
    """The object that keeps the hit from reaching the next boundary."""

    group: str
    unit: int
    tokens: tuple[int, int]
    reason: str
    fix: str


@dataclasses.dataclass(frozen=True, slots=True)
class EngineHit:
    prompt_tokens: int
    boundary_tokens: int  # hits land on multiples of this
    hit_tokens: int
    groups: tuple[GroupReport, ...]
    stops: tuple[EngineStop, ...]  # empty: the hit reaches the prompt's last whole boundary

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _servable(g: GroupUnits, boundary: int) -> bool:
    n = boundary // g.tokens_per_unit
    lo = 0 if g.window_units == 0 else max(0, n - g.window_units)
    return all(r is Reason.OK for r in g.reasons[lo:n])


def _first_bad(g: GroupUnits, boundary: int) -> int | None:
    """The unit that stops `g` at `boundary`: history its first missing unit, state the last one in the window."""
    n = boundary // g.tokens_per_unit
    lo = 0 if g.window_units == 0 else max(0, n - g.window_units)
    bad = [i for i in range(lo, n) if g.reasons[i] is not Reason.OK]
    if not bad:
        return None
    return bad[0] if g.window_units == 0 else bad[-1]


def analyse(prompt_tokens: int, groups: Sequence[GroupUnits]) -> EngineHit:
    step = math.lcm(*(g.tokens_per_unit for g in groups))
    last = prompt_tokens // step * step
    hit = next((b for b in range(last, 0, -step) if all(_servable(g, b) for g in groups)), 0)
    reports = []
    for g in groups:
        alone = next(
            (b for b in range(len(g.reasons) * g.tokens_per_unit, 0, -g.tokens_per_unit) if _servable(g, b)), 0
        )
        n_hit = hit // g.tokens_per_unit
        reports.append(
            GroupReport(
                g.name,
                g.form,
                "state" if g.window_units else "history",
                g.tokens_per_unit,
                len(g.reasons),
                sum(r is Reason.OK for r in g.reasons),
                alone,
                n_hit if g.window_units == 0 else min(n_hit, g.window_units),
            )
        )
    stops = []
    if hit < last:
        nxt = hit + step
        for g in groups:
            unit = _first_bad(g, nxt)
            if unit is None:
                continue
            reason = g.reasons[unit]
            fix = STATE_MISSING_FIX if reason is Reason.MISSING and g.window_units else FIXES.get(reason, "recomputed")
            t = g.tokens_per_unit
            stops.append(EngineStop(g.name, unit, (unit * t, (unit + 1) * t), reason.label, fix))
    return EngineHit(prompt_tokens, step, hit, tuple(reports), tuple(stops))


def render(e: EngineHit, unit: str) -> list[str]:
    """The text report; `unit` names a group's objects (chunk, page)."""
    lines = [
        f"prompt      {e.prompt_tokens:,} tokens (hits land on multiples of {e.boundary_tokens})",
        f"usable hit  {e.hit_tokens:,} tokens",
        "",
        f"{'group':<22} {'form':<11} {'kind':<8} {unit + 's':>7} {'stored':>7} {'alone':>8} {'hit needs':>9}",
    ]
    for g in e.groups:
        lines.append(
            f"{g.group:<22} {g.form:<11} {g.kind:<8} {g.units:>7,} {g.stored:>7,} "
            f"{g.restorable_tokens:>8,} {g.needed:>9,}"
        )
    lines.append("")
    if not e.stops:
        lines.append(f"the hit covers every whole {unit} of the prompt")
    for s in e.stops:
        lines.append(f"stops at    {unit} {s.unit:,} (tokens {s.tokens[0]:,}-{s.tokens[1]:,}) of {s.group}: {s.reason}")
        lines.append(f"  fix       {s.fix}")
    return lines

"""Why did this miss? From a lookup's raw findings to the usable hit, the object that stops it, and a fix.

The daemon's explain answer carries two check vectors over the prompt's blocks: `raw`, what each cache
group found for each block on its own (REUSE: resident in the pool, RECOVER: on disk or in a lower
tier, RECOMPUTE with the reason), and `final`, the same intersected into the usable hit, exactly as a
lookup reports it. The hit stops at the first boundary where some object is not servable: a history
group's block (history must cover every block from 0), or a state group's block in the trailing window
of the next boundary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.core.checkvector import CheckVector
from kvtier.core.forms import Reason, Route

# what an operator can do about each reason an object is not servable
FIXES: dict[Reason, str] = {
    Reason.MISSING: "never stored, or forgotten: run the prompt once (the engine offloads it), or prewarm it",
    Reason.EVICTED: "the cleaner evicted it to stay within the store budget: raise store.budget_bytes or the "
    "form's store.quota_bytes",
    Reason.CORRUPT: "its record failed the checksum and was quarantined: the next offload of this prefix "
    "rewrites it; run `kvtier audit --deep` to see how much is affected",
    Reason.STALE_VERSION: "written under another model, kernel or compressor version (namespace): recomputed "
    "once, cached again under the live one",
    Reason.ABI_MISMATCH: "its layout is not what the current kernels read: recomputed once, then cached again",
    Reason.PARTIAL_BLOCK: "the block was not written whole: engines must offload whole hash blocks",
    Reason.MISALIGNED: "the record is not aligned as the store requires: recomputed and rewritten",
    Reason.ADMISSION: (
        "the recovery queue was full: look up again, or raise [admission] max_recover_queue / max_recovering"
    ),
}
STATE_MISSING_FIX = (
    "state objects are written only at checkpoints (each prefill's end, prewarm boundaries, every "
    "retention interval): the hit falls back to the last checkpoint; checkpoint more often to stop closer"
)


@dataclasses.dataclass(frozen=True, slots=True)
class GroupFinding:
    """One cache group over the prompt: where its objects are, and how many the hit needs."""

    group: str
    form: str
    kind: str  # history | state
    in_pool: int
    on_disk: int  # on disk or in a lower tier: loadable
    absent: int
    needed: int  # objects of this group the usable hit needs


@dataclasses.dataclass(frozen=True, slots=True)
class Stop:
    """An object that keeps the hit from reaching the next boundary."""

    group: str
    block: int
    tokens: tuple[int, int]  # [start, end) of the block
    reason: str
    fix: str


@dataclasses.dataclass(frozen=True, slots=True)
class Explanation:
    prompt_tokens: int
    blocks: int
    hash_block_tokens: int
    hit_blocks: int
    hit_tokens: int
    groups: tuple[GroupFinding, ...]
    stops: tuple[Stop, ...]  # empty: the whole prompt (its whole blocks) is a usable hit

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def explain(prompt_tokens: int, raw: CheckVector, final: CheckVector, windows: Sequence[int]) -> Explanation:
    """`windows[g]`: 0 for a history group, else the trailing blocks n_s a state group needs at a boundary."""
    n_state = np.asarray(windows, dtype=np.int64)
    h, k, n = final.hash_block_tokens, final.hit_blocks, final.num_blocks
    servable = raw.routes != Route.RECOMPUTE
    groups = []
    for g, name in enumerate(raw.group_names):
        needed = k if n_state[g] == 0 else min(int(n_state[g]), k)
        groups.append(
            GroupFinding(
                name,
                raw.group_forms[g].value,
                "history" if n_state[g] == 0 else "state",
                int((raw.routes[g] == Route.REUSE).sum()),
                int((raw.routes[g] == Route.RECOVER).sum()),
                int((raw.routes[g] == Route.RECOMPUTE).sum()),
                needed,
            )
        )
    stops: list[Stop] = []
    if k < n:
        history = n_state == 0
        if not servable[history, k].all():
            # history must be whole from block 0: block k of some history group is what ends it
            cells: list[tuple[int, int]] = [(int(g), k) for g in np.flatnonzero(history & ~servable[:, k])]
        else:
            # history goes on: the boundary k+1 lacks a state group's window [k+1-n_s, k]
            cells = []
            for g in map(int, np.flatnonzero(~history)):
                lo = max(0, k + 1 - int(n_state[g]))
                bad = np.flatnonzero(~servable[g, lo : k + 1])
                if bad.size:
                    cells.append((g, lo + int(bad[-1])))
        for g, b in cells:
            reason = Reason(int(raw.reasons[g, b]))
            fix = STATE_MISSING_FIX if reason is Reason.MISSING and n_state[g] else FIXES.get(reason, "recomputed")
            stops.append(Stop(raw.group_names[g], int(b), (int(b) * h, (int(b) + 1) * h), reason.label, fix))
    return Explanation(prompt_tokens, n, h, k, k * h, tuple(groups), tuple(stops))


def render(e: Explanation) -> list[str]:
    """The text report, one line per item."""
    lines = [
        f"prompt      {e.prompt_tokens:,} tokens: {e.blocks:,} whole blocks of {e.hash_block_tokens} tokens",
        f"usable hit  {e.hit_tokens:,} tokens ({e.hit_blocks:,} blocks)",
        "",
        f"{'group':<14} {'form':<11} {'kind':<8} {'in pool':>8} {'on disk':>8} {'absent':>8} {'hit needs':>9}",
    ]
    for g in e.groups:
        lines.append(
            f"{g.group:<14} {g.form:<11} {g.kind:<8} {g.in_pool:>8,} {g.on_disk:>8,} {g.absent:>8,} {g.needed:>9,}"
        )
    lines.append("")
    if not e.stops:
        lines.append("the hit covers every whole block of the prompt")
    for s in e.stops:
        lines.append(f"stops at    block {s.block:,} (tokens {s.tokens[0]:,}-{s.tokens[1]:,}) of {s.group}: {s.reason}")
        lines.append(f"  fix       {s.fix}")
    return lines

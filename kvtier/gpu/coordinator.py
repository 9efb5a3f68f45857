"""Per-form managers behind one coordinator (vLLM v1 single_type_kv_cache_manager + kv_cache_coordinator).

Each lookup first routes every object from its resident verdict (REUSE or RECOMPUTE). When a lower
tier exists the coordinator then asks it about the non-resident objects that could still extend
the hit, and only those: history managers from the first non-resident block forward (stopping at
the first block no tier can serve), state managers at the trailing window of candidate boundaries,
scanning down from the history hit. The final intersection is `CheckVector.build`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvtier.core.forms import CacheForm, GroupKind, Reason, Route
from kvtier.core.profile import ModelProfile

Ask = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""Ask the lower tier about objects (groups, blocks); one Reason per object as int8 (OK: it would load)."""

# Plain ints: numpy compares against IntEnum members slowly (a class __getattr__ per operation).
_RECOVER, _RECOMPUTE = int(Route.RECOVER), int(Route.RECOMPUTE)
_OK, _MISSING, _EVICTED = int(Reason.OK), int(Reason.MISSING), int(Reason.EVICTED)
_ASKABLE = (_MISSING, _EVICTED)
_FIRST_CHUNK = 64


def _apply(routes: np.ndarray, reasons: np.ndarray, gs: np.ndarray, bs: np.ndarray, answers: np.ndarray) -> bool:
    """Record the lower tier's answers; True if every one was OK (RECOVER)."""
    ok = answers == _OK
    routes[gs[ok], bs[ok]] = _RECOVER
    reasons[gs[ok], bs[ok]] = _OK
    if ok.all():
        return True
    fg, fb, fa = gs[~ok], bs[~ok], answers[~ok]
    keep = (fa == _MISSING) & (reasons[fg, fb] == _EVICTED)  # "evicted" says more than "missing"
    reasons[fg[~keep], fb[~keep]] = fa[~keep]
    return False


class HistoryFormManager:
    """Compressed / indexer groups: every block from 0 to the hit."""

    kind = GroupKind.HISTORY

    def __init__(self, form: CacheForm, groups: tuple[int, ...]) -> None:
        self.form = form
        self.groups = groups


class StateFormManager:
    """Tail / SWA groups: only the `n_s` trailing blocks before the boundary."""

    kind = GroupKind.STATE

    def __init__(self, form: CacheForm, groups: tuple[int, ...], n_state: tuple[int, ...]) -> None:
        self.form = form
        self.groups = groups
        self.n_state = n_state

    def window(self, k: int) -> list[tuple[int, int]]:
        """(group, block) of every object this form needs at boundary k."""
        return [(g, b) for g, n in zip(self.groups, self.n_state) for b in range(max(0, k - n), k)]


class Coordinator:
    """Decides which non-resident objects to ask the lower tier about, per form, toward the longest hit."""

    def __init__(self, profile: ModelProfile, probe_boundaries: int) -> None:
        h = profile.hash_block_tokens
        by_form: dict[CacheForm, list[int]] = {}
        for i, g in enumerate(profile.groups):
            by_form.setdefault(g.form, []).append(i)
        self.history = [HistoryFormManager(f, tuple(ix)) for f, ix in by_form.items() if f.kind is GroupKind.HISTORY]
        self.state = [
            StateFormManager(f, tuple(ix), tuple(profile.groups[i].blocks_needed(h) for i in ix))
            for f, ix in by_form.items()
            if f.kind is GroupKind.STATE
        ]
        self._hist_idx = np.array([g for m in self.history for g in m.groups], dtype=np.intp)
        self.probe_boundaries = probe_boundaries

    def find(self, routes: np.ndarray, reasons: np.ndarray, ask: Ask, room: int) -> bool:
        """Fill in RECOVER routes (and the lower tier's reasons) in place, aiming at the longest hit whose
        recoveries fit `room` (the recovery queue's free places); True if the room cut the hit short."""
        n = routes.shape[1]
        if n == 0:
            return False
        k_hist = n
        history_need = np.zeros(n, dtype=np.int64)
        if self._hist_idx.size:
            run = (routes[self._hist_idx] != _RECOMPUTE).all(axis=0)
            if not run.all():
                k_hist = self._extend_history(routes, reasons, int(np.argmin(run)), ask)
            history_need = np.cumsum((routes[self._hist_idx] == _RECOVER).sum(axis=0))
        if self.state:
            # the largest boundary whose history recoveries alone still fit
            k_fit = int(np.searchsorted(history_need, room, side="right"))
            return self._settle_state(routes, reasons, min(k_hist, k_fit), ask, history_need, room) or k_fit < k_hist
        return int(history_need[-1]) > room

    def _extend_history(self, routes: np.ndarray, reasons: np.ndarray, lo: int, ask: Ask) -> int:
        """Ask about non-resident history objects from block `lo` on, in growing chunks; returns k_hist."""
        n = routes.shape[1]
        hist = self._hist_idx
        chunk = _FIRST_CHUNK
        while lo < n:
            hi = min(n, lo + chunk)
            bad = routes[hist, lo:hi] == _RECOMPUTE
            sub = reasons[hist, lo:hi]
            askable = bad & ((sub == _MISSING) | (sub == _EVICTED))
            hard = (bad & ~askable).any(axis=0)
            if hard.any():
                askable[:, int(np.argmax(hard)) :] = False
            gi, bi = np.nonzero(askable)
            if gi.size:
                gs, bs = hist[gi], bi + lo
                _apply(routes, reasons, gs, bs, ask(gs, bs))
            served = (routes[hist, lo:hi] != _RECOMPUTE).all(axis=0)
            if not served.all():
                return lo + int(np.argmin(served))
            lo = hi
            chunk *= 2
        return n

    def _settle_state(
        self, routes: np.ndarray, reasons: np.ndarray, k_top: int, ask: Ask, history_need: np.ndarray, room: int
    ) -> bool:
        """Scan boundaries down from k_top: stop at the first one every state form can serve within the
        recovery room, asking the lower tier for missing window objects at no more than
        `probe_boundaries` of them. True if a boundary was passed over for want of room."""
        asked: set[tuple[int, int]] = set()
        probes = 0
        squeezed = False
        for k in range(k_top, 0, -1):
            need: list[tuple[int, int]] = []
            recovering = int(history_need[k - 1])
            possible = True
            for manager in self.state:
                for g, b in manager.window(k):
                    route = routes[g, b]
                    if route == _RECOVER:
                        recovering += 1
                    if route != _RECOMPUTE:
                        continue
                    if (g, b) in asked or reasons[g, b] not in _ASKABLE:
                        possible = False
                        break
                    need.append((g, b))
                if not possible:
                    break
            if not possible:
                continue
            if recovering + len(need) > room:
                squeezed = True
                continue
            if not need or probes >= self.probe_boundaries:
                return squeezed
            probes += 1
            asked.update(need)
            gs, bs = np.array(need, dtype=np.intp).T
            if _apply(routes, reasons, gs, bs, ask(gs, bs)):
                return squeezed
        return squeezed

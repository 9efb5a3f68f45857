"""Per-form managers behind one coordinator (vLLM v1 single_type_kv_cache_manager + kv_cache_coordinator).

Each lookup first routes every object from its resident verdict (REUSE or RECOMPUTE). When a lower
tier exists the coordinator then asks it about the non-resident objects that could still extend
the hit, and only those: history managers from the first non-resident block forward (stopping at
the first block no tier can serve), state managers at the trailing window of candidate boundaries,
scanning down from the history hit. The final intersection is `CheckVector.build`'s.

The rules that differ between history and state forms live in `HistoryFormManager` and
`StateFormManager`, behind one set of methods; the coordinator holds a tuple of managers and asks
every one of them the same questions, never which kind it is.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvtier.core.forms import CacheForm, GroupKind, Reason, Route
from kvtier.core.profile import ModelProfile
from kvtier.gpu.table import BlockTable

Ask = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""Ask the lower tier about objects (groups, blocks); one Reason per object as int8 (OK: it would load)."""

# Plain ints: numpy compares against IntEnum members slowly (a class __getattr__ per operation).
_REUSE, _RECOVER, _RECOMPUTE = int(Route.REUSE), int(Route.RECOVER), int(Route.RECOMPUTE)
_OK, _MISSING, _EVICTED = int(Reason.OK), int(Reason.MISSING), int(Reason.EVICTED)
_ASKABLE = (_MISSING, _EVICTED)
_FIRST_CHUNK = 64
_NO_OBJECTS = np.zeros(0, dtype=np.intp)


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


def _window_sum(x: np.ndarray, n: int) -> np.ndarray:
    """out[k-1] = sum of x[max(0, k-n):k] for k = 1..len(x)."""
    c = np.concatenate(([0], np.cumsum(x, dtype=np.int64)))
    ks = np.arange(1, len(x) + 1)
    return c[ks] - c[np.maximum(ks - n, 0)]


class HistoryFormManager:
    """Compressed / indexer groups: every block from 0 to the hit.

    A history form bounds the hit from the left (the first block it cannot serve ends it), counts
    its recoveries cumulatively (a hit at k needs all of them below k), and is protected through
    the rows a lease holds, so it holds no slot of its own.
    """

    max_window = 0

    def __init__(self, form: CacheForm, groups: tuple[int, ...]) -> None:
        self.form = form
        self.groups = np.array(groups, dtype=np.intp)
        self.front_groups = self.groups  # every block from 0 must be served: the forward scan covers them

    def window(self, k: int) -> list[tuple[int, int]]:
        """Nothing: the forward scan has settled every block below the history hit."""
        return []

    def fits(self, servable: np.ndarray) -> np.ndarray:
        """[k-1]: whether a hit at k leaves this form nothing to recompute; the forward scan saw to it."""
        return np.ones(servable.shape[1], dtype=bool)

    def recover_need(self, recover: np.ndarray) -> np.ndarray:
        return np.cumsum(recover[self.groups].sum(axis=0))

    def keep(self, keep: np.ndarray, k: int) -> None:
        """Mark the objects a hit at k uses."""
        keep[self.groups, :k] = True

    def slots_to_hold(self, table: BlockTable, rows: np.ndarray, routes: np.ndarray, k: int) -> list[int]:
        """Nothing: the rows a lease holds protect history objects already."""
        return []


class StateFormManager:
    """Tail / SWA groups: only the `n_s` trailing blocks before the boundary.

    A state form never bounds the hit from the left; it decides which boundary below the history hit
    can serve (its whole window there present or recoverable), and a lease holds its window's slots.
    """

    def __init__(self, form: CacheForm, groups: tuple[int, ...], n_state: tuple[int, ...]) -> None:
        self.form = form
        self.groups = np.array(groups, dtype=np.intp)
        self._windows = tuple(zip(groups, n_state))
        self.max_window = max(n_state)
        self.front_groups = _NO_OBJECTS  # never bounds the hit from the left: no part in the forward scan

    def window(self, k: int) -> list[tuple[int, int]]:
        """(group, block) of every object this form needs at boundary k."""
        return [(g, b) for g, n in self._windows for b in range(max(0, k - n), k)]

    def fits(self, servable: np.ndarray) -> np.ndarray:
        ok = np.ones(servable.shape[1], dtype=bool)
        for g, n in self._windows:
            ok &= _window_sum(~servable[g], n) == 0
        return ok

    def recover_need(self, recover: np.ndarray) -> np.ndarray:
        need = np.zeros(recover.shape[1], dtype=np.int64)
        for g, n in self._windows:
            need = need + _window_sum(recover[g], n)
        return need

    def keep(self, keep: np.ndarray, k: int) -> None:
        for g, n in self._windows:
            keep[g, max(0, k - n) : k] = True

    def slots_to_hold(self, table: BlockTable, rows: np.ndarray, routes: np.ndarray, k: int) -> list[int]:
        """The REUSE slots of the window at k: a lease holds them against pressure eviction."""
        e_slot = table.e_slot
        return [
            int(e_slot[g, rows[b]]) for g, n in self._windows for b in range(max(0, k - n), k) if routes[g, b] == _REUSE
        ]


FormManager = HistoryFormManager | StateFormManager


class Coordinator:
    """Decides which non-resident objects to ask the lower tier about, per form, toward the longest hit;
    fits a lookup's recoveries to the queue's room; holds a hit's objects for its lease."""

    def __init__(self, profile: ModelProfile, probe_boundaries: int) -> None:
        h = profile.hash_block_tokens
        by_form: dict[CacheForm, list[int]] = {}
        for i, g in enumerate(profile.groups):
            by_form.setdefault(g.form, []).append(i)
        # history first: the forward scan asks the lower tier in the order of these groups
        self.managers: tuple[FormManager, ...] = (
            *(HistoryFormManager(f, tuple(ix)) for f, ix in by_form.items() if f.kind is GroupKind.HISTORY),
            *(
                StateFormManager(f, tuple(ix), tuple(profile.groups[i].blocks_needed(h) for i in ix))
                for f, ix in by_form.items()
                if f.kind is GroupKind.STATE
            ),
        )
        # the groups that bound the hit from the left, scanned forward together (one lower-tier batch per chunk)
        self._front = np.concatenate([m.front_groups for m in self.managers])
        self._windowed = any(m.max_window for m in self.managers)
        self.probe_boundaries = probe_boundaries

    # -- lookup: what to ask the lower tier ------------------------------------------------------

    def find(self, routes: np.ndarray, reasons: np.ndarray, ask: Ask, room: int) -> bool:
        """Fill in RECOVER routes (and the lower tier's reasons) in place, aiming at the longest hit whose
        recoveries fit `room` (the recovery queue's free places); True if the room cut the hit short."""
        n = routes.shape[1]
        if n == 0:
            return False
        k_front = n
        prefix_need = np.zeros(n, dtype=np.int64)
        front = self._front
        if front.size:
            run = (routes[front] != _RECOMPUTE).all(axis=0)
            if not run.all():
                k_front = self._extend(routes, reasons, int(np.argmin(run)), ask)
            prefix_need = np.cumsum((routes[front] == _RECOVER).sum(axis=0))
        if self._windowed:
            # the largest boundary whose front recoveries alone still fit
            k_fit = int(np.searchsorted(prefix_need, room, side="right"))
            return self._settle(routes, reasons, min(k_front, k_fit), ask, prefix_need, room) or k_fit < k_front
        return int(prefix_need[-1]) > room

    def _extend(self, routes: np.ndarray, reasons: np.ndarray, lo: int, ask: Ask) -> int:
        """Ask about non-resident objects of the front groups from block `lo` on, in growing chunks,
        stopping at the first block no tier can serve; returns that block (n if none)."""
        n = routes.shape[1]
        front = self._front
        chunk = _FIRST_CHUNK
        while lo < n:
            hi = min(n, lo + chunk)
            bad = routes[front, lo:hi] == _RECOMPUTE
            sub = reasons[front, lo:hi]
            askable = bad & ((sub == _MISSING) | (sub == _EVICTED))
            hard = (bad & ~askable).any(axis=0)  # stale, corrupt, ...: beyond any tier, the hit stops there
            if hard.any():
                askable[:, int(np.argmax(hard)) :] = False
            gi, bi = np.nonzero(askable)
            if gi.size:
                gs, bs = front[gi], bi + lo
                _apply(routes, reasons, gs, bs, ask(gs, bs))
            served = (routes[front, lo:hi] != _RECOMPUTE).all(axis=0)
            if not served.all():
                return lo + int(np.argmin(served))
            lo = hi
            chunk *= 2
        return n

    def _settle(
        self, routes: np.ndarray, reasons: np.ndarray, k_top: int, ask: Ask, prefix_need: np.ndarray, room: int
    ) -> bool:
        """Scan boundaries down from k_top: stop at the first one every form's window can serve within the
        recovery room, asking the lower tier for missing window objects at no more than
        `probe_boundaries` of them. True if a boundary was passed over for want of room."""
        asked: set[tuple[int, int]] = set()
        probes = 0
        squeezed = False
        for k in range(k_top, 0, -1):
            need: list[tuple[int, int]] = []
            recovering = int(prefix_need[k - 1])
            possible = True
            for manager in self.managers:
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

    # -- lookup: recovery admission ---------------------------------------------------------------

    def admit(self, routes: np.ndarray, reasons: np.ndarray, k_max: int, room: int) -> None:
        """Cut the recoveries to the queue's room, in place: the hit becomes the largest boundary <= k_max
        whose RECOVER objects (history before it, state in its window) fit; every other RECOVER turns
        RECOMPUTE `admission`."""
        recover = routes[:, :k_max] == _RECOVER
        servable = routes[:, :k_max] != _RECOMPUTE
        fits = np.logical_and.reduce([m.fits(servable) for m in self.managers])
        need = sum(m.recover_need(recover) for m in self.managers)
        ks = np.flatnonzero(fits & (need <= room))
        k = int(ks[-1]) + 1 if ks.size else 0
        keep = np.zeros_like(routes, dtype=bool)
        for m in self.managers:
            m.keep(keep, k)
        cut = (routes == _RECOVER) & ~keep
        routes[cut] = _RECOMPUTE
        reasons[cut] = Reason.ADMISSION

    # -- leases -------------------------------------------------------------------------------------

    def hold(self, table: BlockTable, rows: np.ndarray, routes: np.ndarray, k: int) -> list[tuple[int, int]]:
        """Protect a hit of k blocks from pressure eviction: its rows (history objects, and the rows stay
        indexed), and every form's own slots; returns the (slot, generation) held."""
        table.hold_rows(rows[:k])
        slots: list[int] = []
        for m in self.managers:
            slots += m.slots_to_hold(table, rows, routes, k)
        return table.hold_slots(slots)

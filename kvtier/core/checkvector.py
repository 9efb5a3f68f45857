"""Check vectors: per block and cache group a route and a reason, and the usable hit they imply."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvtier.core.forms import CacheForm, GroupKind, Reason, Route
from kvtier.core.profile import ModelProfile

_RECOMPUTE = int(Route.RECOMPUTE)
_BEYOND_HIT = int(Reason.BEYOND_HIT)
_OUTSIDE_WINDOW = int(Reason.OUTSIDE_WINDOW)


def window_blocks(profile: ModelProfile) -> np.ndarray:
    """Per group: 0 for history groups, n_s = ceil(window / H) for state groups."""
    h = profile.hash_block_tokens
    return np.array([0 if g.kind is GroupKind.HISTORY else g.blocks_needed(h) for g in profile.groups], dtype=np.int64)


@dataclasses.dataclass(frozen=True, slots=True)
class HitGeometry:
    """What the intersection needs of a profile, computed once (lookups build many check vectors)."""

    hash_block_tokens: int
    group_names: tuple[str, ...]
    group_forms: tuple[CacheForm, ...]
    n_state: np.ndarray  # per group: 0 history, else trailing blocks needed
    history: np.ndarray  # bool per group
    state_windows: tuple[tuple[int, np.ndarray, tuple[int, ...]], ...]  # (n_s, group mask, group indices)

    @classmethod
    def of(cls, profile: ModelProfile) -> HitGeometry:
        n_state = window_blocks(profile)
        history = n_state == 0
        windows = tuple(
            (n, n_state == n, tuple(np.flatnonzero(n_state == n).tolist()))
            for n in sorted(set(n_state[~history].tolist()))
        )
        return cls(
            profile.hash_block_tokens,
            tuple(g.name for g in profile.groups),
            tuple(g.form for g in profile.groups),
            n_state,
            history,
            windows,
        )

    def hit(self, servable: np.ndarray) -> int:
        """The intersection of all groups: hit blocks k.

        `servable` is bool (groups, blocks). k_hist is the longest run of leading blocks servable by
        every history group; k is the largest k <= k_hist at which every state group is servable over
        its trailing n_s blocks.
        """
        n_blocks = servable.shape[1]
        if n_blocks == 0:
            return 0
        if self.history.any():
            all_hist = servable[self.history].all(axis=0)
            k_hist = n_blocks if all_hist.all() else int(np.argmin(all_hist))
        else:
            k_hist = n_blocks
        if k_hist == 0:
            return 0
        ok: np.ndarray | None = None  # ok[k-1]: every state group servable at boundary k
        for n, mask, _ in self.state_windows:
            # every state group with this window servable at each block, then a window-wide AND
            m = np.asarray(servable[mask, :k_hist].all(axis=0))
            if n > 1:
                bad = np.concatenate(([0], np.cumsum(~m)))
                ks = np.arange(1, k_hist + 1)
                m = (bad[ks] - bad[np.maximum(ks - n, 0)]) == 0
            ok = m if ok is None else ok & m
        if ok is None or ok[-1]:
            return k_hist
        return k_hist - int(np.argmax(ok[::-1])) if ok.any() else 0


def usable_hit(servable: np.ndarray, n_state: np.ndarray) -> int:
    """The hit for bool `servable` (groups, blocks) and per-group trailing windows (0 = history group)."""
    n_state = np.asarray(n_state)
    history = n_state == 0
    windows = tuple((n, n_state == n, ()) for n in sorted(set(n_state[~history].tolist())))
    return HitGeometry(0, (), (), n_state, history, windows).hit(servable)


@dataclasses.dataclass(slots=True)
class CheckVector:
    """Route and reason per (group, block) for the blocks a lookup asked about, and the hit they allow."""

    hash_block_tokens: int
    group_names: tuple[str, ...]
    group_forms: tuple[CacheForm, ...]
    routes: np.ndarray  # int8 (groups, blocks) of Route
    reasons: np.ndarray  # int8 (groups, blocks) of Reason
    hit_blocks: int

    @classmethod
    def build(cls, geometry: HitGeometry | ModelProfile, routes: np.ndarray, reasons: np.ndarray) -> CheckVector:
        """Intersect per-group findings into the final vector.

        `routes` / `reasons` are what each group's manager found for each block on its own. Blocks at or
        past the hit become RECOMPUTE (`beyond_hit` where the object itself was fine); state blocks
        before their window become RECOMPUTE `outside_window` (not needed at this boundary).
        """
        geo = geometry if isinstance(geometry, HitGeometry) else HitGeometry.of(geometry)
        servable = routes != _RECOMPUTE
        k = geo.hit(servable)
        routes = routes.astype(np.int8, copy=True)
        reasons = reasons.astype(np.int8, copy=True)
        if k < routes.shape[1]:
            reasons[:, k:][servable[:, k:]] = _BEYOND_HIT
            routes[:, k:] = _RECOMPUTE
        for n, _, groups in geo.state_windows:
            lo = k - n
            if lo > 0:
                for g in groups:
                    routes[g, :lo] = _RECOMPUTE
                    reasons[g, :lo] = _OUTSIDE_WINDOW
        return cls(geo.hash_block_tokens, geo.group_names, geo.group_forms, routes, reasons, k)

    @property
    def num_blocks(self) -> int:
        return int(self.routes.shape[1])

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.hash_block_tokens

    def route(self, group: str, block: int) -> Route:
        return Route(int(self.routes[self.group_names.index(group), block]))

    def reason(self, group: str, block: int) -> Reason:
        return Reason(int(self.reasons[self.group_names.index(group), block]))

    def entries(self) -> Iterator[tuple[int, str, CacheForm, Route, Reason]]:
        """(block, group, form, route, reason) for every entry, block-major."""
        for b in range(self.num_blocks):
            for gi, name in enumerate(self.group_names):
                yield b, name, self.group_forms[gi], Route(int(self.routes[gi, b])), Reason(int(self.reasons[gi, b]))

    def counts(self) -> dict[str, dict[str, int]]:
        """Per form: how many objects got each route (and each recompute reason)."""
        out: dict[str, dict[str, int]] = {}
        for gi, form in enumerate(self.group_forms):
            bucket = out.setdefault(form.value, {})
            for route in Route:
                n = int((self.routes[gi] == route).sum())
                if n:
                    bucket[route.name] = bucket.get(route.name, 0) + n
            recompute = self.routes[gi] == Route.RECOMPUTE
            for reason_value in np.unique(self.reasons[gi][recompute]):
                key = f"RECOMPUTE:{Reason(int(reason_value)).label}"
                bucket[key] = bucket.get(key, 0) + int((self.reasons[gi][recompute] == reason_value).sum())
        return out

    def to_wire(self) -> dict[str, Any]:
        return {
            "hash_block_tokens": self.hash_block_tokens,
            "groups": list(self.group_names),
            "forms": [f.value for f in self.group_forms],
            "shape": list(self.routes.shape),
            "routes": self.routes.tobytes(),
            "reasons": self.reasons.tobytes(),
            "hit_blocks": self.hit_blocks,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> CheckVector:
        shape = tuple(data["shape"])
        return cls(
            int(data["hash_block_tokens"]),
            tuple(data["groups"]),
            tuple(CacheForm(f) for f in data["forms"]),
            np.frombuffer(data["routes"], dtype=np.int8).reshape(shape).copy(),
            np.frombuffer(data["reasons"], dtype=np.int8).reshape(shape).copy(),
            int(data["hit_blocks"]),
        )

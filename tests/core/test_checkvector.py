"""The hit intersection: history from block 0, state at the trailing window, and the DESIGN example."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core import CheckVector, Reason, Route, load_profile, usable_hit, window_blocks


def _brute_force(servable: np.ndarray, n_state: np.ndarray) -> int:
    n = servable.shape[1]
    for k in range(n, 0, -1):
        hist_ok = all(servable[g, :k].all() for g in range(len(n_state)) if n_state[g] == 0)
        state_ok = all(servable[g, max(0, k - n_state[g]) : k].all() for g in range(len(n_state)) if n_state[g] > 0)
        if hist_ok and state_ok:
            return k
    return 0


@given(
    st.integers(1, 5).flatmap(
        lambda g: st.tuples(
            st.lists(st.integers(0, 3), min_size=g, max_size=g),
            st.integers(0, 12).flatmap(
                lambda n: st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=g, max_size=g)
            ),
        )
    )
)
def test_usable_hit_matches_brute_force(data) -> None:
    n_state, rows = data
    n_state = np.array(n_state)
    servable = np.array(rows, dtype=bool).reshape(len(n_state), -1)
    assert usable_hit(servable, n_state) == _brute_force(servable, n_state)


def test_design_example_dsv4() -> None:
    """5 shared blocks; state checkpoints after blocks 3 and 4; block 4's SWA evicted -> hit 1,024 tokens."""
    p = load_profile("deepseek-v4-flash")
    names = [g.name for g in p.groups]
    routes = np.full((len(names), 5), Route.REUSE, dtype=np.int8)
    reasons = np.zeros_like(routes)
    for g in p.groups:
        if g.kind.value == "state":
            i = names.index(g.name)
            routes[i, :3] = Route.RECOMPUTE
            reasons[i, :3] = Reason.MISSING
    swa = names.index("swa")
    routes[swa, 4] = Route.RECOMPUTE
    reasons[swa, 4] = Reason.EVICTED
    cv = CheckVector.build(p, routes, reasons)
    assert cv.hit_tokens == 1024
    assert cv.route("c4_main", 3) is Route.REUSE
    assert cv.route("swa", 3) is Route.REUSE
    assert cv.route("swa", 4) is Route.RECOMPUTE and cv.reason("swa", 4) is Reason.EVICTED
    assert cv.reason("c4_main", 4) is Reason.BEYOND_HIT
    assert cv.reason("swa", 0) is Reason.OUTSIDE_WINDOW
    again = CheckVector.from_wire(cv.to_wire())
    assert again.hit_blocks == 4 and (again.routes == cv.routes).all() and (again.reasons == cv.reasons).all()
    assert cv.counts()["compressed"]["REUSE"] == 8


def test_window_blocks_per_group() -> None:
    p = load_profile("ref-tiny")
    n = dict(zip((g.name for g in p.groups), window_blocks(p)))
    assert n == {"swa": 2, "c4": 0, "c4_index": 0, "c16": 0, "c4_tail": 1, "c16_tail": 1}

"""`kvtier explain`'s analysis: the DESIGN.md example, where the hit stops and why, and the fix it names."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvtier.cli.explain import FIXES, STATE_MISSING_FIX, explain, render
from kvtier.core import load_profile
from kvtier.core.checkvector import CheckVector, window_blocks
from kvtier.core.forms import Reason, Route

DSV4 = load_profile("deepseek-v4-flash")
H = DSV4.hash_block_tokens
G = {g.name: i for i, g in enumerate(DSV4.groups)}
HISTORY = ("c4_main", "c128_main", "indexer_k")
STATE = ("swa", "c4_state", "c128_state")


def grids(blocks: int) -> tuple[np.ndarray, np.ndarray]:
    routes = np.full((len(G), blocks), int(Route.RECOMPUTE), dtype=np.int8)
    reasons = np.full((len(G), blocks), int(Reason.MISSING), dtype=np.int8)
    return routes, reasons


def put(routes: np.ndarray, reasons: np.ndarray, group: str, blocks, route: Route) -> None:
    routes[G[group], blocks] = route
    reasons[G[group], blocks] = Reason.OK


def vectors(routes: np.ndarray, reasons: np.ndarray) -> tuple[CheckVector, CheckVector]:
    names = tuple(g.name for g in DSV4.groups)
    forms = tuple(g.form for g in DSV4.groups)
    raw = CheckVector(H, names, forms, routes.copy(), reasons.copy(), 0)
    return raw, CheckVector.build(DSV4, routes, reasons)


@pytest.fixture
def design_example() -> tuple[np.ndarray, np.ndarray]:
    """DESIGN.md: history for blocks 0-4 (0-2 resident, 3-4 on disk), state at the checkpoints after blocks 3
    and 4, block 4's SWA evicted since; the prompt has a sixth block nobody stored."""
    routes, reasons = grids(6)
    for g in HISTORY:
        put(routes, reasons, g, slice(0, 3), Route.REUSE)
        put(routes, reasons, g, slice(3, 5), Route.RECOVER)
    for g in STATE:
        put(routes, reasons, g, [3, 4], Route.RECOVER)
    reasons[G["swa"], 4] = Reason.EVICTED
    routes[G["swa"], 4] = Route.RECOMPUTE
    return routes, reasons


def test_the_hit_falls_back_to_the_checkpoint_and_names_the_evicted_window(design_example) -> None:
    raw, final = vectors(*design_example)
    e = explain(6 * H + 17, raw, final, window_blocks(DSV4).tolist())
    assert (e.hit_blocks, e.hit_tokens, e.blocks) == (4, 1024, 6) and e.hit_blocks == final.hit_blocks
    assert [(s.group, s.block, s.reason) for s in e.stops] == [("swa", 4, "evicted")]
    assert e.stops[0].tokens == (1024, 1280) and e.stops[0].fix == FIXES[Reason.EVICTED]
    c4 = next(g for g in e.groups if g.group == "c4_main")
    assert (c4.kind, c4.in_pool, c4.on_disk, c4.absent, c4.needed) == ("history", 3, 2, 1, 4)
    swa = next(g for g in e.groups if g.group == "swa")
    assert (swa.kind, swa.on_disk, swa.needed) == ("state", 1, 1)
    text = "\n".join(render(e))
    assert "usable hit  1,024 tokens (4 blocks)" in text and "block 4 (tokens 1,024-1,280) of swa: evicted" in text


def test_history_gap_ends_the_hit_and_state_without_checkpoint_says_so(design_example) -> None:
    routes, reasons = design_example
    put(routes, reasons, "swa", 4, Route.RECOVER)  # the window is whole: the hit reaches block 5
    reasons[G["c128_main"], 5] = Reason.CORRUPT
    put(routes, reasons, "c4_main", 5, Route.RECOVER)
    put(routes, reasons, "indexer_k", 5, Route.RECOVER)
    raw, final = vectors(routes, reasons)
    e = explain(6 * H, raw, final, window_blocks(DSV4).tolist())
    assert e.hit_blocks == final.hit_blocks == 5
    assert [(s.group, s.block, s.reason) for s in e.stops] == [("c128_main", 5, "corrupt")]
    assert "audit --deep" in e.stops[0].fix

    put(routes, reasons, "c128_main", 5, Route.REUSE)  # history whole; no state checkpoint at block 5
    raw, final = vectors(routes, reasons)
    e = explain(6 * H, raw, final, window_blocks(DSV4).tolist())
    assert e.hit_blocks == final.hit_blocks == 5
    assert {(s.group, s.block, s.reason) for s in e.stops} == {(g, 5, "missing") for g in STATE}
    assert all(s.fix == STATE_MISSING_FIX for s in e.stops)


def test_a_whole_hit_has_no_stop() -> None:
    routes, reasons = grids(2)
    for g in G:
        put(routes, reasons, g, slice(0, 2), Route.REUSE)
    raw, final = vectors(routes, reasons)
    e = explain(2 * H, raw, final, window_blocks(DSV4).tolist())
    assert e.hit_blocks == 2 and e.stops == () and "covers every whole block" in "\n".join(render(e))
    assert e.to_json()["groups"][0]["in_pool"] == 2


# -- against a real daemon: the demo's store after engine A ---------------------------------------------------


def test_explain_on_the_demo_store_matches_a_lookup(tmp_path) -> None:
    """Engine A offloads a prompt durably, the daemon restarts (pool cold, as in the demo); engine B's prompt shares
    70% of A's. `kvtier explain` gives the lookup's hit, and names the block where it stops with the lookup's reason."""
    from kvtier.client import Client
    from kvtier.refmodel import RefModel
    from kvtier.refmodel.engine import RefEngine
    from support.daemon import DaemonProc

    profile = load_profile("ref-tiny")
    h = profile.hash_block_tokens
    rng = np.random.default_rng(7)
    prompt_a = rng.integers(0, 256, 64 * h)
    shared = int(len(prompt_a) * 0.7)  # 44.8 blocks: B's 45th block differs
    prompt_b = np.concatenate((prompt_a[:shared], rng.integers(0, 256, len(prompt_a) - shared)))
    d = DaemonProc(tmp_path)
    try:
        with Client(d.socket) as c:
            c.attach("ref-tiny")
            RefEngine(c, RefModel(profile), checkpoint_every=8).prefill_and_offload(prompt_a, durable=True)
        assert d.terminate() == 0
    finally:
        d.close()
    d = DaemonProc(tmp_path)  # the same store, a cold pool
    try:
        (tmp_path / "b.txt").write_text(" ".join(map(str, prompt_b.tolist())))

        def kvtier_explain(*extra: str) -> subprocess.CompletedProcess[str]:
            args = ["explain", "--tokens", str(tmp_path / "b.txt"), "--socket", str(d.socket), *extra]
            return subprocess.run(
                [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=120
            )

        out = kvtier_explain("--json")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        with Client(d.socket) as c:
            c.attach("ref-tiny")
            looked = c.lookup(prompt_b)
            cv = looked.check_vector
            c.release(looked)
        # checkpoints every 8 blocks: the last one inside the 44 shared whole blocks is at 40
        assert doc["hit_blocks"] == cv.hit_blocks == 40 and doc["hit_tokens"] == looked.hit_tokens
        stops = {(s["group"], s["block"], s["reason"]) for s in doc["stops"]}
        assert stops and all(b == 40 for _, b, _ in stops)  # state at boundary 41 was never written
        for group, block, reason in stops:
            assert cv.reason(group, block).label == reason == "missing"
        c4 = next(g for g in doc["groups"] if g["group"] == "c4")
        assert c4["in_pool"] == 0 and c4["on_disk"] == 44 and c4["needed"] == 40  # cold pool: all on disk
        text = kvtier_explain().stdout
        assert f"usable hit  {40 * h:,} tokens (40 blocks)" in text and "stops at    block 40" in text
        assert "checkpoint" in text  # the fix for a state object that was never written
    finally:
        assert d.terminate() == 0

"""Engine A and engine B as separate processes on one real daemon: B resumes from A's objects, bitwise.

Prompts share prefixes of varying lengths and branch off at checkpoint boundaries, at block
boundaries between checkpoints, and inside blocks; B runs against the warm pool (REUSE) and again
after a daemon restart (cold pool: everything RECOVERs from disk).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtier.core.forms import Route
from support.daemon import DaemonProc
from support.e2e_harness import H, Oracle, branch, prompt, run_engine, save_prompts
from support.engine_proc import CHECKPOINT_EVERY

CP = CHECKPOINT_EVERY * H  # 128 tokens


def _prompts() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, int]]:
    """A's prompts, B's prompts, and the hit each B prompt must get."""
    a0 = prompt(1, 20 * H)  # 640 tokens: checkpoints at 128, 256, ..., 640
    a1 = branch(a0, 250, 2, 450)  # shares 7 whole blocks with a0, ends at 700: checkpoints ..., 640, 672 (end)
    a = {"a0": a0, "a1": a1}
    b = {
        "exact_then_more": branch(a0, 640, 10, 37),  # all of a0, then new tokens: hit at a0's end checkpoint
        "at_checkpoint": branch(a0, 3 * CP, 11, 100),  # branches exactly at a checkpoint boundary
        "at_block_between": branch(a0, 3 * CP + 2 * H, 12, 90),  # at a block boundary between checkpoints
        "inside_block": branch(a0, 2 * CP + H + 5, 13, 70),  # inside a block: whole shared blocks, back to a checkpoint
        "inside_first_block": branch(a0, 20, 14, 150),  # nothing whole in common: no hit
        "a1_end": branch(a1, 700, 15, 40),  # a1's end-of-prefill checkpoint (672), written after a0's shared blocks
        "a1_shared_part": branch(a1, 250, 16, 60),  # within the part a1 shares with a0: a0's checkpoint at 128
    }
    hits = {
        "exact_then_more": 640,
        "at_checkpoint": 3 * CP,
        "at_block_between": 3 * CP,
        "inside_block": 2 * CP,
        "inside_first_block": 0,
        "a1_end": 672,
        "a1_shared_part": CP,
    }
    return a, b, hits


def _check(
    reports: dict[str, dict], b: dict[str, np.ndarray], hits: dict[str, int], work: Path, oracle: Oracle
) -> None:
    for name, tokens in b.items():
        rep = reports[name]
        assert rep["hit_tokens"] == hits[name], (name, rep["hit_tokens"])
        oracle.check_file(work, name, tokens, rep["hit_tokens"])


def test_engine_b_resumes_from_engine_a_bitwise_warm_and_after_restart(tmp_path: Path, oracle: Oracle) -> None:
    work = tmp_path / "work"
    work.mkdir()
    a, b, hits = _prompts()
    save_prompts(work, {**a, **b})
    d = DaemonProc(tmp_path)
    try:
        wrote = run_engine(d, work, "offload", "a0", "a1")
        assert wrote["a0"]["persisted"] and wrote["a1"]["persisted"]
        assert wrote["a1"]["skipped"] >= 3 * 7  # a1's first 7 blocks of history were a0's already
        warm = run_engine(d, work, "continue", *b)
        for name in b:
            assert warm[name]["loaded_objects"] == 0, name  # everything was resident
        _check(warm, b, hits, work, oracle)
        assert d.terminate() == 0
    finally:
        d.close()
    d = DaemonProc(tmp_path)  # the pool is cold; the store has everything A wrote
    try:
        cold = run_engine(d, work, "continue", *b)
        _check(cold, b, hits, work, oracle)
        first = cold["exact_then_more"]  # the first request after the restart: nothing resident, all from disk
        assert all("REUSE" not in c and c.get("RECOVER", 0) > 0 for c in first["routes_at_lookup"].values()), first
        assert first["loaded_objects"] == first["read_objects"] > 0 and first["bytes_from_disk"] > 0
        for name in b:  # later requests reuse what earlier ones loaded, and load the rest
            assert not (np.array(cold[name]["routes"]) == Route.RECOVER).any(), name
    finally:
        assert d.terminate() == 0


def test_a_hit_cut_by_the_recovery_queue_grows_over_lookups_bitwise(tmp_path: Path, oracle: Oracle) -> None:
    """A cold pool and a recover queue far smaller than the prefix: each lookup queues what fits (the rest
    RECOMPUTE `admission`); the engine looks up again and gets the whole hit, bitwise."""
    work = tmp_path / "work"
    work.mkdir()
    a, b, hits = _prompts()
    save_prompts(work, {"a0": a["a0"], "exact_then_more": b["exact_then_more"]})
    d = DaemonProc(tmp_path)
    try:
        assert run_engine(d, work, "offload", "a0")["a0"]["persisted"]
    finally:
        assert d.terminate() == 0
    d = DaemonProc(tmp_path, extra_toml="[admission]\nmax_recover_queue = 16\n")  # a0's hit needs 64 objects from disk
    try:
        rep = run_engine(d, work, "continue", "exact_then_more")["exact_then_more"]
    finally:
        assert d.terminate() == 0
    assert rep["hit_tokens"] == hits["exact_then_more"]
    assert rep["lookups"] >= 4, rep["lookups"]
    assert rep["loaded_objects"] >= 64
    oracle.check_file(work, "exact_then_more", b["exact_then_more"], rep["hit_tokens"])

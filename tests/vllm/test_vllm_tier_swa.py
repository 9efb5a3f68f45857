"""A hybrid model (tiny Gemma2: layer 0 sliding window 64, layer 1 full) on kvtier: SWA chunks hit only inside
their window.

vLLM keeps two KV groups; kvtier files the full group as a history form (every chunk from 0) and the
sliding group as the `swa` state form (only the chunks of a whole window before the continuation point).
"""

from __future__ import annotations

import random
from pathlib import Path

from support.vllm_harness import require_vllm

require_vllm()

from support.vllm_engine_run import BLOCK_SIZE  # noqa: E402
from support.vllm_harness import (  # noqa: E402
    KVTIER_TIER,
    assert_same_output,
    audit_namespaces,
    kvtier_tiers,
    new_checkpoint,
    run_engine,
)
from support.vllm_tiny_model import GEMMA2_WINDOW, VOCAB  # noqa: E402

SWA, FULL = f"vllm.g0.swa{GEMMA2_WINDOW}", "vllm.g1.full"
PREFIX_CHUNKS = 4
WINDOW_CHUNKS = GEMMA2_WINDOW // BLOCK_SIZE


def test_sliding_window_chunks_hit_only_with_their_whole_window(tmp_path: Path) -> None:
    model = new_checkpoint(tmp_path / "model", seed=3, arch="gemma2")
    rng = random.Random(5)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    prefix = tokens(PREFIX_CHUNKS * BLOCK_SIZE)
    whole = prefix + tokens(20)  # shares all 4 chunks: at chunk 4 the window is chunks 2-3
    # Shares chunks 0-2 only: the full group could serve 3 chunks, but the window at chunk 3 needs SWA
    # chunks 1-2, and vLLM stored only the trailing window (2-3) of the first prompt.
    partial = prefix[: 3 * BLOCK_SIZE] + tokens(40)
    store = tmp_path / "store"

    # Engine 1 stores the first prompt; the second one reuses it from RAM there (its recompute reference).
    first = run_engine(tmp_path, "store", model, [prefix + tokens(20), whole], kvtier_tiers(store))
    (listing,) = audit_namespaces(store).values()
    groups = [(r["group"], r["form"]) for r in listing["records"]]
    assert groups.count((FULL, "compressed")) == PREFIX_CHUNKS  # history: every chunk of the prefix
    assert groups.count((SWA, "swa")) == WINDOW_CHUNKS  # state: vLLM offers only the trailing window
    assert first.kvtier("store_chunks", outcome="stored") == PREFIX_CHUNKS + WINDOW_CHUNKS

    # Each later prompt in an engine of its own, so every chunk it reuses comes from kvtier (none from RAM).
    partial_hit = run_engine(tmp_path, "partial", model, [partial], kvtier_tiers(store))
    assert_same_output(run_engine(tmp_path, "partial-recompute", model, [partial], []), partial_hit)
    # Chunks 0-2 of the full group hit by hash; SWA chunk 2 matches by hash too, but no whole window holds it
    # (chunk 1 was never stored, this prompt's chunk 3 differs): a miss, so vLLM promotes no useless window.
    assert partial_hit.kvtier("lookups", form="compressed", result="hit") == 3
    assert partial_hit.kvtier("lookups", form="swa", result="outside_window") == 1
    assert partial_hit.kvtier("lookups", form="swa", result="hit") == 0

    whole_hit = run_engine(tmp_path, "whole", model, [whole], kvtier_tiers(store))
    assert whole_hit.results == first.results[1:]  # tokens and logprobs, bit for bit
    # At chunk 4 the window (chunks 2-3) is whole: the full group's 4 chunks and both SWA chunks hit.
    assert whole_hit.kvtier("lookups", form="compressed", result="hit") == PREFIX_CHUNKS
    assert whole_hit.kvtier("lookups", form="swa", result="hit") == WINDOW_CHUNKS
    assert (
        whole_hit.counter("chunk_hits", KVTIER_TIER)
        == whole_hit.kvtier("load_chunks", outcome="ok")
        == PREFIX_CHUNKS + WINDOW_CHUNKS
    )

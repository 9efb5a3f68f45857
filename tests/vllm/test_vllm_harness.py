"""The harness itself: a real vLLM engine on CPU stores into a trivial file tier and a second engine reuses it.

Proves that hits really feed the engine (corrupted chunks change the tokens), so the kvtier tests' equality
checks mean something.
"""

from __future__ import annotations

from pathlib import Path

from support.vllm_harness import require_vllm

require_vllm()

from support.vllm_harness import assert_same_output, new_checkpoint, run_engine, shared_prefix_prompts  # noqa: E402


def test_second_engine_hits_the_tier_and_reproduces_the_first(tmp_path: Path) -> None:
    model = new_checkpoint(tmp_path / "model", seed=1)
    prompts = shared_prefix_prompts(seed=0)
    tiers = [{"type": "PlainFileTier", "module_path": "support.vllm_file_tier", "root": str(tmp_path / "tier")}]

    first = run_engine(tmp_path, "store", model, prompts, tiers)
    chunks = sorted((tmp_path / "tier").iterdir())
    assert len(chunks) == 4  # the 4 whole blocks of the shared prefix, stored once
    assert first.counter("chunk_hits", "PlainFileTier") == 0

    second = run_engine(tmp_path, "hit", model, prompts, tiers)
    assert second.counter("chunk_hits", "PlainFileTier") == 4
    assert second.counter("read_bytes", "PlainFileTier") > 0
    assert_same_output(first, second)

    # Control: this tier checks nothing, so flipped bits reach the engine and change what it generates.
    for chunk in chunks:
        data = bytearray(chunk.read_bytes())
        data[::64] = bytes(b ^ 0x40 for b in data[::64])
        chunk.write_bytes(data)
    corrupted = run_engine(tmp_path, "corrupt", model, prompts, tiers)
    assert corrupted.counter("chunk_hits", "PlainFileTier") == 4
    assert [r["tokens"] for r in corrupted.results] != [r["tokens"] for r in first.results]

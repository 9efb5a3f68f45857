"""`kvtier prewarm` and `kvtier explain` of a real vLLM engine's namespace, the prompt given as text.

An engine stores a 4K-token prompt through the daemon; the daemon restarts (a cold store); `kvtier prewarm`
of the same prompt as text, tokenized with the checkpoint's own tokenizer, finds every record the engine
stored under the keys it computes without vLLM, pins them and reports the whole prompt restorable; a fresh
engine then hits every chunk. `kvtier explain` of a prompt sharing the first half names the chunk and group
where the hit stops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.vllm_harness import require_vllm

require_vllm()

from kvtier.core.tier import ObjectKey  # noqa: E402
from kvtier.integrations.vllm import keys as vl  # noqa: E402
from kvtier.store import DiskStore  # noqa: E402
from support.daemon import DaemonProc, child_env  # noqa: E402
from support.vllm_engine_run import BLOCK_SIZE  # noqa: E402
from support.vllm_harness import (  # noqa: E402
    KVTIER_TIER,
    assert_same_output,
    kvtier_daemon_tiers,
    new_checkpoint,
    run_engine,
)
from support.vllm_tiny_model import VOCAB  # noqa: E402

CHUNKS = 128  # 4,096 tokens of whole chunks
# 20 tokens past the chunks, as the other vLLM tests: vLLM-CPU's attention kernel dies (SIGILL) on this
# machine when a connector hit leaves only a few prompt tokens to compute
PROMPT_TOKENS = CHUNKS * BLOCK_SIZE + 20
ENGINE_ARGS = {"max_model_len": PROMPT_TOKENS + 64}


def _checkpoint_with_tokenizer(path: Path) -> str:
    """The tests' tiny checkpoint, long enough for the prompt, with a word-level tokenizer: word `w<i>` is id i."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    model = new_checkpoint(path, seed=3)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (path / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return model


def _ids(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], env=child_env(), capture_output=True, text=True, timeout=300
    )


def test_prewarm_a_vllm_prompt_as_text_then_a_fresh_engine_hits_it(tmp_path: Path) -> None:
    model = _checkpoint_with_tokenizer(tmp_path / "model")
    prompt = _ids(0, PROMPT_TOKENS)
    store = tmp_path / "store"
    (tmp_path / "d1").mkdir()
    daemon = DaemonProc(tmp_path / "d1", store_root=store)
    try:
        first = run_engine(
            tmp_path, "store", model, [prompt], kvtier_daemon_tiers(daemon.socket), 4, ENGINE_ARGS, shutdown=True
        )
        assert daemon.terminate() == 0
    finally:
        daemon.close()
    seed = os.environ.get("PYTHONHASHSEED")  # the engines' (vLLM's hashes depend on it where set)

    # the keys kvtier computes without vLLM are exactly the records the engine stored (its shutdown finished its stores)
    with DiskStore(str(store), readonly=True) as s:
        ((ns, entry),) = [(n, e) for n, e in s.namespaces().items() if e.version_key.kernel_abi.startswith("vllm ")]
        stored = {r.key for r in s.iter_records(limit=10_000, namespace=ns) if r.key.namespace == ns}
    layout = vl.parse_layout(entry.version_key.dtype_layout)
    (group,) = layout.groups
    hashes = vl.block_hashes(prompt, layout.tokens_per_hash, "sha256", seed)
    ours = {ObjectKey(ns, h, group.name, group.form) for h in vl.chunk_hashes(hashes, layout, group)}
    assert len(ours) == CHUNKS and stored == ours

    (tmp_path / "d2").mkdir()
    daemon = DaemonProc(tmp_path / "d2", store_root=store)  # a new daemon: nothing of the prompt in memory
    try:
        line = {"engine": "vllm", "model_dir": model, "name": "doc", "block_size": BLOCK_SIZE, "hash_algo": "sha256"}
        if seed is not None:
            line["hash_seed"] = seed
        half = prompt[: CHUNKS // 2 * BLOCK_SIZE] + _ids(1, PROMPT_TOKENS - CHUNKS // 2 * BLOCK_SIZE)
        manifest = tmp_path / "m.jsonl"
        manifest.write_text(
            json.dumps({**line, "text": _text(prompt), "ttl_s": 600}) + "\n" + json.dumps({**line, "text": _text(half)})
        )
        (tmp_path / "one.jsonl").write_text(manifest.read_text().splitlines()[0] + "\n")
        out = _kvtier("prewarm", str(tmp_path / "one.jsonl"), "--socket", str(daemon.socket), "--json")
        assert out.returncode == 0, out.stderr
        (rep,) = json.loads(out.stdout)["prefixes"]
        assert rep["tokens"] == PROMPT_TOKENS  # the text became the engine's token ids
        assert rep["hit_tokens"] == CHUNKS * BLOCK_SIZE
        assert rep["pinned"] == CHUNKS
        assert [(g["group"], g["stored"], g["restorable_tokens"]) for g in rep["groups"]] == [
            ("vllm.g0.full", CHUNKS, CHUNKS * BLOCK_SIZE)
        ]
        assert rep["namespace"] == ns.hex()

        out = _kvtier("explain", "--manifest-line", "2", str(manifest), "--socket", str(daemon.socket), "--json")
        assert out.returncode == 0, out.stderr
        e = json.loads(out.stdout)
        assert e["hit_tokens"] == CHUNKS // 2 * BLOCK_SIZE
        assert [(s["group"], s["unit"], s["reason"]) for s in e["stops"]] == [("vllm.g0.full", CHUNKS // 2, "missing")]

        second = run_engine(tmp_path, "hit", model, [prompt], kvtier_daemon_tiers(daemon.socket), 4, ENGINE_ARGS)
        assert second.counter("chunk_hits", KVTIER_TIER) == CHUNKS
        assert second.kvtier("load_chunks", outcome="ok") == CHUNKS
        assert_same_output(first, second)  # tokens and logprobs, bit for bit
    finally:
        daemon.close()


def test_explain_reads_a_sliding_window_models_groups_from_its_namespace(tmp_path: Path) -> None:
    """Gemma-2 (a full and a 64-token sliding-window group): the keys of both groups are the engine's records,
    and explain applies each group's rule (history from chunk 0, the window before the boundary)."""
    model = new_checkpoint(tmp_path / "model", seed=5, arch="gemma2")
    chunks = 8
    prompt = _ids(7, chunks * BLOCK_SIZE + 20)
    store = tmp_path / "store"
    (tmp_path / "d").mkdir()
    daemon = DaemonProc(tmp_path / "d", store_root=store)
    try:
        run_engine(tmp_path, "store", model, [prompt], kvtier_daemon_tiers(daemon.socket), 4, shutdown=True)
        with DiskStore(str(store), readonly=True) as s:
            ((ns, entry),) = [(n, e) for n, e in s.namespaces().items() if e.version_key.kernel_abi.startswith("vllm ")]
            stored = {r.key for r in s.iter_records(limit=10_000, namespace=ns) if r.key.namespace == ns}
        layout = vl.parse_layout(entry.version_key.dtype_layout)
        assert sorted((g.form.value, g.window_tokens) for g in layout.groups) == [("compressed", 0), ("swa", 64)]
        hashes = vl.block_hashes(prompt, layout.tokens_per_hash, "sha256", os.environ.get("PYTHONHASHSEED"))
        ours = {ObjectKey(ns, h, g.name, g.form) for g in layout.groups for h in vl.chunk_hashes(hashes, layout, g)}
        assert stored and stored <= ours
        full = next(g for g in layout.groups if g.window_tokens == 0)
        assert {k for k in stored if k.group == full.name} == {k for k in ours if k.group == full.name}

        manifest = tmp_path / "m.jsonl"
        line = {"engine": "vllm", "model_dir": model, "tokens": prompt}
        seed = os.environ.get("PYTHONHASHSEED")
        manifest.write_text(json.dumps({**line, **({"hash_seed": seed} if seed else {})}) + "\n")
        out = _kvtier("explain", "--manifest-line", "1", str(manifest), "--socket", str(daemon.socket), "--json")
        assert out.returncode == 0, out.stderr
        e = json.loads(out.stdout)
        swa = next(g for g in e["groups"] if g["kind"] == "state")
        assert swa["needed"] == 2 and e["hit_tokens"] == chunks * BLOCK_SIZE, e
    finally:
        daemon.close()

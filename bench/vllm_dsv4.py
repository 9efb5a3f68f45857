"""DeepSeek-V4 through the kvtier vLLM tier: lookup cost of a 128K-token request, and 1 MB row throughput.

Run in the vLLM venv (tests/vllm/run.sh --prepare builds it):
    bench/.venv-vllm/bin/python bench/vllm_dsv4.py [--tokens 131072] [--rows 64]
Prints one JSON object. The groups are the five vLLM 0.32 forms for a DSV4 checkpoint (tests/vllm/dsv4_vllm.py);
lookups follow the connector's scans on a fresh tier (nothing in memory): a prefix over the history group,
then from the end a whole window over each state group. Not measured: vLLM's own `fs` tier on the same rows.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import click
import numpy as np

_TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(_TESTS), str(_TESTS / "vllm")]  # the DSV4 group fixtures and the connector's scans

from test_vllm_dsv4 import Request, block_hashes, run_job, scan  # noqa: E402

from kvtier.integrations.vllm import KvtierSecondaryTier  # noqa: E402
from support.vllm_dsv4 import dsv4_offloading_config  # noqa: E402
from support.vllm_dsv4_model import write_dsv4_checkpoint  # noqa: E402


def tier(config, primary: np.ndarray, store: Path) -> KvtierSecondaryTier:
    return KvtierSecondaryTier(
        SimpleNamespace(config=config),
        memoryview(primary),
        "KvtierSecondaryTier",
        store_dir=str(store),
        attention_backend="FLASHMLA_SPARSE",
    )


@click.command()
@click.option("--tokens", default=131072, help="prompt length of the lookup measurement")
@click.option("--rows", default=64, help="1 MB rows stored and loaded for the throughput measurement")
def main(tokens: int, rows: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="kvtier-vllm-dsv4-"))
    model = write_dsv4_checkpoint(work / "model")
    small, block = dsv4_offloading_config(model, 4096)
    env = SimpleNamespace(config=small)

    # Lookups: store what vLLM keeps for one request (every history chunk, the windows at its end).
    primary = np.random.default_rng(0).integers(0, 256, (1024, 4096), dtype=np.uint8)
    writer = tier(small, primary, work / "lookups")
    prompt = block_hashes(1, tokens // 4)
    req = Request(env, prompt, "store")
    keys = []
    for g, plan in writer._plans.items():
        k = req.keys[g]
        keys += k if plan.window_chunks == 0 else k[-plan.window_chunks :]
    for i in range(0, len(keys), 256):  # max_pending_store_chunks
        batch = keys[i : i + 256]
        assert run_job(writer, batch, list(range(len(batch))), req.ctx, load=False).success
    writer.shutdown()
    fresh = tier(small, primary, work / "lookups")
    again = Request(env, prompt, "repeat")
    asked = 0
    lookup = fresh.lookup

    def counted(key, ctx):
        nonlocal asked
        asked += 1
        return lookup(key, ctx)

    fresh.lookup = counted
    started = time.perf_counter()
    hit = {g: scan(fresh, again, g, p.window_chunks) for g, p in fresh._plans.items()}
    lookup_s = time.perf_counter() - started
    fresh.shutdown()
    assert set(hit.values()) == {tokens}, hit

    # Throughput: rows of vLLM's packed DSV4 block size through the tier (store_dir, one job each way).
    full, _ = dsv4_offloading_config(model, block)
    big = np.random.default_rng(1).integers(0, 256, (2 * rows, block), dtype=np.uint8)
    t = tier(full, big, work / "rows")
    req = Request(SimpleNamespace(config=full), block_hashes(2, rows * 64), "rows")
    history = next(g for g, p in t._plans.items() if p.window_chunks == 0)
    row_keys = req.keys[history][:rows]
    started = time.perf_counter()
    assert run_job(t, row_keys, list(range(rows)), req.ctx, load=False).success
    store_s = time.perf_counter() - started
    started = time.perf_counter()
    assert run_job(t, row_keys, list(range(rows, 2 * rows)), req.ctx, load=True).success
    load_s = time.perf_counter() - started
    t.shutdown()
    assert np.array_equal(big[:rows], big[rows:])
    mb = rows * block / 1e6
    print(
        json.dumps(
            {
                "tokens": tokens,
                "lookups": asked,
                "lookup_total_ms": round(lookup_s * 1e3, 3),
                "lookups_per_s": round(asked / lookup_s),
                "row_bytes": block,
                "rows": rows,
                "store_mb_per_s": round(mb / store_s, 1),
                "load_mb_per_s": round(mb / load_s, 1),
                "fs_tier": "not measured",
            }
        )
    )


if __name__ == "__main__":
    main()

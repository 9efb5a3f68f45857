"""vLLM on an engine-only node: a kvtier daemon with `profiles = []` allocates no pools of its own and serves the
engines' tier: one engine stores through it, a fresh one hits, bit for bit."""

from __future__ import annotations

from pathlib import Path

from support.vllm_harness import require_vllm

require_vllm()

from kvtier.wire import Connection  # noqa: E402
from support.daemon import DaemonProc  # noqa: E402
from support.vllm_harness import (  # noqa: E402
    KVTIER_TIER,
    assert_same_output,
    kvtier_daemon_tiers,
    new_checkpoint,
    run_engine,
    shared_prefix_prompts,
)

PREFIX_CHUNKS = 4
POOLS = "".join(f'{f} = "64MiB"\n' for f in ("compressed", "indexer", "tail", "swa"))


def _shmem_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/PID/status")


def test_engines_store_and_hit_through_an_engine_only_daemon(tmp_path: Path) -> None:
    model = new_checkpoint(tmp_path / "model", seed=3)
    prompts = shared_prefix_prompts(seed=0)
    (tmp_path / "daemon").mkdir()
    daemon = DaemonProc(tmp_path / "daemon", store_root=tmp_path / "store", profiles=(), pools=POOLS)
    try:
        tiers = kvtier_daemon_tiers(daemon.socket)
        first = run_engine(tmp_path, "store", model, prompts, tiers)
        assert first.kvtier("store_chunks", outcome="stored") == PREFIX_CHUNKS
        second = run_engine(tmp_path, "hit", model, prompts, tiers)
        assert second.counter("chunk_hits", KVTIER_TIER) == PREFIX_CHUNKS
        assert second.kvtier("load_chunks", outcome="ok") == PREFIX_CHUNKS
        assert_same_output(first, second)  # tokens and logprobs, bit for bit

        with Connection(daemon.socket, name="test") as conn:
            doc = conn.stats()
        assert doc.daemon is not None and doc.daemon.pools == "none" and doc.profiles == []
        assert _shmem_bytes(daemon.proc.pid) < 64 << 20  # 256 MiB of budgets configured, no pool made
        assert daemon.proc.poll() is None and "Traceback" not in daemon.read_log()
    finally:
        assert daemon.terminate() == 0

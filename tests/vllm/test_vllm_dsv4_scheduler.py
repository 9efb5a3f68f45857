"""DeepSeek-V4's five KV groups through kvtier under vLLM's own Scheduler and OffloadingConnector.

Each engine is vLLM's real `Scheduler` with `TieringOffloadingSpec` (a CPU primary tier, kvtier as its
secondary tier) over the groups vLLM's DSV4 cache modules form; only the GPU is a stand-in, which writes a
byte pattern per (group, token prefix) into the rows it stores and checks every row it loads
(support/vllm_dsv4_engine.py). Engine 1 stores; a fresh engine 2 (an empty CPU tier: everything it hits
comes from kvtier) then asks for the same prompts. Both with the store opened in the engine and through
the kvtier daemon.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.vllm_harness import require_vllm

require_vllm()

from kvtier.core.forms import CacheForm  # noqa: E402
from kvtier.store import DiskStore  # noqa: E402
from support.corrupt import flip_payload_bit  # noqa: E402
from support.daemon import DaemonProc  # noqa: E402
from support.vllm_dsv4_engine import Dsv4Engine  # noqa: E402
from support.vllm_dsv4_model import RATIOS, write_dsv4_checkpoint  # noqa: E402
from support.vllm_harness import KVTIER_TIER, kvtier_audit  # noqa: E402

TOKENS = 1024  # four 256-token scheduler blocks


def prompt(seed: int, shared: list[int] | None = None) -> list[int]:
    rng = random.Random(seed)
    head = shared or []
    return head + [rng.randrange(3, 100_000) for _ in range(TOKENS - len(head))]


def roles(engine: Dsv4Engine) -> dict[str, int]:
    """vLLM group id per DSV4 role, from kvtier's classification (vLLM's ids follow registration order)."""
    plans = engine.tier._plans
    swa = sorted(g for g, p in plans.items() if p.form is CacheForm.SWA)
    by = {"swa_a": swa[0], "swa_b": swa[1]}
    for g, p in plans.items():
        if p.form is CacheForm.COMPRESSED:
            by["history"] = g
        elif p.form is CacheForm.TAIL:
            by["c4_state" if p.window_tokens == 8 else "c128_state"] = g
    return by


@pytest.fixture(params=["store_dir", "daemon"])
def env(request, tmp_path: Path):
    """Engines over one store; `restart()` closes the store's writer (the daemon) so a test may damage it."""
    store = tmp_path / "store"
    model = write_dsv4_checkpoint(tmp_path / "dsv4")
    daemons: list[DaemonProc] = []
    engines: list[Dsv4Engine] = []

    def start_daemon() -> None:
        if request.param == "daemon":
            folder = tmp_path / f"daemon{len(daemons)}"
            folder.mkdir()
            daemons.append(DaemonProc(folder, store_root=store))

    def engine(checkpoint: Path = model, dense: bool = True) -> Dsv4Engine:
        where = {"daemon_socket": str(daemons[-1].socket)} if daemons else {"store_dir": str(store)}
        tier = {"type": KVTIER_TIER, "module_path": "kvtier.integrations.vllm", "attention_backend": "FLASHMLA_SPARSE"}
        engines.append(Dsv4Engine(checkpoint, [{**tier, **where}], dense=dense))
        return engines[-1]

    def offline() -> None:
        """Stop the daemon (the store's writer) if there is one; `start_daemon` brings a new one up."""
        if daemons:
            assert daemons[-1].terminate() == 0

    start_daemon()
    yield SimpleNamespace(engine=engine, offline=offline, start_daemon=start_daemon, store=store, model=model)
    for e in engines:
        e.close()
    if daemons:
        daemons[-1].terminate()


def test_a_fresh_engine_hits_every_group_and_loads_the_stored_rows(env) -> None:
    first = env.engine()
    a = prompt(1)
    stored = first.generate(a)
    assert stored.computed_tokens == TOKENS and stored.wrong_rows == 0
    by = roles(first)
    assert set(stored.stored) == set(by.values())  # every group offloaded something
    first.close()

    second = env.engine()  # a new engine, an empty CPU tier: every hit below is a kvtier load
    repeat = second.generate(a)
    assert repeat.computed_tokens == 1  # all but the last prompt token loaded (vLLM recomputes that one)
    assert repeat.loaded_end == dict.fromkeys(by.values(), TOKENS)  # every group hit up to the prompt's end
    assert repeat.wrong_rows == 0 and sum(repeat.loaded.values()) > 0  # each loaded row is the one stored

    # A prompt sharing 600 tokens: dense retention kept whole windows at 512, so every group loads up to 512.
    shared = second.generate(prompt(2, shared=a[:600]))
    assert shared.computed_tokens == TOKENS - 512
    assert shared.loaded_end == dict.fromkeys(by.values(), 512) and shared.wrong_rows == 0
    second.close()

    env.offline()
    code, report = kvtier_audit(env.store)
    assert code == 0 and report["corrupt"] == 0
    per_namespace = [{f: v["entries"] for f, v in n["forms"].items() if v["entries"]} for n in report["namespaces"]]
    (forms,) = [f for f in per_namespace if f]  # the daemon's own profiles register empty namespaces
    assert set(forms) == {"compressed", "swa", "tail"}
    assert forms["compressed"] == 4 + 2  # the first prompt's 4 history chunks, the second's 2 past the shared 512


def test_a_corrupt_record_recomputes_an_evicted_window_chunk_misses_its_window(env) -> None:
    first = env.engine()
    a, b = prompt(1), prompt(3)
    first.generate(a)
    first.generate(b)
    by = roles(first)
    corrupt = first.object_key(a, by["history"], 768)  # the third history chunk of prompt a
    hole = first.object_key(b, by["swa_a"], 960)  # the first chunk of swa group A's window ending at 1024
    first.close()

    env.offline()
    with DiskStore(str(env.store), writer=True) as store:
        (info,) = store.records([corrupt])
        flip_payload_bit(env.store, info.entry, info.entry.payload_len // 2, 4)
        assert store.evict([hole]) == 1  # a real removal of a stored record
    env.start_daemon()

    second = env.engine()
    # The damaged chunk fails verification in kvtier, never reaches a GPU block; vLLM recomputes from 512.
    got = second.generate(a)
    assert got.wrong_rows == 0
    assert got.loaded_end == dict.fromkeys(by.values(), 512) and got.computed_tokens == TOKENS - 512
    # With one chunk of swa A's last window gone, no group resumes at 1024 (a partial window is no hit):
    # the previous whole windows, at 768, are.
    got = second.generate(b)
    assert got.wrong_rows == 0
    assert got.loaded_end == dict.fromkeys(by.values(), 768) and got.computed_tokens == TOKENS - 768


def test_a_changed_compress_ratios_is_a_new_namespace(env) -> None:
    first = env.engine()
    a = prompt(1)
    first.generate(a)
    first.close()
    # Same weights, same groups, one more compress_ratios entry: kvtier must not serve the old records.
    changed = write_dsv4_checkpoint(env.model.parent / "changed", compress_ratios=[*RATIOS, 4])
    other = env.engine(changed).generate(a)
    assert other.computed_tokens == TOKENS and not other.loaded

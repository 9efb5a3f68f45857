"""DeepSeek-V4.1's KV groups through kvtier under vLLM's own Scheduler and OffloadingConnector.

The layer specs come from vLLM's V4.1 cache classes (support/vllm_dsv41.py) and vLLM forms the groups: two
sliding-window groups (32-token blocks, window 128), one history group holding the ratio-2 and ratio-1 KV
sources and their indexer keys (256-token blocks), and a group of compressor rings that vLLM does not key
by prefix and so never offloads. kvtier classifies each offloaded group by its spec. Each engine is vLLM's
`Scheduler` with `TieringOffloadingSpec`; only the GPU is a stand-in that writes a byte pattern per (group,
token prefix) and checks every row it loads (support/vllm_dsv4_engine.py). The control is the same engine
over a plain file tier (support/vllm_file_tier.py): kvtier must hit at least as much, with exact rows.
"""

from __future__ import annotations

import collections
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.vllm_harness import require_vllm

require_vllm()

from vllm.v1.kv_cache_interface import CircularBufferSpec  # noqa: E402

from kvtier.core.forms import CacheForm  # noqa: E402
from support.daemon import DaemonProc  # noqa: E402
from support.vllm_dsv4_engine import Dsv4Engine  # noqa: E402
from support.vllm_dsv41 import (  # noqa: E402, F401
    dsv41_layer_specs,
    resolved_as_on_amx_hosts,
    resolved_as_on_hosts_without_amx,
)
from support.vllm_dsv41_model import INDEX_SOURCES, KV_SOURCES, write_dsv41_checkpoint  # noqa: E402
from support.vllm_harness import KVTIER_TIER, kvtier_audit  # noqa: E402

pytestmark = pytest.mark.usefixtures("resolved_as_on_amx_hosts")  # (support/vllm_dsv41.py says why)

TOKENS = 1024  # four 256-token scheduler blocks
NO_AMX_CPU_CHUNKS = 16384  # the CPU tier's rows for prompts() in 16-token blocks of every group
WEIGHTS = "xxh3_128:operator-supplied"  # one digest for every checkpoint below: only the config differs


def prompt(seed: int, shared: list[int] | None = None, length: int = TOKENS) -> list[int]:
    rng = random.Random(seed)
    head = shared or []
    return head + [rng.randrange(3, 100_000) for _ in range(length - len(head))]


def prompts() -> list[list[int]]:
    """A 1,024-token prompt, then prompts sharing 600, 300 and all of its tokens, and one of 1,000 tokens."""
    a = prompt(1)
    return [a, prompt(2, a[:600]), prompt(3, a[:300]), list(a), prompt(4, a[:700], length=1000)]


def asked() -> list[list[int]]:
    """What engine 2 asks: new prompts sharing 600 tokens of the first stored prompt and 900 of the second (hits
    end inside them, at the last boundary with every group's window stored), then stored prompts."""
    stored = prompts()
    return [prompt(5, stored[0][:600]), prompt(6, stored[1][:900]), stored[4], stored[0]]


@pytest.fixture(params=["store_dir", "daemon"])
def env(request, tmp_path: Path):
    store = tmp_path / "store"
    model = write_dsv41_checkpoint(tmp_path / "dsv41")
    daemons: list[DaemonProc] = []
    engines: list[Dsv4Engine] = []
    if request.param == "daemon":
        (tmp_path / "daemon").mkdir()
        daemons.append(DaemonProc(tmp_path / "daemon", store_root=store))

    def engine(tier: str = "kvtier", checkpoint: Path = model, **kw: object) -> Dsv4Engine:
        if tier == "file":
            config = {"type": "PlainFileTier", "module_path": "support.vllm_file_tier", "root": str(tmp_path / "file")}
        else:
            where = {"daemon_socket": str(daemons[0].socket)} if daemons else {"store_dir": str(store)}
            config = {
                "type": KVTIER_TIER,
                "module_path": "kvtier.integrations.vllm",
                "attention_backend": "FLASHMLA_SPARSE_DSV41",
                "weights_digest": WEIGHTS,
                **where,
            }
        engines.append(Dsv4Engine(checkpoint, [config], dense=True, layer_specs=dsv41_layer_specs, **kw))  # type: ignore[arg-type]
        return engines[-1]

    yield SimpleNamespace(engine=engine, store=store, model=model, daemons=daemons)
    for e in engines:
        e.close()
    for d in daemons:
        d.terminate()


def test_vllm_forms_the_v41_groups_and_kvtier_files_each_by_its_spec(env) -> None:
    e = env.engine()
    groups = e.scheduler.kv_cache_config.kv_cache_groups
    offloaded = {g.group_id for g in e.offloading_config.groups}
    rings = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, CircularBufferSpec)]
    assert len(groups) == 4 and len(rings) == 1 and offloaded == set(range(4)) - set(rings)
    assert not groups[rings[0]].kv_cache_spec.prefix_cacheable  # why vLLM offloads no ring
    plans = e.tier._plans
    assert set(plans) == offloaded  # every group vLLM offloads has a plan
    got = collections.Counter((p.form, p.tokens_per_chunk, p.window_tokens, p.window_chunks) for p in plans.values())
    assert got == {(CacheForm.SWA, 32, 128, 4): 2, (CacheForm.COMPRESSED, 256, 0, 0): 1}
    (history,) = [p for p in plans.values() if p.form is CacheForm.COMPRESSED]
    # The history group holds the ratio-2 and ratio-1 KV sources and the indexer keys two of them own.
    assert sorted(groups[history.group_id].layer_names) == sorted(
        [f"model.layers.{i}.attn" for i in KV_SOURCES]
        + [f"model.layers.{i}.attn.indexer.k_cache" for i in KV_SOURCES if i in INDEX_SOURCES]
    )
    assert history.name.endswith(".history") and ":r2:" in history.kinds


def _stored_then_asked(env, tier: str, offloaded: set[int], **kw: object) -> list:
    """Engine 1 stores prompts() through `tier`, engine 2 (a new engine, an empty CPU tier: its first hits are loads
    from the tier) asks asked(); engine 2's outcomes. `offloaded` gets the groups vLLM offloads."""
    first = env.engine(tier, **kw)
    offloaded.update(g.group_id for g in first.offloading_config.groups)
    stored = [first.generate(p) for p in prompts()]
    assert all(s.wrong_rows == 0 for s in stored)
    assert set(stored[0].stored) == {g.group_id for g in first.offloading_config.groups}  # every group stored
    first.close()
    second = env.engine(tier, **kw)
    return [second.generate(p) for p in asked()]


def _hits_as_the_file_tier(control: list, got: list) -> None:
    assert control[0].computed_tokens < TOKENS  # the control hits: the comparison means something
    for i, (c, k) in enumerate(zip(control, got)):
        assert k.wrong_rows == 0, f"prompt {i}: {k.wrong_rows} loaded rows differ from the stored ones"
        assert k.computed_tokens <= c.computed_tokens, f"prompt {i}: kvtier computed {k.computed_tokens}, file {c}"


def test_engine_2_hits_at_least_the_file_tier_on_every_prompt_with_exact_rows(env) -> None:
    offloaded: set[int] = set()
    control, got = _stored_then_asked(env, "file", offloaded), _stored_then_asked(env, "kvtier", offloaded)
    _hits_as_the_file_tier(control, got)
    # Dense retention stored whole windows at every 256-token boundary: every group loads up to 512 of 600.
    assert got[0].loaded_end == dict.fromkeys(offloaded, 512) and got[0].computed_tokens == TOKENS - 512

    if env.daemons:
        assert env.daemons[0].terminate() == 0
    code, report = kvtier_audit(env.store)
    assert code == 0 and report["corrupt"] == 0
    forms = {f for n in report["namespaces"] for f, v in n["forms"].items() if v["entries"]}
    assert forms == {"compressed", "swa"}


def test_without_amx_vllm_cpu_runs_v41_in_16_token_blocks_and_kvtier_hits_as_the_file_tier(
    env,
    resolved_as_on_hosts_without_amx,  # noqa: F811  (a fixture: asked for after the module's usefixtures)
) -> None:
    """vllm-cpu on a CPU without AMX tiles runs V4.1's MLA through its reference kernel at 16-token blocks: each
    KV source's cache and the sliding windows in groups of their own (44 offloaded). One request's store job then
    holds more chunks than the tier's queue bound, and kvtier stored none of them. The CPU tier is sized for the
    groups (with the default one, vLLM's own offloading refuses them)."""
    e = env.engine("file", cpu_chunks=NO_AMX_CPU_CHUNKS)
    assert e.scheduler.cache_config.block_size == 16 and len(e.offloading_config.groups) > 4  # the resolution asked for
    e.close()
    offloaded: set[int] = set()
    control = _stored_then_asked(env, "file", offloaded, cpu_chunks=NO_AMX_CPU_CHUNKS)
    got = _stored_then_asked(env, "kvtier", offloaded, cpu_chunks=NO_AMX_CPU_CHUNKS)
    _hits_as_the_file_tier(control, got)


def _changed_run(env, **overrides: object) -> int:
    """Tokens engine 2 loads for the first prompt after engine 1 stored it and config.json changed in place."""
    first = env.engine()
    a = prompts()[0]
    first.generate(a)
    first.close()
    write_dsv41_checkpoint(env.model, **overrides)  # same path, same weights bytes, same operator digest
    got = env.engine().generate(a)
    assert got.wrong_rows == 0
    return TOKENS - got.computed_tokens


def test_a_changed_kv_source_layer_ids_is_a_new_namespace(env) -> None:
    # Layer 32 now reads layer 22's compressed KV instead of owning its own: other bytes in the history rows.
    assert _changed_run(env, kv_source_layer_ids=[2, 12, 22]) == 0


def test_a_changed_index_source_layer_ids_is_a_new_namespace(env) -> None:
    # The cache-owning layers stay as they were (same groups, same layer lists): the resolved config's
    # sharing keys, in the namespace's engine_config, are what makes this a miss.
    assert _changed_run(env, index_source_layer_ids=[2, 8, 22, 27]) == 0

"""`kvtier prewarm` and `kvtier explain` of an SGLang namespace, through SGLang's real classes and a real daemon.

kvtier's page keys (integrations/sglang/keys.py, no SGLang import) equal SGLang's own `get_hash_str` and the
records its backend stores; after a daemon restart, `kvtier prewarm` of the prompt finds every page of every
pool, pins them and reports the whole prompt restorable, and a fresh backend then hits every page.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from kvtier.core.forms import GroupKind
from kvtier.integrations.checkpoint import weights_digest
from kvtier.integrations.sglang import keys as sk
from kvtier.store import DiskStore
from support.daemon import DaemonProc, child_env
from support.sglang_pools import (  # first: it skips this module unless SGLang imports
    PAGE,
    Dsv4Host,
    backup,
    kvtier_backend,
    launch,
    query,
    write_checkpoint,
)

PAGES = 4
SLOTS = list(range(PAGES))


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 150_000) for _ in range(n)]


def test_page_keys_equal_sglangs() -> None:
    from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed  # after support's stand-ins

    tokens = _tokens(0, 3 * PAGE + 5)
    ours = sk.page_hashes(tokens, PAGE)
    assert len(ours) == 3 and ours == get_hash_str(tokens, None, page_size=PAGE)[:3]  # whole pages only
    wide = list(tokens)
    wide[PAGE + 1] = 2**40  # a token id past uint32: SGLang hashes that page's tokens as uint64, tagged
    assert sk.page_hashes(wide, PAGE) == get_hash_str(wide, None, page_size=PAGE)[:3]
    for extra, salt in ((None, "s"), ("lora-1", None), ("lora-1", "s"), ("", "")):
        seed = storage_namespace_seed(extra, salt)
        assert sk.namespace_seed(extra, salt) == seed
        assert sk.page_hashes(tokens, PAGE, extra, salt) == get_hash_str(tokens, seed, page_size=PAGE)[:3]


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], env=child_env(), capture_output=True, text=True, timeout=300
    )


def test_prewarm_an_sglang_namespace_then_a_fresh_backend_hits_it(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model")
    launch(model)
    digest = weights_digest(model)
    tokens = _tokens(1, PAGES * PAGE + 7)
    keys = sk.page_hashes(tokens, PAGE)
    store = tmp_path / "store"
    (tmp_path / "d1").mkdir()
    daemon = DaemonProc(tmp_path / "d1", store_root=store)
    try:
        host = Dsv4Host(PAGES)
        host.fill(seed=4)
        kv = kvtier_backend(host, model, daemon_socket=str(daemon.socket), weights_digest=digest)
        backup(kv, host, keys, SLOTS, state_at={1, PAGES - 1})  # state at the checkpoints after pages 2 and 4
        assert kv.flush(30)
        stored_keys = {kv.object_key(k, g.name) for k in keys for g in host.geometry}
        kv.close()
        assert daemon.terminate() == 0
    finally:
        daemon.close()

    with DiskStore(str(store), readonly=True) as s:
        ((ns, entry),) = [(n, e) for n, e in s.namespaces().items() if e.version_key.kernel_abi.startswith("sglang-")]
        plans = sk.pool_plans(entry.identity["pools"])
        in_store = {r.key for r in s.iter_records(limit=10_000, namespace=ns) if r.key.namespace == ns}
    # the keys computed without SGLang are the backend's, and every record it stored is one of them
    ours = {
        (sk.object_hash(k), p.group, p.form)
        for k in keys
        for p in plans
    }  # fmt: skip
    assert {(k.block_hash, k.group, k.form) for k in stored_keys} <= ours
    assert {(k.block_hash, k.group, k.form) for k in in_store} <= ours
    history = [p for p in plans if p.form.kind is GroupKind.HISTORY]
    state = [p for p in plans if p.form.kind is GroupKind.STATE]
    assert len(in_store) == PAGES * len(history) + 2 * len(state)

    (tmp_path / "d2").mkdir()
    daemon = DaemonProc(tmp_path / "d2", store_root=store)  # cold: a new daemon over the same store
    try:
        line = {"engine": "sglang", "model_dir": str(model), "page_size": PAGE}
        half = tokens[: 2 * PAGE] + _tokens(2, 2 * PAGE + 7)
        manifest = tmp_path / "m.jsonl"
        manifest.write_text(
            json.dumps({**line, "tokens": tokens, "name": "doc"}) + "\n" + json.dumps({**line, "tokens": half}) + "\n"
        )
        (tmp_path / "one.jsonl").write_text(manifest.read_text().splitlines()[0] + "\n")
        out = _kvtier("prewarm", str(tmp_path / "one.jsonl"), "--socket", str(daemon.socket), "--json")
        assert out.returncode == 0, out.stderr
        (rep,) = json.loads(out.stdout)["prefixes"]
        assert rep["namespace"] == ns.hex() and rep["engine"] == "sglang"
        assert rep["hit_tokens"] == PAGES * PAGE
        assert rep["pinned"] == len(in_store)
        by_group = {g["group"]: g for g in rep["groups"]}
        assert all(by_group[p.group]["stored"] == PAGES for p in history)
        assert all(by_group[p.group]["stored"] == 2 for p in state)
        assert all(g["restorable_tokens"] == PAGES * PAGE for g in rep["groups"])

        out = _kvtier("explain", "--manifest-line", "2", str(manifest), "--socket", str(daemon.socket), "--json")
        assert out.returncode == 0, out.stderr
        e = json.loads(out.stdout)
        assert e["hit_tokens"] == 2 * PAGE
        assert {s["group"] for s in e["stops"]} == {p.group for p in plans}  # page 2: no pool holds it
        assert {(s["unit"], s["reason"]) for s in e["stops"]} == {(2, "missing")}

        host = Dsv4Host(PAGES)
        kv = kvtier_backend(host, model, daemon_socket=str(daemon.socket), weights_digest=digest)
        assert query(kv, keys)[0] == PAGES  # a fresh backend: every page is a hit
        kv.close()
        assert "Traceback" not in daemon.read_log()
    finally:
        assert daemon.terminate() == 0

"""`kvtier prewarm` and `kvtier explain` for an engine namespace, against a real daemon, without the engine.

An engine tier's namespace is registered the way the vLLM tier registers it (a raw tier connection with the
tier's version key), its records stored under the keys vLLM's chunks get; the CLI then finds the namespace by
the checkpoint's weights, computes the same keys from the manifest's tokens, and reports per group. That the
keys equal what a real vLLM or SGLang stores is tests/vllm/test_vllm_prewarm.py and
tests/sglang/test_sglang_prewarm.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.store import DiskStore
from support.daemon import DaemonProc, child_env
from support.engine_records import (
    CHUNK,
    CHUNKS,
    engine_model,
    engine_tokens,
    engine_vkey,
    store_engine_records,
)

_model, _vkey, _tokens, _store = engine_model, engine_vkey, engine_tokens, store_engine_records


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], env=child_env(), capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    # One daemon for the module: each test makes a checkpoint of its own (random weights), so its namespaces are
    # its own, and a daemon start is most of what a test here would cost alone.
    d = DaemonProc(tmp_path_factory.mktemp("daemon"))
    try:
        yield d
    finally:
        d.close()


def _line(model: Path, tokens: list[int], **extra: object) -> str:
    return json.dumps({"engine": "vllm", "model_dir": str(model), "tokens": tokens, **extra})


def test_prewarm_and_explain_an_engine_namespace(daemon: DaemonProc, tmp_path: Path) -> None:
    model = _model(tmp_path / "model", 1)
    vkey = _vkey(model)
    tokens = _tokens(0)
    keys = _store(daemon.socket, vkey, tokens, skip={})
    half = tokens[: 5 * CHUNK] + _tokens(9)[5 * CHUNK :]  # shares chunks 0-4
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        _line(model, tokens, name="doc", ttl_s=300, block_size=32, chunk_tokens=32) + "\n" + _line(model, half) + "\n"
    )

    out = _kvtier("prewarm", str(manifest.with_name("one.jsonl")), "--socket", str(daemon.socket))
    assert out.returncode == 2  # no such manifest: a config error
    (tmp_path / "one.jsonl").write_text(manifest.read_text().splitlines()[0] + "\n")
    before = time.time()
    out = _kvtier("prewarm", str(tmp_path / "one.jsonl"), "--socket", str(daemon.socket), "--json")
    assert out.returncode == 0, out.stderr
    (rep,) = json.loads(out.stdout)["prefixes"]
    assert rep["namespace"] == vkey.namespace_hex and rep["engine"] == "vllm"
    assert rep["tokens"] == len(tokens) and rep["hit_tokens"] == CHUNKS * CHUNK
    assert rep["pinned"] == len(keys) == 2 * CHUNKS
    assert [(g["group"], g["stored"], g["restorable_tokens"], g["needed"]) for g in rep["groups"]] == [
        ("vllm.g0.full", CHUNKS, CHUNKS * CHUNK, CHUNKS),
        ("vllm.g1.swa64", CHUNKS, CHUNKS * CHUNK, 2),
    ]
    with DiskStore(str(daemon.tmp / "store"), readonly=True) as s:
        infos = s.records(keys)
        io_backend = s.io_backend
    assert all(i is not None and i.entry.pin_until >= before + 290 for i in infos)  # pinned for ttl_s
    extents = sum(i.entry.record_len for i in infos if i is not None)
    assert rep["warmed_bytes"] == (extents if io_backend == "buffered" else 0)
    assert "vllm.g1.swa64: state, 10/10 stored" in out.stderr

    out = _kvtier("explain", "--manifest-line", "2", str(manifest), "--socket", str(daemon.socket), "--json")
    assert out.returncode == 0, out.stderr
    e = json.loads(out.stdout)
    assert e["hit_tokens"] == 5 * CHUNK
    assert [(s["group"], s["unit"], s["reason"]) for s in e["stops"]] == [
        ("vllm.g0.full", 5, "missing"),
        ("vllm.g1.swa64", 5, "missing"),
    ]
    text = _kvtier("explain", "--manifest-line", "2", str(manifest), "--socket", str(daemon.socket))
    assert "stops at    chunk 5 (tokens 160-192) of vllm.g0.full: missing" in text.stdout


def test_a_state_group_stops_the_hit_at_its_window(daemon: DaemonProc, tmp_path: Path) -> None:
    """The SWA group lacks chunks 7 and 9: its window (2 chunks) is whole last at boundary 224 (chunks 5, 6)."""
    model = _model(tmp_path / "model", 1)
    tokens = _tokens(0)
    _store(daemon.socket, _vkey(model), tokens, skip={"vllm.g1.swa64": {7, 9}})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(_line(model, tokens) + "\n")
    out = _kvtier("explain", "--manifest-line", "1", str(manifest), "--socket", str(daemon.socket), "--json")
    assert out.returncode == 0, out.stderr
    e = json.loads(out.stdout)
    assert e["hit_tokens"] == 7 * CHUNK
    assert [(s["group"], s["unit"], s["reason"]) for s in e["stops"]] == [("vllm.g1.swa64", 7, "missing")]
    assert "checkpoint" in e["stops"][0]["fix"]


def test_the_namespace_is_picked_by_checkpoint_or_named(daemon: DaemonProc, tmp_path: Path) -> None:
    model = _model(tmp_path / "model", 1)
    tokens = _tokens(0)
    a, b = _vkey(model, "cfg-a"), _vkey(model, "cfg-b")  # two engine configurations over one checkpoint
    _store(daemon.socket, a, tokens, skip={})
    _store(daemon.socket, b, tokens[: 3 * CHUNK], skip={})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(_line(model, tokens) + "\n" + _line(model, tokens, namespace=b.namespace_hex[:10]) + "\n")
    out = _kvtier("explain", "--manifest-line", "1", str(manifest), "--socket", str(daemon.socket))
    assert out.returncode == 2
    assert "2 live vllm namespaces of this checkpoint: set 'namespace' to one of" in out.stderr
    assert a.namespace_hex[:12] in out.stderr and b.namespace_hex[:12] in out.stderr
    out = _kvtier("explain", "--manifest-line", "2", str(manifest), "--socket", str(daemon.socket), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["namespace"] == b.namespace_hex
    assert json.loads(out.stdout)["hit_tokens"] == 3 * CHUNK

    other = _model(tmp_path / "other", 2)  # a checkpoint no engine ran: no namespace
    manifest.write_text(_line(other, tokens) + "\n" + _line(model, tokens, namespace=a.namespace_hex, block_size=16))
    out = _kvtier("prewarm", str(manifest), "--socket", str(daemon.socket))
    assert out.returncode == 2 and "no live vllm namespace of" in out.stderr
    (tmp_path / "bs.jsonl").write_text(manifest.read_text().splitlines()[1] + "\n")
    out = _kvtier("prewarm", str(tmp_path / "bs.jsonl"), "--socket", str(daemon.socket))
    assert out.returncode == 2 and "ran with block_size 32, not 16" in out.stderr


def test_records_of_another_layout_are_not_counted(daemon: DaemonProc, tmp_path: Path) -> None:
    """Records under the right keys but another layout digest (another engine build) are no hit: abi_mismatch."""
    model = _model(tmp_path / "model", 1)
    tokens = _tokens(0)
    _store(daemon.socket, _vkey(model), tokens, skip={}, wrong=("vllm.g1.swa64",))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(_line(model, tokens) + "\n")
    out = _kvtier("explain", "--manifest-line", "1", str(manifest), "--socket", str(daemon.socket), "--json")
    assert out.returncode == 0, out.stderr
    e = json.loads(out.stdout)
    assert e["hit_tokens"] == 0
    assert [(s["group"], s["unit"], s["reason"]) for s in e["stops"]] == [("vllm.g1.swa64", 0, "abi_mismatch")]

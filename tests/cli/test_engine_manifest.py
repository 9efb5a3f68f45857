"""Manifest lines naming an engine namespace, the hit rule over an engine's groups, and the layout parse."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvtier.cli.engine_hit import GroupUnits, analyse
from kvtier.cli.manifest import read_manifest
from kvtier.core.errors import ConfigError
from kvtier.core.forms import CacheForm, Reason
from kvtier.integrations.sglang import keys as sk
from kvtier.integrations.vllm import keys as vl

OK, MISS, GONE = Reason.OK, Reason.MISSING, Reason.EVICTED


def _manifest(tmp_path: Path, *lines: dict) -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return p


def test_an_engine_line_reads_its_settings(tmp_path: Path) -> None:
    m = _manifest(
        tmp_path,
        {"engine": "vllm", "model_dir": "model", "tokens": [1, 2, 3], "hash_algo": "sha256_cbor", "block_size": 16},
        {"engine": "sglang", "model_dir": "model", "tokens": [4], "page_size": 64, "cache_salt": "t1", "ttl_s": 5},
    )
    a, b = read_manifest(m)
    assert a.profile == "" and a.engine is not None and a.engine.kind == "vllm"
    assert a.engine.model_dir == tmp_path / "model" and a.engine.hash_algo == "sha256_cbor"
    assert a.engine.block_size == 16 and a.engine.hash_seed is None and a.tokens.tolist() == [1, 2, 3]
    assert b.engine is not None and (b.engine.kind, b.engine.page_size, b.engine.cache_salt) == ("sglang", 64, "t1")
    assert b.ttl_s == 5.0


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ({"engine": "trt", "model_dir": "model", "tokens": [1]}, "must be one of vllm, sglang"),
        ({"engine": "vllm", "tokens": [1]}, "needs the checkpoint's directory"),
        ({"engine": "vllm", "model_dir": "nope", "tokens": [1]}, "is not a directory"),
        ({"engine": "vllm", "model_dir": "model", "tokens": [1], "page_size": 4}, "unknown key for a vllm line"),
        ({"engine": "sglang", "model_dir": "model", "tokens": [1], "hash_algo": "x"}, "unknown key for a sglang"),
        ({"engine": "vllm", "model_dir": "model", "tokens": [1], "hash_algo": "md5"}, "must be one of sha256"),
        ({"engine": "vllm", "model_dir": "model", "tokens": [1], "block_size": 0}, "positive integer"),
        ({"engine": "vllm", "model_dir": "model", "tokens": [1], "text": "hi"}, "exactly one of"),
        ({"engine": "vllm", "model_dir": "model"}, "exactly one of"),
        ({"profile": "ref-tiny", "text": "hi"}, "unknown key"),  # text is for engine lines (their tokenizer)
        ({"engine": "vllm", "model_dir": "model", "messages": "hi"}, "list of"),
    ],
)
def test_a_bad_engine_line_is_a_config_error_naming_the_line(tmp_path: Path, line: dict, says: str) -> None:
    m = _manifest(tmp_path, line)
    with pytest.raises(ConfigError, match=says) as exc:
        read_manifest(m)
    assert f"{m}:1" in str(exc.value)


def test_text_without_transformers_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # an import of it now fails, as where it is absent
    m = _manifest(tmp_path, {"engine": "vllm", "model_dir": "model", "text": "hello"})
    with pytest.raises(ConfigError, match=r"needs the transformers package \(pip install transformers\)"):
        read_manifest(m)


def _g(name: str, t: int, window: int, reasons: list[Reason]) -> GroupUnits:
    return GroupUnits(name, "swa" if window else "compressed", t, window, reasons)


def test_history_stops_at_its_first_missing_unit_state_needs_only_its_window() -> None:
    full = _g("full", 32, 0, [OK] * 6 + [GONE, OK])
    swa = _g("swa", 32, 2, [MISS, MISS, OK, OK, OK, OK, OK, OK])
    e = analyse(8 * 32 + 5, [full, swa])
    assert e.hit_tokens == 6 * 32  # history stops at unit 6; the window (units 4, 5) is whole
    assert [(s.group, s.unit, s.reason) for s in e.stops] == [("full", 6, "evicted")]
    assert [(g.restorable_tokens, g.needed) for g in e.groups] == [(6 * 32, 6), (8 * 32, 2)]


def test_a_hole_in_a_state_window_falls_back_to_an_earlier_boundary() -> None:
    full = _g("full", 32, 0, [OK] * 8)
    swa = _g("swa", 32, 2, [OK] * 5 + [MISS, OK, MISS])
    e = analyse(8 * 32, [full, swa])
    assert e.hit_tokens == 5 * 32  # 8: unit 7 missing; 7: unit 5; 6: unit 5; 5: units 3, 4
    assert [(s.group, s.unit) for s in e.stops] == [("swa", 5)]
    assert "checkpoint" in e.stops[0].fix


def test_hits_land_on_whole_units_of_every_group() -> None:
    e = analyse(7 * 32, [_g("a", 32, 0, [OK] * 7), _g("b", 64, 0, [OK] * 3)])
    assert e.boundary_tokens == 64 and e.hit_tokens == 192 and not e.stops


def test_the_layout_of_a_vllm_namespace() -> None:
    layout = vl.parse_layout(
        "bfloat16;layout=NHD;chunk=65536B/2blk;block=32768B;hash=16t;agnostic;replicated=0;canonical=1;"
        "groups=vllm.g0.history:compressed:256t:c4+c128:layers-0a1b2c3d,"
        "vllm.g1.swa128:swa:128t:all-blocks:SlidingWindowSpec:r1:584B:layers-4e5f6a7b"
    )
    assert (layout.tokens_per_hash, layout.blocks_per_chunk) == (16, 2)
    assert [(g.group_id, g.name, g.form, g.tokens_per_chunk, g.window_tokens) for g in layout.groups] == [
        (0, "vllm.g0.history", CacheForm.COMPRESSED, 256, 0),
        (1, "vllm.g1.swa128", CacheForm.SWA, 128, 128),
    ]
    hashes = [bytes([i]) * 32 for i in range(16)]
    assert len(vl.chunk_hashes(hashes, layout, layout.groups[0])) == 1  # 256 / 16 = every 16th hash
    assert len(vl.chunk_hashes(hashes, layout, layout.groups[1])) == 2
    with pytest.raises(ConfigError, match="not a vLLM tier namespace layout"):
        vl.parse_layout("kv=bf16;page=64t")
    assert sk.page_size_of("kv=auto;page=64t;mla=1;page_first=1;shard=pp0of1") == 64
    with pytest.raises(ConfigError, match="not an SGLang backend namespace layout"):
        sk.page_size_of("bfloat16;hash=16t")

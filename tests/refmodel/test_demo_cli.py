"""`kvtier demo`: a real resume with a bitwise match, a hit below the hash hit, and every broken form diverging."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from click.testing import CliRunner

from kvtier.cli import demo_cmd
from kvtier.cli.main import cli
from kvtier.core import load_profile
from kvtier.refmodel import required_objects


def test_demo_json_reports_a_bitwise_resume_and_load_bearing_forms() -> None:
    result = CliRunner().invoke(cli, ["demo", "--tokens", "1024", "--decode", "4", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    p = load_profile("ref-tiny")
    h = p.hash_block_tokens
    assert doc["bitwise_match"] is True
    assert doc["single_shot_max_abs_diff"] < 1e-4
    # 716 shared tokens: 22 whole blocks hash-hit, but state forms exist only at the checkpoint after block 16.
    assert (doc["shared_tokens"], doc["hash_hit_tokens"], doc["usable_hit_tokens"]) == (716, 704, 512)
    assert doc["checkpoints"] == [512, 1024]
    k = doc["usable_hit_tokens"] // h
    assert sum(c["objects"] for c in doc["restored"].values()) == len(required_objects(p, k))
    per_block = p.bytes_per_hash_block()
    assert doc["exported"]["compressed"]["bytes"] == per_block["compressed"] * (1024 // h)
    assert doc["exported"]["tail"]["bytes"] == per_block["tail"] * 2
    assert doc["restored"]["indexer"]["bytes"] == per_block["indexer"] * k
    assert doc["continuation_tokens"] == 512 and doc["decode_tokens"] == 4
    assert [b["case"] for b in doc["broken"]][0] == "tail missing"
    assert all(b["diverges"] and b["max_abs_diff"] > 1e-4 for b in doc["broken"]), doc["broken"]


def test_demo_text_report_and_exit_code(monkeypatch) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--tokens", "1024"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "bitwise match  yes" in proc.stdout and "usable hit     512 tokens" in proc.stdout
    assert proc.stdout.count("diverges") == 4

    real = demo_cmd.run_demo
    monkeypatch.setattr(demo_cmd, "run_demo", lambda *a: dataclasses.replace(real(*a), bitwise_match=False))
    result = CliRunner().invoke(cli, ["demo", "--tokens", "1024", "--decode", "0"])
    assert result.exit_code == demo_cmd.MISMATCH_EXIT and "bitwise match  NO" in result.stdout


def test_demo_refuses_prompts_too_short_to_resume() -> None:
    for args in (["--tokens", "100"], ["--tokens", "1024", "--checkpoint-every", "64"]):
        result = CliRunner().invoke(cli, ["demo", *args])
        assert result.exit_code == 2, result.output

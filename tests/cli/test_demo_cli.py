"""`kvtier demo`: a real daemon subprocess, a kill -9 and restart, prewarm, a bitwise restore faster than recompute."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from kvtier.cli import exits
from kvtier.cli.main import cli
from kvtier.core import load_profile
from kvtier.refmodel import demo as demo_mod
from kvtier.refmodel.demo import DemoParams, run_demo

PROFILE = load_profile("ref-tiny")
H = PROFILE.hash_block_tokens


def test_demo_json_story_on_a_real_daemon(tmp_path: Path) -> None:
    """As root too (CI): the demo's own config, not the systemd default; the state stays in --dir.

    16K tokens: long enough that restore beats recompute by a wide margin on a busy 2-core machine.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("KVTIER_CONFIG", "KVTIER_SOCKET")}
    env["RUNTIME_DIRECTORY"] = str(tmp_path / "not-used")  # would select the systemd default for a config-less daemon
    work = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "demo",
            "--tokens",
            "16384",
            "--decode",
            "4",
            "--checkpoint-every",
            "16",
            "--dir",
            str(work),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["bitwise_match"] and doc["restore_faster"]
    offloaded = sum(c["objects"] for c in doc["offloaded"].values())
    assert doc["records_after_restart"] == offloaded  # durable offload: everything survived the SIGKILL
    # B shares 11468 tokens: 358 whole blocks, but state exists only at checkpoints (every 16 blocks): hit at 352 blocks
    assert (doc["shared_tokens"], doc["hash_hit_tokens"], doc["hit_tokens"]) == (11468, 358 * H, 352 * H)
    assert doc["compared_tokens"] == 16384 - 352 * H + 4
    # the headline is the cold restore: after the SIGKILL nothing is resident, every object comes from disk
    cold = doc["request"]["routes_at_lookup"]
    assert "REUSE" not in cold["compressed"] and cold["compressed"]["RECOVER"] == 2 * 352
    assert doc["request"]["loaded_objects"] > 0 and doc["request"]["load_s"] > 0
    assert doc["restore_s"] == doc["request"]["restore_s"] < doc["recompute_s"]
    # after a restart and a prewarm of A's prompt, B's history is resident
    warm = doc["prewarmed_request"]["routes_at_lookup"]
    assert "RECOVER" not in warm["compressed"] and warm["compressed"]["REUSE"] == 2 * 352
    assert warm["swa"]["RECOVER"] == 2 and warm["tail"]["RECOVER"] == 2  # B's checkpoint is not A's end: from disk
    assert doc["prewarm"]["hit_tokens"] == 16384 and doc["prewarm"]["bytes_loaded"] > 0
    assert doc["bytes_from_disk"] == doc["prewarm"]["bytes_loaded"] + doc["prewarmed_request"]["bytes_from_disk"]
    # the load moved off the request's path: the prewarmed request reads only B's own checkpoint state from disk
    # (bytes, not times: two sub-100 ms timings on a shared machine order either way)
    assert 0 < doc["prewarmed_request"]["bytes_from_disk"] < doc["request"]["bytes_from_disk"] / 10
    # each stage was announced on stderr as it started, in order
    stages = [line.split("] ", 1)[1] for line in proc.stderr.splitlines() if line.startswith("[")]
    assert [s.split()[0] for s in stages] == [
        "starting",
        "engine",
        "killing",
        "engine",
        "recomputing",
        "restarting",
        "kvtier",
    ]
    audit = doc["audit"]
    assert audit["records"] == offloaded and audit["forms"]["compressed"]["records"] == 2 * 512
    assert (
        not audit["problems"]
        and audit["corrupt"] == 0
        and all(f["verified"] == f["records"] for f in audit["forms"].values())
    )
    assert (work / "store" / "index.lmdb").is_dir() and (work / "daemon.log").exists()
    assert not (work / "kvtier.sock").exists()  # the daemon was stopped cleanly at the end


def test_demo_text_report_and_failure_exit(monkeypatch, tmp_path: Path) -> None:
    real = demo_mod.run_demo  # the command imports it when it runs
    reports = []

    def spy(params: DemoParams, progress):
        reports.append(real(params, progress))
        return reports[-1]

    monkeypatch.setattr(demo_mod, "run_demo", spy)
    # the smallest prompt the demo takes: the report's lines and exit are what is checked here, not its figures
    # (the JSON story above runs the long prompt whose restore must beat the recompute)
    result = CliRunner().invoke(cli, ["demo", "--tokens", "1024", "--decode", "2", "--checkpoint-every", "4"])
    assert result.exit_code == (0 if reports[0].restore_faster else exits.PROBLEMS), result.output
    out = result.stdout
    assert (
        "bitwise    yes" in out and "usable hit" in out and "killed (SIGKILL) and restarted" in out and "audit" in out
    )
    # the headline is the cold restore with its load from disk; the prewarmed one is its own line
    assert "restore    cold " in out and "load from disk" in out and "restore after prewarm " in out
    assert "engine B: cold restore" in result.stderr
    for form in ("compressed", "indexer", "swa", "tail"):
        assert f"             {form:<11} " in out

    monkeypatch.setattr(demo_mod, "run_demo", lambda p, progress: dataclasses.replace(reports[0], bitwise_match=False))
    result = CliRunner().invoke(cli, ["demo", "--tokens", "4096"])
    assert result.exit_code == exits.PROBLEMS and "bitwise    NO" in result.stdout and "FAILED" in result.stdout
    monkeypatch.setattr(
        demo_mod, "run_demo", lambda p, progress: dataclasses.replace(reports[0], recompute_s=reports[0].restore_s / 2)
    )
    result = CliRunner().invoke(cli, ["demo", "--tokens", "4096"])
    assert result.exit_code == exits.PROBLEMS and "SLOWER" in result.stdout


def test_demo_refuses_prompts_too_short_to_resume() -> None:
    for args in (["--tokens", "100"], ["--tokens", "1024", "--checkpoint-every", "64"]):
        result = CliRunner().invoke(cli, ["demo", *args])
        assert result.exit_code == 2, result.output


def test_a_daemon_that_cannot_start_is_a_typed_error_naming_its_log(tmp_path: Path) -> None:
    from kvtier.refmodel.demo import DemoError

    (tmp_path / "kvtier.sock").mkdir()  # the socket path is taken by a directory: serve refuses to start
    try:
        run_demo(DemoParams(tokens=2048, checkpoint_every=4, workdir=tmp_path))
    except DemoError as exc:
        assert "daemon.log" in str(exc) and exc.code == "demo_failed"
    else:
        raise AssertionError("the demo ran without its daemon")

"""Operator commands against a real daemon: `kvtier status`, `kvtier prewarm`, and the metrics endpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import Client
from kvtier.core.forms import Route
from kvtier.core.profile import load_profile
from support.daemon import DaemonProc, child_env
from support.promlint import problems, promtool
from support.workload import caches_for, tokens_for

PROFILE = load_profile("ref-tiny")
H = PROFILE.hash_block_tokens


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], env=child_env(), capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def daemon(shared_daemon: DaemonProc) -> DaemonProc:
    """One daemon for the tests that only read it: each writes prompts of its own seed, and checks counters that
    only grow (a daemon start is most of what each would cost alone)."""
    return shared_daemon


def test_status_text_and_json(daemon: DaemonProc) -> None:
    with Client(daemon.socket) as c:
        c.attach("ref-tiny")
        c.offload(tokens_for(1, 2, H), caches_for(PROFILE, 1, 2))
        c.release(c.lookup(tokens_for(1, 2, H)))
    out = _kvtier("status", "--config", str(daemon.config), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["daemon"]["health"] == "ok" and doc["verifier"]["state"] == "not running"
    assert doc["store"]["io_backend"] in ("gds", "odirect", "buffered")
    prof = doc["profiles"][0]
    assert prof["name"] == "ref-tiny" and prof["namespace"] == PROFILE.namespace.hex()
    assert (
        prof["pools"]["compressed"]["used"] > 0
        and prof["pools"]["compressed"]["slots"] >= prof["pools"]["compressed"]["used"]
    )
    assert doc["forms"]["compressed"]["reuse"] > 0
    text = _kvtier("status", "--socket", str(daemon.socket))
    assert (
        text.returncode == 0
        and "health     ok" in text.stdout
        and "pool compressed" in text.stdout
        and "backend" in text.stdout
    )


_NO_TORCH = """
import sys
from click.testing import CliRunner
from kvtier.cli.main import cli
for args in (
    ["--help"],
    ["config", "show", "--json"],
    ["profile", "show", "ref-tiny"],
    ["status", "--socket", sys.argv[1]],
    ["prewarm", sys.argv[2], "--socket", sys.argv[1]],
):
    assert CliRunner().invoke(cli, args).exit_code == 0, args
print(sorted(m for m in ("torch", "lmdb", "kvtier.store", "kvtier.client") if m in sys.modules))
"""


def test_operator_commands_start_without_torch(daemon: DaemonProc, tmp_path: Path) -> None:
    """`--help`, `config show`, `profile show`, `status` and `prewarm` (against a live daemon) import neither torch
    nor the store nor the engine client: a node's CLI answers in a fraction of a second, not after torch's ~2 s."""
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"profile": "ref-tiny", "tokens": list(range(2 * H))}) + "\n")
    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(daemon.socket), str(manifest)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_serve_says_what_it_starts_and_where_it_listens(daemon: DaemonProc) -> None:
    log = daemon.read_log()
    assert "kvtier serve: user mode (the default: no --user/--system, no mode key, no $KVTIER_MODE); " in log
    assert f"; config {daemon.config}; profiles ref-tiny on cpu; store " in log
    line = next(ln for ln in log.splitlines() if "kvtier serve: listening on" in ln)
    assert f"listening on {daemon.socket} (pid {daemon.proc.pid}); metrics http://127.0.0.1:" in line


def test_status_without_daemon_exits_3(tmp_path: Path) -> None:
    out = _kvtier("status", "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 3 and len(out.stderr.strip().splitlines()) == 1 and "kvtier serve" in out.stderr


def test_prewarm_manifest_loads_from_disk_and_pins(tmp_path: Path) -> None:
    d = DaemonProc(tmp_path)
    try:
        with Client(d.socket) as c:
            c.attach("ref-tiny")
            c.offload(tokens_for(11, 4, H), caches_for(PROFILE, 11, 4), durable=True)
        assert d.terminate() == 0
    finally:
        d.close()
    d = DaemonProc(tmp_path)  # empty pools: everything is on disk
    try:
        (tmp_path / "p.txt").write_text(" ".join(map(str, tokens_for(11, 4, H).tolist())))
        manifest = tmp_path / "manifest.jsonl"
        manifest.write_text(
            json.dumps({"name": "file", "profile": "ref-tiny", "token_file": "p.txt", "ttl_s": 60})
            + "\n"
            + json.dumps({"name": "inline-miss", "profile": "ref-tiny", "tokens": list(range(3 * H))})
            + "\n"
        )
        out = _kvtier("prewarm", str(manifest), "--socket", str(d.socket), "--json")
        assert out.returncode == 0, out.stderr
        # a line per prefix as it finished, on stderr (stdout is the JSON)
        lines = out.stderr.splitlines()
        assert lines[0].startswith(f"file: hit {4 * H:,}/{4 * H:,} tokens, loaded ") and "pinned" in lines[0]
        assert lines[1].startswith(f"inline-miss: hit 0/{3 * H:,} tokens")
        rep = {p["name"]: p for p in json.loads(out.stdout)["prefixes"]}
        assert (
            rep["file"]["hit_tokens"] == 4 * H and rep["file"]["loaded_objects"] > 0 and rep["file"]["bytes_loaded"] > 0
        )
        assert rep["file"]["pinned"] > 0 and "REUSE" in rep["file"]["routes"]["compressed"]
        assert rep["inline-miss"]["hit_tokens"] == 0 and rep["inline-miss"]["loaded_objects"] == 0
        with Client(d.socket) as c:  # now resident: REUSE, no load needed
            c.attach("ref-tiny")
            r = c.lookup(tokens_for(11, 4, H))
            assert r.hit_tokens == 4 * H and not r.needs_load
            assert np.all(r.check_vector.routes[:, :4][r.check_vector.routes[:, :4] != Route.RECOMPUTE] == Route.REUSE)
            c.release(r)
            assert c.stats().prewarm_pins == 1
        # status shows the pin and when it expires (ttl_s 60); --json has the figures
        out = _kvtier("status", "--socket", str(d.socket))
        assert out.returncode == 0, out.stderr
        pin_line = next(ln for ln in out.stdout.splitlines() if ln.startswith("pins "))
        assert "1 prewarmed prefixes" in pin_line and "next expiry in 0m" in pin_line, out.stdout
        assert "  pin      ref-tiny: " in out.stdout and " of 256.0 MiB  persist queue" in out.stdout  # one size format
        pins = json.loads(_kvtier("status", "--socket", str(d.socket), "--json").stdout)["pins"]
        assert len(pins) == 1 and pins[0]["profile"] == "ref-tiny" and 0 < pins[0]["expires_in_s"] <= 60
        assert pins[0]["objects"] == rep["file"]["pinned"]
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"profile": "ref-tiny", "tokenz": [1]}\n')
        out = _kvtier("prewarm", str(bad), "--socket", str(d.socket))
        assert out.returncode == 2 and "tokenz" in out.stderr and len(out.stderr.strip().splitlines()) == 1
        # a profile the daemon does not serve: the manifest line is named
        unknown = tmp_path / "unknown.jsonl"
        unknown.write_text('# comment\n{"profile": "ref-tiny", "tokens": [1, 2]}\n{"profile": "nope", "tokens": [1]}\n')
        out = _kvtier("prewarm", str(unknown), "--socket", str(d.socket))
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert f"{unknown}:3: key 'profile': " in out.stderr and "'nope'" in out.stderr
        assert out.stdout.startswith("line 2: hit 0/2 tokens")  # the prefix before it was done and reported
    finally:
        assert d.terminate() == 0


def test_metrics_endpoint(daemon: DaemonProc) -> None:
    with Client(daemon.socket) as c:
        c.attach("ref-tiny")
        c.offload(tokens_for(2, 2, H), caches_for(PROFILE, 2, 2))
        c.release(c.lookup(tokens_for(2, 2, H)))
        c.release(c.lookup(tokens_for(99, 2, H)))
        address = c.stats().daemon.metrics
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    for name in (
        'kvtier_lookup_objects_total{form="compressed",route="reuse"}',
        'kvtier_recoveries_total{form="compressed",outcome="ok"}',
        "kvtier_recovery_latency_seconds_bucket",
        'kvtier_recomputes_total{form="compressed",reason="missing"}',
        "kvtier_admission_rejections_total",
        'kvtier_evictions_total{form="compressed"}',
        'kvtier_pool_slots{form="compressed",profile="ref-tiny"}',
        'kvtier_pool_used_slots{form="compressed",profile="ref-tiny"}',
        'kvtier_pool_bytes{form="compressed",profile="ref-tiny"}',
        'kvtier_store_bytes{state="live"}',
        "kvtier_store_budget_bytes 2.68435456e+08",  # 256MiB
        "kvtier_persist_queue_objects",
        "kvtier_prewarm_pins 0.0",
        "kvtier_healthy 1.0",
        'kvtier_build_info{version="',
        "kvtier_verifier_actions",
        'kvtier_requests_total{code="ok",op="lookup"}',
    ):
        assert name in body, name
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line[:1] != "#"}
    reuse = samples['kvtier_lookup_objects_total{form="compressed",route="reuse"}']
    recompute = samples['kvtier_lookup_objects_total{form="compressed",route="recompute"}']
    assert reuse > 0 and recompute > 0  # one hit, one miss: the ratio is PromQL's to take
    # the exposition follows the conventions; promtool agrees where it is installed
    assert problems(body) == [], problems(body)
    assert promtool(body) in (None, []), promtool(body)

"""Daemon config: defaults by situation, the file laid over them, and one-line errors naming the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.core.config import load_config, parse_size
from kvtier.core.errors import ConfigError


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


def test_embedded_default_when_not_root(tmp_path: Path) -> None:
    cfg = load_config(None, env={}, uid=1000, cwd=tmp_path)
    assert cfg.source == "embedded default" and cfg.device == "cpu" and cfg.profiles == ("ref-tiny",)
    assert cfg.server.socket == tmp_path / ".kvtier" / "kvtier.sock"
    assert cfg.store.root == tmp_path / ".kvtier" / "store"
    assert max(cfg.pool.budget_bytes.values()) <= 64 * 2**20


def test_systemd_defaults_in_system_mode_and_from_systemd_directories(tmp_path: Path) -> None:
    system = load_config(None, mode="system", env={})
    assert system.server.socket == Path("/run/kvtier/kvtier.sock")
    assert system.store.root == Path("/var/lib/kvtier/store")
    # never by uid alone: root with nothing else said gets the user mode (issue 41)
    assert load_config(None, env={}, uid=0, cwd=tmp_path).store.root == tmp_path / ".kvtier" / "store"
    unit = load_config(None, env={"RUNTIME_DIRECTORY": "/run/x", "STATE_DIRECTORY": "/srv/y"}, uid=999)
    assert unit.server.socket == Path("/run/x/kvtier.sock") and unit.store.root == Path("/srv/y/store")
    assert unit.source == "systemd default" and unit.verifier.mode == "external"


def test_file_overrides_defaults(tmp_path: Path) -> None:
    f = tmp_path / "kvtier.toml"
    f.write_text(
        'device = "cuda:1"\nprofiles = ["ref-tiny", "deepseek-v4-flash"]\nlease_ttl_s = 5\n'
        '[server]\nsocket = "/tmp/k.sock"\nsocket_mode = "0600"\nallowed_gids = [44]\n'
        '[pool.budget_bytes]\nswa = "2MiB"\n[store]\nbudget_bytes = "1.5 GiB"\n[store.quota_bytes]\ntail = 1000\n'
        '[verifier]\nmode = "supervise"\nrate_bytes_per_s = "10MB"\n[metrics]\naddress = "127.0.0.1:0"\n'
    )
    cfg = load_config(f, env={}, uid=1000, cwd=tmp_path)
    assert cfg.device == "cuda:1" and cfg.profiles == ("ref-tiny", "deepseek-v4-flash") and cfg.lease_ttl_s == 5.0
    assert (
        cfg.server.socket == Path("/tmp/k.sock")
        and cfg.server.socket_mode == 0o600
        and cfg.server.allowed_gids == (44,)
    )
    assert cfg.pool.budget_bytes["swa"] == 2 * 2**20 and cfg.pool.budget_bytes["compressed"] == 8 * 2**20
    assert cfg.store.budget_bytes == int(1.5 * 2**30) and cfg.store.quota_bytes == {"tail": 1000}
    assert cfg.verifier.mode == "supervise" and cfg.verifier.rate_bytes_per_s == 10**7
    assert cfg.source == str(f)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[server]\nsockt = "/x"\n', "server.sockt"),
        ("colour = 3\n", "colour"),
        ('[pool.budget_bytes]\nswa = "12XB"\n', "pool.budget_bytes.swa"),
        ("[pool.budget_bytes]\non_disk = 5\n", "pool.budget_bytes.on_disk"),
        ('[server]\nsocket_mode = "999"\n', "server.socket_mode"),
        ('[server]\nallowed_uids = ["bob"]\n', "server.allowed_uids"),
        ('device = "tpu"\n', "device"),
        ('profiles = [""]\n', "profiles"),
        ("lease_ttl_s = -1\n", "lease_ttl_s"),
        ("recovering_cap = 1.5\n", "recovering_cap"),
        ('[verifier]\nmode = "sometimes"\n', "verifier.mode"),
        ('[metrics]\naddress = "nowhere"\n', "metrics.address"),
        ("server = 3\n", "server"),
        ('[store]\ncodec = "lz4"\n', "store.codec"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(f, env={}, uid=1000, cwd=tmp_path)
    assert info.value.key == key
    msg = str(info.value)
    assert "\n" not in msg and f"'{key}'" in msg and str(f) in msg


def test_cli_bad_config_one_line_exit_2(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[server]\nsocket_mode = 660\n")
    proc = _cli("config", "show", "--config", str(f))
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "server.socket_mode" in lines[0], proc.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\n")
    proc = _cli("config", "show", "--config", str(broken))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "not valid TOML" in proc.stderr
    proc = _cli("config", "show", "--config", str(tmp_path / "missing.toml"))
    assert proc.returncode == 2 and "no such config file" in proc.stderr


def test_config_show_round_trips(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text('[store]\nroot = "/data/kv"\n')
    shown = _cli("config", "show", "--config", str(f))
    assert shown.returncode == 0, shown.stderr
    again = tmp_path / "again.toml"
    again.write_text(shown.stdout)
    as_json = json.loads(_cli("config", "show", "--config", str(again), "--json").stdout)
    assert as_json["store"]["root"] == "/data/kv"
    original = json.loads(_cli("config", "show", "--config", str(f), "--json").stdout)
    for doc in (original, as_json):
        doc.pop("source"), doc.pop("mode_why")  # the file read back names its mode itself
    assert as_json == original


def test_sizes() -> None:
    assert parse_size("64MiB", "k") == 64 * 2**20 and parse_size("1 GB", "k") == 10**9 and parse_size(4096, "k") == 4096
    with pytest.raises(ConfigError):
        parse_size(-1, "k")
    with pytest.raises(ConfigError):
        parse_size(True, "k")

"""Explicit modes (issue 41): user or system, chosen by --user/--system, the file's `mode` key, $KVTIER_MODE or
systemd's directories, never by the uid; a partial file fills from the chosen mode; `config show` names the mode
and the file; `config init` writes a commented file that reads back to the mode's defaults."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli.main import cli
from kvtier.core.config import load_config, mode_defaults
from kvtier.core.errors import ConfigError


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.chdir(tmp_path)
    for var in ("RUNTIME_DIRECTORY", "STATE_DIRECTORY", "KVTIER_CONFIG", "KVTIER_MODE", "KVTIER_SOCKET"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_uid_alone_never_chooses(tmp_path: Path) -> None:
    for uid in (0, 1000):
        cfg = load_config(None, env={}, uid=uid, cwd=tmp_path)
        assert cfg.mode == "user" and cfg.server.socket == tmp_path / ".kvtier" / "kvtier.sock", uid
        assert cfg.profiles == ("ref-tiny",) and "the default" in cfg.mode_why


@pytest.mark.parametrize(
    ("flag", "file_mode", "env", "want", "why"),
    [
        ("system", None, {}, "system", "--system"),
        ("user", None, {"RUNTIME_DIRECTORY": "/run/x"}, "user", "--user"),
        (None, "system", {}, "system", "mode key"),
        (None, "user", {"KVTIER_MODE": "system"}, "user", "mode key"),
        (None, None, {"KVTIER_MODE": "system"}, "system", "$KVTIER_MODE"),
        (None, None, {"STATE_DIRECTORY": "/srv/y"}, "system", "$STATE_DIRECTORY"),
    ],
)
def test_what_chooses_the_mode(tmp_path: Path, flag, file_mode, env, want, why) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "k.toml"
    f.write_text((f'mode = "{file_mode}"\n' if file_mode else "") + "lease_ttl_s = 7\n")
    cfg = load_config(f, mode=flag, env=env, cwd=tmp_path)
    assert cfg.mode == want and why in cfg.mode_why and cfg.lease_ttl_s == 7.0


def test_a_flag_against_the_file_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "k.toml"
    f.write_text('mode = "system"\n')
    with pytest.raises(ConfigError, match=r"key 'mode': says 'system' but --user was given"):
        load_config(f, mode="user", env={}, cwd=tmp_path)
    f.write_text('mode = "root"\n')
    with pytest.raises(ConfigError, match=r"key 'mode': must be one of user, system"):
        load_config(f, env={}, cwd=tmp_path)


def test_a_partial_file_fills_from_its_mode(tmp_path: Path) -> None:
    """The issue's case: a partial file as root took the system defaults' verifier (external) and metrics."""
    f = tmp_path / "k.toml"
    f.write_text('[store]\nbudget_bytes = "2GiB"\n')
    user = load_config(f, env={}, uid=0, cwd=tmp_path)
    assert user.verifier.mode == "supervise" and user.metrics.address == "" and user.store.budget_bytes == 2 * 2**30
    assert user.store.root == tmp_path / ".kvtier" / "store"
    system = load_config(f, mode="system", env={}, cwd=tmp_path)
    assert system.verifier.mode == "external" and system.metrics.address == "127.0.0.1:9641"
    assert system.store.root == Path("/var/lib/kvtier/store") and system.store.budget_bytes == 2 * 2**30


def test_config_show_names_mode_and_file(clean_env: Path) -> None:
    f = clean_env / "k.toml"
    f.write_text('mode = "system"\n[metrics]\naddress = ""\n')
    text = CliRunner().invoke(cli, ["config", "show", "--config", str(f)]).stdout
    assert text.splitlines()[0] == f"# effective kvtier config: system mode (the mode key of {f}); file: {f}"
    doc = json.loads(CliRunner().invoke(cli, ["config", "show", "--json"], env={"KVTIER_MODE": "system"}).stdout)
    assert doc["mode"] == "system" and doc["mode_why"] == "$KVTIER_MODE=system" and doc["metrics"]["address"]


@pytest.mark.parametrize("mode", ["user", "system"])
def test_config_init_reads_back_to_the_modes_defaults(clean_env: Path, mode: str) -> None:
    out = clean_env / f"{mode}.toml"
    res = CliRunner().invoke(cli, ["config", "init", f"--{mode}", "-o", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert f'mode = "{mode}"' in text and text.count("\n# ") >= 8  # commented, section by section
    # read back in any situation (even with the other mode in the environment), the file keeps its own mode
    other = "user" if mode == "system" else "system"
    back = load_config(out, env={"KVTIER_MODE": other}, cwd=clean_env)
    want = mode_defaults(mode, env={}, cwd=clean_env).to_dict()
    got = back.to_dict()
    assert got.pop("source") == str(out) and want.pop("source")
    assert got == want
    again = CliRunner().invoke(cli, ["config", "init", f"--{mode}", "-o", str(out)])
    assert isinstance(again.exception, ConfigError) and "exists already; pass --force" in str(again.exception)
    assert CliRunner().invoke(cli, ["config", "init", f"--{mode}", "-o", str(out), "--force"]).exit_code == 0


def test_config_init_user_default_path(clean_env: Path) -> None:
    res = CliRunner().invoke(cli, ["config", "init"])
    assert res.exit_code == 0 and (clean_env / "kvtier.toml").exists(), res.output
    assert "--config kvtier.toml" in res.output
    assert load_config(clean_env / "kvtier.toml", env=dict(os.environ), cwd=clean_env).mode == "user"

"""`kvtier store stats` and `kvtier audit` agree on the store's budget (issue 41: stats said "none" while audit
said the daemon's budget): both report what the store's writer published and enforces."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kvtier.cli.main import cli
from kvtier.core.forms import CacheForm
from kvtier.store import DiskStore


def test_stats_and_audit_report_the_published_budget(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with DiskStore(str(root), writer=True) as store:
        store.set_limits(3 * 2**30, {CacheForm.SWA: 2**28})
    stats = CliRunner().invoke(cli, ["store", "stats", "--store", str(root), "--json"])
    audit = CliRunner().invoke(cli, ["audit", "--store", str(root), "--json"])
    assert stats.exit_code == 0 and audit.exit_code == 0, stats.output + audit.output
    s, a = json.loads(stats.stdout), json.loads(audit.stdout)
    assert s["budget_bytes"] == a["budget_bytes"] == 3 * 2**30
    assert s["forms"]["swa"]["quota_bytes"] == 2**28
    text = CliRunner().invoke(cli, ["store", "stats", "--store", str(root)]).stdout
    assert "budget 3.0 GiB" in text


def test_store_defaults_to_the_configs(tmp_path: Path) -> None:
    """`--store` may be left out where the config names the store (issue 41)."""
    root = tmp_path / "somewhere" / "store"
    with DiskStore(str(root), writer=True) as store:
        store.set_limits(2**30, {})
    config = tmp_path / "k.toml"
    config.write_text(f'[store]\nroot = "{root}"\n')
    stats = CliRunner().invoke(cli, ["store", "stats", "--config", str(config), "--json"])
    audit = CliRunner().invoke(cli, ["audit", "--config", str(config), "--json"])
    assert stats.exit_code == 0 and audit.exit_code == 0, stats.output + audit.output
    assert json.loads(stats.stdout)["root"] == str(root) and json.loads(audit.stdout)["store"] == str(root)

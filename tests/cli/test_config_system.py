"""`kvtier config show --system`: what the systemd units run with, whoever asks (the recipe writes it to /etc)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvtier.cli.main import cli


def test_system_defaults_whoever_asks(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("RUNTIME_DIRECTORY", "STATE_DIRECTORY", "KVTIER_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    doc = json.loads(CliRunner().invoke(cli, ["config", "show", "--system", "--json"]).stdout)
    assert doc["server"]["socket"] == "/run/kvtier/kvtier.sock" and doc["server"]["socket_mode"] == "0666"
    assert doc["store"]["root"] == "/var/lib/kvtier/store" and doc["metrics"]["address"] == "127.0.0.1:9641"
    assert doc["verifier"]["mode"] == "external" and str(tmp_path) not in json.dumps(doc)
    text = CliRunner().invoke(cli, ["config", "show", "--system"]).stdout
    assert text.startswith("# effective kvtier config: system mode (--system); file: none") and ".kvtier" not in text
    assert 'mode = "system"' in text  # read back from /etc, the file keeps the system defaults for unset keys

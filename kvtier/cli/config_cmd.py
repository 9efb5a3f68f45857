"""`kvtier config show` and `kvtier config init`: the effective config, and a commented file to start from."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
import tomli_w

from kvtier.cli.cluster_status import unit_warnings
from kvtier.cli.daemon_cmds import _check_profiles, config_option, mode_option
from kvtier.core.config import SYSTEM_CONFIG, DaemonConfig, choose_mode, load_config, mode_defaults
from kvtier.core.errors import ConfigError
from kvtier.core.units import size_setting

# What each part of the file is for, written above it by `config init` (the keys themselves: docs/cli.md).
_COMMENTS = {
    "mode": "user: a daemon of the folder it starts in (cpu, ref-tiny, its state in that folder); system: the\n"
    "systemd unit's /run/kvtier and /var/lib/kvtier. Unset keys below take this mode's defaults.",
    "device": "cpu, cuda, cuda:N, or auto (cuda when this host has it, else cpu).",
    "profiles": "the model profiles served: bundled names (`kvtier profile list`) or TOML files.",
    "[server]": "the unix socket engines connect to, and who may (root and the daemon's own uid always may).",
    "[pool.budget_bytes]": "pool memory per cache form and profile, allocated once at start; their sum must fit\n"
    "the memory this daemon may use (MemAvailable, the cgroup's memory.max).",
    "[store]": "the disk store. Its root's parent folder must exist unless create = true.",
    "[verifier]": "supervise: the daemon runs the verifier; external: kvtier-verifier.service does; off: none.",
    "[metrics]": "the Prometheus endpoint, HOST:PORT; empty turns it off.",
    "[admission]": "the pools' admission caps (0 entries: the pools' capacity).",
    "[cluster]": "the cluster tier below the disk store (Mooncake Store); off unless enabled.",
    "[events]": "KV events for routers (vLLM's ZMQ wire format, docs/events.md); empty endpoint: off.",
}


def _sizes_readable(value: Any, key: str = "") -> Any:
    """Byte counts (keys naming bytes, and the per-form tables under them) as `512MiB`; JSON keeps bytes."""
    if isinstance(value, dict):
        return {k: _sizes_readable(v, k if "bytes" in k else key) for k, v in value.items()}
    if "bytes" in key and isinstance(value, int) and not isinstance(value, bool):
        return size_setting(value)
    return value


def _toml(cfg: DaemonConfig) -> str:
    doc = cfg.to_dict()
    doc.pop("source")
    mode = doc.pop("mode")
    return tomli_w.dumps({"mode": mode, **_sizes_readable(doc)})


@click.group()
def config() -> None:
    """The daemon's configuration: its mode (--user / --system), defaults and file."""


@config.command("show")
@config_option
@mode_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def config_show(config_path: str | None, mode: str | None, as_json: bool) -> None:
    """Print the effective config (the mode's defaults with the file laid over them), its mode and file.

    Every check `kvtier serve` makes of the values is made here too (profiles, ranges)."""
    cfg = load_config(config_path, mode=mode)
    _check_profiles(cfg)
    for line in unit_warnings(cfg.cluster):  # on stderr: stdout stays the config, parseable
        click.echo(line, err=True)
    if as_json:
        click.echo(json.dumps({**cfg.to_dict(), "mode_why": cfg.mode_why}, indent=2))
        return
    click.echo(f"# effective kvtier config: {cfg.mode} mode ({cfg.mode_why}); file: {cfg.file}")
    click.echo(_toml(cfg), nl=False)


@config.command("init")
@mode_option
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    help=f"Where to write ('-': stdout). Default: {SYSTEM_CONFIG} in system mode, ./kvtier.toml in user mode.",
)
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def config_init(mode: str | None, output: str | None, force: bool) -> None:
    """Write a commented config of the chosen mode's defaults (every key, with its default value).

    The file names its mode (`mode = ...`), so whoever reads it later gets the same defaults for the keys
    removed from it. Exit 2 when the file exists (without --force) or cannot be written."""
    chosen, why = choose_mode(mode, None, os.environ)
    cfg = mode_defaults(chosen)  # the mode's own defaults, never the file this may be about to replace
    text = _commented(_toml(cfg), chosen, why)
    if output == "-":
        click.echo(text, nl=False)
        return
    path = Path(output) if output else (SYSTEM_CONFIG if chosen == "system" else Path("kvtier.toml"))
    if path.exists() and not force:
        raise ConfigError("exists already; pass --force to overwrite it, or -o another path", source=str(path))
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write: folder {path.parent} does not exist; create it first", source=str(path))
    path.write_text(text)
    use = "" if path == SYSTEM_CONFIG else f"; use it with --config {path} (or KVTIER_CONFIG={path})"
    click.echo(f"kvtier config init: wrote {path} ({chosen} mode){use}", err=True)


def _commented(text: str, mode: str, why: str) -> str:
    out = [f"# kvtier daemon config, {mode} mode (written by `kvtier config init`; chosen by {why}).", ""]
    top = True  # key comments are for the top-level keys only (a table's `mode` is another key)
    for line in text.splitlines():
        top = top and not line.startswith("[")
        key = line if line.startswith("[") else line.split(" =", 1)[0] if top else None
        if key and (comment := _COMMENTS.get(key)):
            if out and out[-1] != "":
                out.append("")
            out.extend(f"# {c}" for c in comment.splitlines())
        out.append(line)
    return "\n".join(out) + "\n"

"""`kvtier config show` and `kvtier config init`: the effective config, and a commented file to start from."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

import click
import tomli_w

from kvtier.cli.cluster_status import unit_warnings
from kvtier.cli.daemon_cmds import _check_profiles, config_option, mode_option
from kvtier.core.config import SYSTEM_CONFIG, DaemonConfig, choose_mode, load_config, mode_defaults, plain
from kvtier.core.config_schema import BY_NAME, KEYS, SECTIONS, Key, Kind
from kvtier.core.errors import ConfigError
from kvtier.core.units import size_setting


def _readable(key: Key, value: Any) -> Any:
    """Byte sizes as `512MiB` (the parser reads them back); JSON keeps bytes."""
    if key.kind is Kind.SIZE:
        return size_setting(value)
    if key.kind is Kind.FORM_SIZES:
        return {f: size_setting(n) for f, n in value.items()}
    return value


def _toml(cfg: DaemonConfig) -> str:
    """The config as TOML, one entry per schema key (the `mode` key first), sizes readable."""
    doc: dict[str, Any] = {}
    for key in KEYS:
        table = doc.setdefault(key.section, {}) if key.section else doc
        table[key.name.rpartition(".")[2]] = _readable(key, plain(key, cfg.value(key)))
    return tomli_w.dumps(doc)


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
        click.echo(json.dumps({**cfg.to_dict(), "mode_why": cfg.mode_why, "engine_only": not cfg.profiles}, indent=2))
        return
    click.echo(f"# effective kvtier config: {cfg.mode} mode ({cfg.mode_why}); file: {cfg.file}")
    if not cfg.profiles:
        click.echo("# engine-only node: profiles = [], no pools are allocated ([pool.budget_bytes] is unused)")
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
    """`text` (a config as `_toml` writes it) with each table's purpose and each key's doc above it, from the
    schema: what `config init` writes."""
    out = [f"# kvtier daemon config, {mode} mode (written by `kvtier config init`; chosen by {why}).", ""]
    table = ""
    for line in text.splitlines():
        if line.startswith("["):
            table = line.strip("[]")
            about = SECTIONS.get(table) or (BY_NAME[table].doc if table in BY_NAME else "")
        else:
            name = f"{table}.{line.split(' =', 1)[0]}" if table else line.split(" =", 1)[0]
            about = _about(BY_NAME[name]) if " = " in line and name in BY_NAME else ""
        if about:
            if out and out[-1] != "":
                out.append("")
            out.extend(f"# {c}" for c in textwrap.wrap(about, 110))
        out.append(line)
    return "\n".join(out) + "\n"


def _about(key: Key) -> str:
    unit = f" ({key.unit})" if key.unit else ""
    return f"{key.doc}{unit}{' Reloaded by SIGHUP.' if key.reloadable else ''}"

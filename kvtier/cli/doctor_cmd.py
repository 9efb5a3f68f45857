"""`kvtier doctor`: the host and config checked for a daemon (kvtier.cli.doctor), as lines or --json."""

from __future__ import annotations

import json
import sys

import click

from kvtier.cli import exits
from kvtier.cli.daemon_cmds import config_option, mode_option


@click.command()
@config_option
@mode_option
@click.option(
    "--engine-python",
    "engine_pythons",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="An engine venv's python to check vLLM / SGLang in (repeatable; default: this Python).",
)
@click.option("--json", "as_json", is_flag=True, help="The same checks as a JSON list.")
def doctor(config_path: str | None, mode: str | None, engine_pythons: tuple[str, ...], as_json: bool) -> None:
    """Check the config, memory, kernel knobs, the store's disk, the socket, the cluster, engines and GPU.

    One line per check: ok, warn or fail, and under a warn or fail the fix. Exit 1 when any check fails."""
    from kvtier.cli.doctor import FAIL, run_checks

    checks = run_checks(config_path, mode, engine_pythons)
    if as_json:
        click.echo(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        for c in checks:
            click.echo(f"{c.status:<5} {c.name:<13} {c.detail}")
            if c.fix:
                click.echo(f"{'':<5} {'':<13} fix: {c.fix}")
    sys.exit(exits.PROBLEMS if any(c.status == FAIL for c in checks) else exits.OK)

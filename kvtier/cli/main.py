"""`kvtier` entry point: groups the subcommands and maps typed errors to one-line messages and exit codes."""

from __future__ import annotations

import logging
import sys

import click

from kvtier import __version__
from kvtier.cli.audit_cmd import audit
from kvtier.cli.daemon_cmds import config, prewarm, serve, status
from kvtier.cli.demo_cmd import demo
from kvtier.cli.namespace_cmd import namespace
from kvtier.cli.profile_cmd import profile
from kvtier.cli.store_cmd import store
from kvtier.cli.verifier_cmd import verifier
from kvtier.core.errors import KvtierError

USAGE_EXIT = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvtier")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """kvtier: KV-cache tiering for hybrid-attention inference."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


cli.add_command(profile)
cli.add_command(store)
cli.add_command(demo)
cli.add_command(serve)
cli.add_command(status)
cli.add_command(config)
cli.add_command(prewarm)
cli.add_command(verifier)
cli.add_command(audit)
cli.add_command(namespace)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KvtierError as exc:
        click.echo(f"kvtier: {exc}", err=True)
        sys.exit(USAGE_EXIT)

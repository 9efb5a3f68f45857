"""`kvtier` entry point: groups the subcommands and maps every error to one line on stderr and an exit code.

The exit codes are kvtier.cli.exits' table (docs/cli.md shows it); `-v` adds the traceback to any of them.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import NoReturn

import click

from kvtier import __version__
from kvtier.cli import exits
from kvtier.cli.audit_cmd import audit
from kvtier.cli.config_cmd import config
from kvtier.cli.daemon_cmds import prewarm, serve, status
from kvtier.cli.demo_cmd import demo
from kvtier.cli.doctor_cmd import doctor
from kvtier.cli.explain_cmd import explain
from kvtier.cli.namespace_cmd import namespace
from kvtier.cli.profile_cmd import profile
from kvtier.cli.store_cmd import store
from kvtier.cli.verifier_cmd import verifier
from kvtier.core.errors import KvtierError


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
cli.add_command(explain)
cli.add_command(doctor)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted", exits.INTERRUPTED)
    except KeyboardInterrupt:
        _fail("interrupted", exits.INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KvtierError as exc:
        # a typed error says what is wrong and what to do; its code picks the exit (exits.WIRE_EXITS)
        _fail(str(exc), exits.for_error(exc))
    except OSError as exc:
        # a path the user gave (or a default one) that cannot be used: name it and the usual fix
        where = f": {exc.filename}" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where} (check the path and its permissions, or pick another one)", exits.USAGE)
    except Exception as exc:
        _fail(
            f"internal error: {type(exc).__name__}: {exc} (rerun with -v for the traceback, and report it)",
            exits.INTERNAL,
        )


def _fail(message: str, code: int) -> NoReturn:
    """One line on stderr; with -v the traceback of the exception being handled comes first."""
    if logging.getLogger().isEnabledFor(logging.INFO):
        traceback.print_exc()
    click.echo(f"kvtier: {message}", err=True)
    sys.exit(code)

"""Exit codes for a command that must reach the daemon: 3 when no daemon is there, 4 when one did not answer us."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import click

from kvtier.cli import exits
from kvtier.wire.errors import DaemonBusy, DaemonTimeout, DaemonUnavailable, PermissionDenied


@contextlib.contextmanager
def daemon_exits() -> Iterator[None]:
    """Turn a failure to reach the daemon into its one-line message and exit code."""
    try:
        yield
    except (PermissionDenied, DaemonBusy, DaemonTimeout) as exc:
        click.echo(f"kvtier: {exc}", err=True)
        sys.exit(exits.NOT_ANSWERING)
    except DaemonUnavailable as exc:
        click.echo(f"kvtier: {exc}", err=True)
        sys.exit(exits.NO_DAEMON)

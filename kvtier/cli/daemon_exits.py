"""`daemon_exits()`: a command that must reach the daemon exits as exits.WIRE_EXITS says when it cannot."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import click

from kvtier.cli import exits
from kvtier.wire.errors import DaemonBusy, DaemonUnavailable, PermissionDenied


@contextlib.contextmanager
def daemon_exits() -> Iterator[None]:
    """Turn a failure to reach the daemon (none there, refused, busy, timed out) into one line and its exit."""
    try:
        yield
    except (PermissionDenied, DaemonBusy, DaemonUnavailable) as exc:  # DaemonTimeout is a DaemonUnavailable
        click.echo(f"kvtier: {exc}", err=True)
        sys.exit(exits.for_error(exc))

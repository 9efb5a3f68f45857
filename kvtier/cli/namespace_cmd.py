"""`kvtier namespace list | retire | promote`: the daemon's namespaces (live / canary / retired / store) and bytes.

Exit codes as `kvtier status`: 3 when no daemon is there, 4 when one is there but refused us or did not
answer; a refused operation (retiring a live version, an unknown namespace) is a one-line message and exit 2.
"""

from __future__ import annotations

import json

import click
import msgspec

from kvtier.cli.daemon_cmds import config_option, socket_option, socket_path_of
from kvtier.cli.daemon_exits import daemon_exits
from kvtier.cli.namespace_table import namespace_lines
from kvtier.wire import messages as P

_json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _ask(
    config_path: str | None,
    socket_path: str | None,
    req: P.Namespaces | P.NamespaceRetire | P.NamespacePromote,
    as_json: bool,
) -> None:
    from kvtier.wire import Connection  # not kvtier.client: no torch needed

    path = socket_path_of(config_path, socket_path)
    with daemon_exits(), Connection(path, timeout_s=30.0, name="kvtier namespace") as conn:
        reply = conn.namespaces(req)
    if as_json:
        click.echo(json.dumps({"done": reply.done, "namespaces": msgspec.to_builtins(reply.namespaces)}))
        return
    if reply.done:
        click.echo(reply.done)
    for line in namespace_lines(reply.namespaces):
        click.echo(line)


@click.group()
def namespace() -> None:
    """The daemon's namespaces (one per served model version): list them, retire one, promote a canary."""


@namespace.command("list")
@config_option
@socket_option
@_json_option
def list_(config_path: str | None, socket_path: str | None, as_json: bool) -> None:
    """Every namespace of the store: live / canary (served) / retired / store (no profile's), records, bytes."""
    _ask(config_path, socket_path, P.Namespaces(), as_json)


@namespace.command()
@click.argument("namespace_hex")
@config_option
@socket_option
@_json_option
def retire(namespace_hex: str, config_path: str | None, socket_path: str | None, as_json: bool) -> None:
    """Retire NAMESPACE_HEX (or a unique prefix): a canary, or one no profile serves; the verifier reclaims it."""
    _ask(config_path, socket_path, P.NamespaceRetire(namespace_hex), as_json)


@namespace.command()
@click.argument("profile")
@config_option
@socket_option
@_json_option
def promote(profile: str, config_path: str | None, socket_path: str | None, as_json: bool) -> None:
    """Make PROFILE's canary its live version; the live namespace is retired."""
    _ask(config_path, socket_path, P.NamespacePromote(profile), as_json)

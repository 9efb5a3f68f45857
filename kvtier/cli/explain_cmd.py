"""`kvtier explain`: for one prompt, per cache group what the pool and the disk hold, the usable hit, why it stops."""

from __future__ import annotations

import json
from pathlib import Path

import click
import msgspec

from kvtier.cli.daemon_cmds import config_option, socket_option, socket_path_of
from kvtier.cli.engine_hit import render as render_engine
from kvtier.cli.engine_keys import UNIT, ask, engine_hit, group_keys, pick_namespace
from kvtier.cli.explain import explain as analyse
from kvtier.cli.explain import render
from kvtier.cli.manifest import Prompt, read_manifest, read_token_file
from kvtier.core.checkvector import CheckVector
from kvtier.core.errors import ConfigError, KvtierError
from kvtier.core.hashing import block_hashes
from kvtier.wire import OperatorConnection
from kvtier.wire.errors import DaemonBusy, DaemonUnavailable, PermissionDenied


@click.command()
@click.option(
    "--tokens", "token_file", type=click.Path(dir_okay=False, path_type=Path), help="The prompt: .npy or integers."
)
@click.option(
    "--manifest-line",
    nargs=2,
    type=(click.IntRange(min=1), click.Path(dir_okay=False, path_type=Path)),
    metavar="N MANIFEST",
    help="The prompt on line N of a prewarm manifest (its profile, or its engine namespace, too).",
)
@click.option("--profile", help="Profile of --tokens (default: the one profile the daemon serves).")
@config_option
@socket_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def explain(
    token_file: Path | None,
    manifest_line: tuple[int, Path] | None,
    profile: str | None,
    config_path: str | None,
    socket_path: str | None,
    as_json: bool,
) -> None:
    """Why did this miss? Per cache group: blocks in the pool, on disk, and the usable hit; the block that stops
    it, the reason (missing, evicted, corrupt, stale_version, ...) and what would fix it. Takes no leases.
    A manifest line naming an engine namespace (vLLM, SGLang) is answered per engine group: the chunk or
    page where the hit stops, and why.

    Exit 2 for a bad prompt file or profile, 3 with no daemon.
    """
    if (token_file is None) == (manifest_line is None):
        raise click.UsageError("give the prompt as --tokens FILE or as --manifest-line N MANIFEST (one of them)")
    if manifest_line is not None:
        prompt = read_manifest(manifest_line[1], only_line=manifest_line[0])[0]
        if prompt.engine is not None:
            _explain_engine(prompt, socket_path_of(config_path, socket_path), as_json)
            return
        tokens, profile, where = prompt.tokens, profile or prompt.profile, prompt.where
    else:
        assert token_file is not None
        tokens, where = read_token_file(token_file), str(token_file)
    with OperatorConnection(socket_path_of(config_path, socket_path), name="kvtier explain") as conn:
        if profile is None:
            served = [p.name for p in conn.stats().profiles]
            if len(served) != 1:
                raise click.UsageError(f"the daemon serves {', '.join(served)}: say which with --profile")
            profile = served[0]
        try:
            att = conn.attach_unmapped(profile)
        except (DaemonUnavailable, DaemonBusy, PermissionDenied):
            raise
        except KvtierError as exc:
            raise ConfigError(str(exc), key="profile", source=where) from None
        rep = conn.explain_hashes(b"".join(block_hashes(att.namespace, tokens, att.hash_block_tokens)))
    raw = CheckVector.from_wire(msgspec.structs.asdict(rep.raw))
    final = CheckVector.from_wire(msgspec.structs.asdict(rep.final))
    report = analyse(int(tokens.size), raw, final, rep.windows)
    if as_json:
        click.echo(json.dumps({"profile": att.profile, **report.to_json()}, indent=2))
        return
    click.echo(f"profile     {att.profile}")
    for line in render(report):
        click.echo(line)


def _explain_engine(prompt: Prompt, path: Path, as_json: bool) -> None:
    """Explain for an engine namespace's line: per group where the engine's hit stops and why (nothing pinned)."""
    assert prompt.engine is not None
    with OperatorConnection(path, name="kvtier explain") as conn:
        ns = pick_namespace(conn, prompt.engine, prompt.where)
        groups = group_keys(ns, prompt)
        reasons, _ = ask(conn, ns, groups, prewarm=False, ttl_s=1.0)
    report = engine_hit(prompt, groups, reasons)
    if as_json:
        doc = {"engine": prompt.engine.kind, "namespace": ns.namespace.hex(), **report.to_json()}
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(f"namespace   {ns.namespace.hex()} ({prompt.engine.kind}, {ns.version_key['model_id']})")
    for line in render_engine(report, UNIT[prompt.engine.kind]):
        click.echo(line)

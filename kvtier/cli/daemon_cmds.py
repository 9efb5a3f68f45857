"""`kvtier serve`, `kvtier status`, `kvtier prewarm`: the daemon and its operators' commands (and their shared
options: --config, --socket, --user/--system)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click
import msgspec

from kvtier.cli import exits
from kvtier.cli.cluster_status import cluster_lines
from kvtier.cli.daemon_exits import daemon_exits
from kvtier.cli.engine_keys import prewarm_report
from kvtier.cli.guards import check_device, check_pool_budget, check_pool_slots, check_store_parent
from kvtier.cli.manifest import read_manifest
from kvtier.cli.namespace_table import engine_lines, events_line, namespace_lines
from kvtier.cli.starting import clear_marker, starting, write_marker
from kvtier.core.checkvector import CheckVector
from kvtier.core.config import MODE_ENV, DaemonConfig, load_config
from kvtier.core.errors import ConfigError, KvtierError, ProfileError
from kvtier.core.hashing import block_hashes
from kvtier.core.profile import load_profile
from kvtier.core.units import format_bytes
from kvtier.wire import OperatorConnection
from kvtier.wire.errors import DaemonBusy, DaemonUnavailable, PermissionDenied
from kvtier.wire.messages import AttachOk
from kvtier.wire.stats import StatsDoc

config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="KVTIER_CONFIG",
    help="Daemon config TOML (default: the mode's defaults; in system mode /etc/kvtier/kvtier.toml if present).",
)
socket_option = click.option(
    "--socket",
    "socket_path",
    type=click.Path(readable=False),  # a socket we may not open is the client's to report (permission denied)
    envvar="KVTIER_SOCKET",
    help="Daemon socket (default: the config's).",
)


def mode_option(f: Any) -> Any:
    """--user / --system: whose defaults apply (kvtier.core.config: never chosen by the uid)."""
    f = click.option(
        "--system",
        "mode",
        flag_value="system",
        default=None,
        help="System mode: the systemd unit's defaults (/run/kvtier, /var/lib/kvtier, /etc/kvtier/kvtier.toml).",
    )(f)
    return click.option(
        "--user", "mode", flag_value="user", default=None, help="User mode: everything under ./.kvtier (the default)."
    )(f)


def store_root_of(root: str | None, config_path: str | None, mode: str | None = None) -> str:
    """--store, else the store root of the config (--config, or the mode's defaults)."""
    return root if root else str(load_config(config_path, mode=mode).store.root)


def socket_path_of(config_path: str | None, socket_path: str | None, mode: str | None = None) -> Path:
    """--socket, else the socket of the config (--config, or the mode's defaults)."""
    return Path(socket_path) if socket_path else load_config(config_path, mode=mode).server.socket


@click.command()
@config_option
@mode_option
def serve(config_path: str | None, mode: str | None) -> None:
    """Run the daemon: GPU pools, the disk store writer and the local API (under systemd: Type=notify).

    Says on stderr what it starts and, once it does, where it listens. Exit 2 for a config or path it cannot use.
    """
    from kvtier.daemon.server import claim_socket_path
    from kvtier.daemon.startup_phases import PHASES

    PHASES.mark("imports")
    cfg = load_config(config_path, mode=mode)
    _check_profiles(cfg)
    check_pool_budget(cfg, check_device(cfg))  # before a byte is allocated or a folder made: one line, nothing else
    check_pool_slots(cfg)
    _check_paths(cfg)
    PHASES.mark("guards")
    claim_socket_path(cfg.server.socket)  # refuse before allocating pools if another daemon serves here
    write_marker(cfg.server.socket)  # `kvtier status` says "starting" until we listen
    try:
        _serve(cfg, config_path)
    finally:
        clear_marker(cfg.server.socket)


def _serve(cfg: DaemonConfig, config_path: str | None) -> None:
    from kvtier.daemon.backend import build_backend
    from kvtier.daemon.service import Daemon
    from kvtier.daemon.startup_phases import PHASES

    PHASES.mark("daemon_imports")  # the backend's modules (pools, store, cluster tier) loaded
    # the supervised verifier and a SIGHUP reload read the file in this same mode, whatever chose it
    os.environ[MODE_ENV] = cfg.mode
    served = f"profiles {', '.join(cfg.profiles)} on {cfg.device}" if cfg.profiles else "no profiles (engine-only)"
    then = "; the pools are allocated once it serves" if cfg.profiles else ", no pools"
    click.echo(
        f"kvtier serve: {cfg.mode} mode ({cfg.mode_why}); config {cfg.source}; {served}; store {cfg.store.root}; "
        f"opening the store{then}",
        err=True,
    )
    backend = build_backend(cfg)
    PHASES.mark("store_open")
    try:
        daemon = Daemon(cfg, backend, config_path=config_path)
    except BaseException:
        backend.close()
        raise

    def ready(line: str) -> None:
        clear_marker(cfg.server.socket)
        click.echo(f"kvtier serve: {line}", err=True)

    sys.exit(daemon.run(on_ready=ready))


def _check_profiles(cfg: DaemonConfig) -> None:
    """Every profile the config lists must load (a bundled name or a TOML file), or one line naming the key."""
    for name in cfg.profiles:
        try:
            load_profile(name)
        except ProfileError as exc:
            raise ConfigError(str(exc), key="profiles", source=cfg.source) from None


def _check_paths(cfg: DaemonConfig) -> None:
    """The socket's folder and the store root must be folders this user can write: else one line naming the key."""
    for key, folder in (("server.socket", cfg.server.socket.parent), ("store.root", cfg.store.root)):
        if key == "store.root":
            check_store_parent(cfg)  # after the socket's folder: the user mode's ./.kvtier holds both
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe_ok = os.access(folder, os.W_OK | os.X_OK)
        except OSError as exc:
            why = "a file, not a folder" if folder.exists() and not folder.is_dir() else exc.strerror or str(exc)
        else:
            if probe_ok:
                continue
            why = "not writable by this user"
        raise ConfigError(
            f"cannot use {folder}: {why}; run as a user who may write there (the systemd unit runs as kvtier), "
            "or set it elsewhere in --config",
            key=key,
            source=cfg.source,
        )


def _share(share: float | None) -> str:
    return f"{share:6.1%}" if share is not None else "     -"


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _render_pins(doc: StatsDoc, shown: int = 5) -> None:
    """Prewarm pins: how many objects, and when they expire (soonest first; --json lists every one)."""
    if not doc.pins:
        click.echo("pins       none (kvtier prewarm pins prefixes for their ttl_s)")
        return
    objects = sum(p.objects for p in doc.pins)
    click.echo(
        f"pins       {len(doc.pins)} prewarmed prefixes, {objects:,} objects; next expiry in "
        f"{_duration(doc.pins[0].expires_in_s)}, last in {_duration(doc.pins[-1].expires_in_s)}"
    )
    for p in doc.pins[:shown]:
        click.echo(f"  pin      {p.profile}: {p.objects:,} objects, expires in {_duration(p.expires_in_s)}")
    if len(doc.pins) > shown:
        click.echo(f"  ... and {len(doc.pins) - shown} more (--json lists them all)")


def _render_write_back(store: dict) -> None:
    """One line per form whose write-back the store refuses: how many objects wait, and why."""
    stuck = store.get("write_back_stuck", {})
    for line in store.get("write_back_blocked", []):
        where, _, why = line.partition(": ")
        profile, _, form = where.partition("/")
        n = stuck.get(profile, {}).get(form, 0)
        click.echo(
            f"  write-back blocked  {where}: {n} objects waiting, {store.get('failed_passes', 0)} failed passes: {why}"
        )


_POOLS = {
    "none": "none: no profiles, an engine-only node (engine tier ops only; kvtier's own client cannot attach)",
    "waiting": "starting: allocating (engine tier ops and status are served; an attach waits)",
    "allocating": "starting: allocating (engine tier ops and status are served; an attach waits)",
    "ready": "ready",
}


def _render_status(doc: StatsDoc) -> None:
    d = doc.daemon
    assert d is not None  # the service fills it in before answering
    click.echo(f"health     {d.health}")
    click.echo(
        f"daemon     {d.version}, pid {d.pid}, up {d.uptime_s:.0f}s, {d.connections} connections,"
        f" config: {d.config_source}"
    )
    click.echo(f"socket     {d.socket}" + (f"   metrics http://{d.metrics}/metrics" if d.metrics else ""))
    click.echo(f"pools      {_POOLS.get(d.pools, d.pools)}")
    v = doc.verifier
    click.echo(f"verifier   {v.state} (mode {v.mode}, restarts {v.restarts})")
    s = doc.store
    if s:
        click.echo(
            f"store      {s.get('root')}  backend {s.get('io_backend')}  used {format_bytes(s.get('used_bytes', 0))}"
            f" of {format_bytes(s.get('budget_bytes'))}  persist queue {s.get('persist_queue', 0)}"
        )
        _render_write_back(s)
    for prof in doc.profiles:
        click.echo(
            f"profile    {prof.name}  namespace {prof.namespace}  H={prof.hash_block_tokens}  device {prof.device}"
        )
        for form, p in sorted(prof.pools.items()):
            share = p.used / p.slots if p.slots else 0
            click.echo(
                f"  pool {form:<11} {p.used:>7}/{p.slots:<7} slots used ({share:6.1%}) of {format_bytes(p.bytes)}, "
                f"quota {p.quota}, pages {p.pages}"
                + (f" ({format_bytes(p.moving_bytes)} still being moved onto huge pages)" if p.moving_bytes else "")
            )
    _render_pins(doc)
    if doc.forms:
        click.echo(f"{'form':<11} {'lookups':>9} {'reuse':>7} {'recover':>7} {'recompute':>9}")
        for form, f in sorted(doc.forms.items()):
            reuse, recover, recompute = (_share(f.share(r)) for r in ("reuse", "recover", "recompute"))
            click.echo(f"{form:<11} {f.lookups:>9} {reuse:>7} {recover:>7} {recompute:>9}")
    for line in cluster_lines(doc.cluster):
        click.echo(line)
    if doc.namespaces:
        click.echo("")
        for line in namespace_lines(doc.namespaces):
            click.echo(line)
    if doc.engines:
        click.echo("")
        for line in engine_lines(doc.engines):
            click.echo(line)
    click.echo(events_line(doc.events))


@click.command()
@config_option
@mode_option
@socket_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (the daemon's stats document).")
def status(config_path: str | None, mode: str | None, socket_path: str | None, as_json: bool) -> None:
    """Health, profiles, pool occupancy, store usage and I/O backend, verifier state, per-form rates.

    Exit code 0 when healthy, 1 when degraded, 3 when no daemon is there, 4 when one is there but did not
    answer us (permission denied, busy, timed out), 5 while one is starting (opening its store, or serving the
    store while it allocates its pools).
    """
    from kvtier.wire import Connection  # not kvtier.client: status needs no torch

    path = socket_path_of(config_path, socket_path, mode)
    with daemon_exits():
        try:
            with Connection(path, timeout_s=10.0, name="kvtier status") as conn:
                doc = conn.stats()
        except DaemonUnavailable:
            if (st := starting(path)) is None:
                raise
            click.echo(
                f"kvtier: starting: kvtier serve (pid {st.pid}) is opening its store for {st.since_s:.0f} s; "
                f"it serves on {path} once ready (`kvtier status` again)",
                err=True,
            )
            sys.exit(exits.STARTING)
    if as_json:
        click.echo(json.dumps(msgspec.to_builtins(doc), indent=2, default=str))
    else:
        _render_status(doc)
    if doc.daemon is not None and doc.daemon.pools in ("waiting", "allocating"):
        sys.exit(exits.STARTING)  # it serves the store already; its pools are not ready
    sys.exit(exits.OK if doc.daemon is not None and doc.daemon.health == "ok" else exits.PROBLEMS)


def _prewarm_line(r: dict[str, Any]) -> str:
    return (
        f"{r['name']}: hit {r['hit_tokens']:,}/{r['tokens']:,} tokens, loaded {r['loaded_objects']:,} objects "
        f"({format_bytes(r['bytes_loaded'])}), pinned {r['pinned']:,} for {r['ttl_s']:g} s, {r['seconds']:.2f} s"
    )


def _group_line(g: dict[str, Any]) -> str:
    return (
        f"  {g['group']}: {g['kind']}, {g['stored']:,}/{g['units']:,} stored, restores "
        f"{g['restorable_tokens']:,} tokens alone, {g['needed']:,} loaded by the hit"
    )


@click.command()
@click.argument("manifest", type=click.Path(dir_okay=False, path_type=Path))
@config_option
@mode_option
@socket_option
@click.option("--json", "as_json", is_flag=True, help="One JSON report on stdout (per-prefix lines go to stderr).")
def prewarm(manifest: Path, config_path: str | None, mode: str | None, socket_path: str | None, as_json: bool) -> None:
    """Load the longest usable hit of each manifest prefix from disk into the pool and pin it for its TTL.

    A line naming an engine namespace (vLLM, SGLang) loads from the cluster to local disk what only the
    cluster holds, pins the records for the TTL, warms them, and reports per group what the engine can restore.
    A line per prefix as it finishes (on stderr with --json). Exit 2 for a bad manifest, 3 with no daemon,
    130 when interrupted (after reporting the prefixes done).
    """
    prompts = read_manifest(manifest)
    path = socket_path_of(config_path, socket_path, mode)
    conns: dict[str, tuple[OperatorConnection, AttachOk]] = {}
    reports: list[dict[str, Any]] = []
    engine_conn: OperatorConnection | None = None  # engine namespaces need no attach: one connection for them
    try:
        for prompt in prompts:
            if prompt.engine is not None:
                if engine_conn is None:
                    engine_conn = OperatorConnection(path, name="kvtier prewarm")
                reports.append(prewarm_report(engine_conn, prompt))
                click.echo(_prewarm_line(reports[-1]), err=as_json)
                for g in reports[-1]["groups"]:
                    click.echo(_group_line(g), err=as_json)
                continue
            if prompt.profile not in conns:
                conn = OperatorConnection(path, name="kvtier prewarm")
                try:
                    conns[prompt.profile] = (conn, conn.attach_unmapped(prompt.profile))
                except (DaemonUnavailable, DaemonBusy, PermissionDenied):
                    raise
                except KvtierError as exc:
                    conn.close()
                    raise ConfigError(str(exc), key="profile", source=prompt.where) from None
            conn, att = conns[prompt.profile]
            started = time.perf_counter()
            hashes = b"".join(block_hashes(att.namespace, prompt.tokens, att.hash_block_tokens))
            rep = conn.prewarm_hashes(hashes, prompt.ttl_s)
            cv = CheckVector.from_wire(msgspec.structs.asdict(rep.check_vector))
            reports.append(
                {
                    "name": prompt.name,
                    "profile": prompt.profile,
                    "tokens": int(prompt.tokens.size),
                    "hit_tokens": cv.hit_tokens,
                    "routes": cv.counts(),
                    "loaded_objects": rep.loaded_objects,
                    "bytes_loaded": rep.loaded_bytes,
                    "pinned": rep.pinned,
                    "ttl_s": prompt.ttl_s,
                    "seconds": round(time.perf_counter() - started, 6),
                }
            )
            click.echo(_prewarm_line(reports[-1]), err=as_json)
    except KeyboardInterrupt:
        pinned = sum(r["pinned"] for r in reports)
        kept = f"{pinned:,} objects stay pinned for their ttl_s" if pinned else "nothing was pinned"
        click.echo(f"kvtier: interrupted after {len(reports)} of {len(prompts)} prefixes ({kept})", err=True)
        sys.exit(exits.INTERRUPTED)
    finally:
        for conn, _ in conns.values():
            conn.close()
        if engine_conn is not None:
            engine_conn.close()
    if as_json:
        click.echo(json.dumps({"manifest": str(manifest), "prefixes": reports}, indent=2))

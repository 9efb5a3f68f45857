"""`kvtier serve`, `kvtier status`, `kvtier config show`, `kvtier prewarm`: the daemon and its operators' commands."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click
import msgspec
import numpy as np
import tomli_w

from kvtier.cli.cluster_status import cluster_lines
from kvtier.cli.namespace_table import namespace_lines
from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError
from kvtier.wire.errors import DaemonBusy, DaemonTimeout, DaemonUnavailable, PermissionDenied
from kvtier.wire.stats import StatsDoc

config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="KVTIER_CONFIG",
    help="Daemon config TOML (default: built-in defaults).",
)
socket_option = click.option(
    "--socket",
    "socket_path",
    type=click.Path(readable=False),  # a socket we may not open is the client's to report (permission denied)
    envvar="KVTIER_SOCKET",
    help="Daemon socket (default: the config's).",
)


def _socket(config_path: str | None, socket_path: str | None) -> Path:
    return Path(socket_path) if socket_path else load_config(config_path).server.socket


@click.command()
@config_option
def serve(config_path: str | None) -> None:
    """Run the daemon: GPU pools, the disk store writer and the local API (under systemd: Type=notify)."""
    from kvtier.daemon.backend import build_backend
    from kvtier.daemon.server import claim_socket_path
    from kvtier.daemon.service import Daemon

    cfg = load_config(config_path)
    claim_socket_path(cfg.server.socket)  # refuse before allocating pools if another daemon serves here
    backend = build_backend(cfg)
    try:
        daemon = Daemon(cfg, backend, config_path=config_path)
    except BaseException:
        backend.close()
        raise
    sys.exit(daemon.run())


@click.group()
def config() -> None:
    """The daemon's configuration."""


@config.command("show")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def config_show(config_path: str | None, as_json: bool) -> None:
    """Print the effective config (defaults with the file laid over them)."""
    cfg = load_config(config_path)
    doc = cfg.to_dict()
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    source = doc.pop("source")
    click.echo(f"# effective kvtier config (from: {source})")
    click.echo(tomli_w.dumps(doc), nl=False)


def _share(share: float | None) -> str:
    return f"{share:6.1%}" if share is not None else "     -"


def _render_status(doc: StatsDoc) -> None:
    d = doc.daemon
    assert d is not None  # the service fills it in before answering
    click.echo(f"health     {d.health}")
    click.echo(
        f"daemon     {d.version}, pid {d.pid}, up {d.uptime_s:.0f}s, {d.connections} connections,"
        f" config: {d.config_source}"
    )
    click.echo(f"socket     {d.socket}" + (f"   metrics http://{d.metrics}/metrics" if d.metrics else ""))
    v = doc.verifier
    click.echo(f"verifier   {v.state} (mode {v.mode}, restarts {v.restarts})")
    s = doc.store
    if s:
        click.echo(
            f"store      {s.get('root')}  backend {s.get('io_backend')}  used {s.get('used_bytes', 0) / 2**20:.1f} MiB"
            f" of {s.get('budget_bytes', 0) / 2**20:.0f} MiB  persist queue {s.get('persist_queue', 0)}"
        )
    for prof in doc.profiles:
        click.echo(
            f"profile    {prof.name}  namespace {prof.namespace}  H={prof.hash_block_tokens}  device {prof.device}"
        )
        for form, p in sorted(prof.pools.items()):
            share = p.used / p.slots if p.slots else 0
            click.echo(f"  pool {form:<11} {p.used:>7}/{p.slots:<7} slots used ({share:6.1%}), quota {p.quota}")
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


@click.command()
@config_option
@socket_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (the daemon's stats document).")
def status(config_path: str | None, socket_path: str | None, as_json: bool) -> None:
    """Health, profiles, pool occupancy, store usage and I/O backend, verifier state, per-form rates.

    Exit code 0 when healthy, 1 when degraded, 3 when no daemon is there, 4 when one is there but did not
    answer us (permission denied, busy, timed out).
    """
    from kvtier.wire import Connection  # not kvtier.client: status needs no torch

    path = _socket(config_path, socket_path)
    try:
        with Connection(path, timeout_s=10.0, name="kvtier status") as conn:
            doc = conn.stats()
    except (PermissionDenied, DaemonBusy, DaemonTimeout) as exc:
        click.echo(f"kvtier: {exc}", err=True)
        sys.exit(4)
    except DaemonUnavailable as exc:
        click.echo(f"kvtier: {exc}", err=True)
        sys.exit(3)
    if as_json:
        click.echo(json.dumps(msgspec.to_builtins(doc), indent=2, default=str))
    else:
        _render_status(doc)
    sys.exit(0 if doc.daemon is not None and doc.daemon.health == "ok" else 1)


def _manifest_tokens(entry: dict[str, Any], base: Path, where: str) -> np.ndarray:
    if "tokens" in entry:
        tokens = entry["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise ConfigError("tokens must be a list of non-negative integers", key="tokens", source=where)
        return np.asarray(tokens, dtype=np.int64)
    if "token_file" not in entry:
        raise ConfigError("each prefix needs 'tokens' or 'token_file'", source=where)
    path = base / entry["token_file"]
    try:
        if path.suffix == ".npy":
            return np.load(path).astype(np.int64).reshape(-1)
        return np.asarray([int(t) for t in path.read_text().replace(",", " ").split()], dtype=np.int64)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read token file {path}: {exc} (.npy, or integers separated by spaces or commas)",
            key="token_file",
            source=where,
        ) from None


def read_manifest(path: Path) -> list[dict[str, Any]]:
    """Parse and check a JSONL prewarm manifest: {name, profile, tokens | token_file, ttl_s?} per line."""
    entries = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the manifest: {exc.strerror}", source=str(path)) from None
    for i, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{i}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"not a JSON object: {exc.msg}", source=where) from None
        if not isinstance(entry, dict) or not isinstance(entry.get("profile"), str):
            raise ConfigError("each line must be an object with a 'profile'", key="profile", source=where)
        unknown = set(entry) - {"name", "profile", "tokens", "token_file", "ttl_s"}
        if unknown:
            raise ConfigError("unknown key", key=sorted(unknown)[0], source=where)
        ttl = entry.get("ttl_s", 600.0)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0:
            raise ConfigError(f"must be a positive number of seconds, got {ttl!r}", key="ttl_s", source=where)
        entries.append(
            {
                "name": str(entry.get("name", f"line {i}")),
                "profile": entry["profile"],
                "tokens": _manifest_tokens(entry, path.parent, where),
                "ttl_s": float(ttl),
            }
        )
    return entries


@click.command()
@click.argument("manifest", type=click.Path(dir_okay=False, path_type=Path))
@config_option
@socket_option
@click.option("--json", "as_json", is_flag=True, help="One JSON report on stdout (progress stays on stderr).")
def prewarm(manifest: Path, config_path: str | None, socket_path: str | None, as_json: bool) -> None:
    """Load the longest usable hit of each manifest prefix from disk into the pool and pin it for its TTL."""
    from tqdm import tqdm

    from kvtier.client import Client

    entries = read_manifest(manifest)
    path = _socket(config_path, socket_path)
    clients: dict[str, Client] = {}
    reports = []
    try:
        for entry in tqdm(entries, desc="prewarm", unit="prefix", file=sys.stderr, disable=not sys.stderr.isatty()):
            client = clients.get(entry["profile"])
            if client is None:
                client = clients[entry["profile"]] = Client(path, name="kvtier prewarm")
                client.attach(entry["profile"])
            started = time.perf_counter()
            rep = client.prewarm(entry["tokens"], ttl_s=entry["ttl_s"])
            reports.append(
                {
                    "name": entry["name"],
                    "profile": entry["profile"],
                    "tokens": int(entry["tokens"].size),
                    "hit_tokens": rep.hit_tokens,
                    "routes": rep.check_vector.counts(),
                    "loaded_objects": rep.loaded_objects,
                    "bytes_loaded": rep.loaded_bytes,
                    "pinned": rep.pinned,
                    "seconds": round(time.perf_counter() - started, 6),
                }
            )
    finally:
        for client in clients.values():
            client.close()
    if as_json:
        click.echo(json.dumps({"manifest": str(manifest), "prefixes": reports}, indent=2))
        return
    for r in reports:
        click.echo(
            f"{r['name']}: hit {r['hit_tokens']}/{r['tokens']} tokens, loaded {r['loaded_objects']} objects "
            f"({r['bytes_loaded'] / 2**20:.2f} MiB), pinned {r['pinned']}, {r['seconds']:.3f}s"
        )

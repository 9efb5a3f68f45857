"""`kvtier store`: rebuild the index from segments, and show store statistics."""

from __future__ import annotations

import json
from typing import Any

import click

from kvtier.cli.daemon_cmds import config_option, mode_option, store_root_of
from kvtier.core.units import format_bytes


@click.group()
def store() -> None:
    """The on-disk prefix store (LMDB index + segments)."""


@store.command("rebuild-index")
@click.option("--store", "root", required=True, type=click.Path(file_okay=False), help="Store root directory.")
@click.option(
    "--dry-run", is_flag=True, help="Only report what the segments hold against the index (orphans, corruption)."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def rebuild_index_cmd(root: str, dry_run: bool, as_json: bool) -> None:
    """Rebuild index.lmdb from the segments alone (the daemon must be stopped)."""
    from kvtier.store import rebuild_index

    report = rebuild_index(root, dry_run=dry_run).to_dict()
    if as_json:
        click.echo(json.dumps(report))
        return
    for name, value in report.items():
        shown = format_bytes(value) if name.endswith("_bytes") and isinstance(value, int) else value
        click.echo(f"{name:<18} {shown}")


@store.command("stats")
@click.option(
    "--store", "root", type=click.Path(file_okay=False), help="Store root directory (default: the config's store.root)."
)
@config_option
@mode_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (sizes in bytes).")
def stats_cmd(root: str | None, config_path: str | None, mode: str | None, as_json: bool) -> None:
    """Records and bytes per form, codec ratios, segments, namespaces, I/O backend, eviction tombstones."""
    from kvtier.store import DiskStore

    root = store_root_of(root, config_path, mode)

    with DiskStore(root, readonly=True) as s:
        stats = with_published_limits(s.stats(), s.limits())
    if as_json:
        click.echo(json.dumps(stats))
        return
    for line in render_stats(stats):
        click.echo(line)


def with_published_limits(stats: dict[str, Any], limits: Any) -> dict[str, Any]:
    """The budget and quotas the store's writer (the daemon) published and enforces, as `kvtier audit` reports
    them: a reader's own store config has none, so without this `store stats` said "budget none"."""
    if limits is None:
        return stats
    from kvtier.core.forms import CacheForm

    stats["budget_bytes"] = limits.budget_bytes or None
    for form, f in stats["forms"].items():
        f["quota_bytes"] = limits.quota(CacheForm(form)) or None
    return stats


def render_stats(stats: dict[str, Any]) -> list[str]:
    """The store's statistics for a person: sizes in binary units, one row per form."""
    ns = stats["namespaces"]
    payload = sum(f["payload_bytes"] for f in stats["forms"].values())
    lines = [
        f"store       {stats['root']}  (I/O {stats['io_backend']})",
        f"records     {stats['records']:,}, {format_bytes(stats['record_bytes'])} on disk "
        f"(payload {format_bytes(payload)}), budget {format_bytes(stats['budget_bytes'])}",
        f"segments    {stats['segments']:,}  unverified {stats['unverified']:,}  namespaces {ns['live']} live, "
        f"{ns['retired']} retired  evicted keys remembered {stats['evicted_tombstones']:,}",
        "",
        f"{'form':<11} {'records':>9} {'on disk':>11} {'payload':>11} {'codec':>6} {'quota':>11}",
    ]
    for form, f in stats["forms"].items():
        on_disk, payload_bytes, quota = (format_bytes(f[k]) for k in ("record_bytes", "payload_bytes", "quota_bytes"))
        codec = "-" if f["codec_ratio"] is None else f"{f['codec_ratio']:.2f}"  # None: no records of the form
        lines.append(f"{form:<11} {f['records']:>9,} {on_disk:>11} {payload_bytes:>11} {codec:>6} {quota:>11}")
    return lines

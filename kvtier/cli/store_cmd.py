"""`kvtier store`: rebuild the index from segments, and show store statistics."""

from __future__ import annotations

import json

import click


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
        click.echo(f"{name:<18} {value}")


@store.command("stats")
@click.option(
    "--store", "root", required=True, type=click.Path(exists=True, file_okay=False), help="Store root directory."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def stats_cmd(root: str, as_json: bool) -> None:
    """Records and bytes per form, codec ratios, segments, namespaces, I/O backend, eviction tombstones."""
    from kvtier.store import DiskStore

    with DiskStore(root, readonly=True) as s:
        stats = s.stats()
    if as_json:
        click.echo(json.dumps(stats))
        return
    click.echo(f"store      {stats['root']}  ({stats['io_backend']})")
    click.echo(
        f"records    {stats['records']}  ({stats['record_bytes']} bytes, budget {stats['budget_bytes']}); "
        f"{stats['evicted_tombstones']} evicted keys remembered"
    )
    click.echo(f"segments   {stats['segments']}  unverified {stats['unverified']}  namespaces {stats['namespaces']}")
    for form, f in stats["forms"].items():
        click.echo(f"  {form:<11} {f['records']:>8} records {f['record_bytes']:>14} B  codec ratio {f['codec_ratio']}")

"""`kvtier audit`: what the disk store holds, what is wrong with it, and (--fix) the verifier's actions once."""

from __future__ import annotations

import json
import sys

import click
from tqdm import tqdm

from kvtier.cli import exits
from kvtier.cli.daemon_cmds import mode_option, store_root_of


@click.command()
@click.option(
    "--store", "root", type=click.Path(file_okay=False), help="Store root directory (default: the config's store.root)."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (no progress bar).")
@click.option("--deep", is_flag=True, help="Re-read and checksum every record (progress bar on stderr).")
@click.option("--fix", is_flag=True, help="Apply the verifier's actions once, then report the store as it is after.")
@click.option("--cluster", is_flag=True, help="Also audit the cluster tier named by the config's [cluster] table.")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="KVTIER_CONFIG",
    help="Daemon config file: its store.root when --store is not given, and its [cluster] for --cluster.",
)
@mode_option
@click.option("--sample", default=32, show_default=True, type=click.IntRange(0), help="Cluster objects to verify.")
def audit(
    root: str | None,
    as_json: bool,
    deep: bool,
    fix: bool,
    cluster: bool,
    config_path: str | None,
    mode: str | None,
    sample: int,
) -> None:
    """Per namespace and form counts, orphaned / reclaimable bytes, budget use.

    Exit 0 when clean; 1 when corruption or orphaned bytes were found (with --fix: found before or left after);
    2 for usage errors (a missing store included). With --cluster, a sampled cluster object that fails its
    checks is corruption too; a cluster that cannot be reached is exit 2.
    """
    from kvtier.cli.cluster_census import render_cluster, run_cluster_audit
    from kvtier.verifier import Verifier, VerifierSettings, audit_store, open_store, render_table

    settings = VerifierSettings()
    root = store_root_of(root, config_path, mode)
    with open_store(root, readonly=not fix) as store:
        bar = None
        if deep and not as_json:
            bar = tqdm(
                total=int(store.stats()["records"]), unit="rec", desc="audit", file=sys.stderr, dynamic_ncols=True
            )
        try:
            before = audit_store(store, settings, deep=deep, progress=bar.update if bar else None)
        finally:
            if bar is not None:
                bar.close()
        report, actions = before, {}
        if fix:
            actions = Verifier(store, settings).run_once()
            report = audit_store(store, settings)
        remote = run_cluster_audit(config_path, store, sample) if cluster else None
    if as_json:
        click.echo(json.dumps({**report.to_json(), **({"cluster": remote.to_json()} if remote else {})}))
    else:
        click.echo(render_table(report))
        if fix:
            done = ", ".join(f"{k} {v}" for k, v in sorted(actions.items())) or "nothing to do"
            click.echo(f"\nfixed: {done}")
        if remote:
            click.echo("\n" + render_cluster(remote))
    found = before.problems or report.problems or actions.get("quarantined", 0) > 0 or (remote and remote.problems)
    sys.exit(exits.PROBLEMS if found else exits.OK)

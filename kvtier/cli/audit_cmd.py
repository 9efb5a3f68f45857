"""`kvtier audit`: what the disk store holds, what is wrong with it, and (--fix) the verifier's actions once."""

from __future__ import annotations

import json
import sys

import click
from tqdm import tqdm


@click.command()
@click.option("--store", "root", required=True, type=click.Path(file_okay=False), help="Store root directory.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (no progress bar).")
@click.option("--deep", is_flag=True, help="Re-read and checksum every record (progress bar on stderr).")
@click.option("--fix", is_flag=True, help="Apply the verifier's actions once, then report the store as it is after.")
def audit(root: str, as_json: bool, deep: bool, fix: bool) -> None:
    """Per namespace and form counts, orphaned / reclaimable bytes, budget use.

    Exit 0 when clean; 1 when corruption or orphaned bytes were found (with --fix: found before or left after);
    2 for usage errors (a missing store included).
    """
    from kvtier.verifier import Verifier, VerifierSettings, audit_store, open_store, render_table

    settings = VerifierSettings()
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
    if as_json:
        click.echo(json.dumps(report.to_json()))
    else:
        click.echo(render_table(report))
        if fix:
            done = ", ".join(f"{k} {v}" for k, v in sorted(actions.items())) or "nothing to do"
            click.echo(f"\nfixed: {done}")
    found = before.problems or report.problems or actions.get("quarantined", 0) > 0
    sys.exit(1 if found else 0)

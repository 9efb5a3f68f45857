"""`kvtier verifier run|status`: the verifier/cleaner process the daemon supervises (or systemd runs)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

from kvtier.cli import exits

_OVERRIDES = {
    "rate": ("rate_bytes_per_s", int, "Payload bytes per second to read (verify) and copy (compaction); 0: unlimited."),
    "busy_rate": (
        "busy_rate_bytes_per_s",
        int,
        "The rate while other processes use the store's disk (at most --rate; 0: --rate).",
    ),
    "sweep_interval": ("sweep_interval_s", float, "Seconds between full sweeps."),
    "maintenance_interval": ("maintenance_interval_s", float, "Seconds between index scans + cleaner actions."),
    "poll": ("poll_s", float, "Idle wake-up in seconds when no watchdog hint arrives."),
    "compact_below": ("compact_below", float, "Compact sealed segments whose live fraction is below this."),
    "quarantine_retention": (
        "quarantine_retention_s",
        float,
        "Seconds a quarantined record stays visible before it is dropped.",
    ),
    "tombstone_retention": (
        "tombstone_retention_s",
        float,
        "Seconds an evicted key reads as `evicted` (not `missing`).",
    ),
    "batch_records": ("batch_records", int, "Records per read / write transaction."),
    "orphan_grace": (
        "orphan_grace_s",
        float,
        "Seconds before an unreferenced file or tail counts as orphaned and is reclaimed.",
    ),
}


@click.group()
def verifier() -> None:
    """The disk store's verifier and cleaner (its own process; never blocks the daemon's readers)."""


def _override_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for name, (_, kind, text) in reversed(_OVERRIDES.items()):
        fn = click.option(f"--{name.replace('_', '-')}", name, type=kind, default=None, help=text)(fn)
    return fn


@verifier.command("run")
@click.option("--store", "root", required=True, type=click.Path(file_okay=False), help="Store root directory.")
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    default=None,
    help="The daemon's TOML config: rates, budget, quotas, profiles.",
)
@click.option(
    "--wait-for-store",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds to wait for the daemon to create the store.",
)
@_override_options
def run_cmd(root: str, config: str | None, wait_for_store: float, **given: object) -> None:
    """Verify, quarantine, retire, evict and compact until SIGTERM; SIGHUP re-reads --config."""
    from kvtier.verifier import process

    overrides = {_OVERRIDES[k][0]: v for k, v in given.items() if v is not None}
    process.exit_without_teardown(process.run(root, config, overrides, wait_for_store_s=wait_for_store))


@verifier.command("status")
@click.option("--store", "root", required=True, type=click.Path(file_okay=False), help="Store root directory.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status_cmd(root: str, as_json: bool) -> None:
    """What the verifier last published: phase, heartbeat, sweep progress, actions. Exit 1 if it is not running."""
    from kvtier.verifier import open_store, verifier_status

    with open_store(root, readonly=True) as store:
        doc = verifier_status(store)
    if as_json:
        click.echo(json.dumps(doc))
    else:
        click.echo(
            f"verifier   {'running' if doc['running'] else 'not running'} ({doc['phase']}, ready {doc['ready']})"
        )
        if "heartbeat_age_s" in doc:
            click.echo(f"heartbeat  {doc['heartbeat_age_s']}s ago (pid {doc['verifier_pid']})")
        if rates := doc["settings"]:
            pace = "busy: others use the disk" if doc["paced_busy"] else "full"
            click.echo(
                f"rate       {rates.get('rate_bytes_per_s')} B/s, {rates.get('busy_rate_bytes_per_s')} B/s while the "
                f"disk is busy (now {pace})"
            )
        for action, n in sorted(doc["actions"].items()):
            click.echo(f"  {action:<22} {n}")
    sys.exit(exits.OK if doc["running"] else exits.PROBLEMS)

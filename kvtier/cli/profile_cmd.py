"""`kvtier profile`: list and show model profiles."""

from __future__ import annotations

import json

import click

from kvtier.core.profile import bundled_profile_names, load_profile
from kvtier.core.units import format_bytes


@click.group()
def profile() -> None:
    """Model profiles: cache groups, hash block and bytes per form."""


@profile.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_(as_json: bool) -> None:
    """List the bundled profiles."""
    rows = [load_profile(n) for n in bundled_profile_names()]
    if as_json:
        click.echo(
            json.dumps(
                [{"name": p.name, "hash_block_tokens": p.hash_block_tokens, "description": p.description} for p in rows]
            )
        )
        return
    width = max(len(p.name) for p in rows)
    for p in rows:
        click.echo(f"{p.name:<{width}}  H={p.hash_block_tokens:<5} {p.description}")


@profile.command("show")
@click.argument("name_or_path")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def show(name_or_path: str, as_json: bool) -> None:
    """Show a bundled profile by name, or a profile TOML file."""
    summary = load_profile(name_or_path).summary()
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"profile    {summary['name']}")
    click.echo(f"namespace  {summary['namespace']}")
    click.echo(f"hash block {summary['hash_block_tokens']} tokens")
    click.echo("")
    click.echo(
        f"{'group':<12} {'form':<11} {'kind':<8} {'layers':>6} {'tok/blk':>8} {'ratio':>5} {'window':>6} "
        f"{'bytes/obj':>10}"
    )
    for g in summary["groups"]:
        click.echo(
            f"{g['name']:<12} {g['form']:<11} {g['kind']:<8} {g['layers']:>6} {g['tokens_per_block']:>8} "
            f"{g['ratio']:>5} {g['window']:>6} {format_bytes(g['bytes_per_block']):>10}"
        )
    click.echo("")
    click.echo(f"{'form':<11} {'per hash block':>14} {'per 1M tokens':>14}")
    for form, n in summary["bytes_per_hash_block"].items():
        click.echo(f"{form:<11} {format_bytes(n):>14} {format_bytes(summary['bytes_per_million_tokens'][form]):>14}")

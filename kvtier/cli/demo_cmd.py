"""`kvtier demo`: a daemon serves the reference model; offload, crash, prewarm, restore, continue, compare bitwise."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from kvtier.refmodel.demo import DemoReport

FAILED_EXIT = 1


@click.command()
@click.option(
    "--tokens", type=click.IntRange(min=1024), default=32768, show_default=True, help="Prompt length of both requests."
)
@click.option(
    "--decode",
    "decode_steps",
    type=click.IntRange(min=0),
    default=16,
    show_default=True,
    help="Greedy decode steps after the prompt.",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Hash blocks between state checkpoints.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random prompts.")
@click.option(
    "--profile", "profile_name", default="ref-tiny", show_default=True, help="Bundled profile name or TOML path."
)
@click.option(
    "--dir",
    "workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the daemon's config, socket, store and log here (e.g. ./.kvtier-demo) instead of a temporary folder.",
)
@click.option(
    "--threads", type=click.IntRange(min=1), default=1, show_default=True, help="torch intra-op threads of the engines."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def demo(
    tokens: int,
    decode_steps: int,
    checkpoint_every: int,
    seed: int,
    profile_name: str,
    workdir: Path | None,
    threads: int,
    as_json: bool,
) -> None:
    """Start a daemon, offload a long prompt, kill -9 and restart it, prewarm, restore and continue, compare bitwise.

    Exit 1 when the continuation differs from the uninterrupted run or the restore is not faster than
    recomputing the prefix.
    """
    import torch  # here, not at import: every other command starts without torch

    from kvtier.refmodel.demo import DemoParams, run_demo

    torch.set_num_threads(threads)
    try:
        report = run_demo(DemoParams(tokens, decode_steps, checkpoint_every, seed, profile_name, workdir))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print(report)
    if not report.ok:
        sys.exit(FAILED_EXIT)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _routes(counts: dict[str, int]) -> str:
    routes = ", ".join(f"{k} {v}" for k, v in counts.items() if ":" not in k)
    reasons = ", ".join(f"{k.split(':', 1)[1]} {v}" for k, v in counts.items() if ":" in k)
    return routes + (f" ({reasons})" if reasons else "")


def _print(r: DemoReport) -> None:
    echo = click.echo
    req = r.request
    objects = sum(c["objects"] for c in r.offloaded.values())
    offered = sum(c["bytes"] for c in r.offloaded.values())
    echo(
        f"kvtier demo: profile {r.profile} (namespace {r.namespace[:16]}…, hash block {r.hash_block_tokens} tokens), daemon in {r.workdir}"
    )
    echo("")
    echo(f"engine A   prefilled {r.prompt_tokens:,} tokens in {_ms(r.prefill_s)}, {r.checkpoints} state checkpoints;")
    echo(f"           offloaded {objects:,} objects ({_mib(offered)}) durably in {_ms(r.offload_s)}")
    echo(
        f"daemon     killed (SIGKILL) and restarted in {_ms(r.restart_s)}: pool cold, store kept {r.records_after_restart:,} records"
    )
    p = r.prewarm
    echo(
        f"prewarm    {p['hit_tokens']:,} tokens: {p['loaded_objects']:,} objects ({_mib(p['bytes_loaded'])}) from disk in {_ms(p['seconds'])}, pinned"
    )
    echo(f"engine B   shares the first {r.shared_tokens:,} tokens, then differs")
    echo(f"           hash hit    {r.hash_hit_tokens:>7,} tokens (whole blocks in common)")
    echo(f"           usable hit  {r.hit_tokens:>7,} tokens (the last checkpoint inside it: every form servable)")
    echo("           routes per form at lookup:")
    for form, counts in req["routes_at_lookup"].items():
        echo(f"             {form:<11} {_routes(counts)}")
    echo(
        f"           bytes from disk: {_mib(r.bytes_from_disk)} (prewarm {_mib(p['bytes_loaded'])}, request {_mib(req['bytes_from_disk'])})"
    )
    speed = r.recompute_s / max(r.restore_s, 1e-9)
    echo(
        f"restore    {_ms(r.restore_s)} (lookup {_ms(req['lookup_s'])}, load {_ms(req['load_s'])}, {req['read_objects']:,} objects read)"
        f" vs recompute {_ms(r.recompute_s)}: {speed:,.0f}x {'faster' if r.restore_faster else 'SLOWER'}"
    )
    verdict = "yes" if r.bitwise_match else "NO"
    echo(
        f"bitwise    {verdict}: logits of {r.compared_tokens - req['decode_tokens']:,} prompt + {req['decode_tokens']} decoded tokens"
        " after the restore equal the uninterrupted run (torch.equal)"
    )
    a = r.audit
    verdict = "PROBLEMS" if a["problems"] else "clean"
    echo(
        f"audit      ({a['source']}) {verdict}: {a['records']:,} records, {_mib(a['record_bytes'])}, {a['corrupt']} corrupt, "
        f"{a['quarantined']} quarantined, {_mib(a['orphaned_bytes'])} orphaned"
    )
    for form, f in sorted(a["forms"].items()):
        echo(
            f"             {form:<11} {f['records']:>7,} records {_mib(f['record_bytes']):>12}, {f['verified']:,} verified"
        )
    echo("")
    echo(f"{'ok' if r.ok else 'FAILED'} in {r.total_s:.1f} s")

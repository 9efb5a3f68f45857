"""`kvtier demo`: a daemon serves the reference model; offload, crash, prewarm, restore, continue, compare bitwise."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvtier.cli import exits
from kvtier.core.units import format_bytes

if TYPE_CHECKING:
    from kvtier.refmodel.demo import DemoReport


class Terminated(BaseException):
    """SIGTERM or SIGHUP reached the demo: unwinds it like Ctrl-C does, so that what it started is stopped
    (the daemon, and with it its verifier) and its temporary folder removed. A BaseException: nothing on the
    way may catch it as an ordinary error."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _terminate(signum: int, frame: object) -> None:
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # the clean-up runs once, whatever comes next
        signal.signal(s, signal.SIG_IGN)
    raise Terminated(signum)


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
    """Start a daemon, offload a long prompt, kill -9 and restart it, restore cold and continue, prewarm and restore
    again, compare bitwise. Each stage is announced on stderr as it starts.

    Exit 1 when a continuation differs from the uninterrupted run or the cold restore (lookup + load from disk +
    rebuild) is not faster than recomputing the prefix.
    """
    import torch  # here, not at import: every other command starts without torch

    from kvtier.refmodel.demo import DemoParams, run_demo

    torch.set_num_threads(threads)
    started = time.perf_counter()

    def progress(stage: str) -> None:  # on stderr, so --json keeps stdout one JSON object
        click.echo(f"[{time.perf_counter() - started:6.1f} s] {stage}", err=True)

    previous = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        report = run_demo(DemoParams(tokens, decode_steps, checkpoint_every, seed, profile_name, workdir), progress)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    except Terminated as exc:
        name = signal.Signals(exc.signum).name
        click.echo(f"kvtier demo: {name}: stopped the daemon it started and removed its temporary folder", err=True)
        sys.exit(exits.signalled(exc.signum))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print(report)
    if not report.ok:
        sys.exit(exits.PROBLEMS)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _routes(counts: dict[str, int]) -> str:
    routes = ", ".join(f"{k} {v}" for k, v in counts.items() if ":" not in k)
    reasons = ", ".join(f"{k.split(':', 1)[1]} {v}" for k, v in counts.items() if ":" in k)
    return routes + (f" ({reasons})" if reasons else "")


def _restore(req: dict[str, Any], recompute_s: float) -> str:
    """One restore against the recompute of the same prefix: the whole cost on the request's path, split."""
    rebuild = req["restore_s"] - req["lookup_s"] - req["load_s"]
    speed = recompute_s / max(req["restore_s"], 1e-9)
    verdict = "faster" if req["restore_s"] < recompute_s else "SLOWER"
    return (
        f"{_ms(req['restore_s'])} (lookup {_ms(req['lookup_s'])}, load from disk {_ms(req['load_s'])} "
        f"[{req['loaded_objects']:,} objects, {format_bytes(req['bytes_from_disk'])}], read + rebuild {_ms(rebuild)}) "
        f"vs recompute {_ms(recompute_s)}: {speed:,.1f}x {verdict}"
    )


def _print(r: DemoReport) -> None:
    echo = click.echo
    req = r.request
    objects = sum(c["objects"] for c in r.offloaded.values())
    offered = sum(c["bytes"] for c in r.offloaded.values())
    echo(
        f"kvtier demo: profile {r.profile} (namespace {r.namespace[:16]}…, hash block {r.hash_block_tokens} tokens), "
        f"daemon in {r.workdir}"
    )
    echo("")
    echo(f"engine A   prefilled {r.prompt_tokens:,} tokens in {_ms(r.prefill_s)}, {r.checkpoints} state checkpoints;")
    echo(f"           offloaded {objects:,} objects ({format_bytes(offered)}) durably in {_ms(r.offload_s)}")
    echo(
        f"daemon     killed (SIGKILL) and restarted in {_ms(r.restart_s)}: pool cold, "
        f"store kept {r.records_after_restart:,} records"
    )
    echo(f"engine B   shares the first {r.shared_tokens:,} tokens, then differs")
    echo(f"           hash hit    {r.hash_hit_tokens:>7,} tokens (whole blocks in common)")
    echo(f"           usable hit  {r.hit_tokens:>7,} tokens (the last checkpoint inside it: every form servable)")
    echo("           routes per form at lookup (pool cold):")
    for form, counts in req["routes_at_lookup"].items():
        echo(f"             {form:<11} {_routes(counts)}")
    echo(f"restore    cold {_restore(req, r.recompute_s)}")
    p, warm = r.prewarm, r.prewarmed_request
    echo(
        f"prewarm    after another restart: {p['hit_tokens']:,} tokens of A, {p['loaded_objects']:,} objects "
        f"({format_bytes(p['bytes_loaded'])}) from disk in {_ms(p['seconds'])}, pinned"
    )
    echo(f"           restore after prewarm {_restore(warm, r.recompute_s)}")
    echo("           (the prewarm's own load is not on the request's path, so it is not in that figure)")
    verdict = "yes" if r.bitwise_match else "NO"
    echo(
        f"bitwise    {verdict}: logits of {r.compared_tokens - req['decode_tokens']:,} prompt + "
        f"{req['decode_tokens']} decoded tokens"
        " after each restore equal the uninterrupted run (torch.equal)"
    )
    a = r.audit
    verdict = "PROBLEMS" if a["problems"] else "clean"
    echo(
        f"audit      ({a['source']}) {verdict}: {a['records']:,} records, {format_bytes(a['record_bytes'])}, "
        f"{a['corrupt']} corrupt, "
        f"{a['quarantined']} quarantined, {format_bytes(a['orphaned_bytes'])} orphaned"
    )
    for form, f in sorted(a["forms"].items()):
        echo(
            f"             {form:<11} {f['records']:>7,} records {format_bytes(f['record_bytes']):>12}, "
            f"{f['verified']:,} verified"
        )
    echo("")
    echo(f"{'ok' if r.ok else 'FAILED'} in {r.total_s:.1f} s")

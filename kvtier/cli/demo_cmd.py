"""`kvtier demo`: the reference model resumes from its own exported cache forms, bitwise, and each broken form shows."""

from __future__ import annotations

import json
import sys

import click
import torch

from kvtier.core.profile import load_profile
from kvtier.refmodel.demo import DemoParams, DemoReport, run_demo

MISMATCH_EXIT = 1


@click.command()
@click.option("--tokens", type=click.IntRange(min=512), default=4096, show_default=True, help="Prompt length of both requests.")
@click.option("--decode", "decode_steps", type=click.IntRange(min=0), default=16, show_default=True, help="Greedy decode steps after the prompt.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=16, show_default=True, help="Hash blocks between state checkpoints.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random prompts.")
@click.option("--profile", "profile_name", default="ref-tiny", show_default=True, help="Bundled profile name or TOML path.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="torch intra-op threads.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def demo(tokens: int, decode_steps: int, checkpoint_every: int, seed: int, profile_name: str, threads: int, as_json: bool) -> None:
    """Prefill, export the five cache forms, resume at a checkpoint from their bytes, and compare."""
    torch.set_num_threads(threads)
    profile = load_profile(profile_name)
    try:
        report = run_demo(profile, DemoParams(tokens, decode_steps, checkpoint_every, seed))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print(report)
    if not report.bitwise_match:
        sys.exit(MISMATCH_EXIT)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _print(r: DemoReport) -> None:
    echo = click.echo
    echo(f"kvtier demo: profile {r.profile} (namespace {r.namespace[:16]}…, hash block {r.hash_block_tokens} tokens)")
    echo("")
    echo(f"request 1  prefill {r.prompt_tokens} tokens in {_ms(r.prefill_s)}; state checkpoints at {len(r.checkpoints)} boundaries")
    echo(f"           (every {r.checkpoint_every_tokens} tokens and the end of prefill); objects offloaded:")
    echo(f"           {'form':<11} {'objects':>8} {'bytes':>12}")
    for form, c in r.exported.items():
        echo(f"           {form:<11} {c['objects']:>8} {c['bytes']:>12,}")
    echo("")
    echo(f"request 2  shares the first {r.shared_tokens} tokens, then differs")
    echo(f"           hash hit    {r.hash_hit_tokens:>6} tokens  (every history object present)")
    echo(f"           usable hit  {r.usable_hit_tokens:>6} tokens  (last checkpoint inside it: every form servable)")
    echo("           check vector per form:")
    for form, counts in r.check_vector.items():
        routes = ", ".join(f"{k} {v}" for k, v in counts.items() if ":" not in k)
        reasons = ", ".join(f"{k.split(':', 1)[1]} {v}" for k, v in counts.items() if ":" in k)
        echo(f"             {form:<11} {routes}" + (f" ({reasons})" if reasons else ""))
    echo(f"           restored from {sum(c['objects'] for c in r.restored.values())} objects: "
         + ", ".join(f"{form} {c['objects']} ({c['bytes']:,} B)" for form, c in r.restored.items()))
    echo(f"           restore {_ms(r.restore_s)} vs recompute {_ms(r.recompute_s)} "
         f"({r.recompute_s / max(r.restore_s, 1e-9):.0f}x)")
    echo("")
    cont = f"{r.continuation_tokens} prompt + {r.decode_tokens} decoded tokens"
    verdict = "yes" if r.bitwise_match else "NO"
    echo(f"bitwise match  {verdict}: logits of {cont} after resuming equal recomputing the prefix (torch.equal)")
    if r.single_shot_max_abs_diff is not None:
        echo(f"               vs one-chunk prefill: max abs diff {r.single_shot_max_abs_diff:.2e} (other BLAS shapes; informational)")
    echo("")
    echo("broken form (resume, then the same continuation)       objects  max |Δlogit|  first diff  greedy changes  verdict")
    for b in r.broken:
        first = "-" if b.first_diff is None else f"+{b.first_diff}"
        verdict = "diverges" if b.diverges else "no effect"
        echo(f"{b.case:<52} {b.objects:>8}  {b.max_abs_diff:>12.3e}  {first:>10}  {b.greedy_changes:>14}  {verdict}")

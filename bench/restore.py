"""Restore vs recompute on the reference model, side by side in one run; prints one JSON object.

For each prompt length (4K-64K tokens by default, one independent random prompt each):

1. engine A prefills the prompt and offloads every object it produced (history per hash block,
   state at its checkpoints) through `kvtier.client` to a real daemon (`kvtier.refmodel.engine`),
   durably;
2. the daemon is restarted (its pools start empty) and the store's page cache is dropped;
3. engine B (a new client) asks for the prompt plus `--continue-tokens` new ones: lookup, load from disk, read
   through the leases, rebuild the model state at the hit and continue (`restore_s` is everything
   up to the rebuilt state); then the same again with the objects now resident (`resident_s`);
4. recompute: a fresh state prefills the prefix up to the same boundary (`recompute_s`) and
   continues; the continuation's logits must be bitwise equal to the restored one's.

Steps 2-4 run `--repeat` times; each time's best is reported. Each round starts from the next length (4K first,
then 8K first, ...): a daemon's first load after its start can cost a few ms more than its next (a new process's
caches are cold: each numpy function's first call, the first AIO context), and with a fixed order the shortest
prompt would pay that in every round.
`first_after_start` lists, per round, the length restored first and its `us_per_object`.

`ratio` = recompute_s / restore_s at the same boundary (> 1: restoring is faster); `request_ratio` is the
whole request (prefix + continuation + decode) without a cache over the same with it; `us_per_object` is the
cold load through the daemon (`load_s`, lookup excluded) over the objects it loaded. One lookup hands
out at most the daemon's recover queue (`AdmissionConfig.max_recover_queue` objects) for loading; past
that the hit is shorter (`hit_tokens` < `tokens`, and `note` says so) and the continuation prefills the
rest, on both sides alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from pagecache import drop_cache_tree  # noqa: E402

from kvtier.client import Client  # noqa: E402
from kvtier.core.profile import ModelProfile, load_profile  # noqa: E402
from kvtier.gpu import AdmissionConfig  # noqa: E402
from kvtier.refmodel import RefModel  # noqa: E402
from kvtier.refmodel.demo import DemoDaemon, pool_budgets, settle_pages  # noqa: E402  (a real `kvtier serve` on its own config)
from kvtier.refmodel.engine import RefEngine  # noqa: E402

CHECKPOINT_EVERY = 16  # hash blocks between state checkpoints (the engine's default retention interval)


def prompts(model: RefModel, lengths: list[int], extra: int) -> dict[int, np.ndarray]:
    vocab = model.config.vocab_size
    return {n: np.random.default_rng(n).integers(0, vocab, n + extra, dtype=np.int64) for n in lengths}


def measure(
    profile: ModelProfile, lengths: list[int], extra: int, decode: int, repeat: int, work: Path
) -> tuple[dict[int, dict], list[dict]]:
    model = RefModel(profile)
    ps = prompts(model, lengths, extra)
    daemon = DemoDaemon(
        work, profile, pool_budgets(profile, sum(lengths), CHECKPOINT_EVERY)
    )  # pools hold every prompt at once
    out: dict[int, dict] = {}
    with _engine_on(daemon, model) as engine:
        for n in lengths:
            off = engine.prefill_and_offload(ps[n][:n], durable=True)
            if off.refused or not off.persisted:
                raise SystemExit(f"offload of {n} tokens incomplete (refused {off.refused}, persisted {off.persisted})")
            out[n] = {"prefill_s": off.prefill_s, "offload_s": off.offload_s, "objects": off.objects}
    firsts = []
    for r in range(repeat):
        drop_cache_tree(work / "store")
        order = lengths[r % len(lengths) :] + lengths[: r % len(lengths)]
        with _engine_on(daemon, model) as engine:
            for n in order:
                case = _restore_vs_recompute(engine, ps[n], decode)
                if n == order[0]:
                    firsts.append({"tokens": n, "us_per_object": _per_object(case)})
                _merge(out[n], case)
    return out, firsts


@contextlib.contextmanager
def _engine_on(daemon: DemoDaemon, model: RefModel) -> Iterator[RefEngine]:
    """Start the daemon and attach an engine of `model` to it; stop the daemon (a cold pool next time) after."""
    daemon.start()
    settle_pages(daemon.socket)  # its pools as they stay: moved onto huge pages where the host does that after start
    try:
        with Client(daemon.socket) as c:
            c.attach(model.profile.name)
            yield RefEngine(c, model, checkpoint_every=CHECKPOINT_EVERY)
    finally:
        _stop(daemon)


def _restore_vs_recompute(engine: RefEngine, tokens: np.ndarray, decode: int) -> dict:
    """Cold restore (pools empty, page cache dropped), the same again resident, and recompute at the cold hit."""
    cold = engine.restore_and_continue(tokens, decode=decode)
    warm = engine.restore_and_continue(tokens, decode=decode)
    rec = engine.recompute(tokens, cold.hit_tokens, decode=decode)
    return {
        "hit_tokens": cold.hit_tokens,
        "lookups": cold.lookups,
        "bytes_from_disk": cold.bytes_from_disk,
        "loaded_objects": cold.loaded_objects,
        "lookup_s": cold.lookup_s,
        "load_s": cold.load_s,
        "restore_s": cold.restore_s,
        "resident_s": warm.restore_s,
        "resident_hit_tokens": warm.hit_tokens,
        "resident_loaded_objects": warm.loaded_objects,
        "recompute_s": rec.recompute_s,
        "continue_s": cold.continue_s,
        "recompute_continue_s": rec.continue_s,
        "bitwise_equal": torch.equal(cold.logits, rec.logits),
        "resident_bitwise_equal": torch.equal(warm.logits, rec.logits) if warm.hit_tokens == cold.hit_tokens else None,
    }


def _per_object(case: dict) -> float | None:
    """The cold load's µs an object (lookup excluded); None where nothing was loaded."""
    return round(case["load_s"] / case["loaded_objects"] * 1e6, 1) if case["loaded_objects"] else None


def _merge(acc: dict, new: dict) -> None:
    """Best time of the repeats; equality must hold in every one."""
    for k, v in new.items():
        if k.endswith("_s") and k in acc:
            acc[k] = min(acc[k], v)
        elif k.endswith("bitwise_equal") and k in acc and acc[k] is not None:
            acc[k] = acc[k] and v
        else:
            acc[k] = v


def _stop(daemon: DemoDaemon) -> None:
    if rc := daemon.stop():
        raise SystemExit(f"the daemon exited {rc}; see {daemon.log_path}:\n{daemon.log_tail()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="ref-tiny")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--continue-tokens", type=int, default=64, help="New prompt tokens after the cached prefix.")
    ap.add_argument("--decode", type=int, default=8, help="Greedy decode steps after the prompt.")
    ap.add_argument(
        "--dir", default=os.environ.get("KVTIER_BENCH_DIR", "/var/tmp"), help="Directory on the filesystem to measure."
    )
    ap.add_argument(
        "--repeat", type=int, default=2, help="Restart + cold restore + recompute rounds; each time's best is reported."
    )
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides).")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    profile = load_profile(args.profile)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-restore-", dir=args.dir) as d:
        results, firsts = measure(profile, sorted(args.tokens), args.continue_tokens, args.decode, args.repeat, Path(d))
    cases = []
    for n, r in sorted(results.items()):
        # Derived from the times as measured: rounded to 0.1 ms first, a 4K load's µs an object moved up to 0.7%.
        request = (r["recompute_s"] + r["recompute_continue_s"]) / (r["restore_s"] + r["continue_s"])
        cases.append(
            {
                "tokens": n,
                **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()},
                "ratio": round(r["recompute_s"] / r["restore_s"], 2),
                "request_ratio": round(request, 2),
                "us_per_object": _per_object(r),
            }
        )
    short = [c["tokens"] for c in cases if c["hit_tokens"] < c["tokens"]]
    note = (
        f"hit shorter than the prefix at {short} tokens: one lookup hands out at most the daemon's recover queue "
        f"({AdmissionConfig().max_recover_queue:,} objects) for loading, and the engine looks up again only after "
        "a failed load; the rest is prefilled"
        if short
        else None
    )
    print(
        json.dumps(
            {
                "profile": profile.name,
                "path": "daemon",
                "note": note,
                "threads": args.threads,
                "continue_tokens": args.continue_tokens,
                "decode": args.decode,
                "repeat": args.repeat,
                "cases": cases,
                "first_after_start": firsts,
            }
        )
    )


if __name__ == "__main__":
    main()

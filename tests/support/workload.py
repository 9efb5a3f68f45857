"""An engine stand-in for the daemon tests: deterministic prefixes and cache objects, written and checked through a
Client.

Run as a script it is one engine process: `workload.py SOCKET write SEED BLOCKS` offloads a prefix,
looks it up, loads and compares every object it reads; `read SEED BLOCKS [SEED BLOCKS ...]` checks
prefixes other processes wrote; `hold SEED BLOCKS` takes leases and waits (to be killed).
Each prints one JSON line. The tests fork it warm (`support.warm_start`) with these arguments as sys.argv.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.client import Client, LookupResult
from kvtier.core.forms import GroupKind, Route
from kvtier.core.profile import ModelProfile

if TYPE_CHECKING:
    from support.daemon import DaemonProc


def tokens_for(seed: int, n_blocks: int, hash_block_tokens: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n_blocks * hash_block_tokens, dtype=np.int64)


def caches_for(profile: ModelProfile, seed: int, n_blocks: int) -> dict[str, dict[int, torch.Tensor]]:
    """Every history object of every block; state objects for the trailing window of the last boundary (a
    checkpoint)."""
    h = profile.hash_block_tokens
    out: dict[str, dict[int, torch.Tensor]] = {}
    for gi, g in enumerate(profile.groups):
        layout = profile.layout(g)
        first = 0 if g.kind is GroupKind.HISTORY else max(0, n_blocks - g.blocks_needed(h))
        gen = torch.Generator().manual_seed(seed * 1000 + gi)
        out[g.name] = {
            b: torch.randn(layout.shape, generator=gen, dtype=torch.float32) + b for b in range(first, n_blocks)
        }
    return out


def compare(client: Client, result: LookupResult, caches: dict[str, dict[int, torch.Tensor]]) -> int:
    """Read every REUSE object of the hit and compare with what was written; returns how many matched."""
    cv = result.check_vector
    n = 0
    for block, group, _form, route, _reason in cv.entries():
        if route is Route.REUSE:
            got = client.read(result, group, block)
            want = caches[group][block]
            if not torch.equal(got, want):
                raise AssertionError(f"{group} block {block}: read differs from what was written")
            n += 1
    return n


def offload_durably(client: Client, profile: ModelProfile, seed: int, n_blocks: int) -> None:
    """Offload the prefix `seed` (its caches from `caches_for`) and see it persisted to the store."""
    tokens = tokens_for(seed, n_blocks, profile.hash_block_tokens)
    assert client.offload(tokens, caches_for(profile, seed, n_blocks), durable=True).persisted


def restore_and_compare(client: Client, profile: ModelProfile, seed: int, n_blocks: int) -> int:
    """On a daemon with nothing resident: the whole prefix `seed` (offloaded durably before) hits, every object is
    read from disk into its pools, and the engine reads back what was written; returns the objects loaded."""
    h = profile.hash_block_tokens
    r = client.lookup(tokens_for(seed, n_blocks, h))
    assert r.hit_tokens == n_blocks * h and r.needs_load
    rep = client.load(r)
    assert rep.loaded_objects > 0
    assert compare(client, r, caches_for(profile, seed, n_blocks)) == rep.loaded_objects
    client.release(r)
    return rep.loaded_objects


def through_disk(start: Callable[[], DaemonProc], check: Callable[[DaemonProc], None], profile: ModelProfile) -> None:
    """A prefix offloaded durably through one daemon (`start`ed, then `check`ed), stopped; then restored from disk
    through a second one on the same store (nothing resident, `check`ed first), the engine reading back what was
    written (`restore_and_compare`)."""
    for restore in (False, True):
        d = start()
        try:
            check(d)
            with Client(d.socket) as c:
                c.attach(profile.name)
                if restore:
                    restore_and_compare(c, profile, 7, 4)
                else:
                    offload_durably(c, profile, 7, 4)
        except BaseException:
            d.close()
            raise
        assert d.terminate() == 0


def _lookup_and_check(client: Client, profile: ModelProfile, seed: int, n_blocks: int) -> dict[str, int]:
    tokens = tokens_for(seed, n_blocks, profile.hash_block_tokens)
    result = client.lookup(tokens)
    before = result.check_vector.counts()
    report = client.load(result)
    checked = compare(client, result, caches_for(profile, seed, n_blocks))
    hit = result.hit_tokens
    client.release(result)
    recover = sum(v.get("RECOVER", 0) for v in before.values())
    return {"hit_tokens": hit, "checked": checked, "recovered": recover, "loaded": report.loaded_objects}


def main() -> None:
    from kvtier.core.profile import load_profile

    socket_path, role, *rest = sys.argv[1:]
    profile = load_profile("ref-tiny")
    with Client(socket_path, name=f"workload {role}") as client:
        client.attach("ref-tiny")
        pairs = [(int(rest[i]), int(rest[i + 1])) for i in range(0, len(rest), 2)]
        if role == "write":
            ((seed, n_blocks),) = pairs
            rep = client.offload(
                tokens_for(seed, n_blocks, profile.hash_block_tokens), caches_for(profile, seed, n_blocks)
            )
            out = {"written": rep.written, **_lookup_and_check(client, profile, seed, n_blocks)}
        elif role == "read":
            out = {str(seed): _lookup_and_check(client, profile, seed, n) for seed, n in pairs}
        elif role == "hold":
            ((seed, n_blocks),) = pairs
            result = client.lookup(tokens_for(seed, n_blocks, profile.hash_block_tokens))
            print(json.dumps({"held": len(result.leases), "hit_tokens": result.hit_tokens}), flush=True)
            sys.stdin.read()  # until killed
            return
        else:
            raise SystemExit(f"unknown role {role}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

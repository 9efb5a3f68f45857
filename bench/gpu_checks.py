"""Device check for kvtier.gpu: a CUDA graph captured over the pools replays correctly after evictions
and recoveries (static topology). Prints one JSON object.

The graph is captured once, over the whole pool of every history group: it computes a checksum per
slot. Then prefixes are written, looked up, evicted (persisted to a lower tier first), other prefixes
take their slots, and the first ones are recovered into whatever slots they get. After each step the
graph is replayed and, for every leased object, the replayed checksum of its slot must equal the
checksum of the bytes written for it; pool addresses and the topology epoch must not change.

Without CUDA it prints {"skipped": ...} and exits 0. `--device cpu` runs the same scenario with the
graph replaced by the same function called eagerly (to check the scenario itself; no graph is involved).
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections.abc import Callable

import numpy as np
import torch

from kvtier.core import CacheForm, GroupKind, block_hashes, load_profile
from kvtier.core.layout import slot_stride
from kvtier.core.tier import ObjectKey
from kvtier.gpu import CacheManager, Pool
from kvtier.testing import MemoryTier

PROFILE = load_profile("ref-tiny")
H = PROFILE.hash_block_tokens
BLOCKS = 4


def _payload(group: str, block_hash: bytes) -> torch.Tensor:
    n = PROFILE.group(group).object_bytes(H)
    rng = np.random.default_rng([int.from_bytes(block_hash[:8], "little"), zlib.crc32(group.encode())])
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))


def _checksum(t: torch.Tensor) -> float:
    return float(t.to(torch.float64).sum().item())


def _slot_sums(pools: list[Pool], out: list[torch.Tensor]) -> None:
    """What the graph runs: for every pool, the sum of each slot's bytes, into a preallocated output."""
    for pool, dst in zip(pools, out):
        slots = pool.tensor.view(pool.n_slots, pool.slot_stride)[:, : pool.slot_nbytes]
        dst.copy_(slots.to(torch.float32).sum(dim=1))


def _capture(pools: list[Pool], out: list[torch.Tensor], device: torch.device) -> Callable[[], None]:
    if device.type != "cuda":
        return lambda: _slot_sums(pools, out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up outside the graph, as torch.cuda.graphs requires
            _slot_sums(pools, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _slot_sums(pools, out)
    return graph.replay


def _write(m: CacheManager, hashes: list[bytes]) -> None:
    for b, h in enumerate(hashes):
        for g in PROFILE.groups:
            if g.kind is GroupKind.STATE and b < BLOCKS - g.blocks_needed(H):
                continue
            m.write_block(
                ObjectKey(m.namespace, h, g.name, g.form), _payload(g.name, h), layout_digest=m.layout_digest(g.name)
            )


def run(device: torch.device) -> dict:
    tier = MemoryTier()
    budgets: dict[CacheForm, int] = {}
    for g in PROFILE.groups:  # room for exactly two prefixes' history: the second one takes the first's slots
        n = 2 * BLOCKS if g.kind is GroupKind.HISTORY else 2 * g.blocks_needed(H)
        budgets[g.form] = budgets.get(g.form, 0) + slot_stride(g.object_bytes(H)) * n
    m = CacheManager(PROFILE, budgets_bytes=budgets, device=device, lower=tier)
    addresses = m.pool_addresses()
    pools = [p for p in m.pools() if PROFILE.group(p.group).kind is GroupKind.HISTORY]
    out = [torch.zeros(p.n_slots, dtype=torch.float32, device=device) for p in pools]
    replay = _capture(pools, out, device)
    prefixes = [block_hashes(m.namespace, np.random.default_rng(s).integers(0, 256, BLOCKS * H), H) for s in range(3)]
    steps: list[dict] = []

    def check(step: str, hashes: list[bytes], recover: bool = False) -> None:
        result = m.lookup(hashes, owner=step)
        if recover:
            result = m.recover(result)
        replay()
        if device.type == "cuda":
            torch.cuda.synchronize()
        sums = {p.group: o.cpu().numpy() for p, o in zip(pools, out)}
        checked = 0
        for handle in m.handles(result):
            if handle.group in sums:
                expected = _checksum(_payload(handle.group, hashes[handle.block]))
                got = float(sums[handle.group][handle.slot])
                if abs(got - expected) > 0.5:
                    raise AssertionError(
                        f"{step}: graph read {got} from {handle.group} slot {handle.slot}, expected {expected}"
                    )
                checked += 1
        if m.pool_addresses() != addresses or m.topology_epoch != 0:
            raise AssertionError(f"{step}: pool addresses moved outside a recompile window")
        steps.append({"step": step, "hit_blocks": result.check_vector.hit_blocks, "slots_checked": checked})
        m.release(result)

    _write(m, prefixes[0])
    check("written", prefixes[0])
    m.persist()
    keys = [ObjectKey(m.namespace, h, g.name, g.form) for h in prefixes[0] for g in PROFILE.groups]
    evicted = m.evict(keys)
    _write(m, prefixes[1])
    _write(m, prefixes[2])  # takes the slots the first prefix had
    check("slots_reused", prefixes[2])
    check("recovered", prefixes[0], recover=True)
    if steps[-1]["hit_blocks"] != BLOCKS:
        raise AssertionError(f"recovery gave {steps[-1]['hit_blocks']} blocks, expected {BLOCKS}")
    return {"device": str(device), "graph": device.type == "cuda", "evicted": evicted, "steps": steps, "ok": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (scenario only, no graph)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            json.dumps(
                {
                    "skipped": "CUDA is not available on this machine; run on a GPU host "
                    "(or --device cpu for the scenario alone)"
                }
            )
        )
        return 0
    try:
        print(json.dumps(run(device)))
    except AssertionError as exc:
        print(json.dumps({"device": str(device), "ok": False, "error": str(exc)}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

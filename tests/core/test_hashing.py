"""Block hashes: chained, namespace-seeded, equal across processes, incremental == one-shot."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvtier.core import BlockHasher, block_hashes, load_profile

SCRIPT = """
import sys, numpy as np
from kvtier.core import block_hashes, load_profile
p = load_profile('ref-tiny')
t = np.random.default_rng(7).integers(0, 256, 1000)
print(','.join(h.hex() for h in block_hashes(p.namespace, t, p.hash_block_tokens)))
"""


def test_equal_across_processes_and_hash_seeds() -> None:
    outs = {
        subprocess.run(
            [sys.executable, "-c", SCRIPT],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    p = load_profile("ref-tiny")
    t = np.random.default_rng(7).integers(0, 256, 1000)
    assert outs.pop().strip() == ",".join(h.hex() for h in block_hashes(p.namespace, t, 32))


def test_chain_depends_on_every_earlier_token_and_namespace() -> None:
    p = load_profile("ref-tiny")
    t = np.arange(32 * 4) % 256
    base = block_hashes(p.namespace, t, 32)
    assert len(base) == 4 and len(set(base)) == 4
    t2 = t.copy()
    t2[5] += 1
    changed = block_hashes(p.namespace, t2, 32)
    assert all(a != b for a, b in zip(base, changed))
    other = p.version.bumped(indexer_version="other")
    assert block_hashes(other.namespace, t, 32)[0] != base[0]
    assert block_hashes(p.namespace, t[:100], 32) == base[:3]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=300), st.lists(st.integers(1, 80), max_size=10))
def test_incremental_equals_one_shot(tokens: list[int], cuts: list[int]) -> None:
    ns = b"\x01" * 16
    hasher = BlockHasher(ns, 16)
    pos = 0
    for c in cuts:
        hasher.extend(tokens[pos : pos + c])
        pos += c
    hasher.extend(tokens[pos:])
    assert hasher.hashes == block_hashes(ns, tokens, 16)

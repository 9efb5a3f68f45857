"""Validation layers 1, 2, 4 per object and layer 3 (the intersection) through real lookups."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.core import CacheForm, GroupKind, Reason, Route, VersionError, block_hashes, load_profile
from kvtier.core.errors import LayoutError
from kvtier.core.layout import slot_stride
from kvtier.core.tier import ObjectKey
from kvtier.gpu import AdmissionConfig, BadKey, BlockState, CacheManager, IllegalTransition, PartialBlock
from kvtier.gpu.table import BlockTable
from support.gpuworld import PROFILE, hashes_of, key, make, payload, prompt, state_blocks_for, write


def test_partial_block_is_never_sealed() -> None:
    m, _, _ = make()
    hs = hashes_of(m, prompt(1, 2))
    h = m.begin_write(key(m, hs[0], "c4"), layout_digest=m.layout_digest("c4"))
    assert h is not None
    with pytest.raises(PartialBlock, match=r"only\s+when whole"):
        m.seal(h, written_bytes=h.nbytes - 1)
    assert m.block_state("c4", h.slot).state is BlockState.FREE
    with pytest.raises(PartialBlock):
        m.write_block(
            key(m, hs[0], "c4"), payload(PROFILE, "c4", hs[0], m.namespace)[:-64], layout_digest=m.layout_digest("c4")
        )
    # a begun but unsealed write is a partial block to lookups
    h2 = m.begin_write(key(m, hs[0], "c4"), layout_digest=m.layout_digest("c4"))
    cv = m.lookup(hs).check_vector
    assert cv.route("c4", 0) is Route.RECOMPUTE and cv.reason("c4", 0) is Reason.PARTIAL_BLOCK
    assert m.abort(h2) and not m.abort(h2)
    assert m.invariant_violations() == []


def test_layout_digest_form_and_namespace_are_checked_at_write() -> None:
    m, _, _ = make()
    hs = hashes_of(m, prompt(2, 1))
    with pytest.raises(LayoutError, match="layout digest"):
        m.begin_write(key(m, hs[0], "c4"), layout_digest=m.layout_digest("c16"))
    other_abi = PROFILE.version.bumped(kernel_abi="other-kernel/2")
    with pytest.raises(LayoutError):
        m.begin_write(
            key(m, hs[0], "c4"),
            layout_digest=PROFILE.group("c4").layout(PROFILE.hash_block_tokens, other_abi.kernel_abi).digest,
        )
    with pytest.raises(BadKey):
        m.begin_write(ObjectKey(m.namespace, hs[0], "c4", CacheForm.INDEXER), layout_digest=m.layout_digest("c4"))
    with pytest.raises(BadKey):
        m.begin_write(ObjectKey(m.namespace, hs[0], "nope", CacheForm.COMPRESSED), layout_digest=m.layout_digest("c4"))
    with pytest.raises(VersionError):
        m.begin_write(
            ObjectKey(other_abi.namespace, hs[0], "c4", CacheForm.COMPRESSED), layout_digest=m.layout_digest("c4")
        )
    with pytest.raises(VersionError):
        m.lookup(hs, namespace=other_abi.namespace)


def test_version_bump_makes_old_objects_stale_and_first_to_go() -> None:
    m, _, _ = make(blocks=4, lower=False)
    toks = prompt(3, 3)
    old = hashes_of(m, toks)
    write(m, old, range(3), state_at=state_blocks_for(PROFILE, 3))
    first = m.lookup(old)
    assert first.check_vector.hit_blocks == 3
    m.release(first)  # a live lease would (rightly) keep the old objects from eviction
    m.set_version(PROFILE.version.bumped(compression_version="ref-compressor/2"))
    cv = m.lookup(old).check_vector  # old-namespace hashes: found, but stale
    assert cv.hit_blocks == 0 and cv.reason("c4", 0) is Reason.STALE_VERSION
    new = hashes_of(m, toks)
    assert new != old and m.lookup(new).check_vector.hit_blocks == 0
    write(m, new, range(3), state_at=state_blocks_for(PROFILE, 3))
    assert m.lookup(new).check_vector.hit_blocks == 3  # stale objects made room first
    assert m.invariant_violations() == []


def test_illegal_transitions_are_refused() -> None:
    t = BlockTable([2], [True])
    t.move(0, BlockState.WRITING)
    with pytest.raises(IllegalTransition):
        t.move(0, BlockState.EVICTING)
    with pytest.raises(IllegalTransition):
        t.move(1, BlockState.SEALED)  # FREE -> SEALED skips the write
    t.move(0, BlockState.SEALED)
    with pytest.raises(IllegalTransition):
        t.move(0, BlockState.WRITING)  # a sealed object is never rewritten in place


def _meta_write(m: CacheManager, block_hash: bytes, group: str) -> None:
    h = m.begin_write(
        ObjectKey(m.namespace, block_hash, group, m.profile.group(group).form), layout_digest=m.layout_digest(group)
    )
    assert h is not None
    m.seal(h, written_bytes=h.nbytes)


def test_design_example_on_the_dsv4_profile() -> None:
    """DESIGN.md: 5 shared blocks, state checkpoints after blocks 3 and 4, block 4's SWA evicted -> 1,024 tokens."""
    p = load_profile("deepseek-v4-flash")
    h = p.hash_block_tokens
    budget = {}
    for g in p.groups:
        budget[g.form] = budget.get(g.form, 0) + slot_stride(g.object_bytes(h)) * (
            6 if g.kind is GroupKind.HISTORY else 2
        )
    m = CacheManager(p, budgets_bytes=budget, admission=AdmissionConfig())
    toks = np.random.default_rng(0).integers(0, 129280, 5 * h + 100)
    hs = block_hashes(m.namespace, toks, h)
    assert len(hs) == 5
    for b in range(5):
        for g in p.groups:
            if g.kind is GroupKind.HISTORY or b in (3, 4):
                _meta_write(m, hs[b], g.name)
    assert m.evict([ObjectKey(m.namespace, hs[4], "swa", CacheForm.SWA)]) == 1
    result = m.lookup(hs)
    cv = result.check_vector
    assert cv.hit_tokens == 1024
    assert cv.route("c4_main", 3) is Route.REUSE and cv.route("swa", 3) is Route.REUSE
    assert cv.route("swa", 4) is Route.RECOMPUTE and cv.reason("swa", 4) is Reason.EVICTED
    assert cv.reason("c4_main", 4) is Reason.BEYOND_HIT
    assert cv.reason("c128_state", 2) is Reason.OUTSIDE_WINDOW
    for handle in m.handles(result):
        assert handle.offset % 128 == 0 and handle.nbytes == p.group(handle.group).object_bytes(h)


def test_no_hit_crosses_a_missing_history_block_or_an_incomplete_window() -> None:
    m, _, _ = make(blocks=8, lower=False)
    hs = hashes_of(m, prompt(5, 6))
    write(m, hs, [0, 1, 3, 4, 5], state_at=state_blocks_for(PROFILE, 6))  # block 2 history missing
    cv = m.lookup(hs).check_vector
    assert cv.hit_blocks == 0  # the only state is at boundary 6, beyond the hole
    write(m, hs, [2])
    assert m.lookup(hs).check_vector.hit_blocks == 6
    m.evict([key(m, hs[4], "swa")])  # the SWA window at 6 needs blocks 4 and 5
    cv = m.lookup(hs).check_vector
    assert cv.hit_blocks == 0 and cv.reason("swa", 4) is Reason.EVICTED

"""Ground truth: a resume from exported bytes is bitwise the uninterrupted run; every form is load-bearing."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.core import ModelProfile
from kvtier.refmodel import RefModel, RefState, required_objects

log = logging.getLogger(__name__)

DECODE = (7, 200, 31, 64)
LENGTHS = (100, 167, 224)


def _as_bytes(objects: dict) -> dict:
    """The round trip a store makes: tensors to raw bytes."""
    return {oid: bytes(t.numpy()) for oid, t in objects.items()}


def _continue(model: RefModel, state: RefState, rest: torch.Tensor) -> torch.Tensor:
    """Logits of the rest of the prompt, then of a few decoded tokens."""
    rows = [model.prefill(state, rest).logits] if rest.numel() else []
    rows += [model.decode(state, t).unsqueeze(0) for t in DECODE]
    return torch.cat(rows)


def _reference(model: RefModel, tokens: torch.Tensor, boundary: int) -> tuple[torch.Tensor, dict]:
    """Uninterrupted run cut at the boundary: the continuation's logits and the bytes of every object it wrote."""
    state = model.new_state()
    first = model.prefill(state, tokens[:boundary], checkpoints=[boundary])
    return _continue(model, state, tokens[boundary:]), _as_bytes(first.objects)


@pytest.mark.parametrize("n", LENGTHS)
def test_resume_is_bitwise_equal_at_every_boundary(
    model: RefModel, profile: ModelProfile, make_prompt, n: int, record_property
) -> None:
    tokens = make_prompt(n, n)
    h = model.hash_block_tokens
    one_chunk = RefModel(profile, chunk_tokens=-(-n // h) * h)
    single_state = one_chunk.new_state()
    single = torch.cat(
        (
            one_chunk.prefill(single_state, tokens).logits,
            torch.stack([one_chunk.decode(single_state, t) for t in DECODE]),
        )
    )
    worst = 0.0
    for k in range(1, n // h + 1):
        boundary = k * h
        expected, objects = _reference(model, tokens, boundary)
        needed = required_objects(profile, k)
        assert set(needed) <= set(objects)
        restored = model.restore({oid: objects[oid] for oid in needed}, k)
        assert restored.pos == boundary
        got = _continue(model, restored, tokens[boundary:])
        assert torch.equal(got, expected), f"n={n} boundary={boundary}: max abs diff {(got - expected).abs().max()}"
        worst = max(worst, float((got - single[boundary:]).abs().max()))
    log.info("n=%d: max abs diff of resumed logits vs one-chunk prefill: %.3e", n, worst)
    record_property("max_abs_diff_vs_single_shot", worst)
    assert worst < 1e-4  # other BLAS shapes round differently, but only by float32 noise


def test_one_call_with_checkpoint_equals_two_calls(model: RefModel, make_prompt) -> None:
    """The schedule is 'prefill up to the boundary, then the rest': one call cut at L is two calls split at L."""
    tokens = make_prompt(200, 3)
    one = model.prefill(model.new_state(), tokens, checkpoints=[96]).logits
    state = model.new_state()
    two = torch.cat((model.prefill(state, tokens[:96]).logits, model.prefill(state, tokens[96:]).logits))
    assert torch.equal(one, two)
    assert model.schedule(0, 200, [96]) == [(0, 64), (64, 96), (96, 128), (128, 192), (192, 200)]


# --- the forms are load-bearing ------------------------------------------------------------------

N_NEG = 224
NEG_BOUNDARIES = (2, 4, 6)  # leave >= 32 prompt tokens after the boundary: past both tails' next row


@pytest.fixture(scope="module")
def other_versions(profile: ModelProfile) -> dict[str, RefModel]:
    v = profile.version
    return {
        "indexer": RefModel(profile, v.bumped(indexer_version=v.indexer_version + "+other"), chunk_tokens=64),
        "compressed": RefModel(
            profile, v.bumped(compression_version=v.compression_version + "+other"), chunk_tokens=64
        ),
    }


def _broken(model: RefModel, profile, tokens, k: int, objects: dict, **kw) -> torch.Tensor:
    state = model.restore(objects, k, **kw)
    return _continue(model, state, tokens[k * model.hash_block_tokens :])


def _assert_diverges(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    diff = float((got - expected).abs().max())
    log.info("%s: max abs logit diff %.3e", what, diff)
    assert not torch.equal(got, expected) and diff > 1e-4, f"{what} did not change the logits"


@pytest.mark.parametrize("k", NEG_BOUNDARIES)
@pytest.mark.parametrize("tail", ["c4_tail", "c16_tail"])
def test_missing_tail_changes_logits(model: RefModel, profile, make_prompt, k: int, tail: str) -> None:
    tokens = make_prompt(N_NEG, 11)
    expected, objects = _reference(model, tokens, k * 32)
    del objects[(tail, k - 1)]
    got = _broken(model, profile, tokens, k, objects, allow_missing=True)
    _assert_diverges(got, expected, f"{tail} missing at block {k}")
    zeroed = {**objects, (tail, k - 1): bytes(profile.group(tail).object_bytes(32))}
    assert torch.equal(_broken(model, profile, tokens, k, zeroed), got), "a missing object is read as zeros"


@pytest.mark.parametrize("k", NEG_BOUNDARIES)
@pytest.mark.parametrize("which", ["oldest", "newest"])
def test_missing_swa_block_changes_logits(model: RefModel, profile, make_prompt, k: int, which: str) -> None:
    tokens = make_prompt(N_NEG, 12)
    expected, objects = _reference(model, tokens, k * 32)
    n_s = profile.group("swa").blocks_needed(32)
    assert n_s == 2
    j = k - n_s if which == "oldest" else k - 1
    del objects[("swa", j)]
    _assert_diverges(
        _broken(model, profile, tokens, k, objects, allow_missing=True), expected, f"swa block {j} missing"
    )


@pytest.mark.parametrize("k", NEG_BOUNDARIES)
@pytest.mark.parametrize("form", ["indexer", "compressed"])
def test_rows_from_another_version_change_logits(
    model: RefModel, profile, make_prompt, other_versions, k: int, form: str
) -> None:
    """Indexer keys only steer the top-k: different logits from other-version keys mean a different selection."""
    tokens = make_prompt(N_NEG, 13)
    expected, objects = _reference(model, tokens, k * 32)
    other = other_versions[form]
    assert other.version.namespace != model.version.namespace
    theirs = other.prefill(other.new_state(), tokens[: k * 32]).objects
    swapped = {
        oid: bytes(theirs[oid].numpy()) if profile.group(oid[0]).form.value == form else b for oid, b in objects.items()
    }
    assert swapped != objects
    _assert_diverges(
        _broken(model, profile, tokens, k, swapped), expected, f"{form} rows of another version at block {k}"
    )


def test_version_bumps_change_only_their_weights(model: RefModel, other_versions) -> None:
    base = model.weights.blocks[1].attn
    idx, cmp = other_versions["indexer"].weights.blocks[1].attn, other_versions["compressed"].weights.blocks[1].attn
    assert torch.equal(idx.compressor.proj, base.compressor.proj) and not torch.equal(idx.indexer.wk, base.indexer.wk)
    assert torch.equal(cmp.indexer.wk, base.indexer.wk) and not torch.equal(cmp.compressor.proj, base.compressor.proj)
    assert torch.equal(idx.wq, base.wq) and torch.equal(cmp.wq, base.wq)

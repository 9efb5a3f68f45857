"""Export layout, typed errors for missing or inconsistent objects, and weights stable across processes."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch

from kvtier.core import KvtierError, LayoutError, ProfileError, load_profile, profile_from_dict
from kvtier.refmodel import (
    BoundaryError,
    CorruptObjectError,
    MissingObjectError,
    RefModel,
    TokenError,
    required_objects,
)


def test_exported_objects_follow_the_profile_layout(model: RefModel, profile, make_prompt) -> None:
    h = model.hash_block_tokens
    result = model.prefill(model.new_state(), make_prompt(200, 1), checkpoints=[96, 192])
    history = {g.name for g in profile.groups if g.kind.value == "history"}
    expected = {(g, j) for g in history for j in range(200 // h)}
    for k in (3, 6):
        expected |= {("swa", k - 2), ("swa", k - 1), ("c4_tail", k - 1), ("c16_tail", k - 1)}
    assert set(result.objects) == expected
    for (group, _), payload in result.objects.items():
        g = profile.group(group)
        layout = profile.layout(g)
        assert payload.dtype == torch.uint8 and payload.ndim == 1 and payload.is_contiguous()
        assert payload.numel() == g.object_bytes(h) == layout.nbytes
        assert torch.isfinite(payload.view(torch.float32).reshape(layout.shape)).all()
    # An SWA object depends only on its block: the same bytes whichever checkpoint wrote it (160 or 192).
    again = model.prefill(model.new_state(), make_prompt(200, 1)[:160], checkpoints=[128, 160]).objects
    assert torch.equal(again[("swa", 4)], result.objects[("swa", 4)])


def test_required_objects_are_history_from_zero_and_state_at_the_window(profile) -> None:
    need = required_objects(profile, 5)
    assert [j for g, j in need if g == "c4"] == [0, 1, 2, 3, 4]
    assert [j for g, j in need if g == "swa"] == [3, 4]
    assert [j for g, j in need if g == "c16_tail"] == [4]
    assert required_objects(profile, 0) == []


@pytest.fixture(scope="module")
def exported(model: RefModel) -> dict:
    tokens = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(5))
    return {
        oid: bytes(t.numpy()) for oid, t in model.prefill(model.new_state(), tokens, checkpoints=[128]).objects.items()
    }


@pytest.mark.parametrize("oid", [("c4", 0), ("c4_index", 2), ("c16", 3), ("swa", 2), ("c4_tail", 3), ("c16_tail", 3)])
def test_missing_object_is_a_typed_error_naming_it(model: RefModel, exported: dict, oid) -> None:
    objects = {k: v for k, v in exported.items() if k != oid}
    with pytest.raises(MissingObjectError) as info:
        model.restore(objects, 4)
    assert info.value.missing == [oid] and info.value.code == "missing_object"
    assert f"{oid[0]} block {oid[1]}" in str(info.value) and "\n" not in str(info.value)
    assert model.restore(objects, 4, allow_missing=True).pos == 128


def test_resume_past_the_exported_blocks_is_missing(model: RefModel, exported: dict) -> None:
    with pytest.raises(MissingObjectError) as info:
        model.restore(exported, 5)
    assert ("c4", 4) in info.value.missing and ("swa", 4) in info.value.missing


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda b: b[:-4], LayoutError),  # truncated
        (lambda b: b + b"\0" * 4, LayoutError),  # too long
        (lambda b: b"", LayoutError),
        (
            lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).view(torch.float32).clone(),
            LayoutError,
        ),  # not bytes
        (lambda b: b[:4] + bytes.fromhex("0000c07f") + b[8:], CorruptObjectError),  # a NaN
    ],
)
def test_inconsistent_object_is_a_typed_error(model: RefModel, exported: dict, mutate, error) -> None:
    objects = dict(exported)
    objects[("c4", 1)] = mutate(objects[("c4", 1)])
    with pytest.raises(error) as info:
        model.restore(objects, 4)
    assert isinstance(info.value, KvtierError) and "('c4', 1)" in str(info.value)


def test_objects_of_another_group_do_not_fit(model: RefModel, exported: dict) -> None:
    objects = dict(exported)
    objects[("c16", 0)] = objects[("c4_index", 0)]  # same byte count would be needed: 512 vs 512
    model.restore(objects, 4)  # sizes equal: only the namespace can tell these apart, by design
    objects[("c16", 0)] = objects[("c4", 0)]
    with pytest.raises(LayoutError):
        model.restore(objects, 4)


def test_bad_boundaries_and_tokens_are_typed_errors(model: RefModel, exported: dict) -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(BoundaryError):
            model.restore(exported, bad)  # type: ignore[arg-type]
    with pytest.raises(BoundaryError, match="multiples of 32"):
        model.prefill(model.new_state(), [1] * 100, checkpoints=[50])
    with pytest.raises(BoundaryError):
        model.prefill(model.new_state(), [1] * 100, checkpoints=[128])
    state = model.restore(exported, 4)
    model.decode(state, 3)
    with pytest.raises(BoundaryError):
        from kvtier.refmodel import export_checkpoint

        export_checkpoint(model.profile, state)
    with pytest.raises(TokenError):
        model.prefill(model.new_state(), [1, 256])
    with pytest.raises(TokenError):
        model.prefill(model.new_state(), [0.5, 1.0])
    with pytest.raises(TokenError):
        model.prefill(model.new_state(), [[1, 2]])


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d["model"].update(prefill_chunk=48), "model.prefill_chunk"),
        (lambda d: d["model"].pop("index_topk"), "model.index_topk"),
        (lambda d: d["model"].update(head_dim=16), "groups.swa.row"),
        (lambda d: d["groups"][4].update(window=8, rows_per_block=4, tokens_per_block=4), "groups.c4_tail.window"),
        (lambda d: d["groups"].pop(5), "groups.c16.layers"),
    ],
)
def test_profile_that_does_not_fit_the_model_is_a_profile_error(profile, mutate, field) -> None:
    data = profile.to_dict()
    data["model"] = dict(data["model"])
    data["groups"] = [dict(g) for g in data["groups"]]
    mutate(data)
    with pytest.raises(ProfileError) as info:
        RefModel(profile_from_dict(data))
    assert info.value.field == field


_DIGEST_SCRIPT = """
import hashlib, torch
from kvtier.core import load_profile
from kvtier.refmodel import RefModel
m = RefModel(load_profile("ref-tiny"))
tokens = torch.arange(300) * 7 % 256
print(hashlib.sha256(m.prefill(m.new_state(), tokens).logits.numpy().tobytes()).hexdigest())
"""


def test_weights_and_logits_are_the_same_in_another_process() -> None:
    """An engine restarted on the same profile must read back the objects it wrote: same weights, same numbers."""
    m = RefModel(load_profile("ref-tiny"))
    tokens = torch.arange(300) * 7 % 256
    here = hashlib.sha256(m.prefill(m.new_state(), tokens).logits.numpy().tobytes()).hexdigest()
    there = subprocess.run(
        [sys.executable, "-c", _DIGEST_SCRIPT], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert here == there

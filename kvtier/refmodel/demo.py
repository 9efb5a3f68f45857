"""The in-process resume story behind `kvtier demo`.

Request 1 prefills a prompt and writes its five-form objects, keyed by (namespace, block hash,
group), into an in-process object store, with state forms only at checkpoint boundaries. Request 2
shares a prefix that does not end on a checkpoint: the lookup builds a check vector, the usable hit
is the last checkpoint inside the hash hit, the model resumes there from the stored bytes and
continues. The continuation is compared bitwise with recomputing the prefix, and each form is
broken in turn to show it is load-bearing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtier.core.checkvector import CheckVector
from kvtier.core.forms import CacheForm, GroupKind, Reason, Route
from kvtier.core.hashing import block_hashes
from kvtier.core.profile import ModelProfile
from kvtier.core.tier import ObjectKey
from kvtier.refmodel.model import RefModel
from kvtier.refmodel.objects import required_objects
from kvtier.refmodel.state import ObjectId, RefState

log = logging.getLogger(__name__)

SHARED_FRACTION = 0.7  # request 2 shares this much of request 1's prompt, then diverges
SINGLE_SHOT_MAX = 8192  # one-chunk prefill materialises (tokens x tokens) scores: informational, small prompts only


@dataclasses.dataclass(frozen=True, slots=True)
class DemoParams:
    tokens: int = 4096
    decode: int = 16
    checkpoint_every: int = 16  # blocks between state checkpoints (the retention interval)
    seed: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class BrokenForm:
    """What resuming with one form broken does to the continuation."""

    case: str
    objects: int
    max_abs_diff: float
    first_diff: int | None  # offset into the continuation of the first logit row that differs
    greedy_changes: int  # continuation positions whose argmax token differs
    diverges: bool


@dataclasses.dataclass(frozen=True, slots=True)
class DemoReport:
    profile: str
    namespace: str
    hash_block_tokens: int
    prompt_tokens: int
    checkpoint_every_tokens: int
    checkpoints: list[int]
    exported: dict[str, dict[str, int]]
    shared_tokens: int
    hash_hit_tokens: int
    usable_hit_tokens: int
    check_vector: dict[str, dict[str, int]]
    restored: dict[str, dict[str, int]]
    continuation_tokens: int
    decode_tokens: int
    prefill_s: float
    restore_s: float
    recompute_s: float
    bitwise_match: bool
    single_shot_max_abs_diff: float | None
    broken: list[BrokenForm]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def run_demo(profile: ModelProfile, params: DemoParams) -> DemoReport:
    """Run both requests and every broken-form resume; raises ValueError when the prompt is too short to show a resume."""
    model = RefModel(profile)
    h, ns = model.hash_block_tokens, profile.namespace
    rng = np.random.default_rng(params.seed)
    vocab = model.config.vocab_size
    prompt_a = rng.integers(0, vocab, params.tokens)
    end_a = params.tokens // h * h
    every = params.checkpoint_every * h
    checkpoints = sorted({*range(every, end_a + 1, every), end_a} - {0})

    # Request 1: prefill, checkpoint, offload every object under its chained block hash.
    t0 = time.perf_counter()
    first = model.prefill(model.new_state(), prompt_a, checkpoints=checkpoints)
    prefill_s = time.perf_counter() - t0
    hashes_a = block_hashes(ns, prompt_a, h)
    store: dict[ObjectKey, bytes] = {
        _key(profile, hashes_a[j], g): bytes(t.numpy()) for (g, j), t in first.objects.items()
    }
    log.info("request 1: %d tokens prefilled in %.3f s, %d objects stored", params.tokens, prefill_s, len(store))

    # Request 2: shares a prefix that ends between checkpoints.
    shared = int(params.tokens * SHARED_FRACTION)
    prompt_b = np.concatenate((prompt_a[:shared], rng.integers(0, vocab, params.tokens - shared)))
    hashes_b = block_hashes(ns, prompt_b, h)
    cv = _lookup(profile, store, hashes_b)
    k = cv.hit_blocks
    hash_hit = _leading_hash_hits(profile, store, hashes_b)
    if k < 2:
        raise ValueError(f"the usable hit is {k} blocks: use more tokens or a smaller checkpoint interval")
    boundary = k * h
    log.info("request 2: hash hit %d tokens, usable hit %d tokens", hash_hit * h, boundary)
    loaded = {oid: store[_key(profile, hashes_b[oid[1]], oid[0])] for oid in required_objects(profile, k)}
    rest = prompt_b[boundary:]

    t0 = time.perf_counter()
    recomputed = model.new_state()
    model.prefill(recomputed, prompt_b[:boundary])
    recompute_s = time.perf_counter() - t0
    reference, generated = _continue_greedy(model, recomputed, rest, params.decode)

    t0 = time.perf_counter()
    restored = model.restore(loaded, k)
    restore_s = time.perf_counter() - t0
    resumed = _continue(model, restored, rest, generated)
    bitwise = torch.equal(resumed, reference)
    log.info("restore %.4f s vs recompute %.4f s; bitwise match: %s", restore_s, recompute_s, bitwise)

    cases = _broken_forms(model, loaded, k, prompt_b, generated, reference)
    single = _single_shot(profile, prompt_b, boundary, generated, reference) if len(prompt_b) <= SINGLE_SHOT_MAX else None

    return DemoReport(
        profile=profile.name,
        namespace=profile.version.namespace_hex,
        hash_block_tokens=h,
        prompt_tokens=params.tokens,
        checkpoint_every_tokens=every,
        checkpoints=checkpoints,
        exported=_per_form(profile, first.objects),
        shared_tokens=shared,
        hash_hit_tokens=hash_hit * h,
        usable_hit_tokens=boundary,
        check_vector=cv.counts(),
        restored=_per_form(profile, loaded),
        continuation_tokens=len(rest),
        decode_tokens=len(generated),
        prefill_s=prefill_s,
        restore_s=restore_s,
        recompute_s=recompute_s,
        bitwise_match=bitwise,
        single_shot_max_abs_diff=single,
        broken=cases,
    )


def _broken_forms(
    model: RefModel, loaded: dict[ObjectId, bytes], k: int, prompt: np.ndarray, generated: list[int], reference: torch.Tensor
) -> list[BrokenForm]:
    """Resume with one form broken at a time (a degraded resume: absent objects read as zeros) and compare."""
    profile, h = model.profile, model.hash_block_tokens
    boundary = k * h
    tails = [g.name for g in profile.groups_of(CacheForm.TAIL)]
    swas = profile.groups_of(CacheForm.SWA)
    oldest_swa = [(g.name, max(0, k - g.blocks_needed(h))) for g in swas]
    cases: list[tuple[str, Callable[[dict[ObjectId, bytes]], int]]] = [
        ("tail missing", lambda o: _drop(o, [(g, k - 1) for g in tails])),
        ("oldest SWA block of the window missing", lambda o: _drop(o, oldest_swa)),
        (
            "indexer rows from another indexer version",
            lambda o: _swap(profile, o, _other(profile, prompt[:boundary], indexer_version="other"), CacheForm.INDEXER),
        ),
        (
            "compressed rows from another compressor version",
            lambda o: _swap(profile, o, _other(profile, prompt[:boundary], compression_version="other"), CacheForm.COMPRESSED),
        ),
    ]
    out = []
    for case, breaker in cases:
        objects = dict(loaded)
        touched = breaker(objects)
        logits = _continue(model, model.restore(objects, k, allow_missing=True), prompt[boundary:], generated)
        out.append(_compare(case, touched, logits, reference))
    return out


def _single_shot(profile: ModelProfile, prompt: np.ndarray, boundary: int, generated: list[int], reference: torch.Tensor) -> float:
    """Max abs difference of the continuation against prefilling the whole prompt as one chunk."""
    h = profile.hash_block_tokens
    model = RefModel(profile, chunk_tokens=-(-len(prompt) // h) * h)
    state = model.new_state()
    rows = [model.prefill(state, prompt).logits[boundary:]] + [model.decode(state, t).unsqueeze(0) for t in generated]
    return float((torch.cat(rows) - reference).abs().max())


def _key(profile: ModelProfile, block_hash: bytes, group: str) -> ObjectKey:
    return ObjectKey(profile.namespace, block_hash, group, profile.group(group).form)


def _lookup(profile: ModelProfile, store: dict[ObjectKey, bytes], hashes: list[bytes]) -> CheckVector:
    """Per group and block: RECOVER when the store has the object (it must be loaded), else RECOMPUTE missing."""
    present = np.array([[_key(profile, hb, g.name) in store for hb in hashes] for g in profile.groups], dtype=bool)
    routes = np.where(present, Route.RECOVER, Route.RECOMPUTE).astype(np.int8)
    reasons = np.where(present, Reason.OK, Reason.MISSING).astype(np.int8)
    return CheckVector.build(profile, routes, reasons)


def _leading_hash_hits(profile: ModelProfile, store: dict[ObjectKey, bytes], hashes: list[bytes]) -> int:
    """Leading blocks whose history objects are all stored: the hit a plain prefix-hash cache would report."""
    history = [g.name for g in profile.groups if g.kind is GroupKind.HISTORY]
    n = 0
    while n < len(hashes) and all(_key(profile, hashes[n], g) in store for g in history):
        n += 1
    return n


def _continue_greedy(model: RefModel, state: RefState, rest: np.ndarray, steps: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill the rest of the prompt, then decode greedily; logits of every continued position and the tokens picked."""
    rows = [model.prefill(state, rest).logits]
    picked: list[int] = []
    for _ in range(steps):
        picked.append(int(rows[-1][-1].argmax()))
        rows.append(model.decode(state, picked[-1]).unsqueeze(0))
    return torch.cat(rows), picked


def _continue(model: RefModel, state: RefState, rest: np.ndarray, generated: list[int]) -> torch.Tensor:
    """The same continuation, fed the reference's generated tokens so positions compare one to one."""
    rows = [model.prefill(state, rest).logits] + [model.decode(state, t).unsqueeze(0) for t in generated]
    return torch.cat(rows)


def _compare(case: str, touched: int, out: torch.Tensor, reference: torch.Tensor) -> BrokenForm:
    diff = (out - reference).abs().amax(dim=-1)
    differing = torch.nonzero(diff).flatten()
    changes = int((out.argmax(dim=-1) != reference.argmax(dim=-1)).sum())
    return BrokenForm(case, touched, float(diff.max()), int(differing[0]) if differing.numel() else None, changes, bool(differing.numel()))


def _drop(objects: dict[ObjectId, bytes], ids: list[ObjectId]) -> int:
    for oid in ids:
        del objects[oid]
    return len(ids)


def _swap(profile: ModelProfile, objects: dict[ObjectId, bytes], other: dict[ObjectId, torch.Tensor], form: CacheForm) -> int:
    """Replace every object of `form` with the other version's object for the same block."""
    ids = [oid for oid in objects if profile.group(oid[0]).form is form]
    for oid in ids:
        objects[oid] = bytes(other[oid].numpy())
    return len(ids)


def _other(profile: ModelProfile, tokens: np.ndarray, **changes: str) -> dict[ObjectId, torch.Tensor]:
    """The objects a model of a bumped version writes for the same tokens (its namespace differs: a store never serves them)."""
    version = profile.version.bumped(**{f: f"{getattr(profile.version, f)}+{v}" for f, v in changes.items()})
    model = RefModel(profile, version)
    return model.prefill(model.new_state(), tokens).objects


def _per_form(profile: ModelProfile, objects: dict[ObjectId, torch.Tensor] | dict[ObjectId, bytes]) -> dict[str, dict[str, int]]:
    """Object count and payload bytes per form."""
    out: dict[str, dict[str, int]] = {}
    for (group, _), payload in objects.items():
        c = out.setdefault(profile.group(group).form.value, {"objects": 0, "bytes": 0})
        c["objects"] += 1
        c["bytes"] += payload.numel() if isinstance(payload, torch.Tensor) else len(payload)
    return out

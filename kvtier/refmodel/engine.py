"""An inference engine stand-in: the reference model served through a kvtier daemon (`kvtier.client`).

`prefill_and_offload` runs a prompt and writes every object it produced (history per block, state at
its checkpoints). `restore_and_continue` looks the prompt up, loads what the check vector routes
RECOVER, reads the REUSE slots through its leases, resumes the model at the usable hit and prefills
the rest. `recompute` is the same continuation from a fresh state (the prefix recomputed), timed
apart: the oracle the restore must equal bitwise, and the cost it saves.

Both paths cut the prefill at the hit boundary, so everything after it is the same computation
(same chunk shapes, same BLAS calls): equality is exact, not approximate.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from kvtier.client import Client, LookupResult, NotDurable, OutOfOrder
from kvtier.core.checkvector import CheckVector
from kvtier.core.errors import VersionError
from kvtier.core.forms import Reason
from kvtier.refmodel.model import RefModel, Tokens
from kvtier.refmodel.objects import required_objects
from kvtier.refmodel.state import RefState

log = logging.getLogger(__name__)


def checkpoint_policy(n_tokens: int, hash_block_tokens: int, every_blocks: int) -> list[int]:
    """State checkpoints of one prefill: every `every_blocks` hash blocks, and the last whole boundary."""
    h = hash_block_tokens
    end = n_tokens // h * h
    step = every_blocks * h
    return sorted({*range(step, end + 1, step), end} - {0})


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadResult:
    """What one prefill wrote through the daemon."""

    tokens: int
    checkpoints: tuple[int, ...]
    objects: dict[str, dict[str, int]]  # per form: objects, bytes offered
    written: int
    skipped: int
    refused: int
    persisted: bool
    prefill_s: float
    offload_s: float
    logits: torch.Tensor  # (tokens, vocab)


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreResult:
    """One request served from the cache: where it resumed, what each form did, and what it cost.

    `lookup_cv` is the first lookup's check vector (REUSE resident, RECOVER on disk); `final_cv` the one
    resumed from, after its load (RECOVER objects REUSE, or RECOMPUTE with the store's reason).
    """

    prompt_tokens: int
    lookup_cv: CheckVector
    final_cv: CheckVector
    lookups: int  # > 1 when a failed load or the recovery queue made another lookup worthwhile
    loaded_objects: int
    bytes_from_disk: int
    read_objects: int
    lookup_s: float
    load_s: float
    restore_s: float  # lookup + load + read + rebuild of the model state: the cost of reaching the hit
    continue_s: float
    logits: torch.Tensor  # (prompt_tokens - hit_tokens + decode, vocab): positions [hit, prompt) then decoded ones
    generated: tuple[int, ...]

    @property
    def hit_tokens(self) -> int:
        return self.final_cv.hit_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "lookup_hit_tokens": self.lookup_cv.hit_tokens,
            "hit_tokens": self.hit_tokens,
            "routes_at_lookup": self.lookup_cv.counts(),
            "routes_after_load": self.final_cv.counts(),
            "lookups": self.lookups,
            "loaded_objects": self.loaded_objects,
            "bytes_from_disk": self.bytes_from_disk,
            "read_objects": self.read_objects,
            "lookup_s": self.lookup_s,
            "load_s": self.load_s,
            "restore_s": self.restore_s,
            "continue_s": self.continue_s,
            "decode_tokens": len(self.generated),
        }


@dataclasses.dataclass(frozen=True, slots=True)
class RecomputeResult:
    """The same continuation from a fresh state: the prefix [0, boundary) recomputed, then the rest."""

    boundary_tokens: int
    recompute_s: float  # prefill of the prefix alone: what a hit saves
    continue_s: float
    logits: torch.Tensor
    generated: tuple[int, ...]


class EngineVersionError(VersionError):
    """The engine's model and the daemon's profile are different versions: objects would mean other things."""


class RefEngine:
    """The reference model on one attached `Client`: offload after prefill, restore before it."""

    def __init__(self, client: Client, model: RefModel, *, checkpoint_every: int = 16) -> None:
        att = client.attachment
        if att is None:
            raise OutOfOrder("attach the client to the model's profile first (client.attach(name))")
        if att.namespace != model.version.namespace or att.hash_block_tokens != model.hash_block_tokens:
            raise EngineVersionError(
                f"the daemon serves {att.profile} as namespace {att.namespace.hex()}, this model is "
                f"{model.version.namespace.hex()}: run the daemon with this model's profile "
                "(or this model with the daemon's)"
            )
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1 hash block, got {checkpoint_every}")
        self.client = client
        self.model = model
        self.checkpoint_every = checkpoint_every

    @property
    def hash_block_tokens(self) -> int:
        return self.model.hash_block_tokens

    def checkpoints(self, n_tokens: int) -> list[int]:
        return checkpoint_policy(n_tokens, self.hash_block_tokens, self.checkpoint_every)

    # -- write ---------------------------------------------------------------------------------------

    def prefill_and_offload(
        self, tokens: Tokens, checkpoints: Iterable[int] | None = None, durable: bool = False
    ) -> OffloadResult:
        """Prefill from scratch; offload every history object and the state objects of each checkpoint."""
        ids = _np(tokens)
        cps = tuple(sorted(self.checkpoints(len(ids)) if checkpoints is None else set(checkpoints)))
        started = time.perf_counter()
        out = self.model.prefill(self.model.new_state(), ids, checkpoints=cps)
        prefill_s = time.perf_counter() - started
        caches: dict[str, dict[int, torch.Tensor]] = {}
        per_form: dict[str, dict[str, int]] = {}
        for (group, block), payload in out.objects.items():
            caches.setdefault(group, {})[block] = payload
            c = per_form.setdefault(self.model.profile.group(group).form.value, {"objects": 0, "bytes": 0})
            c["objects"] += 1
            c["bytes"] += payload.numel()
        started = time.perf_counter()
        rep = self.client.offload(ids, caches, durable=durable)
        offload_s = time.perf_counter() - started
        if durable and not rep.persisted:
            raise NotDurable(
                f"{rep.not_durable} objects of this prefix are not in the store: {'; '.join(rep.reasons)}",
                pending=rep.not_durable,
                why=rep.why,
            )
        log.info(
            "offloaded %d tokens: %d written, %d cached already, %d refused",
            len(ids),
            rep.written,
            rep.skipped,
            rep.refused,
        )
        return OffloadResult(
            len(ids),
            cps,
            per_form,
            rep.written,
            rep.skipped,
            rep.refused,
            rep.persisted,
            prefill_s,
            offload_s,
            out.logits,
        )

    # -- read ----------------------------------------------------------------------------------------

    def restore_and_continue(self, tokens: Tokens, *, decode: int = 0, lookups: int = 8) -> RestoreResult:
        """Resume at the usable hit from the daemon's objects, then prefill the rest and decode greedily.

        Looks up again (up to `lookups` in all) while that can lengthen the hit: after a load that
        failed (corrupt or vanished records shrink the hit; the store has quarantined them, so the next
        lookup finds the best hit left, e.g. an earlier checkpoint), and after a hit the daemon's
        recovery queue cut short (RECOMPUTE `admission`: the next lookup finds the loaded objects
        resident and queues the rest).
        """
        if lookups < 1:
            raise ValueError(f"lookups must be >= 1, got {lookups}")
        ids = _np(tokens)
        started = time.perf_counter()
        lookup_cv: CheckVector | None = None
        loaded_objects = loaded_bytes = 0
        lookup_s = load_s = 0.0
        best = 0
        for attempt in range(1, lookups + 1):
            t0 = time.perf_counter()
            result = self.client.lookup(ids)
            lookup_s += time.perf_counter() - t0
            lookup_cv = lookup_cv or result.check_vector
            try:
                wanted = result.check_vector.hit_blocks
                if result.needs_load:
                    t0 = time.perf_counter()
                    rep = self.client.load(result)
                    load_s += time.perf_counter() - t0
                    loaded_objects += rep.loaded_objects
                    loaded_bytes += rep.loaded_bytes
                got = result.check_vector.hit_blocks
                if attempt < lookups and got < wanted:
                    log.info("load shrank the hit from %d to %d blocks; looking up again", wanted, got)
                    continue
                if attempt < lookups and got > best and _admission_cut(result.check_vector):
                    log.info("recovery queue cut the hit at %d blocks; looking up again", got)
                    best = got
                    continue
                state, n_read = self._restore(result)
                break
            finally:
                self.client.release(result)
        restore_s = time.perf_counter() - started
        t0 = time.perf_counter()
        logits, generated = continue_greedy(self.model, state, ids, decode)
        continue_s = time.perf_counter() - t0
        assert lookup_cv is not None
        return RestoreResult(
            len(ids),
            lookup_cv,
            result.check_vector,
            attempt,
            loaded_objects,
            loaded_bytes,
            n_read,
            lookup_s,
            load_s,
            restore_s,
            continue_s,
            logits,
            generated,
        )

    def _restore(self, result: LookupResult) -> tuple[RefState, int]:
        """The model state at the hit, rebuilt from the REUSE objects read through the leases (copied out)."""
        k = result.check_vector.hit_blocks
        if k == 0:
            return self.model.new_state(), 0
        needed = required_objects(self.model.profile, k)
        objects = {oid: self.client.read(result, oid[0], oid[1]).reshape(-1).view(torch.uint8) for oid in needed}
        return self.model.restore(objects, k), len(needed)

    def recompute(self, tokens: Tokens, boundary_tokens: int, *, decode: int = 0) -> RecomputeResult:
        """No cache: prefill [0, boundary) fresh (timed), then the same continuation as a restore at that boundary."""
        return recompute(self.model, tokens, boundary_tokens, checkpoint_every=self.checkpoint_every, decode=decode)


def _admission_cut(cv: CheckVector) -> bool:
    """True if some object was refused only by the recovery queue's cap (a later lookup may serve it)."""
    return bool((cv.reasons == int(Reason.ADMISSION)).any())


def recompute(
    model: RefModel, tokens: Tokens, boundary_tokens: int, *, checkpoint_every: int = 16, decode: int = 0
) -> RecomputeResult:
    """The oracle without a daemon: a fresh state through [0, boundary) (the engine's checkpoint cuts), then the
    rest."""
    ids = _np(tokens)
    h = model.hash_block_tokens
    if boundary_tokens % h or not 0 <= boundary_tokens <= len(ids):
        raise ValueError(f"boundary {boundary_tokens} must be a multiple of {h} within the {len(ids)} tokens")
    state = model.new_state()
    started = time.perf_counter()
    if boundary_tokens:
        cps = [c for c in checkpoint_policy(len(ids), h, checkpoint_every) if c < boundary_tokens]
        model.prefill(state, ids[:boundary_tokens], checkpoints=cps)
    recompute_s = time.perf_counter() - started
    t0 = time.perf_counter()
    logits, generated = continue_greedy(model, state, ids, decode)
    return RecomputeResult(boundary_tokens, recompute_s, time.perf_counter() - t0, logits, generated)


def continue_greedy(
    model: RefModel, state: RefState, tokens: np.ndarray, decode: int
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Prefill tokens[state.pos:] in one call (nothing is exported, so no checkpoint cuts), then decode greedily."""
    rows = []
    if state.pos < len(tokens):
        rows.append(model.prefill(state, tokens[state.pos :]).logits)
    picked: list[int] = []
    for _ in range(decode):
        if not rows:
            raise ValueError("nothing to decode from: the prompt is entirely cached; continue with at least one token")
        picked.append(int(rows[-1][-1].argmax()))
        rows.append(model.decode(state, picked[-1]).unsqueeze(0))
    logits = torch.cat(rows) if rows else torch.zeros(0, model.config.vocab_size)
    return logits, tuple(picked)


def _np(tokens: Tokens) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        return tokens.cpu().numpy()
    return np.asarray(tokens)

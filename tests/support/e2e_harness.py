"""Engine processes and the bitwise oracle shared by the e2e tests and the fault matrix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from kvtier.core.profile import ModelProfile, load_profile
from kvtier.refmodel import RefModel
from kvtier.refmodel.engine import recompute
from support.daemon import DaemonProc, child_env
from support.engine_proc import CHECKPOINT_EVERY
from support.warm_start import WarmProc

PROFILE = load_profile("ref-tiny")
H = PROFILE.hash_block_tokens
VOCAB = 256


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n, dtype=np.int64)


def branch(base: np.ndarray, at: int, seed: int, n: int) -> np.ndarray:
    """base[:at] followed by n tokens of its own."""
    return np.concatenate((base[:at], prompt(seed, n)))


def save_prompts(work: Path, prompts: dict[str, np.ndarray]) -> None:
    for name, tokens in prompts.items():
        np.save(work / f"{name}.npy", tokens)


def start_engine(
    d: DaemonProc, work: Path, role: str, *names: str, profile: str = "ref-tiny", weights: str = ""
) -> WarmProc:
    """An engine process (forked warm, `support.warm_start`); `weights` (a weights digest) runs the model at that
    version of the profile."""
    return WarmProc(
        [str(d.socket), profile, str(work), role, *names],
        env=child_env(ENGINE_WEIGHTS_DIGEST=weights) if weights else child_env(),
        cwd=Path.cwd(),
        out=None,
        entry="support.engine_proc:main",
    )


def run_engine(
    d: DaemonProc, work: Path, role: str, *names: str, profile: str = "ref-tiny", weights: str = ""
) -> dict[str, dict]:
    """Run one engine process to completion; its JSON report per prompt name."""
    return engine_reports(d, start_engine(d, work, role, *names, profile=profile, weights=weights), role)


def engine_reports(d: DaemonProc, proc: WarmProc, role: str, stdin: str | None = None) -> dict[str, dict]:
    """Wait for an engine process to finish (after writing `stdin` to it); its JSON report per prompt name."""
    out, err = proc.communicate(stdin, timeout=120)
    assert proc.returncode == 0, f"engine {role} failed:\n{err}\ndaemon log:\n{d.read_log()[-3000:]}"
    docs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {doc["name"]: doc for doc in docs if "name" in doc}


class Oracle:
    """Recomputes a continuation in this process (one torch thread, like the engines)."""

    def __init__(self, profile: ModelProfile = PROFILE) -> None:
        torch.set_num_threads(1)
        self.model = RefModel(profile)

    def continuation(self, tokens: np.ndarray, hit_tokens: int) -> torch.Tensor:
        return recompute(self.model, tokens, hit_tokens, checkpoint_every=CHECKPOINT_EVERY).logits

    def matches(self, logits: torch.Tensor, tokens: np.ndarray, hit_tokens: int) -> bool:
        """Bitwise equality with the uninterrupted run (cut at the same boundary)."""
        return torch.equal(logits, self.continuation(tokens, hit_tokens))

    def check_file(self, work: Path, name: str, tokens: np.ndarray, hit_tokens: int) -> None:
        logits = torch.load(work / f"{name}.logits.pt")
        assert logits.shape[0] == len(tokens) - hit_tokens
        assert self.matches(logits, tokens, hit_tokens), (
            f"{name}: continuation after a {hit_tokens}-token hit differs from recomputing"
        )

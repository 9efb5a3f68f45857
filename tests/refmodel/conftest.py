"""Shared fixtures: the ref-tiny model with small chunks (so boundaries cut chunks), one intra-op thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier.core import ModelProfile, load_profile
from kvtier.refmodel import RefModel

CHUNK = 64  # two hash blocks: odd boundaries cut a chunk, even ones fall on the grid


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Two cores are shared by four engineers: oversubscribed OpenMP spins make timings erratic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def profile() -> ModelProfile:
    return load_profile("ref-tiny")


@pytest.fixture(scope="session")
def model(profile: ModelProfile) -> RefModel:
    return RefModel(profile, chunk_tokens=CHUNK)


@pytest.fixture(scope="session")
def make_prompt() -> Callable[[int, int], torch.Tensor]:
    """Seeded random token ids: make_prompt(length, seed)."""
    return lambda n, seed: torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))

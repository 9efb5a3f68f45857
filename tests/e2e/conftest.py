"""e2e fixtures: a scratch folder for prompts and logits, and the oracle."""

from __future__ import annotations

import pytest

from .harness import Oracle


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    return Oracle()

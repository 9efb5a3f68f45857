"""The reference model's running state: a position and one small state per layer."""

from __future__ import annotations

import dataclasses

from kvtier.refmodel.compressed import CompressedState
from kvtier.refmodel.swa import SwaState

LayerState = SwaState | CompressedState

ObjectId = tuple[str, int]
"""(cache group name, hash block index): the caller maps the index to the chained block hash."""


@dataclasses.dataclass(slots=True)
class RefState:
    """Tokens [0, pos) have been seen; `layers[i]` is layer i's state."""

    pos: int
    layers: list[LayerState]

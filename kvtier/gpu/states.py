"""The block state machine: five states, the legal moves between them, and a per-slot snapshot record."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from kvtier.core.forms import CacheForm
from kvtier.gpu.errors import IllegalTransition


class BlockState(enum.IntEnum):
    """Where a pool slot is in its life; stored as int8 in the slot table."""

    FREE = 0
    WRITING = 1
    SEALED = 2
    RECOVERING = 3
    EVICTING = 4


_MOVES = {
    BlockState.FREE: (BlockState.WRITING, BlockState.RECOVERING),
    BlockState.WRITING: (BlockState.SEALED, BlockState.FREE),
    BlockState.RECOVERING: (BlockState.SEALED, BlockState.FREE),
    BlockState.SEALED: (BlockState.EVICTING,),
    BlockState.EVICTING: (BlockState.FREE,),
}

LEGAL = np.zeros((len(BlockState), len(BlockState)), dtype=bool)
for _src, _dsts in _MOVES.items():
    LEGAL[_src, list(_dsts)] = True


def check_move(current: int, to: BlockState, slot: int) -> None:
    """Raise IllegalTransition unless `current -> to` is an edge of the state machine."""
    if not LEGAL[current, to]:
        raise IllegalTransition(
            f"slot {slot}: {BlockState(current).name} -> {to.name} is not a legal move; "
            "this is a kvtier bug, please report it"
        )


def check_moves(current: np.ndarray, to: BlockState, slots: np.ndarray) -> None:
    """`check_move` for a batch of slots (their states `current`), raising for the first illegal one."""
    bad = ~LEGAL[current, to]
    if bad.any():
        i = int(np.argmax(bad))
        check_move(int(current[i]), to, int(slots[i]))


@dataclasses.dataclass(frozen=True, slots=True)
class CacheBlockState:
    """A read-only snapshot of one pool slot, assembled from the slot table's arrays."""

    group: str
    slot: int
    form: CacheForm
    namespace: bytes | None
    generation: int
    recoverable: bool
    last_touch: int
    state: BlockState
    pins: int
    leases: int

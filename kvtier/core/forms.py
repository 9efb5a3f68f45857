"""The four cache forms, their kinds, and the routes and reasons a check vector speaks.

Where an object lives (a pool slot or a disk record) is its residence, not a form: a disk record names the form
it carries, so no form stands for "on disk".
"""

from __future__ import annotations

import enum


class CacheForm(enum.Enum):
    """What an object holds; fixed when it is written, never reinterpreted."""

    COMPRESSED = "compressed"
    TAIL = "tail"
    SWA = "swa"
    INDEXER = "indexer"

    # Members are singletons, equal only to themselves: hashed by identity (in C), not by Enum's hash of the name
    # (a Python call), which the store's admission and accounting paid per object in their dicts keyed by form.
    __hash__ = object.__hash__

    @property
    def kind(self) -> GroupKind:
        return GroupKind.HISTORY if self in (CacheForm.COMPRESSED, CacheForm.INDEXER) else GroupKind.STATE


class GroupKind(enum.Enum):
    """History forms cover every block from 0 to the hit; state forms only the trailing window."""

    HISTORY = "history"
    STATE = "state"


class Route(enum.IntEnum):
    """What the engine must do with one object of the check vector."""

    REUSE = 0
    RECOVER = 1
    RECOMPUTE = 2


class Reason(enum.IntEnum):
    """Why an object got its route; OK for REUSE and RECOVER."""

    OK = 0
    MISSING = 1
    STALE_VERSION = 2
    ABI_MISMATCH = 3
    PARTIAL_BLOCK = 4
    MISALIGNED = 5
    EVICTED = 6
    OUTSIDE_WINDOW = 7
    ADMISSION = 8
    CORRUPT = 9
    BEYOND_HIT = 10

    @property
    def label(self) -> str:
        return self.name.lower()

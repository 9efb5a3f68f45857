"""Typed errors of the GPU-resident cache manager; each names what the caller should do."""

from __future__ import annotations

from kvtier.core.errors import KvtierError, StaleHandle

__all__ = [
    "AdmissionRefused",
    "BadKey",
    "BudgetError",
    "IllegalTransition",
    "PartialBlock",
    "StaleHandle",
    "TopologyError",
]


class TopologyError(KvtierError):
    """A change of pool addresses was asked for outside a recompile window."""

    code = "topology"


class AdmissionRefused(KvtierError):
    """No slot can be had for a new object: every candidate is pinned, leased or in flight."""

    code = "admission"


class PartialBlock(KvtierError):
    """A block was sealed before it was whole (layer 1 of validation)."""

    code = "partial_block"


class IllegalTransition(KvtierError):
    """A slot was asked to move between two block states that the state machine does not connect."""

    code = "illegal_transition"


class BadKey(KvtierError):
    """An object key names a group or form this manager's profile does not have."""

    code = "bad_key"


class BudgetError(KvtierError):
    """A pool byte budget is missing or too small to hold one object of a group."""

    code = "bad_budget"

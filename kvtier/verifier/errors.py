"""Typed errors of the verifier and `kvtier audit`."""

from __future__ import annotations

from kvtier.core.errors import KvtierError


class VerifierError(KvtierError):
    code = "verifier_error"


class StoreNotFound(VerifierError):
    """The --store directory does not hold a kvtier store."""

    code = "store_not_found"
